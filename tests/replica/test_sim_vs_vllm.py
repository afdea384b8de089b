"""The sim against real vLLM: the same requests give the same cache hits and the same events.

The session's vLLM server (block size 32, sha256, PYTHONHASHSEED "0", tiny model) and a
sim with the same settings get the same request sequence. Prompts are random token ids
drawn per run, so blocks cached by other tests sharing the server cannot hit. The
events each side published for the sequence are read back through replay (vLLM's from
the sequence number it had reached before the test), so no subscriber can miss any.

Generated tokens differ (the sim does not run the model), so the HTTP comparison keeps
every cached block inside the prompts; the decode-filled blocks are compared by
replaying vLLM's own generated tokens through the in-process Engine.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from replica.engine import Engine, EngineConfig, EngineRequest
from replica.fleet import SimFleet
from replica.profiles import load_profile
from router.hashing import chain_hashes, event_key
from router.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent, stored_token_ids

pytestmark = pytest.mark.vllm

Replay = Callable[..., list[tuple[int, EventBatch]]]


def _complete(url: str, model: str | None, prompt: list[int], max_tokens: int,
              salt: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, **(extra or {})}
    if model:
        body["model"] = model
    if salt:
        body["cache_salt"] = salt
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _last_seq(replay: Replay, endpoint: str) -> int:
    kept = replay(endpoint, start=0)
    return kept[-1][0] if kept else -1


def _stored(events: list[KVEvent]) -> list[tuple[Any, ...]]:
    """Stores and removals as comparable tuples, in publication order."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("stored", tuple(e.block_hashes), e.parent_block_hash, tuple(stored_token_ids(e)),
                        e.block_size, repr(e.extra_keys), e.medium, e.group_idx,
                        e.kv_cache_spec_kind))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", tuple(e.block_hashes)))
    return out


def _events_since(replay: Replay, endpoint: str, after: int) -> list[KVEvent]:
    return [e for seq, batch in replay(endpoint, start=after + 1) for e in batch.events]


def test_same_requests_same_hits_and_block_keys(vllm_server: Any, replay: Replay) -> None:
    rng = random.Random(uuid.uuid4().int)
    p = [rng.randrange(100, 3000) for _ in range(100)]
    q = [rng.randrange(100, 3000) for _ in range(60)]
    r = [rng.randrange(100, 3000) for _ in range(40)]
    full = {"vllm_xargs": {"kv_cache_report_mode": "full"}}
    logprobs = {"prompt_logprobs": 0}
    # (prompt, max_tokens, salt, extra body fields, cached tokens by hand at block size 32)
    sequence: list[tuple[list[int], int, str | None, dict[str, Any], int]] = [
        (p, 4, None, {}, 0),            # stores blocks 0-2 (103 computed tokens)
        (p, 4, None, {}, 96),           # (100 - 1) // 32 = 3 blocks hit; nothing new stored
        (p + q, 1, None, {}, 96),       # hits p's 3 blocks; stores blocks 3-4
        (p[:64], 1, None, {}, 32),      # 63 // 32 = 1 block; recomputes block 1, re-stores it
        (p, 1, "tenant-A", {}, 0),      # the salt changes block 0's key, hence every key
        (p, 1, "tenant-A", {}, 96),
        (r, 1, None, {}, 0),
        (r, 1, None, {}, 32),
        (p, 1, None, full, 96),         # re-announces p's 3 hit blocks as one BlockStored
        (r, 1, None, logprobs, 0),      # prompt logprobs skip the cache: recomputes, re-stores
    ]
    with SimFleet(1, block_size=vllm_server.block_size, seed=vllm_server.hash.seed,
                  hash_algo=vllm_server.hash.algo, model_dir=vllm_server.model_dir,
                  served_model_name=vllm_server.served_model_name) as fleet:
        sim = fleet.replicas[0]
        assert sim.replay_endpoint
        vllm_before = _last_seq(replay, vllm_server.replay_endpoint)
        real = [_complete(vllm_server.url, vllm_server.served_model_name, prompt, n, salt, x)
                for prompt, n, salt, x, _ in sequence]
        simmed = [_complete(sim.url, vllm_server.served_model_name, prompt, n, salt, x)
                  for prompt, n, salt, x, _ in sequence]
        vllm_events = _events_since(replay, vllm_server.replay_endpoint, vllm_before)
        sim_events = _events_since(replay, sim.replay_endpoint, -1)

    def cached(resp: dict[str, Any]) -> int:
        return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])

    expected = [c for *_, c in sequence]
    assert [cached(x) for x in real] == expected
    assert [cached(x) for x in simmed] == expected
    assert _stored(sim_events) == _stored(vllm_events)
    # And both publish router.hashing's keys: p's blocks, the salted chain, p+q's tail.
    stores = [e for e in vllm_events if isinstance(e, BlockStored)]
    cfg = vllm_server.hash
    assert stores[0].block_hashes == [event_key(k) for k in chain_hashes(cfg, p)]
    assert stores[1].block_hashes == [event_key(k) for k in chain_hashes(cfg, p + q)[3:5]]
    assert stores[2].block_hashes == [event_key(chain_hashes(cfg, p)[1])]
    salted = [event_key(k) for k in chain_hashes(cfg, p, cache_salt="tenant-A")]
    assert stores[3].block_hashes == salted and stores[3].extra_keys == [["tenant-A"], None, None]
    assert stores[5].block_hashes == stores[0].block_hashes  # the full-mode report
    assert stores[5].parent_block_hash is None


