"""The vLLM command line the launcher builds, and a real server started with it."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from replica.vllm_launcher import (
    API_SERVER_MODULE,
    VllmSettings,
    add_arguments,
    child_env,
    format_command,
    kv_events_config,
    settings_from_args,
    vllm_command,
)
from router.hashing import HashConfig

REPO = Path(__file__).resolve().parents[2]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_command_has_cache_flags_and_seed_env() -> None:
    settings = VllmSettings(
        model="/models/tiny", port=9001, block_size=32, hash_algo="sha256_cbor", seed="0",
        kv_events_port=5557, kv_replay_port=5558, served_model_name="tiny", gpu=False,
        available_cpus=(0, 1),
    )
    argv, env = vllm_command(settings)
    assert argv[1:3] == ["-m", API_SERVER_MODULE]
    assert _flag(argv, "--model") == "/models/tiny"
    assert _flag(argv, "--port") == "9001"
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--block-size") == "32"
    assert _flag(argv, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert _flag(argv, "--served-model-name") == "tiny"
    assert "--enable-prefix-caching" in argv
    assert "--enable-prompt-tokens-details" in argv
    events = json.loads(_flag(argv, "--kv-events-config"))
    # Events carry raw prompt tokens: both sockets bind loopback unless told otherwise.
    assert events == {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
        "endpoint": "tcp://[::ffff:127.0.0.1]:5557", "replay_endpoint": "tcp://127.0.0.1:5558",
    }
    # One replica on this host: every allowed core, and as many OpenMP threads.
    assert env == {"PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}


def test_cpu_drops_gpu_flags_and_gpu_keeps_them() -> None:
    base = dict(model="m", block_size=64, gpu_memory_utilization=0.8)
    cpu_argv, cpu_env = vllm_command(VllmSettings(**base, gpu=False))  # type: ignore[arg-type]
    gpu_argv, gpu_env = vllm_command(VllmSettings(**base, gpu=True))  # type: ignore[arg-type]
    assert "--gpu-memory-utilization" not in cpu_argv
    assert cpu_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert _flag(gpu_argv, "--gpu-memory-utilization") == "0.8"
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu_env


def test_no_seed_removes_inherited_pythonhashseed() -> None:
    _, env = vllm_command(VllmSettings(model="m", block_size=32, gpu=False))
    assert "PYTHONHASHSEED" not in env
    merged = child_env(env, base={"PYTHONHASHSEED": "123", "PATH": "/bin"})
    assert "PYTHONHASHSEED" not in merged
    assert merged["PATH"] == "/bin"
    assert child_env({"PYTHONHASHSEED": "7"}, base={"PYTHONHASHSEED": "1"})["PYTHONHASHSEED"] == "7"


def test_cpu_needs_block_size_multiple_of_32() -> None:
    with pytest.raises(ValueError, match=r"block size 16 does not work on CPU.*multiple of 32"):
        vllm_command(VllmSettings(model="m", block_size=16, gpu=False))
    argv, _ = vllm_command(VllmSettings(model="m", block_size=16, gpu=True))
    assert _flag(argv, "--block-size") == "16"


def test_no_events_port_means_no_events_config() -> None:
    argv, _ = vllm_command(VllmSettings(model="m", block_size=32, gpu=False))
    assert "--kv-events-config" not in argv
    assert kv_events_config(VllmSettings(model="m", kv_events_port=1)) == {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": "tcp://[::ffff:127.0.0.1]:1", "topic": "",
    }


def test_extra_args_pass_through_last() -> None:
    argv, _ = vllm_command(VllmSettings(model="m", block_size=32, gpu=False, extra_args=("--max-model-len", "4096")))
    assert argv[-2:] == ["--max-model-len", "4096"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hash_algo": "md5"}, "unknown hash algorithm 'md5'"),
        ({"block_size": 0}, "block size must be positive, got 0"),
        ({"kv_replay_port": 5558}, "needs --kv-events-port"),
        ({"port": 70000}, "port must be in 1..65535, got 70000"),
    ],
)
def test_bad_settings_name_the_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        VllmSettings(model="m", **kwargs)  # type: ignore[arg-type]


def test_flags_parse_with_installed_vllm_parser() -> None:
    """Every flag the launcher emits exists in the installed vLLM's own argument parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv, _ = vllm_command(VllmSettings(
        model="/models/tiny", block_size=32, hash_algo="xxhash", seed="1",
        kv_events_port=5557, kv_replay_port=5558, served_model_name="tiny",
        gpu_memory_utilization=0.5, gpu=True,
    ))
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.enable_prefix_caching is True
    assert args.block_size == 32
    assert args.prefix_caching_hash_algo == "xxhash"
    assert args.enable_prompt_tokens_details is True
    assert args.gpu_memory_utilization == 0.5
    assert args.kv_events_config.endpoint == "tcp://[::ffff:127.0.0.1]:5557"
    assert args.kv_events_config.replay_endpoint == "tcp://127.0.0.1:5558"
    assert args.kv_events_config.enable_kv_cache_events is True


