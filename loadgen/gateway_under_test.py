"""Our gateway in a comparison: its config, its process (and indexer), its cost profile.

The gateway is configured as a user would configure it (`--gateway-profile`):

- calibrated (the default): its prefill profile is what `python -m replica calibrate`
  fits against one of the replicas, as docs/POLICY.md tells an operator to do. The fit
  sees what a client sees (HTTP, tokenization, noise), not the sims' coefficients.
- default: no prefill profile at all; the gateway's built-in one (the tiny model as
  measured on a CPU), whatever the replicas are.
- exact: the sims' own coefficients, a control no user has.

The report names the choice and the profile the gateway ran with.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadgen.harness import MODEL_NAME, REPO, HarnessError, LoggedProcess
from loadgen.target_fleet import TargetFleet
from replica.processes import free_port
from replica.profiles import SimCostProfile, load_profile

GATEWAY_PROFILES = ("calibrated", "default", "exact")
DEFAULT_GATEWAY_PROFILE = "calibrated"
# Prompt lengths calibrate measures (those under the run's max_model_len): up to 8k, so
# the quadratic (attention) term is measured where it matters, not extrapolated from
# short prompts where it hides in the noise.
CALIBRATE_LENGTHS = (64, 256, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class GatewayProfile:
    """How our gateways predict prefill: which choice, and the config it gives them."""

    choice: str
    prefill: dict[str, float] | None  # the config's policy.prefill; None: built-in

    def describe(self) -> str:
        """For reports: the choice and the coefficients the gateway ran with."""
        if self.prefill is None:
            return f"{self.choice} (the gateway's built-in prefill profile)"
        return (f"{self.choice} (wall seconds): "
                + ", ".join(f"{k}={v:.3g}" for k, v in self.prefill.items()))


def gateway_prefill(profile: SimCostProfile) -> dict[str, float]:
    """A sim cost profile as the gateway's `policy.prefill` config.

    Both charge attention per (query, key) pair, new x (cached + (new + 1) / 2), so the
    gateway predicts a lone request's prefill exactly as the sim runs it.
    """
    return {"base_s": profile.base_s, "per_token_s": profile.token_s,
            "per_token_context_s": profile.attention_s}


def calibrate(url: str, out: Path, max_model_len: int) -> SimCostProfile:
    """Run `python -m replica calibrate` against one replica, as a user would.

    The fit is in wall seconds, as the gateway that uses it: its queues drain, its
    holds wait and its first bytes are timed by the wall clock, whatever the sims'
    --time-scale (sims K times faster are, to the gateway, replicas K times faster).
    """
    lengths = [n for n in CALIBRATE_LENGTHS if n < max_model_len - 16]
    proc = subprocess.run(
        [sys.executable, "-m", "replica", "calibrate", "--url", url, "--model", MODEL_NAME,
         "--lengths", ",".join(map(str, lengths)), "--repeats", "3", "--decode-tokens", "4",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise HarnessError(f"replica calibrate against {url} failed:\n{proc.stderr[-2000:]}")
    return load_profile(str(out))


def wall_profile(profile: SimCostProfile, time_scale: float) -> SimCostProfile:
    """A sim cost profile (simulated seconds) as seen on the wall clock of sims running
    `time_scale` times faster than real time."""
    return SimCostProfile(profile.name, *(v / time_scale for v in (
        profile.base_s, profile.token_s, profile.attention_s, profile.kv_read_s)))


def choose_profile(args: argparse.Namespace, fleet: TargetFleet, log_dir: Path) -> GatewayProfile:
    """The gateway profile `--gateway-profile` asks for (calibrating once if asked), in
    wall seconds (see calibrate). Until 2026-12-07 both were in simulated seconds, K
    times the replicas' wall-clock speed: with --time-scale 2 every gateway started 2x
    pessimistic and its learned bias had to bring it down to about 0.5, which one
    gateway learned within its first readings and 4 gateways, each from a quarter of
    them, learned over the whole run."""
    choice = args.gateway_profile
    if choice == "default":
        return GatewayProfile(choice, None)
    if choice == "exact":
        if args.replica_kind != "sim":
            raise HarnessError("--gateway-profile exact needs sims (real vLLM has no "
                               "profile to copy): use calibrated or default")
        return GatewayProfile(choice, gateway_prefill(
            wall_profile(load_profile(args.prefill_profile), args.time_scale)))
    fitted = calibrate(fleet.replicas[0].url, log_dir / "calibrated.json", fleet.max_model_len)
    return GatewayProfile(choice, gateway_prefill(fitted))


def gateway_config(policy: str, fleet: TargetFleet, port: int, index: str, model_dir: Path,
                   seed: int, prefill: dict[str, float] | None,
                   overrides: dict[str, Any] | None = None,
                   index_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway.yaml the harness runs a policy with (routing headers exposed).

    `prefill` None leaves the gateway's built-in profile. `overrides` (--policy-set) and
    `index_overrides` (--index-set) replace or add keys of `policy:` and `index:`.
    """
    policy_section: dict[str, Any] = {"name": policy, "seed": seed}
    if prefill is not None:
        policy_section["prefill"] = prefill
    other: dict[str, dict[str, Any]] = {}
    policy_keys: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        section, inner = _section_key(key)
        if section != "policy":  # `health.scrape_interval_s`: a key of another section
            other.setdefault(section, {})[inner] = value
        else:
            policy_keys[key] = value
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": {MODEL_NAME: {"tokenizer": str(model_dir), "max_model_len": fleet.max_model_len}},
        "replicas": [
            {"url": r.url, "name": r.name, "models": [MODEL_NAME],
             "block_size": fleet.block_size, "hash_algo": "sha256", "hash_seed": str(seed),
             "kv_events": r.kv_events, "kv_replay": r.kv_replay}
            for r in fleet.replicas
        ],
        "index": {"backend": index, **(index_overrides or {})},
        "policy": {**policy_section, **policy_keys},
        "tenants": {"allow_anonymous": True},
        "proxy": {"expose_routing_headers": True},
        # Health checks and metrics scrapes at the gateway's defaults, as users run it.
        # (The harness once checked every 0.5 s and scraped every 0.25 s; with the
        # defaults groups as chat measured p50 18.6 against 21.1 ms with one gateway,
        # 24.2 against 27.7 ms with four, p99 no worse: results/gateways-groups-x1x4-health.)
        "health": {},
    }
    for section, keys in other.items():
        config[section] = {**config[section], **keys}
    return config