def test_engine_replaying_vllm_outputs_caches_decoded_blocks_alike(
        vllm_server: Any, replay: Replay) -> None:
    rng = random.Random(uuid.uuid4().int)
    s = [rng.randrange(100, 3000) for _ in range(50)]
    u = [rng.randrange(100, 3000) for _ in range(20)]
    before = _last_seq(replay, vllm_server.replay_endpoint)
    turn1 = _complete(vllm_server.url, vllm_server.served_model_name, s, 40)
    out1 = turn1["choices"][0]["token_ids"]
    assert len(out1) == 40
    prompt2 = s + out1 + u  # the next turn resends the answer
    turn2 = _complete(vllm_server.url, vllm_server.served_model_name, prompt2, 10)
    out2 = turn2["choices"][0]["token_ids"]
    vllm_events = _events_since(replay, vllm_server.replay_endpoint, before)

    engine = Engine(EngineConfig(hash=vllm_server.hash, num_blocks=4097, max_model_len=8192))
    sim_events: list[KVEvent] = []
    cached: list[int] = []
    for rid, prompt, out in (("t1", s, out1), ("t2", prompt2, out2)):
        engine.add_request(EngineRequest(rid, prompt, len(out), output_token_ids=out))
        while engine.has_work():
            step = engine.run_step()
            sim_events.extend(step.events)
            cached.extend(res.cached_tokens for res in step.finished)
    # Turn 1 computes 50 + 39 tokens: 2 full blocks, the second holding 14 generated tokens.
    # Turn 2 (110 tokens) hits both and stores block 2 once 119 tokens are computed.
    assert [turn1["usage"]["prompt_tokens_details"]["cached_tokens"],
            turn2["usage"]["prompt_tokens_details"]["cached_tokens"]] == [0, 64]
    assert cached == [0, 64]
    assert _stored(sim_events) == _stored(vllm_events)
    assert sum(len(e.block_hashes) for e in vllm_events if isinstance(e, BlockStored)) == 3