def test_cli_rejects_bad_value_with_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "replica", "vllm", "--model", "m", "--block-size", "-4"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "block size must be positive, got -4" in proc.stderr


def test_cli_arguments_map_to_settings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--model", "m", "--cpu", "--seed", "0", "--block-size", "32", "--hash-algo", "xxhash",
        "--kv-events-port", "5557", "--kv-replay-port", "5558",
        "--", "--max-model-len", "4096", "--enforce-eager",
    ])
    settings = settings_from_args(args)
    assert settings == VllmSettings(
        model="m", seed="0", block_size=32, hash_algo="xxhash", kv_events_port=5557,
        kv_replay_port=5558, gpu=False, extra_args=("--max-model-len", "4096", "--enforce-eager"),
    )
    assert settings_from_args(parser.parse_args(["--model", "m"])).gpu is None  # detect


def test_format_command_shows_env_first() -> None:
    line = format_command(["python", "-m", "x", "--a", "b c"], {"PYTHONHASHSEED": "0"})
    assert line == "PYTHONHASHSEED=0 python -m x --a 'b c'"


# -- CPU thread binding and the KV-event sockets' address ----------------------------------


def _cpu_env(**kwargs: object) -> dict[str, str]:
    _, env = vllm_command(VllmSettings(model="m", block_size=32, gpu=False, **kwargs))  # type: ignore[arg-type]
    return env


def test_replicas_on_one_host_get_disjoint_cores_and_matching_threads() -> None:
    four = {"available_cpus": (0, 1, 2, 3), "replicas_per_host": 2}
    first, second = _cpu_env(replica_index=0, **four), _cpu_env(replica_index=1, **four)
    assert (first["VLLM_CPU_OMP_THREADS_BIND"], first["OMP_NUM_THREADS"]) == ("0-1", "2")
    assert (second["VLLM_CPU_OMP_THREADS_BIND"], second["OMP_NUM_THREADS"]) == ("2-3", "2")
    # Two replicas on two cores (this test machine's shape): core 0 and core 1.
    two = [_cpu_env(available_cpus=(0, 1), replicas_per_host=2, replica_index=i) for i in (0, 1)]
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in two] == ["0", "1"]
    assert [e["OMP_NUM_THREADS"] for e in two] == ["1", "1"]
    # Slices follow the affinity mask (a container's cpuset), not ids from 0; a core left
    # over by an uneven split stays unused rather than shared.
    odd = _cpu_env(available_cpus=(4, 5, 6, 9, 10), replicas_per_host=2, replica_index=1)
    assert odd["VLLM_CPU_OMP_THREADS_BIND"] == "6,9"


def test_explicit_cpu_bind_wins_and_modes_pass_through() -> None:
    env = _cpu_env(cpu_bind="0,2-3", replicas_per_host=4, replica_index=3)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("0,2-3", "3")
    auto = _cpu_env(cpu_bind="auto")
    assert auto["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "OMP_NUM_THREADS" not in auto
    _, gpu_env = vllm_command(VllmSettings(model="m", gpu=True, replicas_per_host=2))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in gpu_env and "OMP_NUM_THREADS" not in gpu_env


def test_more_replicas_than_cores_is_refused() -> None:
    message = "cannot give each of 3 replicas its own core: this process may use 2 (0-1)"
    with pytest.raises(ValueError, match=re.escape(message)):
        _cpu_env(replicas_per_host=3, available_cpus=(0, 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_index": 2, "replicas_per_host": 2},
         "replica-index must be in 0..1 (--replicas-per-host 2), got 2"),
        ({"replicas_per_host": 0}, "replicas-per-host must be >= 1, got 0"),
        ({"cpu_bind": "0-"}, "cpu-bind must be a core list like '0-3'"),
        ({"cpu_bind": "3-1"}, "got '3-1'"),
        ({"kv_events_bind_host": "localhost"},
         "kv-events-bind-host must be an IPv4 address or '*', got 'localhost'"),
        ({"kv_events_bind_host": "::1"}, "vLLM cannot bind an IPv6 KV-event endpoint"),
    ],
)
def test_bad_binding_settings_name_the_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        VllmSettings(model="m", **kwargs)  # type: ignore[arg-type]


