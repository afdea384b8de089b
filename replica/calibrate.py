"""`python -m replica calibrate --url URL`: fit the sim's cost profile to a real replica.

Sends uncached prompts of several lengths (random token ids plus a unique cache_salt per
request, so nothing can hit) as streaming completions, takes the time to the first
streamed token as the prefill time, and fits

    ttft(n) = base_s + token_s * n + attention_s * n (n + 1) / 2

by least squares (numpy) over each length's median TTFT, refitting without any coefficient that came out negative.
Decode steps of the same requests (the gaps between later tokens) give kv_read_s as the
slope of the inter-token time over context length. The result prints as JSON and is
written with --out; `python -m replica sim --prefill-profile FILE` loads it.

TTFT measured from a client includes HTTP and tokenization overheads; those land in
base_s, which is what a router experiences too.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import httpx
import numpy as np

from replica.profiles import SimCostProfile
from router.cli.arg_types import int_list

DEFAULT_LENGTHS = (64, 256, 512, 1024, 2048)


@dataclass
class Sample:
    """One request's prompt length, time to first token and mean decode gap."""

    prompt_tokens: int
    ttft: float
    decode_gap: float | None


def _lengths(text: str) -> list[int]:
    """--lengths: prompt lengths in tokens, each at least 1."""
    lengths = int_list(text)
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"want prompt lengths of at least 1 token, got {text!r}")
    return lengths


def _token_range(text: str) -> tuple[int, int]:
    """--token-range LO,HI: token ids are drawn from [LO, HI)."""
    bounds = int_list(text)
    if len(bounds) != 2 or not 0 <= bounds[0] < bounds[1]:
        raise argparse.ArgumentTypeError(f"want LO,HI with 0 <= LO < HI, got {text!r}")
    return bounds[0], bounds[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the replica, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    parser.add_argument("--out", default=None, help="write the fitted profile here (JSON)")
    parser.add_argument("--name", default="calibrated")
    parser.add_argument("--lengths", type=_lengths, default=list(DEFAULT_LENGTHS),
                        help="comma-separated prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--token-range", type=_token_range, default="100,1000",
                        help="prompt token ids are drawn from [lo, hi) (keep inside the vocab)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)


def measure(client: httpx.Client, url: str, model: str | None, prompt: list[int],
            decode_tokens: int) -> Sample:
    """Stream one uncached completion; return its TTFT and mean inter-token gap."""
    body: dict[str, object] = {"prompt": prompt, "max_tokens": decode_tokens, "stream": True,
                               "cache_salt": uuid.uuid4().hex, "ignore_eos": True,
                               "temperature": 0}
    if model:
        body["model"] = model
    arrivals: list[float] = []
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"{url} answered {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"{url} streamed no tokens")
    gaps = [b - a for a, b in pairwise(arrivals)]
    return Sample(len(prompt), arrivals[0] - start, statistics.median(gaps) if gaps else None)


def _nonneg_lstsq(columns: list[np.ndarray], y: np.ndarray) -> list[float]:
    """Least squares, dropping columns whose coefficient comes out negative."""
    active = list(range(len(columns)))
    while True:
        a = np.stack([columns[i] for i in active], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        negative = [active[k] for k, c in enumerate(coef) if c < 0]
        if not negative:
            out = [0.0] * len(columns)
            for k, i in enumerate(active):
                out[i] = float(coef[k])
            return out
        active.remove(negative[0])
        if not active:
            return [0.0] * len(columns)


def fit_profile(samples: Sequence[Sample], name: str = "calibrated") -> SimCostProfile:
    """Fit the linear + quadratic prefill profile (and kv_read_s from decode gaps).

    The fit runs over each length's median TTFT: one request stalled by a busy machine
    would otherwise pull every coefficient (least squares weighs outliers squared).
    """
    by_length: dict[int, list[float]] = {}
    for sample in samples:
        by_length.setdefault(sample.prompt_tokens, []).append(sample.ttft)
    n = np.array(sorted(by_length), dtype=float)
    y = np.array([statistics.median(by_length[int(k)]) for k in n], dtype=float)
    base, token, attention = _nonneg_lstsq([np.ones_like(n), n, n * (n + 1) / 2], y)
    kv_read = 0.0
    decodes = [s for s in samples if s.decode_gap is not None]
    if len({s.prompt_tokens for s in decodes}) >= 2:
        ctx = np.array([s.prompt_tokens for s in decodes], dtype=float)
        gap = np.array([s.decode_gap for s in decodes], dtype=float)
        _, kv_read = _nonneg_lstsq([np.ones_like(ctx), ctx], gap)
    return SimCostProfile(name, base_s=base, token_s=token, attention_s=attention,
                          kv_read_s=kv_read)


def _served_model(client: httpx.Client, url: str) -> str:
    data = client.get(f"{url}/v1/models").json()["data"]
    return str(data[0]["id"])


def run(args: argparse.Namespace) -> int:
    """Measure, fit, print and (with --out) write the profile."""
    lengths: list[int] = args.lengths
    lo, hi = args.token_range
    rng = random.Random(args.seed)
    url = args.url.rstrip("/")
    samples: list[Sample] = []
    try:
        with httpx.Client(timeout=args.timeout) as client:
            model = args.model or _served_model(client, url)
            measure(client, url, model, [rng.randrange(lo, hi) for _ in range(16)], 2)  # warm-up
            for _ in range(args.repeats):
                for length in lengths:
                    prompt = [rng.randrange(lo, hi) for _ in range(length)]
                    sample = measure(client, url, model, prompt, args.decode_tokens)
                    samples.append(sample)
                    print(f"prompt {length:6d} tokens: ttft {sample.ttft * 1000:8.2f} ms",
                          file=sys.stderr)
    except httpx.HTTPError as exc:
        print(f"replica calibrate: {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    profile = fit_profile(samples, args.name)
    text = profile.to_json()
    print(text)
    if args.out:
        try:
            Path(args.out).write_text(text + "\n")
        except OSError as exc:
            print(f"replica calibrate: cannot write {args.out!r}: {exc}", file=sys.stderr)
            return 1
    return 0
