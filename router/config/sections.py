"""The gateway's config sections: each is the settings object its component takes.

One definition and one set of defaults per knob: the Fleet takes `HealthConfig`, the
Forwarder `ProxyConfig`, admission and the request edge `LimitsConfig`. Built and
validated by router.config.build; see router/config/__init__.py for the sources.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from router.hashing import HashConfig
from router.policy.types import PolicyConfig, PrefillProfile

ENV_PREFIX = "CACHEROUTE_"
DEFAULT_SECRET_ENV = "CACHEROUTE_SALT_SECRET"
CLIENT_SALT_MODES = ("reject", "namespace")
TOKENIZE_MODES = ("local", "remote")
MIN_SECRET_BYTES = 16

class ConfigError(ValueError):
    """A setting is missing or invalid; the message starts with its key path."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)



@dataclass(frozen=True)
class ListenConfig:
    """Where the gateway listens."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Worker processes sharing the port (SO_REUSEPORT); more than 1 needs a shared
    # (Redis) index, since each worker would otherwise keep an index of its own.
    workers: int = 1
    # The event loop each process runs on: "asyncio" or "uvloop" (router/event_loop.py
    # says what each measured).
    event_loop: str = "asyncio"
    # A connection must send each request's headers and body within this (slowloris and
    # half-open clients otherwise hold a socket and a task each; router/read_deadline.py).
    request_read_timeout_s: float = 30.0
    # The completion endpoints' plain HTTP/1.1 requests are read by the gateway's own
    # protocol, not aiohttp's server (router/front_http.py says why and what it takes).
    fast_front: bool = True
    # The garbage collector's young-generation threshold while serving, in net new
    # container objects between collections (Python's default is 700; router/app.py says
    # what each measured).
    gc_young_threshold: int = 10_000
    # When set, /ready and /metrics move off the API port to this one (router/admin.py),
    # bound on admin_host (default: host); see docs/SECURITY.md.
    admin_port: int | None = None
    admin_host: str | None = None


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
    # rediss:// only: the CA bundle that verifies the Redis server's certificate.
    tls_ca_file: str | None = None
    # Redis only: gateways share the token ids of long prompt pieces (system prompts,
    # tools, histories) once two of them had to encode one, kept segment_ttl_s
    # (router/shared_segments.py; 4 bytes a token).
    share_segments: bool = True
    segment_ttl_s: float = 600.0
    # Redis only: this gateway subscribes to the replicas' KV events itself and answers
    # lookups from that mirror, in-process; Redis keeps the chains recorded for replicas
    # without events (router/index/mirror.py). Off: every lookup is a Redis round trip.
    mirror_events: bool = True

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
    min_retry_budget: int = 3  # retries allowed at once even with few requests in flight
    backoff_base_s: float = 0.01  # full-jitter backoff between attempts, doubling
    backoff_max_s: float = 0.2
    hold_until_content: bool = True
    # A streamed answer's head goes to the client once the first replica accepted the
    # stream, not with its first token: for clients or proxies in front that time out a
    # response with no head during a long prefill. Off by default: a request failed
    # everywhere then gets an error event, not an error status (router/proxy.py).
    early_head: bool = False
    # A burst's routing work (parse, tokenize, hash, decide) in arrival order, not
    # interleaved: the first requests go upstream first (router/arrival_order.py). Off
    # by default: it helped agent bursts on 4 sims and hurt them on 8 (results/README.md).
    route_in_arrival_order: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    # Each answer says where it went and why (x-cacheroute-replica, -predicted-cached-
    # tokens, -predicted-ttft-ms, and -candidates: every replica ranked, with what the
    # policy predicted there) and where the gateway's time went (Server-Timing: parse,
    # route, hold, gate, admit, upstream; router/completions.py Stages). Off by default:
    # they describe the fleet to every client.
    expose_routing_headers: bool = False
    tokenize_mode: str = "local"
    # A request that fails as its replica dies is refused this long (router/suspects.py),
    # at most this many fingerprints kept; the probe asks the failed replica's /health.
    suspect_ttl_s: float = 300.0
    suspect_capacity: int = 10_000
    suspect_probe_timeout_s: float = 1.0


@dataclass(frozen=True)
class LimitsConfig:
    """Admission limits and request-size limits."""

    global_concurrency: int = 1024
    per_replica_concurrency: int = 256
    queue_size: int = 1024
    queue_timeout_s: float = 30.0
    max_n: int = 16
    max_tokens_limit: int = 131072
    # Prompt blocks whose keys the gateway remembers so a conversation's next turn hashes
    # only its new blocks (router.routing.ChainCache): about 130 bytes each (tracemalloc,
    # new 8k-token prompts; 200 while every block had a fingerprint; a branch counts its
    # shared prefix again, at 16 bytes a block), so the default holds ~65 MB at most; a
    # soak plateaus once it is full.
    chain_cache_blocks: int = 500_000


@dataclass(frozen=True)
class HealthConfig:
    """Health checks, ejection after failures (exponential backoff), metrics scraping."""

    interval_s: float = 2.0
    timeout_s: float = 1.0
    eject_after_failures: int = 3
    eject_base_s: float = 5.0
    eject_max_s: float = 60.0
    scrape_interval_s: float = 1.0
    # Not a key of its own: the shortest replicas[].dns_refresh_s, set by build_config.
    dns_interval_s: float = 10.0


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
