"""A raw mapping (the YAML file's shape) -> a validated GatewayConfig, section by section."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from router.config.sections import (
    CLIENT_SALT_MODES,
    MIN_SECRET_BYTES,
    TOKENIZE_MODES,
    ConfigError,
    GatewayConfig,
    HealthConfig,
    IndexConfig,
    LimitsConfig,
    ListenConfig,
    ModelConfig,
    ProxyConfig,
    ReplicaConfig,
    TenantKeyConfig,
    TenantsConfig,
)
from router.config.values import (
    _bool,
    _choice,
    _fraction,
    _is_null,
    _list,
    _nonneg_int,
    _nonneg_number,
    _optional,
    _pos_int,
    _pos_number,
    _Section,
    _str,
    _str_list,
    _structured,
    _Text,
)
from router.event_loop import EVENT_LOOPS
from router.event_loop import missing as event_loop_missing
from router.hashing import HASH_ALGOS, HashConfig, UnknownSeedError
from router.policy.scorers import SCORERS
from router.policy.types import POLICY_NAMES, PolicyConfig, PrefillProfile


def _listen(s: _Section) -> ListenConfig:
    d = ListenConfig()
    port = s.get("port", _pos_int, d.port)
    if port > 65535:
        raise ConfigError(s.sub("port"), f"must be a TCP port (1-65535), got {port}")
    admin_port = s.get("admin_port", _optional(_pos_int), None)
    if admin_port is not None and (admin_port > 65535 or admin_port == port):
        raise ConfigError(s.sub("admin_port"), "must be a TCP port (1-65535) other than "
                          f"listen.port, got {admin_port}")
    loop = s.get("event_loop", _choice(*EVENT_LOOPS), d.event_loop)
    if (problem := event_loop_missing(loop)) is not None:
        raise ConfigError(s.sub("event_loop"), problem)
    out = ListenConfig(host=s.get("host", _str, d.host), port=port,
                       workers=s.get("workers", _pos_int, d.workers),
                       event_loop=loop,
                       request_read_timeout_s=s.get("request_read_timeout_s", _pos_number,
                                                    d.request_read_timeout_s),
                       fast_front=s.get("fast_front", _bool, d.fast_front),
                       gc_young_threshold=s.get("gc_young_threshold", _pos_int,
                                                d.gc_young_threshold),
                       admin_port=admin_port,
                       admin_host=s.get("admin_host", _optional(_str), None))
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
    if text == "memory" or re.match(r"^(redis|rediss|unix|redis\+sentinel|rediss\+sentinel)://\S+$",
                                    text):
        return text
    raise ConfigError(path, f"must be 'memory' or a redis:// URL (or rediss://, unix://, "
                      f"redis+sentinel://), got {text!r}")


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
        tls_ca_file=s.get("tls_ca_file", _optional(_str), None),
        share_segments=s.get("share_segments", _bool, d.share_segments),
        mirror_events=s.get("mirror_events", _bool, d.mirror_events),
        segment_ttl_s=s.get("segment_ttl_s", _pos_number, d.segment_ttl_s),
    )
    if out.tls_ca_file is not None and not out.backend.startswith("rediss"):
        raise ConfigError(s.sub("tls_ca_file"), f"needs a rediss:// backend, got {out.backend!r}")
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
        prefill_chunk_tokens=s.get("prefill_chunk_tokens", _pos_int, d.prefill_chunk_tokens),
        saturation_load=s.get("saturation_load", _pos_int, d.saturation_load),
        saturation_cost_s=s.get("saturation_cost_s", _nonneg_number, d.saturation_cost_s),
        kv_threshold=s.get("kv_threshold", _fraction, d.kv_threshold),
        kv_cost_s=s.get("kv_cost_s", _nonneg_number, d.kv_cost_s),
        hot_ratio=s.get("hot_ratio", _nonneg_number, d.hot_ratio),
        hot_slack=s.get("hot_slack", _nonneg_number, d.hot_slack),
        hot_cost_s=s.get("hot_cost_s", _nonneg_number, d.hot_cost_s),
        tolerance=s.get("tolerance", _nonneg_number, d.tolerance),
        pending_ttl_s=s.get("pending_ttl_s", _nonneg_number, d.pending_ttl_s),
        work_weight=s.get("work_weight", _nonneg_number, d.work_weight),
        work_relative=s.get("work_relative", _bool, d.work_relative),
        share_work=s.get("share_work", _bool, d.share_work),
        spread_ties=s.get("spread_ties", _bool, d.spread_ties),
        lanes=s.get("lanes", _bool, d.lanes),
        claim=s.get("claim", _bool, d.claim),
        shared_step=s.get("shared_step", _bool, d.shared_step),
        step_gate=s.get("step_gate", _bool, d.step_gate),
        fleet_waiting=s.get("fleet_waiting", _bool, d.fleet_waiting),
        defer_cap=s.get("defer_cap", _optional(_nonneg_number), d.defer_cap),
        hold_cap=s.get("hold_cap", _optional(_nonneg_number), d.hold_cap),
        hold_step_tokens=s.get("hold_step_tokens", _pos_int, d.hold_step_tokens),
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
        min_retry_budget=s.get("min_retry_budget", _nonneg_int, d.min_retry_budget),
        backoff_base_s=s.get("backoff_base_s", _nonneg_number, d.backoff_base_s),
        backoff_max_s=s.get("backoff_max_s", _nonneg_number, d.backoff_max_s),
        hold_until_content=s.get("hold_until_content", _bool, d.hold_until_content),
        early_head=s.get("early_head", _bool, d.early_head),
        route_in_arrival_order=s.get("route_in_arrival_order", _bool,
                                     d.route_in_arrival_order),
        max_body_bytes=s.get("max_body_bytes", _pos_int, d.max_body_bytes),
        expose_routing_headers=s.get("expose_routing_headers", _bool, d.expose_routing_headers),
        tokenize_mode=s.get("tokenize_mode", _choice(*TOKENIZE_MODES), d.tokenize_mode),
        suspect_ttl_s=s.get("suspect_ttl_s", _nonneg_number, d.suspect_ttl_s),
        suspect_capacity=s.get("suspect_capacity", _pos_int, d.suspect_capacity),
        suspect_probe_timeout_s=s.get("suspect_probe_timeout_s", _pos_number,
                                      d.suspect_probe_timeout_s),
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
        chain_cache_blocks=s.get("chain_cache_blocks", _pos_int, d.chain_cache_blocks),
    )
    s.finish()
    return out


def _health(s: _Section, replicas: tuple[ReplicaConfig, ...]) -> HealthConfig:
    d = HealthConfig()
    dns = [r.dns_refresh_s for r in replicas if r.dns]
    out = HealthConfig(
        interval_s=s.get("interval_s", _pos_number, d.interval_s),
        timeout_s=s.get("timeout_s", _pos_number, d.timeout_s),
        eject_after_failures=s.get("eject_after_failures", _pos_int, d.eject_after_failures),
        eject_base_s=s.get("eject_base_s", _pos_number, d.eject_base_s),
        eject_max_s=s.get("eject_max_s", _pos_number, d.eject_max_s),
        scrape_interval_s=s.get("scrape_interval_s", _pos_number, d.scrape_interval_s),
        dns_interval_s=min(dns) if dns else d.dns_interval_s,
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
    replicas = _replicas(top, models)
    config = GatewayConfig(
        listen=_listen(top.section("listen")),
        models=MappingProxyType(models),
        replicas=replicas,
        index=_index(top.section("index"), env),
        policy=_policy(top.section("policy")),
        tenants=_tenants(top.section("tenants"), env),
        proxy=_proxy(top.section("proxy")),
        limits=_limits(top.section("limits")),
        health=_health(top.section("health"), replicas),
    )
    top.finish()
    return config


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