def test_kv_events_bind_host_is_explicit() -> None:
    everywhere = kv_events_config(VllmSettings(model="m", kv_events_port=7, kv_replay_port=8,
                                               kv_events_bind_host="*"))
    assert everywhere is not None
    assert (everywhere["endpoint"], everywhere["replay_endpoint"]) == ("tcp://*:7", "tcp://*:8")
    pod = kv_events_config(VllmSettings(model="m", kv_events_port=7, kv_replay_port=8,
                                        kv_events_bind_host="10.1.2.3"))
    assert pod is not None
    assert (pod["endpoint"], pod["replay_endpoint"]) == ("tcp://[::ffff:10.1.2.3]:7",
                                                         "tcp://10.1.2.3:8")


def test_vllms_own_publisher_binds_the_default_endpoints_on_loopback_only() -> None:
    """The endpoints as vLLM 0.32's ZmqEventPublisher treats them: bound, on 127.0.0.1."""
    import psutil
    import zmq
    from vllm.distributed.kv_events import EventBatch, ZmqEventPublisher

    from replica.processes import free_port

    events_port, replay_port = free_port(), free_port()
    config = kv_events_config(VllmSettings(model="m", kv_events_port=events_port,
                                           kv_replay_port=replay_port))
    assert config is not None
    publisher = ZmqEventPublisher(0, endpoint=str(config["endpoint"]),
                                  replay_endpoint=str(config["replay_endpoint"]))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{events_port}")
        listening = {c.laddr for c in psutil.Process().net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert {(a.ip, a.port) for a in listening if a.port in (events_port, replay_port)} == {
            ("127.0.0.1", events_port), ("127.0.0.1", replay_port)}
        # A SUB joins asynchronously: publish until one batch arrives (bounded).
        for _ in range(100):
            publisher.publish(EventBatch(ts=0.0, events=[]))
            if sub.poll(50):
                break
        else:
            raise AssertionError("no KV-event batch reached a loopback subscriber")
    finally:
        sub.close(0)
        ctx.term()
        publisher.shutdown()


def test_dry_run_prints_the_binding_without_starting_vllm() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "replica", "vllm", "--model", "m", "--cpu", "--block-size", "32",
         "--kv-events-port", "5557", "--cpu-bind", "1", "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert "OMP_NUM_THREADS=1 " in line and "VLLM_CPU_OMP_THREADS_BIND=1 " in line
    assert "tcp://[::ffff:127.0.0.1]:5557" in line
    assert API_SERVER_MODULE in line


def test_test_servers_each_bind_the_next_core() -> None:
    from vllm_server import next_cpu_bind

    from replica.vllm_launcher import allowed_cpus

    cpus = list(allowed_cpus())
    first, second = int(next_cpu_bind()), int(next_cpu_bind())
    assert second == cpus[(cpus.index(first) + 1) % len(cpus)]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        result: dict[str, object] = json.loads(resp.read())
        return result


@pytest.mark.vllm
def test_real_server_caches_prefix_blocks(vllm_server) -> None:  # type: ignore[no-untyped-def]
    """A repeated 100-token prompt hits 3 blocks of 32: 96 tokens (the last is recomputed)."""
    assert vllm_server.hash == HashConfig("sha256", 32, "0")
    metrics = _get(f"{vllm_server.url}/metrics")
    assert "vllm:prefix_cache_queries" in metrics

    # Token ids chosen away from the specials and unique to this test, so no other test's
    # blocks on the shared server can make the first request hit.
    prompt = [100 + (i * 37) % 3000 for i in range(100)]
    body = {"model": vllm_server.served_model_name, "prompt": prompt, "max_tokens": 1,
            "temperature": 0}
    first = _post(f"{vllm_server.url}/v1/completions", body)
    second = _post(f"{vllm_server.url}/v1/completions", body)
    usage1, usage2 = first["usage"], second["usage"]
    assert isinstance(usage1, dict) and isinstance(usage2, dict)
    assert usage1["prompt_tokens"] == 100
    assert (usage1.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert usage2["prompt_tokens_details"]["cached_tokens"] == 96, vllm_server.log_tail()

    queries = re.search(r"^vllm:prefix_cache_queries_total\{[^}]*\} ([0-9.e+]+)$",
                        _get(f"{vllm_server.url}/metrics"), re.M)
    assert queries is not None and float(queries.group(1)) >= 200
