"""Layering the config's sources: a YAML file, then CACHEROUTE_* variables, then flags."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from router.config.build import _ITEM_SHORTHANDS, _TOP_KEYS, _expand_shorthands, build_config
from router.config.sections import ENV_PREFIX, ConfigError, GatewayConfig
from router.config.values import _structured, _Text
from router.policy.types import POLICY_NAMES


def _parse_path(path: str) -> list[str | int]:
    """'replicas[0].url' or 'replicas.0.url' -> ['replicas', 0, 'url']."""
    parts: list[str | int] = []
    for piece in path.split("."):
        m = re.fullmatch(r"([A-Za-z0-9_-]*)((?:\[\d+\])*)", piece)
        if not piece or m is None:
            raise ConfigError(path, "is not a valid key path (use a.b.c or a[0].b)")
        name, indices = m.groups()
        if name:
            parts.append(int(name) if name.isdigit() else name)
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", indices))
    if not parts or not isinstance(parts[0], str):
        raise ConfigError(path, "is not a valid key path (use a.b.c or a[0].b)")
    return parts


def _format_path(parts: Sequence[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _set_path(raw: dict[str, Any], parts: Sequence[str | int], value: Any, source: str) -> None:
    if parts[0] not in _TOP_KEYS:
        raise ConfigError(
            str(parts[0]), f"unknown key (from {source}); expected one of {', '.join(_TOP_KEYS)}"
        )
    _expand_shorthands(raw)
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        nxt_is_index = isinstance(parts[depth + 1], int)
        node = _child(node, part, [] if nxt_is_index else {}, parts[: depth + 1], source)
    last = parts[-1]
    if isinstance(node, list):
        if not isinstance(last, int):
            raise ConfigError(
                _format_path(parts[:-1]), f"is a list; index it by position (from {source})"
            )
        if last < len(node):
            node[last] = value
        elif last == len(node):
            node.append(value)
        else:
            raise ConfigError(
                _format_path(parts),
                f"index {last} skips items: the list has {len(node)} (from {source})",
            )
    elif isinstance(last, str) and isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(_format_path(parts[:-1]), f"is not a list (from {source})")


def _child(node: Any, part: str | int, empty: Any, walked: Sequence[str | int], source: str) -> Any:
    where = _format_path(walked)
    if isinstance(part, int):
        if not isinstance(node, list):
            raise ConfigError(where, f"is not a list (from {source})")
        if part == len(node):
            node.append(empty)
        elif part > len(node):
            raise ConfigError(
                where, f"index {part} skips items: the list has {len(node)} (from {source})"
            )
        item = _structured(node[part])
        if isinstance(item, str) and walked[0] in _ITEM_SHORTHANDS:
            item = {_ITEM_SHORTHANDS[str(walked[0])]: item}
        node[part] = empty if item is None else item
        return node[part]
    if not isinstance(node, dict):
        raise ConfigError(where, f"is not a mapping (from {source})")
    if isinstance(node.get(part), _Text):
        node[part] = _structured(node[part])
    if not isinstance(node.get(part), dict | list):
        node[part] = empty
    return node[part]


def env_overrides(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """The (key path, text) pairs that CACHEROUTE_* variables set, in a stable order."""
    out: list[tuple[str, str]] = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        segments = rest.split("__")
        if len(segments) == 1 and segments[0] not in _TOP_KEYS:
            continue  # a variable such as CACHEROUTE_SALT_SECRET, not a setting
        if any(not seg for seg in segments):
            raise ConfigError(name, "empty key segment (use a double underscore between keys)")
        out.append((".".join(segments), env[name]))
    return out


def load_config(
    path: str | None, env: Mapping[str, str], overrides: Sequence[str],
    *, sections: Collection[str] | None = None,
) -> GatewayConfig:
    """Build the config from a YAML file, then CACHEROUTE_* env vars, then KEY=VALUE overrides.

    With `sections`, only those top-level keys are kept and validated; every other
    section takes its defaults. A process that reads part of the gateway's config (the
    indexer) so needs none of the other sections' secrets.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError("config", f"cannot read {path}: {e.strerror or e}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError("config", f"{path} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("config", f"{path} must hold a mapping at the top level")
        raw = loaded or {}
    for key, value in env_overrides(env):
        envname = ENV_PREFIX + key.upper().replace(".", "__")
        _set_path(raw, _parse_path(key), _Text(value), f"environment variable {envname}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(item, "an override must be KEY=VALUE, e.g. policy.name=cache_aware")
        _set_path(raw, _parse_path(key.strip()), _Text(value), f"--set {key.strip()}")
    if sections is not None:
        raw = {key: value for key, value in raw.items() if key in sections}
    return build_config(raw, env)


# ------------------------------------------------------------------------------ flags


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config, --set and shortcuts for the most common settings to `parser`."""
    g = parser.add_argument_group("configuration (file, then CACHEROUTE_* env, then these flags)")
    g.add_argument("--config", metavar="FILE", help="gateway YAML file (see examples/gateway.yaml)")
    g.add_argument("--host", help="listen address (listen.host)")
    g.add_argument("--port", help="listen port (listen.port)")
    g.add_argument("--workers", help="worker processes sharing the port (listen.workers)")
    g.add_argument("--index", help="'memory' or redis://host:6379/0 (index.backend)")
    g.add_argument("--policy", help=f"routing policy (policy.name): {', '.join(POLICY_NAMES)}")
    g.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        default=None,
        help="replica URL, repeatable; replaces the file's replicas list",
    )
    g.add_argument(
        "--model-dir", metavar="DIR", help="the served model's tokenizer directory (model_dir)"
    )
    g.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=None,
        dest="set_overrides",
        help="any setting by its dotted key, e.g. --set policy.tolerance=0.2 (repeatable)",
    )


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """The KEY=VALUE overrides that add_config_arguments' flags stand for, shortcuts first."""
    out: list[str] = []
    for flag, key in (
        ("host", "listen.host"),
        ("port", "listen.port"),
        ("workers", "listen.workers"),
        ("index", "index.backend"),
        ("policy", "policy.name"),
        ("model_dir", "model_dir"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            out.append(f"{key}={value}")
    replicas = getattr(args, "replica", None)
    if replicas:
        out.append("replicas=" + json.dumps([{"url": u} for u in replicas]))
    out.extend(getattr(args, "set_overrides", None) or [])
    return out


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> GatewayConfig:
    """load_config for a namespace parsed with add_config_arguments (env defaults to os.environ)."""
    return load_config(
        getattr(args, "config", None), os.environ if env is None else env, overrides_from_args(args)
    )