# Sections of gateway.yaml other than `policy:` a variant may set (SECTION.KEY=VALUE);
# not listen.host, listen.port or index.backend, which the harness picks and connects to.
VARIANT_SECTIONS = ("health", "proxy", "limits", "listen", "index")
_HARNESS_KEYS = ("listen.host", "listen.port", "index.backend")


def _section_key(key: str) -> tuple[str, str]:
    """("policy", key) for a policy key; (SECTION, KEY) for `SECTION.KEY` naming a key of
    one of VARIANT_SECTIONS; a HarnessError for anything else."""
    section, dot, inner = key.partition(".")
    if not dot:
        return "policy", key
    if section not in VARIANT_SECTIONS or not inner or key in _HARNESS_KEYS:
        raise HarnessError(f"setting {key!r}: want a policy key, or SECTION.KEY for SECTION "
                           f"in {', '.join(VARIANT_SECTIONS)} (not {', '.join(_HARNESS_KEYS)})")
    return section, inner


def policy_variant(policy: str) -> tuple[str, dict[str, Any]]:
    """`cache_aware@work_weight=0@hot_cost_s=0.5` -> ("cache_aware", {those keys}).

    A variant is one of our policies with `policy:` keys of its own, so settings can be
    compared interleaved in one run (the machine's noise moves between runs, not within
    a round) instead of in separate runs with --policy-set. `SECTION.KEY=VALUE` sets a
    key of another section (`cache_aware@health.scrape_interval_s=1`).
    """
    name, *pairs = policy.split("@")
    out: dict[str, Any] = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or key == "name":
            raise HarnessError(f"policy variant {policy!r}: want NAME@KEY=VALUE, got {item!r}")
        try:
            _section_key(key)
        except HarnessError as exc:
            raise HarnessError(f"policy variant {policy!r}: {exc}") from None
        out[key] = yaml.safe_load(value)
    return name, out


def config_overrides(args: argparse.Namespace, dest: str = "policy_set") -> dict[str, Any]:
    """--policy-set (or --index-set) KEY=VALUE pairs as a dict, values parsed as YAML."""
    flag = "--" + dest.replace("_", "-")
    out: dict[str, Any] = {}
    for item in getattr(args, dest, None) or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise HarnessError(f"{flag} wants KEY=VALUE, got {item!r}")
        if key in ("name", "backend"):
            raise HarnessError(f"{flag} cannot change {key}; use --policies / --index")
        if dest == "policy_set":
            _section_key(key)
        out[key] = yaml.safe_load(value)
    return out


