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
    assert events == {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
    }
    assert env == {"PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


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
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:1", "topic": "",
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
    assert args.kv_events_config.endpoint == "tcp://*:5557"
    assert args.kv_events_config.replay_endpoint == "tcp://*:5558"
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
