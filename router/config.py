"""One validated `GatewayConfig`, built once at start-up and passed down.

Sources, later ones winning: a YAML file, then environment variables, then flags.

- Environment: `CACHEROUTE_<KEY>` with a double underscore for each level of nesting,
  e.g. `CACHEROUTE_POLICY__NAME=cache_aware`, `CACHEROUTE_REPLICAS__0__URL=http://...`;
  names are lowercased into keys (so a model named with capitals or dashes is set from
  the file or --set, not the environment).
  A variable without `__` counts only when it names a top-level key
  (`CACHEROUTE_INDEX=redis://...`, `CACHEROUTE_MODEL_DIR=...`), so variables such as the
  salt secret (`CACHEROUTE_SALT_SECRET`) are not mistaken for settings; a variable with
  `__` must name a known section.
- Flags: `--set a.b=value` (repeatable; list items as `replicas[0].url` or
  `replicas.0.url`) and a few shortcuts from `add_config_arguments`.

Values from the environment and flags are text, converted by the type the key expects
(so `--set tenants.anonymous_tenant=no` stays the string "no"); lists and mappings are
parsed as YAML (`--set 'replicas=[{url: "http://a:8000"}]'`).

Every error a user can cause is a `ConfigError` whose message starts with the key path,
e.g. "replicas[1].block_size: must be a positive integer, got 'x'". Secrets (API keys,
the salt secret, the Redis password) are read here from the environment variables the
file names, kept out of reprs, and never put in messages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from router.hashing import HASH_ALGOS, HashConfig, UnknownSeedError
from router.policy.scorers import SCORERS
from router.policy.types import POLICY_NAMES, PolicyConfig, PrefillProfile

ENV_PREFIX = "CACHEROUTE_"
DEFAULT_SECRET_ENV = "CACHEROUTE_SALT_SECRET"
CLIENT_SALT_MODES = ("reject", "namespace")
TOKENIZE_MODES = ("local", "remote")
MIN_SECRET_BYTES = 16

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing or invalid; the message starts with its key path."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


class _Text(str):
    """A value that arrived as text (environment or flag), to be read by its key's type."""


# ---------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ListenConfig:
    """Where the gateway listens."""

    host: str = "127.0.0.1"
    port: int = 8000