def overrides_note(args: argparse.Namespace) -> str:
    """For reports: the config keys --policy-set and --index-set changed."""
    changed = {**{f"policy.{k}": v for k, v in config_overrides(args).items()},
               **{f"index.{k}": v for k, v in config_overrides(args, "index_set").items()}}
    return ("settings: " + ", ".join(f"{k}={v}" for k, v in changed.items())) if changed else ""


def _gateway_ready(url: str) -> bool:
    """Ready once /ready says every replica is healthy: a policy must see the whole fleet."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    replicas = body.get("replicas") or []
    return bool(body.get("ready")) and all(r.get("state") == "healthy" for r in replicas)


def _all_listening(proc: LoggedProcess, workers: int) -> bool:
    return proc.log_tail(200_000).count(" listening on http") >= workers


@contextlib.contextmanager
def gateway(policy: str, fleet: TargetFleet, index: str, profile: GatewayProfile,
            args: argparse.Namespace, log_dir: Path, tag: str = "") -> Iterator[str]:
    """One gateway process (and its indexer on a Redis index) for one policy; yields its URL."""
    with gateways(policy, fleet, index, profile, args, log_dir, tag) as urls:
        yield urls[0]


@contextlib.contextmanager
def gateways(policy: str, fleet: TargetFleet, index: str, profile: GatewayProfile,
             args: argparse.Namespace, log_dir: Path, tag: str = "", count: int = 1,
             repo: Path = REPO) -> Iterator[list[str]]:
    """`count` gateway processes for one policy, sharing one index; yields their URLs.
    `repo`: the checkout whose code they (and the indexer) run.

    On a Redis index one indexer feeds it for all of them (issue #16: several gateways
    share one index); an in-memory index cannot be shared, so count > 1 needs Redis.
    """
    if count > 1 and not index.startswith("redis://"):
        raise HarnessError(f"--gateways {count} needs a Redis index to share (--index redis)")
    configs = []
    base, variant = policy_variant(policy)
    for i in range(count):
        config = gateway_config(base, fleet, free_port(), index, Path(args.model_dir),
                                args.seed, profile.prefill, {**config_overrides(args), **variant},
                                config_overrides(args, "index_set"))
        name = f"{policy}{tag}" + (f"-g{i}" if count > 1 else "")
        path = log_dir / f"gateway-{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        configs.append((name, path, int(config["listen"]["port"])))
    workers = int(config["listen"].get("workers", 1))  # every instance alike
    cpus: frozenset[int] | None = getattr(args, "router_cpu_set", None)  # --router-cpus
    path = configs[0][1]
    name = f"{policy}{tag}"
    procs: list[LoggedProcess] = []
    try:
        if index.startswith("redis://"):
            # A gateway on a Redis index reads it but does not feed it: the indexer does,
            # from the replicas' KV events. Started first and synced before any request.
            # Leased, as the chart runs it (its stored positions seed a starting
            # gateway's mirror of the events).
            indexer = LoggedProcess(f"indexer-{name}", [
                sys.executable, "-m", "router", "indexer", "--config", str(path), "--lease",
                "--log-level", "INFO"], cpus=getattr(args, "index_cpu_set", None) or cpus,
                cwd=repo)
            procs.append(indexer)
            indexer.start(log_dir)
            # Its replay of the replicas' histories applied: until then the index shows
            # them oldest first (the previous runs' prefixes, before each reset's clear).
            indexer.wait_until(lambda: any(
                line in indexer.log_tail(20_000)
                for line in ("caught up with ", "still catching up after ")))
        urls = []
        for gw_name, gw_path, port in configs:
            proc = LoggedProcess(f"gateway-{gw_name}",
                                 [sys.executable, "-m", "router", "serve", "--config",
                                  str(gw_path), "--shutdown-timeout", "2"], cpus=cpus, cwd=repo)
            procs.append(proc)
            proc.start(log_dir)
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs[-count:], urls, strict=True):
            proc.wait_until(functools.partial(_gateway_ready, url))
            if workers > 1:
                # /ready answers from whichever worker listens first; a worker listens
                # only once it is set up, and says so: wait for all of them.
                proc.wait_until(functools.partial(_all_listening, proc, workers))
        yield urls
    finally:
        for p in reversed(procs):
            p.stop()