def test_calibrate_fits_a_profile_to_real_vllm(vllm_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "vllm-cpu-tiny.json"
    proc = subprocess.run(
        [sys.executable, "-m", "replica", "calibrate", "--url", vllm_server.url,
         "--lengths", "64,512,1024,2048", "--repeats", "2", "--decode-tokens", "4",
         "--token-range", "100,3000", "--name", "vllm-cpu-tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    profile = load_profile(str(out))
    print(proc.stderr + proc.stdout)  # the measured TTFTs and the fit, for the record
    # Every request carried a fresh salt, so TTFT grew with length: a positive slope.
    assert profile.name == "vllm-cpu-tiny"
    assert profile.token_s > 0 or profile.attention_s > 0
    assert profile.prefill_seconds(2048) > profile.prefill_seconds(64)


def _post_raw(url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=120)


def test_sim_answers_vllms_surface_alike(vllm_server: Any) -> None:
    """Refusals word for word, batched prompts, the capped budget, cache skipping, and the
    small endpoints: the same request to vLLM and to a sim of the same model."""
    rng = random.Random(uuid.uuid4().int)
    name = vllm_server.served_model_name
    with SimFleet(1, block_size=vllm_server.block_size, seed=vllm_server.hash.seed,
                  hash_algo=vllm_server.hash.algo, model_dir=vllm_server.model_dir,
                  served_model_name=name) as fleet:
        sim = fleet.replicas[0].url
        real = vllm_server.url
        (real_card,) = httpx.get(f"{real}/v1/models", timeout=30).json()["data"]
        (sim_card,) = httpx.get(f"{sim}/v1/models", timeout=30).json()["data"]
        assert set(sim_card) == set(real_card)
        for key in ("id", "object", "owned_by", "root", "parent", "max_model_len"):
            assert sim_card[key] == real_card[key], key
        assert set(sim_card["permission"][0]) == set(real_card["permission"][0])
        limit = int(real_card["max_model_len"])
        assert httpx.get(f"{sim}/version", timeout=30).json() == httpx.get(
            f"{real}/version", timeout=30).json()

        def ids(n: int) -> list[int]:
            return [rng.randrange(100, 3000) for _ in range(n)]

        refused = [
            json.dumps({"model": name, "prompt": ids(limit + 1), "max_tokens": 1}).encode(),
            json.dumps({"model": name, "prompt": ids(limit + 7), "max_tokens": 1}).encode(),
            json.dumps({"model": name, "prompt": ids(limit), "max_tokens": 1}).encode(),
            json.dumps({"model": name, "prompt": ids(10), "max_tokens": limit + 1}).encode(),
            json.dumps({"model": name, "prompt": "word " * (limit + 50),
                        "max_tokens": 1}).encode(),
            b'{"prompt": [101, 102, 103], "max_tokens": 2, "temperature": NaN}',
            b'{"prompt": [101, 102, 103], "max_tokens": 2, "top_p": Infinity}',
            b'{"prompt": [101, 102, 103], "max_tokens": 2, "presence_penalty": -Infinity}',
            b'{"prompt": [101, 102, 103], "max_tokens": NaN}',
            b'{"prompt": [101, 102, 103], "max_tokens": 0}',
            b'{"prompt": "", "max_tokens": 2}',
            b'{"prompt": [101, 102], "cache_salt": "a/b"}',
            b'{"prompt": [101, 102], "prompt_logprobs": 1, "stream": true}',
            b'{"prompt": [101, 102], "stream_options": {"include_usage": true}}',
        ]
        for body in refused:
            got_real = _post_raw(real, "/v1/completions", body)
            got_sim = _post_raw(sim, "/v1/completions", body)
            assert (got_sim.status_code, got_sim.json()) == (
                got_real.status_code, got_real.json()), body[:120]

        # A budget past the context is capped, not refused.
        near = ids(limit - 5)
        for url in (real, sim):
            body = {"model": name, "prompt": near, "max_tokens": 100, "ignore_eos": True,
                    "temperature": 0}
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
            assert resp["usage"]["completion_tokens"] == 5
            assert resp["choices"][0]["finish_reason"] == "length"

        # Batched prompts: one choice per prompt, in order, usage summed, last prompt's cache.
        a, b = ids(70), ids(40)
        shapes = []
        for url in (real, sim):
            httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": b,
                                                      "max_tokens": 1}, timeout=120)
            resp = httpx.post(f"{url}/v1/completions", json={
                "model": name, "prompt": [a, b], "max_tokens": 3, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True}, timeout=120).json()
            shapes.append(([c["index"] for c in resp["choices"]],
                           [c["prompt_token_ids"] for c in resp["choices"]],
                           [len(c["token_ids"]) for c in resp["choices"]],
                           # vLLM also dumps its unset usage fields as null: compare numbers.
                           [resp["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                                       "total_tokens")],
                           resp["usage"]["prompt_tokens_details"]["cached_tokens"]))
        assert shapes[1] == shapes[0]

        # prompt_logprobs skips reading the cache; /detokenize gives the same text.
        for url in (real, sim):
            body = {"model": name, "prompt": a, "max_tokens": 1, "prompt_logprobs": 0}
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
            assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        texts = [httpx.post(f"{url}/detokenize", json={"model": name, "tokens": a[:20]},
                            timeout=30).json() for url in (real, sim)]
        assert texts[1] == texts[0]
