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

from router.config.build import build_config, url_name
from router.config.sections import (
    CLIENT_SALT_MODES,
    DEFAULT_SECRET_ENV,
    ENV_PREFIX,
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
from router.config.sources import (
    add_config_arguments,
    config_from_args,
    env_overrides,
    load_config,
    overrides_from_args,
)

__all__ = [
    "CLIENT_SALT_MODES", "DEFAULT_SECRET_ENV", "ENV_PREFIX", "MIN_SECRET_BYTES", "TOKENIZE_MODES",
    "ConfigError", "GatewayConfig", "HealthConfig", "IndexConfig", "LimitsConfig",
    "ListenConfig", "ModelConfig", "ProxyConfig", "ReplicaConfig", "TenantKeyConfig",
    "TenantsConfig", "add_config_arguments", "build_config", "config_from_args",
    "env_overrides", "load_config", "overrides_from_args", "url_name",
]
