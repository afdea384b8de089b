"""The comparison's fleet between runs (loadgen/target_fleet.py), against a real sim."""

from __future__ import annotations

import json
import urllib.request

import zmq

from loadgen.harness import MODEL_NAME
from loadgen.target_fleet import TargetFleet, TargetReplica
from replica.fleet import SimFleet
from router.kv_events import AllBlocksCleared, BlockStored, decode_batch


def _replayed(endpoint: str) -> list[list[object]]:
    """Every batch the replica's replay socket keeps, from seq 0, as event lists."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a bound, not a wait: the answer comes at once
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[list[object]] = []
        while True:
            frames = sock.recv_multipart()
            if frames[-1] == b"":  # the end marker
                return batches
            batches.append(list(decode_batch(frames[-1]).events))
    finally:
        sock.close()
        ctx.term()


def test_a_reset_replica_replays_to_an_empty_cache() -> None:
    """The next run's indexer replays each replica's history when it subscribes: the
    history must end with the reset's AllBlocksCleared, which vLLM (and the sim) publish
    only with the next engine step; an idle replica would otherwise replay the last run's
    blocks as held."""
    with SimFleet(1, block_size=16, num_blocks=4000, served_model_name=MODEL_NAME) as sims:
        sim = sims.replicas[0]
        body = json.dumps({"model": MODEL_NAME, "prompt": list(range(300, 364)),
                           "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{sim.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.status == 200
        assert sim.replay_endpoint is not None
        fleet = TargetFleet([TargetReplica(sim.name, sim.url, sim.kv_events_endpoint,
                                           sim.replay_endpoint)],
                            block_size=16, blocks_per_replica=4000, max_model_len=4096,
                            stop=lambda: None)
        fleet.reset_caches()
        events = [e for batch in _replayed(sim.replay_endpoint) for e in batch]
    assert any(isinstance(e, BlockStored) for e in events), events
    cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    assert cleared, events
    assert not any(isinstance(e, BlockStored) for e in events[cleared[-1]:]), events
