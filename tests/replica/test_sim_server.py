"""The sim over real HTTP and real ZMQ: responses, usage, metrics, KV events, replay, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from replica.fleet import SimFleet
from replica.profiles import load_profile
from router.hashing import HashConfig, chain_hashes, event_key
from router.kv_events import AllBlocksCleared, BlockStored, stored_token_ids
from router.tokenize import PromptTokenizer

HASH16 = HashConfig(algo="sha256", block_size=16, seed="0")
Fleet = Callable[..., SimFleet]
Fn = Callable[..., Any]


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 104729 + i * 17) % 30000 + 100 for i in range(n)]


def _complete(url: str, prompt: list[int], max_tokens: int = 2, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions",
                      json={"prompt": prompt, "max_tokens": max_tokens, **extra}, timeout=10)


def test_completion_usage_reports_cached_tokens(make_fleet: Fleet, scrape: Fn) -> None:
    (sim,) = make_fleet(1).replicas
    prompt = _ids(1, 40)
    first = _complete(sim.url, prompt, 3, return_token_ids=True).json()
    assert first["object"] == "text_completion"
    assert first["choices"][0]["finish_reason"] == "length"
    assert len(first["choices"][0]["token_ids"]) == 3
    assert first["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    second = _complete(sim.url, prompt, 3, return_token_ids=True).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # (40-1)//16 blocks
    # Same prompt, same seed: the same answer, as greedy decoding gives.
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    m = scrape(sim.url)
    assert (m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]) == (80, 32)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:time_to_first_token_seconds_count"] == 2
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim"}' in m


def test_streaming_chunks_and_usage(make_fleet: Fleet) -> None:
    (sim,) = make_fleet(1).replicas
    body = {"prompt": _ids(2, 20), "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    # 4 token chunks, the finish chunk, then the usage chunk with no choices.
    assert [c["choices"][0]["finish_reason"] if c["choices"] else "usage" for c in chunks] == [
        None, None, None, None, "length", "usage"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_stream_without_usage_has_no_usage_chunk(make_fleet: Fleet) -> None:
    (sim,) = make_fleet(1).replicas
    body = {"prompt": _ids(3, 20), "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as resp:
        chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln and ln != "data: [DONE]"]
    assert all("usage" not in c for c in chunks)
    assert len(chunks) == 3


def test_kv_events_carry_vllm_block_keys(make_fleet: Fleet, replay: Fn, subscribe: Fn) -> None:
    (sim,) = make_fleet(1).replicas
    assert sim.kv_events_endpoint and sim.replay_endpoint
    sub = subscribe(sim.kv_events_endpoint)
    # A SUB joins asynchronously: probe with unique prompts until one batch arrives.
    probe = 0
    got = None
    while got is None:
        probe += 1
        assert probe < 100, "subscriber never received a batch"
        _complete(sim.url, _ids(1000 + probe, 17), 1)
        got = sub.recv(timeout=0.2)
    while sub.recv(timeout=0.2) is not None:
        pass  # drain probe batches that raced the subscription
    prompt = _ids(4, 50)
    _complete(sim.url, prompt, 1, cache_salt="tenant-A")
    received = sub.recv()
    assert received is not None
    seq, batch = received
    assert seq == probe  # probes took seqs 0..probe-1, one batch each
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    keys = chain_hashes(HASH16, prompt, cache_salt="tenant-A")
    assert event.block_hashes == [event_key(k) for k in keys]  # 3 full blocks
    assert event.parent_block_hash is None
    assert event.extra_keys == [["tenant-A"], None, None]
    assert stored_token_ids(event) == prompt[:48]
    assert batch.data_parallel_rank == 0
    # A full hit (same prompt, 1 token) fills no new block: no batch at all.
    _complete(sim.url, prompt, 1, cache_salt="tenant-A")
    assert sub.recv(timeout=0.3) is None
    replayed = replay(sim.replay_endpoint, start=0)
    assert [s for s, _ in replayed] == list(range(probe + 1))
    assert replay(sim.replay_endpoint, start=probe)[0][1].events[0] == event


def test_reset_prefix_cache_clears_hits_and_announces_it(make_fleet: Fleet, replay: Fn) -> None:
    (sim,) = make_fleet(1).replicas
    prompt = _ids(5, 40)
    _complete(sim.url, prompt, 1)
    assert httpx.post(f"{sim.url}/reset_prefix_cache", timeout=5).json() == {"success": True}
    again = _complete(sim.url, prompt, 1).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    events = [e for _, b in replay(sim.replay_endpoint) for e in b.events]
    # vLLM publishes the clear with the next step's batch, ahead of that step's stores.
    assert [type(e).__name__ for e in events] == ["BlockStored", "AllBlocksCleared", "BlockStored"]
    assert isinstance(events[1], AllBlocksCleared)


@pytest.mark.parametrize("salt", ["", "a/b", "a@b", "a\\b", "x" * 129, 5])
def test_bad_cache_salt_is_400(make_fleet: Fleet, salt: object) -> None:
    (sim,) = make_fleet(1).replicas
    resp = _complete(sim.url, _ids(6, 10), 1, cache_salt=salt)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "cache_salt" and err["code"] == 400 and err["type"] == "BadRequestError"
    assert "cache_salt" in err["message"]


def test_client_errors(make_fleet: Fleet, scrape: Fn) -> None:
    (sim,) = make_fleet(1, num_blocks=65, extra_args=["--max-model-len", "256"]).replicas
    too_long = _complete(sim.url, _ids(7, 257), 1)
    assert too_long.status_code == 400
    assert "maximum context length is 256 tokens" in too_long.json()["error"]["message"]
    chat = httpx.post(f"{sim.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]}, timeout=5)
    assert chat.status_code == 400 and "without --model" in chat.json()["error"]["message"]
    text = httpx.post(f"{sim.url}/v1/completions", json={"prompt": "hello"}, timeout=5)
    assert text.status_code == 400 and text.json()["error"]["param"] == "prompt"
    wrong = _complete(sim.url, _ids(7, 10), 1, model="other")
    assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "NotFoundError"
    bad_json = httpx.post(f"{sim.url}/v1/completions", content=b"{nope",
                          headers={"content-type": "application/json"}, timeout=5)
    assert bad_json.status_code == 400
    zero = _complete(sim.url, _ids(7, 10), 0)
    assert zero.status_code == 400
    # The sim is still healthy and serving after all of that.
    assert _complete(sim.url, _ids(7, 10), 1).status_code == 200
    m = scrape(sim.url)
    assert m["vllm:prefix_cache_queries_total"] == 10


def test_client_disconnect_aborts_the_request(make_fleet: Fleet, scrape: Fn, wait_until: Fn) -> None:
    # unit profile at real time: 5,000 tokens at 2 ms per decode step take ~10 s.
    (sim,) = make_fleet(1, prefill_profile="unit").replicas
    body = {"prompt": _ids(8, 20), "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as resp:
        lines = resp.iter_lines()  # kept referenced: a dropped iterator closes the stream
        next(lines)
        assert scrape(sim.url)["vllm:num_requests_running"] == 1
    started = time.monotonic()
    wait_until(lambda: scrape(sim.url)["vllm:num_requests_running"] == 0, timeout=5,
               what="the aborted request to leave the running set")
    assert time.monotonic() - started < 5
    assert scrape(sim.url)["vllm:kv_cache_usage_perc"] == 0.0


def test_time_scale_paces_the_cost_model(make_fleet: Fleet) -> None:
    # unit profile: a 1,000-token prefill costs 1.001 virtual s; at time scale 10, >= 0.1 s.
    (sim,) = make_fleet(1, prefill_profile="unit", time_scale=10.0).replicas
    started = time.monotonic()
    resp = _complete(sim.url, _ids(9, 1000), 1)
    assert resp.status_code == 200
    assert time.monotonic() - started >= 0.1


def test_chat_with_model_and_tokenize(make_fleet: Fleet, tiny_model_dir: Path) -> None:
    (sim,) = make_fleet(1, model_dir=tiny_model_dir, served_model_name="tiny").replicas
    tok = PromptTokenizer.from_dir(tiny_model_dir)
    body = {"model": "tiny", "messages": [{"role": "system", "content": "You are terse. " * 20},
                                          {"role": "user", "content": "Say hi."}],
            "max_tokens": 5}
    expected = tok.chat_tokens(body)
    tokenized = httpx.post(f"{sim.url}/tokenize", json=body, timeout=10).json()
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)
    first = httpx.post(f"{sim.url}/v1/chat/completions", json=body, timeout=10).json()
    assert first["object"] == "chat.completion"
    assert first["usage"]["prompt_tokens"] == len(expected)
    assert isinstance(first["choices"][0]["message"]["content"], str)
    second = httpx.post(f"{sim.url}/v1/chat/completions", json=body, timeout=10).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        (len(expected) - 1) // 16 * 16)
    oov = httpx.post(f"{sim.url}/v1/completions", json={"prompt": [5, 999_999]}, timeout=10)
    assert oov.status_code == 400
    assert oov.json()["error"]["message"] == "Token id 999999 is out of vocabulary"
    models = httpx.get(f"{sim.url}/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "tiny"


def test_calibrate_recovers_the_sims_profile(make_fleet: Fleet, tmp_path: Path) -> None:
    # The unit profile costs 1 ms + 1 ms per prefill token; the fit should find ~1 ms/token.
    (sim,) = make_fleet(1, prefill_profile="unit").replicas
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "replica", "calibrate", "--url", sim.url, "--lengths",
         "32,128,256,384", "--repeats", "2", "--decode-tokens", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    profile = load_profile(str(out))
    assert 0.0008 < profile.token_s < 0.0012
    assert profile.base_s < 0.02
    assert json.loads(proc.stdout)["token_s"] == profile.token_s
