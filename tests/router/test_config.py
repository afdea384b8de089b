"""GatewayConfig: file, then env, then flags; every error names its key path."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from router.config import (
    ConfigError,
    GatewayConfig,
    add_config_arguments,
    build_config,
    config_from_args,
    env_overrides,
    load_config,
    overrides_from_args,
)
from router.hashing import HashConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gateway.yaml"
ONE_REPLICA = ["replicas[0].url=http://127.0.0.1:9001"]
SECRET = "s" * 32


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def error_of(path: str | None, env: dict[str, str], overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env, overrides)
    return str(info.value)


def test_defaults_with_one_replica() -> None:
    config = load_config(None, {}, ONE_REPLICA)
    assert config.listen.host == "127.0.0.1" and config.listen.port == 8000
    assert config.policy.name == "cache_aware"
    assert config.index.backend == "memory" and config.index.deadline_ms == 10.0
    assert config.tenants.allow_anonymous is False
    assert config.proxy.hold_until_content is True
    assert config.proxy.early_head is False
    assert config.proxy.route_in_arrival_order is False
    assert config.proxy.expose_routing_headers is False
    (replica,) = config.replicas
    assert replica.name == "127.0.0.1:9001"
    assert replica.hash == HashConfig("sha256", 16, None)


def test_example_file_exercises_every_section(tmp_path: Path) -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert set(raw) >= {
        "listen",
        "models",
        "replicas",
        "index",
        "policy",
        "tenants",
        "proxy",
        "limits",
        "health",
    }
    env = {"CACHEROUTE_SALT_SECRET": SECRET, "ACME_API_KEY": "sk-acme-1", "DOCS_API_KEY": "sk-docs"}
    config = load_config(str(EXAMPLE), env, [f"models.tiny.tokenizer={tmp_path}"])
    assert config.models["tiny"].tokenizer == str(tmp_path)
    assert config.models["tiny"].max_model_len == 2048
    assert config.replicas[0].name == "sim-0"
    assert config.replicas[0].kv_events == "tcp://127.0.0.1:5557"
    assert config.replicas[0].prefill is not None
    assert [k.tenant for k in config.tenants.keys] == ["acme", "docs-bot"]
    assert config.tenants.keys[0].key == "sk-acme-1"
    assert config.tenants.keys[1].salted is False
    assert config.tenants.secret == SECRET.encode()
    assert config.served_models() == {"tiny"}


def _flag(command: str, name: str) -> str:
    words = command.split()
    return words[words.index(name) + 1]


def test_the_readmes_running_it_commands_fit_the_example_file(tmp_path: Path) -> None:
    # README.md's "Running it" starts a sim and serves examples/gateway.yaml: each flag
    # and variable there must be what the example expects, or the commands fail as shown.
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Running it"):text.index("`examples/gateway.yaml` shows")]
    commands = " ".join(line.strip().rstrip("\\") for line in section.splitlines())
    sim = commands[commands.index("python -m replica sim"):]
    exported = commands[commands.index("export "):].split("python -m router serve")[0]
    env = {name: "s" * 32 if value.startswith("$(") else value  # $(openssl rand -hex 16)
           for name, _, value in (pair.partition("=") for pair in exported.split()[1:])
           if value}
    tiny = _flag(commands, "--out")
    # The example names the directory the README's tiny-model command writes; the config
    # checks it exists, which it need not on a machine that has not run that command.
    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["models"]["tiny"]["tokenizer"] == tiny == _flag(sim, "--model")
    config = load_config(str(EXAMPLE), env, [f"models.tiny.tokenizer={tmp_path}"])
    assert config.models["tiny"].tokenizer == str(tmp_path)
    (replica,) = config.replicas
    assert replica.url == f"http://127.0.0.1:{_flag(sim, '--port')}"
    assert replica.hash.block_size == int(_flag(sim, "--block-size"))
    assert (replica.kv_events, replica.kv_replay) == (_flag(sim, "--kv-events"),
                                                      _flag(sim, "--kv-replay"))
    assert config.served_models() == {_flag(sim, "--served-model-name")}
    assert f"localhost:{config.listen.port}/v1/completions" in commands


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["replicas[0].url=http://a:1", "replicas[0].block_size=x"],
            "replicas[0].block_size: must be a positive integer, got 'x'",
        ),
        (
            [
                "replicas[0].url=http://a:1",
                "replicas[1].url=http://b:1",
                "replicas[1].block_size=0",
            ],
            "replicas[1].block_size: must be a positive integer, got 0",
        ),
        (
            ["replicas[0].url=http://a:1", "replicas[0].hash_algo=md5"],
            "replicas[0].hash_algo: must be one of sha256, sha256_cbor, xxhash, xxhash_cbor",
        ),
        (["replicas[0].url=ftp://a:1"], "replicas[0].url: must be an http(s) URL"),
        (["replicas[0].dns=nohost"], "replicas[0].dns: must be host:port"),
        (["replicas[0].name=x"], "replicas[0]: needs exactly one of url or dns"),
        (
            ["replicas[0].url=http://a:1", "replicas[0].kv_events=10.0.0.1:5557"],
            "replicas[0].kv_events: must be a ZMQ endpoint",
        ),
        (
            ["replicas[0].url=http://a:1", "replicas[0].colour=red"],
            "replicas[0].colour: unknown key",
        ),
        (
            ["replicas[0].url=http://a:1", "replicas[1].url=http://a:1"],
            "replicas[1].name: 'a:1' is also replicas[0]'s name",
        ),
        (["replicas[0].url=http://a:1", "listen.port=70000"], "listen.port: must be a TCP port"),
        (
            ["replicas[0].url=http://a:1", "policy.name=fastest"],
            "policy.name: must be one of random, round_robin, least_loaded, session_affinity, cache_aware",
        ),
        (
            ["replicas[0].url=http://a:1", "policy.weights.magic=1"],
            "policy.weights.magic: unknown scorer",
        ),
        (
            ["replicas[0].url=http://a:1", "policy.kv_threshold=1.5"],
            "policy.kv_threshold: must be at most 1.0",
        ),
        (
            ["replicas[0].url=http://a:1", "policy.defer_cap=-1"],
            "policy.defer_cap: must not be negative, got -1.0",
        ),
        (
            ["replicas[0].url=http://a:1", "policy.hold_cap=-0.5"],
            "policy.hold_cap: must not be negative, got -0.5",
        ),
        (
            ["replicas[0].url=http://a:1", "index.backend=postgres://x"],
            "index.backend: must be 'memory' or a redis:// URL",
        ),
        (
            ["replicas[0].url=http://a:1", "index.password_env=NOPE_PW"],
            "index.password_env: environment variable NOPE_PW is not set",
        ),
        (
            ["replicas[0].url=http://a:1", "listen.event_loop=trio"],
            "listen.event_loop: must be one of asyncio, uvloop",
        ),
        (
            ["replicas[0].url=http://a:1", "proxy.tokenize_mode=guess"],
            "proxy.tokenize_mode: must be one of local, remote",
        ),
        (
            ["replicas[0].url=http://a:1", "proxy.hold_until_content=maybe"],
            "proxy.hold_until_content: must be true or false, got 'maybe'",
        ),
        (
            ["replicas[0].url=http://a:1", "proxy.early_head=soon"],
            "proxy.early_head: must be true or false, got 'soon'",
        ),
        (
            ["replicas[0].url=http://a:1", "proxy.route_in_arrival_order=sometimes"],
            "proxy.route_in_arrival_order: must be true or false, got 'sometimes'",
        ),
        (
            ["replicas[0].url=http://a:1", "limits.max_n=-1"],
            "limits.max_n: must be a positive integer, got -1",
        ),
        (
            ["replicas[0].url=http://a:1", "health.eject_base_s=10", "health.eject_max_s=5"],
            "health.eject_max_s: must be >= eject_base_s",
        ),
        (
            ["replicas[0].url=http://a:1", "models.m.max_model_len=10"],
            "models.m.tokenizer: is required",
        ),
        (
            ["replicas[0].url=http://a:1", "model_dir=/definitely/not/here"],
            "model_dir: directory '/definitely/not/here' does not exist",
        ),
        (
            ["replicas[0].url=http://a:1", "tenants.keys[0].tenant=acme"],
            "tenants.keys[0]: needs exactly one of key or key_env",
        ),
        (
            [
                "replicas[0].url=http://a:1",
                "tenants.keys[0].key_env=ACME_KEY",
                "tenants.keys[0].tenant=a",
            ],
            "tenants.keys[0].key_env: environment variable ACME_KEY is not set",
        ),
        (
            [
                "replicas[0].url=http://a:1",
                "tenants.keys[0].key=k",
                "tenants.keys[0].tenant=a",
                "tenants.keys[0].allow_client_salt=maybe",
            ],
            "tenants.keys[0].allow_client_salt: must be one of reject, namespace",
        ),
        (
            ["replicas[0].url=http://a:1", "tenants.keys[0].key=k", "tenants.keys[0].tenant=a"],
            "tenants.secret_env: environment variable CACHEROUTE_SALT_SECRET is not set; tenant 'a' is salted",
        ),
        (["replicas[0].url=http://a:1", "nonsense.key=1"], "nonsense: unknown key"),
        ([], "replicas: at least one replica is required"),
        (["replicas[2].url=http://a:1"], "replicas[2]: index 2 skips items: the list has 0"),
        (["policy..name=x"], "policy..name: is not a valid key path"),
        (["policy.name"], "policy.name: an override must be KEY=VALUE"),
    ],
)
def test_errors_name_the_key_path(overrides: list[str], expected: str) -> None:
    assert error_of(None, {}, overrides).startswith(expected)


def test_xxhash_without_seed_fails_with_the_hashing_explanation() -> None:
    message = error_of(None, {}, ["replicas[0].url=http://a:1", "replicas[0].hash_algo=xxhash"])
    assert message.startswith("replicas[0].hash_seed: hash algorithm 'xxhash' without a seed")
    assert "PYTHONHASHSEED" in message
    ok = load_config(
        None,
        {},
        ["replicas[0].url=http://a:1", "replicas[0].hash_algo=xxhash", "replicas[0].hash_seed=0"],
    )
    assert ok.replicas[0].hash == HashConfig("xxhash", 16, "0")


def test_yaml_int_seed_means_the_same_text(tmp_path: Path) -> None:
    path = write(tmp_path, {"replicas": [{"url": "http://a:1", "hash_seed": 0}]})
    assert load_config(path, {}, []).replicas[0].hash_seed == "0"


def test_file_errors_name_list_positions(tmp_path: Path) -> None:
    path = write(
        tmp_path, {"replicas": [{"url": "http://a:1"}, {"url": "http://b:1", "block_size": "x"}]}
    )
    assert error_of(path, {}, []) == "replicas[1].block_size: must be a positive integer, got 'x'"


def test_strings_in_the_file_are_not_silently_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, {"replicas": ["http://a:1"], "listen": {"port": "8000"}})
    assert error_of(path, {}, []) == "listen.port: must be a positive integer, got '8000'"


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "replicas": ["http://a:1"],
            "listen": {"port": 1111, "host": "0.0.0.0"},
            "policy": {"name": "random", "tolerance": 0.3},
        },
    )
    from_file = load_config(path, {}, [])
    assert (from_file.listen.port, from_file.policy.name) == (1111, "random")
    env = {"CACHEROUTE_LISTEN__PORT": "2222", "CACHEROUTE_POLICY__NAME": "least_loaded"}
    from_env = load_config(path, env, [])
    assert (from_env.listen.port, from_env.policy.name) == (2222, "least_loaded")
    assert from_env.listen.host == "0.0.0.0" and from_env.policy.tolerance == 0.3
    from_flags = load_config(path, env, ["listen.port=3333"])
    assert (from_flags.listen.port, from_flags.policy.name) == (3333, "least_loaded")


def test_env_nesting_lists_and_shorthands() -> None:
    env = {
        "CACHEROUTE_REPLICAS__0__URL": "http://a:1",
        "CACHEROUTE_REPLICAS__0__MODELS": "m1, m2",
        "CACHEROUTE_REPLICAS__1": "http://b:2",
        "CACHEROUTE_INDEX": "redis://127.0.0.1:6379/0",
        "CACHEROUTE_INDEX__DEADLINE_MS": "3",
        "CACHEROUTE_PROXY__EXPOSE_ROUTING_HEADERS": "yes",
        "CACHEROUTE_SALT_SECRET": SECRET,  # not a setting: no __ and not a top-level key
        "CACHEROUTE_TINY_MODEL": "/tmp/x",
        "OTHER__THING": "ignored",
    }
    config = load_config(None, env, [])
    assert [r.url for r in config.replicas] == ["http://a:1", "http://b:2"]
    assert config.replicas[0].models == ("m1", "m2")
    assert config.index.backend == "redis://127.0.0.1:6379/0" and config.index.deadline_ms == 3.0
    assert config.proxy.expose_routing_headers is True
    assert config.tenants.secret == SECRET.encode()


def test_env_errors_name_the_variable() -> None:
    message = error_of(None, {"CACHEROUTE_POLCY__NAME": "x"}, ONE_REPLICA)
    assert message.startswith(
        "polcy: unknown key (from environment variable CACHEROUTE_POLCY__NAME)"
    )


def test_text_values_keep_their_text_for_string_keys() -> None:
    config = load_config(
        None, {}, [*ONE_REPLICA, "tenants.anonymous_tenant=no", "tenants.allow_anonymous=true"]
    )
    assert config.tenants.anonymous_tenant == "no"
    assert config.tenants.allow_anonymous is True


def test_structured_override_values() -> None:
    config = load_config(
        None,
        {},
        [
            'replicas=[{url: "http://a:1", block_size: 32}, "http://b:2"]',
            "policy.weights={ttft: 1, prefix: 0.5}",
        ],
    )
    assert [r.block_size for r in config.replicas] == [32, 16]
    assert dict(config.policy.weights) == {"ttft": 1.0, "prefix": 0.5}


def test_defer_cap_defaults_to_half_and_null_lifts_it() -> None:
    assert load_config(None, {}, ["replicas[0].url=http://a:1"]).policy.defer_cap == 0.5
    lifted = load_config(None, {}, ["replicas[0].url=http://a:1", "policy.defer_cap=null"])
    assert lifted.policy.defer_cap is None
    assert load_config(None, {}, ["replicas[0].url=http://a:1",
                                  "policy.defer_cap=2"]).policy.defer_cap == 2.0


def test_tenant_keys_mapping_form_and_secrets_stay_out_of_messages_and_reprs() -> None:
    raw: dict[str, Any] = {
        "replicas": ["http://a:1"],
        "tenants": {"keys": {"sk-secret-abc": {"tenant": "acme"}, "sk-other": {"tenant": 7}}},
    }
    with pytest.raises(ConfigError) as info:
        build_config(raw, {"CACHEROUTE_SALT_SECRET": SECRET})
    assert str(info.value).startswith("tenants.keys[1].tenant: must be a non-empty string")
    assert "sk-" not in str(info.value)
    raw["tenants"]["keys"]["sk-other"] = {"tenant": "other", "salted": False}
    config = build_config(raw, {"CACHEROUTE_SALT_SECRET": SECRET})
    assert {k.tenant: k.key for k in config.tenants.keys} == {
        "acme": "sk-secret-abc",
        "other": "sk-other",
    }
    text = repr(config)
    assert "sk-secret-abc" not in text and SECRET not in text


def test_duplicate_keys_are_rejected_without_echoing_them() -> None:
    env = {"K1": "sk-same", "K2": "sk-same"}
    message = error_of(
        None,
        env,
        [
            *ONE_REPLICA,
            "tenants.keys[0].key_env=K1",
            "tenants.keys[0].tenant=a",
            "tenants.keys[0].salted=false",
            "tenants.keys[1].key_env=K2",
            "tenants.keys[1].tenant=b",
            "tenants.keys[1].salted=false",
        ],
    )
    assert message == "tenants.keys[1]: has the same key as tenants.keys[0]"


def test_short_secret_is_rejected() -> None:
    message = error_of(None, {"CACHEROUTE_SALT_SECRET": "short"}, ONE_REPLICA)
    assert message.startswith(
        "tenants.secret_env: the secret in CACHEROUTE_SALT_SECRET must be at least 16 bytes"
    )


def test_models_and_model_dir(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 4096}')
    config = load_config(None, {}, [*ONE_REPLICA, f"model_dir={model}"])
    assert config.models["tiny"].tokenizer == str(model)
    assert config.models["tiny"].resolved_max_model_len() == 4096
    message = error_of(
        None,
        {},
        [f"model_dir={model}", "replicas[0].url=http://a:1", "replicas[0].models=[tiny, big]"],
    )
    assert message == "replicas[0].models[1]: unknown model 'big'; models has tiny"


def test_dns_replica_is_named_by_its_target() -> None:
    config = load_config(
        None, {}, ["replicas[0].dns=vllm.ns.svc.cluster.local:8000", "replicas[0].dns_refresh_s=5"]
    )
    (replica,) = config.replicas
    assert replica.name == "vllm.ns.svc.cluster.local:8000" and replica.url is None
    assert replica.dns_refresh_s == 5.0
    # The fleet re-resolves as often as the most eager DNS replica asks.
    assert config.health.dns_interval_s == 5.0
    assert load_config(None, {}, ["replicas[0].url=http://a:1"]).health.dns_interval_s == 10.0


def test_proxy_retry_floor_and_backoff_are_settings() -> None:
    config = load_config(None, {}, ["replicas[0].url=http://a:1", "proxy.min_retry_budget=0",
                                    "proxy.backoff_base_s=0.05", "proxy.backoff_max_s=1"])
    assert (config.proxy.min_retry_budget, config.proxy.backoff_base_s,
            config.proxy.backoff_max_s) == (0, 0.05, 1.0)


def test_flags_map_onto_dotted_overrides() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(
        [
            "--port",
            "9000",
            "--policy",
            "round_robin",
            "--replica",
            "http://a:1",
            "--replica",
            "http://b:2",
            "--index",
            "memory",
            "--set",
            "limits.max_n=4",
            "--set",
            "listen.port=9100",
        ]
    )
    assert overrides_from_args(args)[0] == "listen.port=9000"
    config = config_from_args(args, env={"CACHEROUTE_LISTEN__PORT": "1"})
    # --set comes after the shortcuts, so the later --set wins over --port.
    assert config.listen.port == 9100
    assert config.policy.name == "round_robin"
    assert [r.name for r in config.replicas] == ["a:1", "b:2"]
    assert config.limits.max_n == 4


def test_replica_flag_replaces_the_files_replicas(tmp_path: Path) -> None:
    path = write(tmp_path, {"replicas": [{"url": "http://a:1", "block_size": 32}]})
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--config", path, "--replica", "http://c:3"])
    config = config_from_args(args, env={})
    assert [r.url for r in config.replicas] == ["http://c:3"]
    assert config.replicas[0].block_size == 16
    # --set applies after --replica, so it can refine the replicas the flag gave.
    args = parser.parse_args(
        [
            "--config",
            path,
            "--replica",
            "http://c:3",
            "--set",
            "replicas[0].block_size=32",
            "--set",
            "replicas[1]=http://d:4",
        ]
    )
    config = config_from_args(args, env={})
    assert [(r.url, r.block_size) for r in config.replicas] == [
        ("http://c:3", 32),
        ("http://d:4", 16),
    ]


def test_config_is_frozen() -> None:
    config = load_config(None, {}, ONE_REPLICA)
    with pytest.raises(AttributeError):
        config.listen.port = 1  # type: ignore[misc]
    assert isinstance(config, GatewayConfig)


@given(st.integers(min_value=1, max_value=65535), st.integers(min_value=1, max_value=4096))
def test_env_integers_roundtrip(port: int, block_size: int) -> None:
    env = {
        "CACHEROUTE_LISTEN__PORT": str(port),
        "CACHEROUTE_REPLICAS__0__URL": "http://a:1",
        "CACHEROUTE_REPLICAS__0__BLOCK_SIZE": f" {block_size} ",
    }
    config = load_config(None, env, [])
    assert config.listen.port == port
    assert config.replicas[0].block_size == block_size == config.replicas[0].hash.block_size


@given(st.text(alphabet=st.characters(categories=["L", "N"]), min_size=1, max_size=12))
def test_env_overrides_only_take_known_top_level_names(name: str) -> None:
    key = f"CACHEROUTE_{name.upper()}"
    pairs = env_overrides({key: "v"})
    if name.lower() in (
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
    ):
        assert pairs == [(name.lower(), "v")]
    else:
        assert pairs == []


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert error_of(missing, {}, []).startswith(f"config: cannot read {missing}")
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    assert error_of(str(bad), {}, []).startswith(f"config: {bad} is not valid YAML")
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    assert error_of(str(listy), {}, []) == f"config: {listy} must hold a mapping at the top level"
    unknown = write(tmp_path, {"replicas": ["http://a:1"], "colour": "red"})
    assert error_of(unknown, {}, []).startswith("colour: unknown key; expected one of")


def test_shorthands_in_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"replicas": ["http://a:1"], "index": "redis://r:6379/0", "policy": "least_loaded"},
    )
    config = load_config(path, {}, ["index.deadline_ms=2", "policy.seed=5"])
    assert (config.index.backend, config.index.deadline_ms) == ("redis://r:6379/0", 2.0)
    assert (config.policy.name, config.policy.seed) == ("least_loaded", 5)


def test_redis_password_is_read_from_the_named_variable() -> None:
    config = load_config(
        None,
        {"REDIS_PW": "hunter2hunter2"},
        [*ONE_REPLICA, "index.backend=redis://r:6379/0", "index.password_env=REDIS_PW"],
    )
    assert config.index.password == "hunter2hunter2" and config.index.is_redis
    assert "hunter2" not in repr(config)


def test_replica_rekey_setting_is_validated_and_reaches_the_indexer(tmp_path: Path) -> None:
    from router.indexer import rekey_setting

    def replica(extra: str) -> str:
        return f"replicas:\n  - url: http://127.0.0.1:9\n    kv_events: tcp://127.0.0.1:5557\n{extra}"

    good = tmp_path / "good.yaml"
    good.write_text(replica("    rekey: auto\n"))
    cfg = load_config(str(good), {}, [])
    assert cfg.replicas[0].rekey == "auto"
    assert rekey_setting(cfg.replicas[0], "never") == (cfg.replicas[0].hash, "auto")
    bad = tmp_path / "bad.yaml"
    bad.write_text(replica("    rekey: sometimes\n"))
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.rekey"):
        load_config(str(bad), {}, [])