@dataclass(frozen=True)
class ModelConfig:
    """A served model: where its tokenizer lives and its context length if overridden."""

    name: str
    tokenizer: str
    max_model_len: int | None = None

    def resolved_max_model_len(self) -> int | None:
        """max_model_len, else the model's config.json max_position_embeddings, else None."""
        if self.max_model_len is not None:
            return self.max_model_len
        try:
            data = json.loads((Path(self.tokenizer) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        value = data.get("max_position_embeddings") if isinstance(data, dict) else None
        return value if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica (url) or a DNS name standing for every address it resolves to (dns)."""

    name: str
    url: str | None = None
    dns: str | None = None
    dns_refresh_s: float = 10.0
    models: tuple[str, ...] = ()
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    max_concurrency: int | None = None
    prefill: PrefillProfile | None = None
    # How the indexer keys this replica's blocks: never (as the replica sends them),
    # always (re-keyed from their token ids with `hash`), auto (re-keyed only if its
    # keys turn out to differ). None: the indexer's --rekey default.
    rekey: str | None = None
    hash: HashConfig = field(default_factory=HashConfig)

    def serves(self, model: str) -> bool:
        """Whether this replica serves `model` (an empty models list serves every model)."""
        return not self.models or model in self.models


@dataclass(frozen=True)
class IndexConfig:
    """The prefix index: in memory, or shared through Redis."""

    backend: str = "memory"
    # The longest a request waits for its lookup before routing on load alone. A Redis
    # lookup (router/index.py, bisecting) takes well under 1 ms on an idle host; the
    # deadline absorbs what the round trip meets on a busy one (the gateway's own event
    # loop, a descheduled Redis, a network hop), and stays small against what a match
    # saves: one 16-token block of prefill is ~1 ms at 15k tokens/s (H100, 8B), so a
    # request with 10 matched blocks at stake gains from waiting this long. At 5 ms, on a
    # loaded 2-core host (4 sims, 8 requests in flight), most lookups missed it even when
    # fast; at 10 ms most made it.
    deadline_ms: float = 10.0
    record_ttl_s: float = 3600.0
    record_capacity_blocks: int = 1_000_000
    password_env: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def is_redis(self) -> bool:
        return self.backend != "memory"


@dataclass(frozen=True)
class TenantKeyConfig:
    """One API key and the tenant it authenticates as."""

    key: str = field(repr=False)
    tenant: str
    salted: bool = True
    allow_client_salt: str = "reject"
    key_env: str | None = None


@dataclass(frozen=True)
class TenantsConfig:
    """API keys, the salt secret and what to do with requests carrying no valid key."""

    secret_env: str = DEFAULT_SECRET_ENV
    keys: tuple[TenantKeyConfig, ...] = ()
    allow_anonymous: bool = False
    anonymous_tenant: str = "anonymous"
    secret: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ProxyConfig:
    """Forwarding: timeouts (no total timeout: streams may be long), retries, body limits."""

    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    max_retries: int = 2
    retry_budget_ratio: float = 0.2
    hold_until_content: bool = True
    max_body_bytes: int = 16 * 1024 * 1024
    expose_routing_headers: bool = False
    tokenize_mode: str = "local"


@dataclass(frozen=True)
class LimitsConfig:
    """Admission limits and request-size limits."""

    global_concurrency: int = 1024
    per_replica_concurrency: int = 256
    queue_size: int = 1024
    queue_timeout_s: float = 30.0
    max_n: int = 16
    max_tokens_limit: int = 131072


@dataclass(frozen=True)
class HealthConfig:
    """Health checks, ejection after failures (exponential backoff), metrics scraping."""

    interval_s: float = 2.0
    timeout_s: float = 1.0
    eject_after_failures: int = 3
    eject_base_s: float = 5.0
    eject_max_s: float = 60.0
    scrape_interval_s: float = 1.0


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway is configured with."""

    listen: ListenConfig = field(default_factory=ListenConfig)
    models: Mapping[str, ModelConfig] = field(default_factory=lambda: MappingProxyType({}))
    replicas: tuple[ReplicaConfig, ...] = ()
    index: IndexConfig = field(default_factory=IndexConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def served_models(self) -> frozenset[str]:
        """Model names the gateway accepts: the models section, else the replicas' lists."""
        if self.models:
            return frozenset(self.models)
        return frozenset(m for r in self.replicas for m in r.models)

    def replica(self, name: str) -> ReplicaConfig:
        """The replica called `name` (KeyError if none)."""
        for r in self.replicas:
            if r.name == name:
                return r
        raise KeyError(name)


# ----------------------------------------------------------------------- value readers


def _describe(value: Any) -> str:
    return repr(str(value)) if isinstance(value, _Text) else repr(value)


def _read_int(path: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, _Text):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"must be {kind}, got {_describe(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(path, f"must be {kind}, got {value!r}")
    return value


def _pos_int(path: str, value: Any) -> int:
    return _read_int(path, value, 1)


def _nonneg_int(path: str, value: Any) -> int:
    return _read_int(path, value, 0)


def _number(
    path: str, value: Any, *, positive: bool = False, at_most: float | None = None
) -> float:
    if isinstance(value, _Text):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(path, f"must be a number, got {_describe(value)}")
    if positive and value <= 0:
        raise ConfigError(path, f"must be a positive number, got {value!r}")
    if value < 0:
        raise ConfigError(path, f"must not be negative, got {value!r}")
    if at_most is not None and value > at_most:
        raise ConfigError(path, f"must be at most {at_most}, got {value!r}")
    return float(value)


def _pos_number(path: str, value: Any) -> float:
    return _number(path, value, positive=True)


def _nonneg_number(path: str, value: Any) -> float:
    return _number(path, value)


def _fraction(path: str, value: Any) -> float:
    return _number(path, value, at_most=1.0)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _bool(path: str, value: Any) -> bool:
    if isinstance(value, _Text):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    if not isinstance(value, bool):
        raise ConfigError(path, f"must be true or false, got {_describe(value)}")
    return value


def _str(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(path, f"must be a non-empty string, got {_describe(value)}")
    return str(value)


def _is_null(value: Any) -> bool:
    return value is None or (
        isinstance(value, _Text) and value.strip() in ("", "null", "~", "none")
    )


def _optional(read: Callable[[str, Any], T]) -> Callable[[str, Any], T | None]:
    def reader(path: str, value: Any) -> T | None:
        return None if _is_null(value) else read(path, value)

    return reader


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def reader(path: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(path, f"must be one of {', '.join(choices)}; got {_describe(value)}")
        return str(value)

    return reader


def _structured(value: Any) -> Any:
    """Text from the environment or a flag standing for a list or mapping: parse as YAML."""
    if isinstance(value, _Text):
        try:
            return yaml.safe_load(str(value))
        except yaml.YAMLError:
            return value
    return value


def _list(path: str, value: Any) -> list[Any]:
    value = _structured(value)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(path, f"must be a list, got {_describe(value)}")
    return value


def _str_list(path: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, _Text) and not value.strip().startswith("["):
        # A comma-separated list is the natural way to write one in an env var.
        return tuple(_str(path, _Text(v.strip())) for v in value.split(",") if v.strip())
    return tuple(_str(f"{path}[{i}]", v) for i, v in enumerate(_list(path, value)))


class _Section:
    """A mapping being read key by key; `finish` rejects keys nobody asked for."""

    def __init__(self, path: str, raw: Any) -> None:
        raw = _structured(raw)
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(path, f"must be a mapping, got {_describe(raw)}")
        for key in raw:
            if not isinstance(key, str):
                raise ConfigError(path, f"keys must be strings, got {key!r}")
        self.path = path
        self.raw = raw
        self.seen: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.raw and not _is_null(self.raw[key])

    def get(self, key: str, read: Callable[[str, Any], T], default: T) -> T:
        self.seen.add(key)
        if key not in self.raw:
            return default
        return read(self.sub(key), self.raw[key])

    def section(self, key: str) -> _Section:
        self.seen.add(key)
        return _Section(self.sub(key), self.raw.get(key))

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.seen)
        if unknown:
            expected = ", ".join(sorted(self.seen))
            raise ConfigError(self.sub(unknown[0]), f"unknown key; expected one of {expected}")


# ------------------------------------------------------------------------ section builders


def _listen(s: _Section) -> ListenConfig:
    d = ListenConfig()
    port = s.get("port", _pos_int, d.port)
    if port > 65535:
        raise ConfigError(s.sub("port"), f"must be a TCP port (1-65535), got {port}")
    out = ListenConfig(host=s.get("host", _str, d.host), port=port)
    s.finish()
    return out


def _models(top: _Section) -> dict[str, ModelConfig]:
    models: dict[str, ModelConfig] = {}
    s = top.section("models")
    for name in s.raw:
        s.seen.add(name)
        m = _Section(s.sub(name), s.raw[name])
        tokenizer = m.get("tokenizer", _directory, "")
        if not tokenizer:
            raise ConfigError(
                m.sub("tokenizer"), "is required: the directory holding the tokenizer"
            )
        models[name] = ModelConfig(
            name=name,
            tokenizer=tokenizer,
            max_model_len=m.get("max_model_len", _optional(_pos_int), None),
        )
        m.finish()
    s.finish()
    model_dir = top.get("model_dir", _optional(_directory), None)
    model_name = top.get("model_name", _optional(_str), None)
    if model_dir is not None:
        name = model_name or Path(model_dir.rstrip("/")).name
        if name in models:
            raise ConfigError("model_dir", f"model {name!r} is also in models; give one of them")
        models[name] = ModelConfig(name=name, tokenizer=model_dir)
    elif model_name is not None:
        raise ConfigError("model_name", "names the model of model_dir, which is not set")
    return models


def _directory(path: str, value: Any) -> str:
    text = _str(path, value)
    if not Path(text).is_dir():
        raise ConfigError(path, f"directory {text!r} does not exist")
    return text


def _replica_url(path: str, value: Any) -> str:
    text = _str(path, value).rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            path, f"must be an http(s) URL such as http://10.0.0.5:8000, got {text!r}"
        )
    try:
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        raise ConfigError(path, f"has an invalid port: {text!r}") from None
    return text


def _dns_target(path: str, value: Any) -> str:
    text = _str(path, value)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            path, f"must be host:port such as vllm.ns.svc.cluster.local:8000, got {text!r}"
        )
    return text


def _zmq_endpoint(path: str, value: Any) -> str:
    text = _str(path, value)
    if not re.match(r"^(tcp|ipc)://\S+$", text):
        raise ConfigError(path, f"must be a ZMQ endpoint such as tcp://10.0.0.5:5557, got {text!r}")
    return text


def _seed(path: str, value: Any) -> str:
    # PYTHONHASHSEED is text; YAML reads `hash_seed: 0` as an int, which means "0".
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ConfigError(
            path, f"must be a string (the replicas' PYTHONHASHSEED) or null, got {value!r}"
        )
    return str(value)


def _prefill(path: str, raw: Any, default: PrefillProfile) -> PrefillProfile:
    s = _Section(path, raw)
    out = PrefillProfile(
        base_s=s.get("base_s", _nonneg_number, default.base_s),
        per_token_s=s.get("per_token_s", _nonneg_number, default.per_token_s),
        per_token_context_s=s.get(
            "per_token_context_s", _nonneg_number, default.per_token_context_s
        ),
    )
    s.finish()
    return out


def _replica(path: str, raw: Any, models: Mapping[str, ModelConfig]) -> ReplicaConfig:
    if isinstance(raw, str | _Text) and not str(raw).lstrip().startswith("{"):
        raw = {"url": str(raw)}  # a bare URL is shorthand for {url: URL}
    s = _Section(path, raw)
    url = s.get("url", _optional(_replica_url), None)
    dns = s.get("dns", _optional(_dns_target), None)
    if (url is None) == (dns is None):
        raise ConfigError(path, "needs exactly one of url or dns")
    name = s.get("name", _optional(_str), None) or (url_name(url) if url else str(dns))
    replica_models: tuple[str, ...] = s.get("models", _str_list, ())
    if models:
        for i, m in enumerate(replica_models):
            if m not in models:
                raise ConfigError(
                    f"{path}.models[{i}]",
                    f"unknown model {m!r}; models has {', '.join(sorted(models))}",
                )
    block_size = s.get("block_size", _pos_int, 16)
    algo = s.get("hash_algo", _choice(*HASH_ALGOS), "sha256")
    seed = s.get("hash_seed", _optional(_seed), None)
    try:
        hash_config = HashConfig(algo=algo, block_size=block_size, seed=seed)
        hash_config.check_reproducible()
    except UnknownSeedError as e:
        raise ConfigError(s.sub("hash_seed"), str(e)) from None
    prefill = None
    if s.has("prefill"):
        s.seen.add("prefill")
        prefill = _prefill(s.sub("prefill"), s.raw["prefill"], PrefillProfile())
    out = ReplicaConfig(
        name=name,
        url=url,
        dns=dns,
        dns_refresh_s=s.get("dns_refresh_s", _pos_number, 10.0),
        models=replica_models,
        block_size=block_size,
        hash_algo=algo,
        hash_seed=seed,
        kv_events=s.get("kv_events", _optional(_zmq_endpoint), None),
        kv_replay=s.get("kv_replay", _optional(_zmq_endpoint), None),
        max_concurrency=s.get("max_concurrency", _optional(_pos_int), None),
        prefill=prefill,
        rekey=s.get("rekey", _optional(_choice("never", "always", "auto")), None),
        hash=hash_config,
    )
    s.seen.add("prefill")
    s.finish()
    return out


def url_name(url: str) -> str:
    """A replica's default name: its URL's host:port."""
    parts = urlsplit(url)
    return parts.netloc or url


def _replicas(top: _Section, models: Mapping[str, ModelConfig]) -> tuple[ReplicaConfig, ...]:
    raw: list[Any] = top.get("replicas", _list, [])
    out = tuple(_replica(f"replicas[{i}]", r, models) for i, r in enumerate(raw))
    seen: dict[str, int] = {}
    for i, r in enumerate(out):
        if r.name in seen:
            raise ConfigError(
                f"replicas[{i}].name",
                f"{r.name!r} is also replicas[{seen[r.name]}]'s name; names must be unique",
            )
        seen[r.name] = i
    if not out:
        raise ConfigError(
            "replicas",
            "at least one replica is required "
            "(the file's replicas, CACHEROUTE_REPLICAS or --replica URL)",
        )
    return out


def _index_backend(path: str, value: Any) -> str:
    text = _str(path, value)
    if text == "memory" or re.match(r"^(redis|rediss|unix)://\S+$", text):
        return text
    raise ConfigError(path, f"must be 'memory' or a redis:// URL, got {text!r}")


def _index(s: _Section, env: Mapping[str, str]) -> IndexConfig:
    d = IndexConfig()
    password_env = s.get("password_env", _optional(_str), None)
    password = None
    if password_env is not None:
        password = env.get(password_env)
        if not password:
            raise ConfigError(
                s.sub("password_env"), f"environment variable {password_env} is not set"
            )
    out = IndexConfig(
        backend=s.get("backend", _index_backend, d.backend),
        deadline_ms=s.get("deadline_ms", _pos_number, d.deadline_ms),
        record_ttl_s=s.get("record_ttl_s", _pos_number, d.record_ttl_s),
        record_capacity_blocks=s.get("record_capacity_blocks", _pos_int, d.record_capacity_blocks),
        password_env=password_env,
        password=password,
    )
    s.finish()
    return out


def _weights(path: str, value: Any) -> Mapping[str, float]:
    s = _Section(path, value)
    for name in s.raw:
        if name not in SCORERS:
            raise ConfigError(s.sub(name), f"unknown scorer; expected one of {', '.join(SCORERS)}")
    out = {k: s.get(k, _nonneg_number, 0.0) for k in list(s.raw)}
    return MappingProxyType(out)


def _policy(s: _Section) -> PolicyConfig:
    d = PolicyConfig()
    seed = s.get("seed", _optional(_nonneg_int), None)
    prefill = d.prefill
    if s.has("prefill"):
        prefill = _prefill(s.sub("prefill"), s.raw["prefill"], d.prefill)
    s.seen.add("prefill")
    out = PolicyConfig(
        name=s.get("name", _choice(*POLICY_NAMES), d.name),
        seed=seed,
        weights=s.get("weights", _weights, d.weights),
        prefill=prefill,
        load_cost_s=s.get("load_cost_s", _nonneg_number, d.load_cost_s),
        saturation_load=s.get("saturation_load", _pos_int, d.saturation_load),
        saturation_cost_s=s.get("saturation_cost_s", _nonneg_number, d.saturation_cost_s),
        kv_threshold=s.get("kv_threshold", _fraction, d.kv_threshold),
        kv_cost_s=s.get("kv_cost_s", _nonneg_number, d.kv_cost_s),
        hot_ratio=s.get("hot_ratio", _nonneg_number, d.hot_ratio),
        hot_slack=s.get("hot_slack", _nonneg_number, d.hot_slack),
        hot_cost_s=s.get("hot_cost_s", _nonneg_number, d.hot_cost_s),
        tolerance=s.get("tolerance", _nonneg_number, d.tolerance),
    )
    if out.kv_threshold >= 1.0:
        raise ConfigError(s.sub("kv_threshold"), f"must be below 1.0, got {out.kv_threshold!r}")
    s.finish()
    return out


def _env_name(path: str, value: Any) -> str:
    text = _str(path, value)
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", text):
        raise ConfigError(path, f"must be an environment variable name, got {text!r}")
    return text


def _tenant_key(path: str, raw: Any, env: Mapping[str, str]) -> TenantKeyConfig:
    s = _Section(path, raw)
    key_env = s.get("key_env", _optional(_env_name), None)
    s.seen.add("key")
    literal = s.raw.get("key")
    if (key_env is None) == (_is_null(literal)):
        raise ConfigError(path, "needs exactly one of key or key_env")
    if key_env is not None:
        key = env.get(key_env, "")
        if not key:
            raise ConfigError(s.sub("key_env"), f"environment variable {key_env} is not set")
    else:
        if not isinstance(literal, str) or not literal.strip():
            # Never echo the value: it may be a real key with a typo.
            raise ConfigError(s.sub("key"), "must be a non-empty string")
        key = str(literal)
    out = TenantKeyConfig(
        key=key,
        key_env=key_env,
        tenant=s.get("tenant", _str, ""),
        salted=s.get("salted", _bool, True),
        allow_client_salt=s.get("allow_client_salt", _choice(*CLIENT_SALT_MODES), "reject"),
    )
    if not out.tenant:
        raise ConfigError(s.sub("tenant"), "is required")
    s.finish()
    return out


def _tenants(s: _Section, env: Mapping[str, str]) -> TenantsConfig:
    d = TenantsConfig()
    secret_env = s.get("secret_env", _env_name, d.secret_env)
    s.seen.add("keys")
    raw_keys = _structured(s.raw.get("keys"))
    entries: list[Any]
    if isinstance(raw_keys, Mapping):
        # DESIGN.md's form {sk-abc: {tenant: acme}}. Paths use the position, never the key.
        entries = [
            {**(v if isinstance(v, Mapping) else {"tenant": v}), "key": k}
            for k, v in raw_keys.items()
        ]
    else:
        entries = _list(s.sub("keys"), raw_keys)
    keys = tuple(_tenant_key(f"{s.sub('keys')}[{i}]", e, env) for i, e in enumerate(entries))
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k.key in seen:
            raise ConfigError(
                f"{s.sub('keys')}[{i}]", f"has the same key as {s.sub('keys')}[{seen[k.key]}]"
            )
        seen[k.key] = i
    secret_text = env.get(secret_env)
    secret = secret_text.encode() if secret_text else None
    salted = [k.tenant for k in keys if k.salted]
    if salted and secret is None:
        raise ConfigError(
            s.sub("secret_env"),
            f"environment variable {secret_env} is not set; tenant {salted[0]!r} is salted "
            "and its salt is derived from this secret",
        )
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            s.sub("secret_env"),
            f"the secret in {secret_env} must be at least {MIN_SECRET_BYTES} bytes",
        )
    out = TenantsConfig(
        secret_env=secret_env,
        keys=keys,
        allow_anonymous=s.get("allow_anonymous", _bool, d.allow_anonymous),
        anonymous_tenant=s.get("anonymous_tenant", _str, d.anonymous_tenant),
        secret=secret,
    )
    s.finish()
    return out


def _proxy(s: _Section) -> ProxyConfig:
    d = ProxyConfig()
    out = ProxyConfig(
        connect_timeout_s=s.get("connect_timeout_s", _pos_number, d.connect_timeout_s),
        first_token_timeout_s=s.get("first_token_timeout_s", _pos_number, d.first_token_timeout_s),
        idle_timeout_s=s.get("idle_timeout_s", _pos_number, d.idle_timeout_s),
        max_retries=s.get("max_retries", _nonneg_int, d.max_retries),
        retry_budget_ratio=s.get("retry_budget_ratio", _fraction, d.retry_budget_ratio),
        hold_until_content=s.get("hold_until_content", _bool, d.hold_until_content),
        max_body_bytes=s.get("max_body_bytes", _pos_int, d.max_body_bytes),
        expose_routing_headers=s.get("expose_routing_headers", _bool, d.expose_routing_headers),
        tokenize_mode=s.get("tokenize_mode", _choice(*TOKENIZE_MODES), d.tokenize_mode),
    )
    s.finish()
    return out


def _limits(s: _Section) -> LimitsConfig:
    d = LimitsConfig()
    out = LimitsConfig(
        global_concurrency=s.get("global_concurrency", _pos_int, d.global_concurrency),
        per_replica_concurrency=s.get(
            "per_replica_concurrency", _pos_int, d.per_replica_concurrency
        ),
        queue_size=s.get("queue_size", _nonneg_int, d.queue_size),
        queue_timeout_s=s.get("queue_timeout_s", _nonneg_number, d.queue_timeout_s),
        max_n=s.get("max_n", _pos_int, d.max_n),
        max_tokens_limit=s.get("max_tokens_limit", _pos_int, d.max_tokens_limit),
    )
    s.finish()
    return out


def _health(s: _Section) -> HealthConfig:
    d = HealthConfig()
    out = HealthConfig(
        interval_s=s.get("interval_s", _pos_number, d.interval_s),
        timeout_s=s.get("timeout_s", _pos_number, d.timeout_s),
        eject_after_failures=s.get("eject_after_failures", _pos_int, d.eject_after_failures),
        eject_base_s=s.get("eject_base_s", _pos_number, d.eject_base_s),
        eject_max_s=s.get("eject_max_s", _pos_number, d.eject_max_s),
        scrape_interval_s=s.get("scrape_interval_s", _pos_number, d.scrape_interval_s),
    )
    if out.eject_max_s < out.eject_base_s:
        raise ConfigError(
            s.sub("eject_max_s"),
            f"must be >= eject_base_s ({out.eject_base_s}), got {out.eject_max_s}",
        )
    s.finish()
    return out


def build_config(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Validate a raw mapping (the YAML file's shape) into a GatewayConfig."""
    env = {} if env is None else env
    top = _Section("", _expand_shorthands(dict(raw)))
    models = _models(top)
    config = GatewayConfig(
        listen=_listen(top.section("listen")),
        models=MappingProxyType(models),
        replicas=_replicas(top, models),
        index=_index(top.section("index"), env),
        policy=_policy(top.section("policy")),
        tenants=_tenants(top.section("tenants"), env),
        proxy=_proxy(top.section("proxy")),
        limits=_limits(top.section("limits")),
        health=_health(top.section("health")),
    )
    top.finish()
    return config


# --------------------------------------------------------------------- layering sources

# A top-level key given a scalar stands for one field of its section.
_SHORTHANDS = {"index": "backend", "policy": "name"}
# A list item given a scalar stands for one field of the item (a replica's url).
_ITEM_SHORTHANDS = {"replicas": "url"}
_TOP_KEYS = (
    "listen",
    "models",
    "model_dir",
    "model_name",
    "replicas",
    "index",
    "policy",
    "tenants",
    "proxy",
    "limits",
    "health",
)


def _expand_shorthands(raw: dict[str, Any]) -> dict[str, Any]:
    for key, field_name in _SHORTHANDS.items():
        value = raw.get(key)
        if isinstance(value, str):
            raw[key] = {field_name: value}
    return raw


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
    path: str | None, env: Mapping[str, str], overrides: Sequence[str]
) -> GatewayConfig:
    """Build the config from a YAML file, then CACHEROUTE_* env vars, then KEY=VALUE overrides."""
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
    return build_config(raw, env)


# ------------------------------------------------------------------------------ flags


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config, --set and shortcuts for the most common settings to `parser`."""
    g = parser.add_argument_group("configuration (file, then CACHEROUTE_* env, then these flags)")
    g.add_argument("--config", metavar="FILE", help="gateway YAML file (see examples/gateway.yaml)")
    g.add_argument("--host", help="listen address (listen.host)")
    g.add_argument("--port", help="listen port (listen.port)")
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
