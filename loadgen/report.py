"""The comparison report: results.json, a Markdown table and PNG plots.

One row per policy, TTFT always beside hit rate: a policy that raises the hit rate by
piling every request on one replica shows its cost in the TTFT tail and the imbalance
column. The oracle bounds (oracle.py) say how much reuse the stream offered at all.

Times are what the client measured; when the sims ran faster than real time
(`time_scale` > 1) they are multiplied back into simulated seconds, and the report
says so.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.driver import RequestRecord, RunResult, server_timing_stages
from loadgen.floor import TtftFloor
from loadgen.oracle import OracleBounds
from loadgen.rounds import PROMPT_SIZES, aggregate, ratios_against_peers, size_figure

OURS = "cache_aware"
# Percentiles of measured - predicted TTFT the report gives (summarize, prediction_lines).
PREDICTION_QUANTILES = (10, 50, 90)


@dataclass
class PolicyRun:
    """One policy's run of the workload, and what it ran against."""

    policy: str
    result: RunResult
    replicas: Sequence[str]
    oracle: OracleBounds | None = None
    note: str = ""
    # Requests each replica served, counted at the replicas (their TTFT histograms); used
    # when the router names no replica per response (vllm-router sets no header).
    replica_counts: dict[str, int] | None = None
    # Which round of a repeated comparison (0-based); every policy runs once per round.
    round: int = 0
    # The replicas' own TTFT histograms over the run: (requests, seconds summed), each
    # from the request's arrival at the replica to its first token.
    replica_ttft: tuple[int, float] | None = None
    # User + system seconds the router's processes used while the requests were sent
    # (every instance; our gateways with their indexer, not Redis); None where unknown.
    router_cpu_s: float | None = None

    def requests_per_replica(self) -> dict[str, int]:
        """Requests per replica: from response headers, else from the replicas' counts."""
        per = Counter(r.replica for r in self.result.records if r.replica)
        if not per and self.replica_counts is not None:
            return {name: self.replica_counts.get(name, 0) for name in self.replicas}
        return {name: per.get(name, 0) for name in self.replicas}


@dataclass
class ReportFiles:
    """Paths the report wrote."""

    results_json: Path
    table_md: Path
    plots: list[Path] = field(default_factory=list)


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# The stages of our gateway's Server-Timing header before its request goes upstream
# (router/completions.py Stages.server_timing).
_BEFORE_UPSTREAM = ("parse", "route", "admit")


def before_upstream_s(server_timing: str | None) -> float | None:
    """Seconds our gateway spent on a request before sending it upstream (Server-Timing's
    parse + route + admit), or None without those stages (a peer, or no header)."""
    if not server_timing:
        return None
    try:
        durations = server_timing_stages(server_timing)
    except ValueError:
        return None
    if not all(stage in durations for stage in _BEFORE_UPSTREAM):
        return None
    return sum(durations[stage] for stage in _BEFORE_UPSTREAM)


def held_s(server_timing: str | None, stage: str = "hold") -> float | None:
    """Seconds our gateway held a request: before deciding it (Server-Timing's hold,
    router/prefill_hold.py), or with `stage` "gate" after it, for the queue ahead on its
    replica (policy.step_gate); None without that stage. Records made before the gate had
    a stage of its own counted it in hold, and give None for it."""
    if not server_timing:
        return None
    try:
        return server_timing_stages(server_timing).get(stage)
    except ValueError:
        return None


def summarize(run: PolicyRun, time_scale: float = 1.0) -> dict[str, Any]:
    """The table row of one policy: latency percentiles, throughput, hits, balance."""
    done = run.result.completed()
    ttft = [r.ttft_s * time_scale for r in done if r.ttft_s is not None]
    e2e = [r.e2e_s * time_scale for r in done if r.e2e_s is not None]
    itl = [g * time_scale for r in done for g in r.itl_s]
    wall = run.result.wall_s * time_scale
    reported = [r for r in done if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    per_replica = Counter(r.replica for r in run.result.records if r.replica)
    counts = list(run.requests_per_replica().values())
    unknown = sum(n for name, n in per_replica.items() if name not in run.replicas)
    mean = sum(counts) / len(counts) if counts and sum(counts) else 0.0
    row: dict[str, Any] = {
        "policy": run.policy,
        "round": run.round,
        "requests": len(run.result.records),
        "completed": len(done),
        "errors": len(run.result.records) - len(done),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
        "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99),
        "itl_p50_s": _pct(itl, 50),
        "throughput_rps": len(done) / wall if wall > 0 else None,
        "output_tps": sum(r.output_tokens for r in done) / wall if wall > 0 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "hit_rate_reported_by": len(reported),
        "requests_per_replica": dict(zip(run.replicas, counts, strict=True)),
        "unattributed_requests": unknown,
        "imbalance_max_over_mean": max(counts) / mean if mean else None,
        # The gateway's own expectation (x-cacheroute-predicted-cached-tokens): how well
        # its index tracked the replicas' caches.
        "predicted_cached_tokens": (
            sum(r.predicted_cached_tokens or 0 for r in reported)
            if any(r.predicted_cached_tokens is not None for r in reported) else None),
        "answers_substituted": sum(1 for r in done if not r.answer_from_server),
        "wall_s": run.result.wall_s,
        "note": run.note,
    }
    # What the router, its hops and the client add to a first token: the client's mean
    # TTFT over the replicas' own (same requests: counted only where the replicas timed
    # as many as the client did). The client's share is the same under every router.
    handler = [t * time_scale for r in done if (t := before_upstream_s(r.server_timing))
               is not None]
    # Of that, what our gateway itself spent before going upstream (its own clock): the
    # rest is the hops, the replica's HTTP side and the client.
    row["before_upstream_mean_s"] = float(np.mean(handler)) if handler and \
        len(handler) == len(done) else None
    # Of the TTFT at the replicas' doors, what it waited at the gateway for a queue to
    # fall under a step (policy.hold_cap): over every request, held or not.
    held = [t * time_scale for r in done if (t := held_s(r.server_timing)) is not None]
    row["held_mean_s"] = float(np.mean(held)) if held and len(held) == len(done) else None
    row["held_requests"] = sum(1 for t in held if t > 0)
    # And after its decision, for the queue ahead on its replica (policy.step_gate).
    gated = [t * time_scale for r in done if (t := held_s(r.server_timing, "gate")) is not None]
    row["gated_mean_s"] = float(np.mean(gated)) if gated and len(gated) == len(done) else None
    row["gated_requests"] = sum(1 for t in gated if t > 0)
    # What routing cost in CPU: where routers share cores with their replicas or with
    # each other, this is what they take from everything else.
    row["router_cpu_per_request_s"] = (run.router_cpu_s / len(done)
                                       if run.router_cpu_s is not None and done else None)
    row["replica_ttft_mean_s"] = row["ttft_outside_mean_s"] = None
    if run.replica_ttft is not None and run.replica_ttft[0] == len(ttft) and ttft:
        at_replicas = run.replica_ttft[1] / run.replica_ttft[0] * time_scale
        row["replica_ttft_mean_s"] = at_replicas
        row["ttft_outside_mean_s"] = row["ttft_mean_s"] - at_replicas
    # How far the first token came from what the policy predicted on the replica it
    # chose (measured - predicted: above 0, later than predicted). A decision is only as
    # good as that prediction: one gateway that knows every queue it feeds predicts within
    # tens of ms; gateways that share the replicas see one another's work late.
    errors = [(r.ttft_s - r.predicted_ttft_s) * time_scale for r in done
              if r.ttft_s is not None and r.predicted_ttft_s is not None]
    for q in PREDICTION_QUANTILES:
        row[f"ttft_error_p{q}_s"] = _pct(errors, q)
    row["ttft_predicted_requests"] = len(errors)
    for label, low, high in PROMPT_SIZES:
        sized = [r.ttft_s * time_scale for r in done if r.ttft_s is not None
                 and r.prompt_len >= low and (high is None or r.prompt_len < high)]
        row[size_figure(label)] = _pct(sized, 50)
        row[f"requests_size_{label}"] = len(sized)
    if run.oracle is not None:
        row.update({f"oracle_{k}": v for k, v in run.oracle.as_dict().items()})
    return row


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _pct_str(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per policy: TTFT, E2E, throughput, hit rate beside the oracle bounds, imbalance, errors."""
    head = ("| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms "
            "| req/s | out tok/s | hit rate | oracle pooled | oracle unlimited "
            "| imbalance max/mean | errors |")
    lines = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p90_s'])} "
            f"| {_ms(r['ttft_p99_s'])} | {_ms(r['e2e_p50_s'])} | {_ms(r['e2e_p99_s'])} "
            f"| {_num(r['throughput_rps'])} | {_num(r['output_tps'], 1)} "
            f"| {_pct_str(r['hit_rate'])} | {_pct_str(r.get('oracle_pooled_hit_rate'))} "
            f"| {_pct_str(r.get('oracle_unlimited_hit_rate'))} "
            f"| {_num(r['imbalance_max_over_mean'])} | {r['errors']} |"
        )
    return "\n".join(lines) + "\n"


def is_peer(policy: str) -> bool:
    """Peer routers' policies are named PEER:POLICY (vllm-router:kv_aware, smg:cache_aware)."""
    return ":" in policy


def instance_count(policy: str) -> int | None:
    """N of a policy run as N instances (`cache_aware*4`, loadgen/compare.py), None
    without `*N` (the run's --gateways, the same for every such policy)."""
    _, star, count = policy.rpartition("*")
    return int(count) if star and count.isdigit() else None


def ratios_by_instances(aggregated: Sequence[dict[str, Any]]
                        ) -> dict[int | None, dict[str, dict[str, Any]]]:
    """Our cache_aware against the best peer policy run as as many instances: four
    gateways on one index are held against four vllm-routers, not against one (each
    layout's ratios, None for the plain names)."""
    out = {}
    for n in dict.fromkeys(instance_count(a["policy"]) for a in aggregated):
        ours = OURS if n is None else f"{OURS}*{n}"
        ratios = ratios_against_peers(
            aggregated, ours, lambda p, n=n: is_peer(p) and instance_count(p) == n)
        if ratios:
            out[n] = ratios
    return out


def _cell(figure: dict[str, float] | None, fmt: Any) -> str:
    if not figure:
        return "-"
    return f"{fmt(figure['median'])} ({fmt(figure['min'])}-{fmt(figure['max'])})"


def rounds_table(aggregated: Sequence[dict[str, Any]]) -> str:
    """Per policy over rounds: each figure's median and, in brackets, its min-max."""
    head = ("| policy | rounds | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | hit rate "
            "| imbalance max/mean | errors |")
    lines = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for a in aggregated:
        lines.append(
            f"| {a['policy']} | {a['rounds']} | {_cell(a['ttft_p50_s'], _ms)} "
            f"| {_cell(a['ttft_p90_s'], _ms)} | {_cell(a['ttft_p99_s'], _ms)} "
            f"| {_cell(a['hit_rate'], _pct_str)} "
            f"| {_cell(a['imbalance_max_over_mean'], _num)} "
            f"| {_cell(a['errors'], lambda v: f'{v:g}')} |")
    return "\n".join(lines) + "\n"


def ratio_lines(ratios: dict[str, dict[str, Any]], ours: str = OURS) -> list[str]:
    """One line per figure: our median over the best peer policy's median."""
    names = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "hit_rate": "hit rate"}
    out = []
    for figure, r in ratios.items():
        fmt = _pct_str if figure == "hit_rate" else _ms
        unit = "" if figure == "hit_rate" else " ms"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        out.append(f"- {ours} {names[figure]}: {ratio} of the best peer's "
                   f"({fmt(r['ours'])}{unit} vs {fmt(r['best_peer_value'])}{unit}, "
                   f"{r['best_peer']}; medians over rounds)")
    return out


def prediction_lines(aggregated: Sequence[dict[str, Any]]) -> list[str]:
    """Each policy's first tokens against what our gateway predicted for them (medians
    over rounds); peers predict nothing and get no line."""
    out = []
    for a in aggregated:
        spreads = {q: s for q in PREDICTION_QUANTILES if (s := a.get(f"ttft_error_p{q}_s"))}
        if len(spreads) < len(PREDICTION_QUANTILES):
            continue
        parts = [f"p{q} {_signed_ms(s['median'])} ({_signed_ms(s['min'])} to "
                 f"{_signed_ms(s['max'])})" for q, s in spreads.items()]
        out.append(f"  - {a['policy']}: {', '.join(parts)} ms")
    if out:
        out.insert(0, "- TTFT measured minus the TTFT the gateway predicted on the replica it "
                      "chose (x-cacheroute-predicted-ttft-ms), over requests: how well the "
                      "policy saw the queues it decided on (above 0: later than predicted; "
                      "measured from the client's send, predicted from the decision, so time "
                      "held before it counts as late)")
    return out


def size_lines(aggregated: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]
               ) -> list[str]:
    """A table of each policy's TTFT p50 per prompt size (median and range over rounds),
    with the requests per round in each; none where the prompts fill fewer than two."""
    counts = {label: max((row.get(f"requests_size_{label}") or 0 for row in rows), default=0)
              for label, _, _ in PROMPT_SIZES}
    labels = [label for label, _, _ in PROMPT_SIZES if counts[label]]
    if len(labels) < 2:
        return []
    out = ["- TTFT p50 ms by prompt size (tokens sent; median (min-max) over rounds): where a "
           "router loses on every request, short prompts show it; where it queues badly, "
           "long ones", "",
           "| policy | " + " | ".join(f"{label} ({counts[label]})" for label in labels) + " |",
           "| --- |" + " --- |" * len(labels)]
    for entry in aggregated:
        out.append(f"| {entry['policy']} | " + " | ".join(
            _cell(entry.get(size_figure(label)), _ms) for label in labels) + " |")
    return out


def _signed_ms(v: float) -> str:
    return f"{v * 1000:+.0f}"


def outside_lines(aggregated: Sequence[dict[str, Any]]) -> list[str]:
    """Each policy's mean TTFT outside the replicas (medians over rounds), where known."""
    out = []
    for a in aggregated:
        outside = a.get("ttft_outside_mean_s")
        mean = a.get("ttft_mean_s")
        if outside and mean:
            before = a.get("before_upstream_mean_s")
            own = "" if not before else (
                f"; {_ms(before['median'])} ms ({_ms(before['min'])}-{_ms(before['max'])}) "
                "of it in the gateway before going upstream")
            held = a.get("held_mean_s")
            if held and held["max"] > 0:
                own += (f"; held there for a replica's queue to fall under a step "
                        f"(hold_cap) {_ms(held['median'])} ms a request ({_ms(held['min'])}-"
                        f"{_ms(held['max'])})")
            gated = a.get("gated_mean_s")
            if gated and gated["max"] > 0:
                own += (f"; gated there for its queue ahead to reach a first token "
                        f"(step_gate) {_ms(gated['median'])} ms a request "
                        f"({_ms(gated['min'])}-{_ms(gated['max'])})")
            out.append(f"  - {a['policy']}: {_ms(outside['median'])} ms "
                       f"({_ms(outside['min'])}-{_ms(outside['max'])}) of a "
                       f"{_ms(mean['median'])} ms mean{own}")
    if out:
        out.insert(0, "- TTFT outside the replicas: the client's mean minus the replicas' "
                      "own (their histograms, arrival to first token): the router, its "
                      "hops and the client, whose share is the same for every router; "
                      "for our gateway, its Server-Timing's parse + route + admit says "
                      "how much of it the gateway spent before sending the request on")
    return out


def cpu_lines(aggregated: Sequence[dict[str, Any]]) -> list[str]:
    """Each router's CPU per request (medians over rounds), where known."""
    out = [f"  - {a['policy']}: {cpu['median'] * 1000:.2f} ms ({cpu['min'] * 1000:.2f}-"
           f"{cpu['max'] * 1000:.2f})" for a in aggregated
           if (cpu := a.get("router_cpu_per_request_s")) is not None]
    if out:
        out.insert(0, "- Router CPU per request: the user + system time of the router's "
                      "processes while the requests were sent, over the requests completed "
                      "(every instance; our gateways with their indexer, not Redis), in CPU "
                      "seconds as measured (never scaled with the sims' time): on cores "
                      "shared with others, what routing takes from them")
    return out


def floor_lines(floor: TtftFloor, aggregated: Sequence[dict[str, Any]]) -> list[str]:
    """The TTFT floor (floor.py) and each policy's median p50 and p99 as multiples of it."""
    p50, p99 = floor.percentile(50), floor.percentile(99)
    out = [f"- TTFT floor, each request alone on a sim holding the pooled oracle's prefix "
           f"(no queue, no router; floor.py): p50 {_ms(p50)} ms, p99 {_ms(p99)} ms"]
    for a in aggregated:
        mine50 = (a.get("ttft_p50_s") or {}).get("median")
        mine99 = (a.get("ttft_p99_s") or {}).get("median")
        if mine50 is None or mine99 is None or not p50 or not p99:
            continue
        out.append(f"  - {a['policy']}: p50 {mine50 / p50:.2f}x, p99 {mine99 / p99:.2f}x "
                   "the floor's")
    reach = floor_reach(floor, aggregated)
    if reach is not None:
        hop, at_p50, peer, ratio = reach
        out.append(f"  - the floor plus the least time outside the replicas any router had "
                   f"here ({_ms(hop)} ms, a mean): p50 {_ms(at_p50)} ms, {ratio:.2f}x "
                   f"{peer}'s; no router without a queue at all gets under that")
    return out


def floor_reach(floor: TtftFloor, aggregated: Sequence[dict[str, Any]]
                ) -> tuple[float, float, str, float] | None:
    """What a router with no queueing could reach at p50 against the best peer's p50.

    Each request's floor plus the time its first token spends outside the replicas (the
    client, the HTTP hops, the router's own work), taken as the least mean any policy of
    the run had: the part of a p50 no placement removes. The best peer is the one with
    the least median p50. Returns (that time, the reachable p50, the peer, the ratio), or
    None without a floor, a peer, or an outside figure.
    """
    p50 = floor.percentile(50)
    hops = [a["ttft_outside_mean_s"]["median"] for a in aggregated
            if (a.get("ttft_outside_mean_s") or {}).get("median") is not None]
    peers = [(a["ttft_p50_s"]["median"], a["policy"]) for a in aggregated
             if is_peer(a["policy"]) and (a.get("ttft_p50_s") or {}).get("median")]
    if p50 is None or not hops or not peers:
        return None
    hop = max(0.0, min(hops))
    best, name = min(peers)
    # A constant added to every request moves its percentiles by exactly that much.
    return hop, p50 + hop, name, (p50 + hop) / best


def _plots(runs: Sequence[PolicyRun], out: Path, time_scale: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ttft = sorted(r.ttft_s * time_scale * 1000 for r in run.result.completed()
                      if r.ttft_s is not None)
        if ttft:
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=run.policy)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    for run in runs:
        times, hits, ttfts = _over_time(run.result.records, time_scale)
        ax_hit.plot(times, hits, label=run.policy, marker=".")
        ax_ttft.plot(times, ttfts, label=run.policy, marker=".")
    ax_hit.set_ylabel("hit rate (window)")
    ax_hit.set_ylim(0, 1)
    ax_ttft.set_ylabel("mean TTFT ms (window)")
    ax_ttft.set_xlabel("seconds since start (when sent)")
    ax_hit.set_title("hit rate and TTFT over time")
    for a in (ax_hit, ax_ttft):
        a.grid(alpha=0.3)
    ax_hit.legend()
    paths.append(out / "over_time.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = sorted({n for run in runs for n in run.replicas})
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        counts = run.requests_per_replica()
        ax.bar(np.arange(len(names)) + i * width, [counts.get(n, 0) for n in names],
               width=width, label=run.policy)
    ax.set_xticks(np.arange(len(names)) + width * (len(runs) - 1) / 2, names)
    ax.set_ylabel("requests")
    ax.set_title("requests per replica")
    # Beside the axes: with many policies a legend inside hides the tallest bars.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(out / "requests_per_replica.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def _over_time(records: Sequence[RequestRecord], time_scale: float,
               windows: int = 12) -> tuple[list[float], list[float], list[float]]:
    """Hit rate and mean TTFT in equal windows of send time."""
    done = [r for r in records if r.ok and r.ttft_s is not None]
    if not done:
        return [], [], []
    end = max(r.sent_s for r in done) or 1.0
    width = end / windows
    times, hits, ttfts = [], [], []
    for w in range(windows):
        lo, hi = w * width, (w + 1) * width
        inside = [r for r in done if lo <= r.sent_s < hi or (w == windows - 1 and r.sent_s == end)]
        if not inside:
            continue
        prompt = sum(r.prompt_tokens or 0 for r in inside)
        cached = sum(r.cached_tokens or 0 for r in inside)
        times.append((lo + hi) / 2 * time_scale)
        hits.append(cached / prompt if prompt else math.nan)
        ttfts.append(float(np.mean([r.ttft_s or 0.0 for r in inside])) * time_scale * 1000)
    return times, hits, ttfts


def write_report(out: Path, runs: Sequence[PolicyRun], meta: dict[str, Any],
                 time_scale: float = 1.0, plots: bool = True,
                 floor: TtftFloor | None = None) -> ReportFiles:
    """Write results.json, report.md and the plots into `out`; returns their paths.

    With several rounds (runs of the same policy with different `round`), the report
    leads with each policy's median and spread over rounds and our cache_aware's ratios
    against the best peer policy; the per-run table follows, and the plots show round 0.
    """
    out.mkdir(parents=True, exist_ok=True)
    rows = [summarize(run, time_scale) for run in runs]
    repeated = len({run.round for run in runs}) > 1
    aggregated = aggregate(rows)
    by_instances = ratios_by_instances(aggregated)
    ratios = by_instances.get(None, {})
    results: dict[str, Any] = {
        "meta": {**meta, "time_scale": time_scale},
        "policies": rows,
        "requests": {_run_key(run): [r.summary() for r in run.result.records] for run in runs},
    }
    if repeated:
        results["over_rounds"] = aggregated
    if ratios:
        results["ratios_against_best_peer"] = ratios
    if any(n is not None for n in by_instances):
        results["ratios_against_best_peer_by_instances"] = {
            str(n): r for n, r in by_instances.items() if n is not None}
    if floor is not None:
        results["ttft_floor"] = floor.as_dict()
    results_json = out / "results.json"
    results_json.write_text(json.dumps(results, indent=1) + "\n")
    lines = ["# Routing policy comparison", ""]
    for key, value in meta.items():
        lines.append(f"- {key}: {value}")
    if time_scale != 1.0:
        lines.append(f"- times: the sims ran {time_scale:g}x faster than real time; every time "
                     f"below is the client's measurement x {time_scale:g} (simulated seconds)")
    if repeated:
        lines += ["", "## Over rounds: median (min-max)", "", rounds_table(aggregated)]
    ratio_text = [line for n, r in by_instances.items()
                  for line in ratio_lines(r, OURS if n is None else f"{OURS}*{n}")]
    if ratio_text:
        lines += ["", *ratio_text, ""]
    if floor is not None:
        lines += [*([] if ratio_text else [""]), *floor_lines(floor, aggregated), ""]
    outside = outside_lines(aggregated)
    if outside:
        lines += [*outside, ""]
    cpu = cpu_lines(aggregated)
    if cpu:
        lines += [*cpu, ""]
    sizes = size_lines(aggregated, rows)
    if sizes:
        lines += [*sizes, ""]
    predicted = prediction_lines(aggregated)
    if predicted:
        lines += [*predicted, ""]
    if repeated:
        lines += ["## Every run", ""]
        table = markdown_table([{**row, "policy": f"{row['policy']} (round {row['round'] + 1})"}
                                for row in rows])
    else:
        table = markdown_table(rows)
    lines += ["", table]
    lines.append("hit rate: tokens served from cache / prompt tokens, from the servers' usage "
                 "(cached_tokens). oracle pooled: one LRU cache of the fleet's total size; "
                 "oracle unlimited: a cache that never evicts; both replay the same stream "
                 "one request at a time (oracle.py). imbalance: max/mean requests per replica.")
    notes = list(dict.fromkeys(
        f"- {row['policy']}: {row['note']}" for row in rows if row["note"]))
    subs = [row for row in rows if row["answers_substituted"]]
    if subs:
        notes += [f"- {row['policy']}: {row['answers_substituted']} answers were not returned "
                  "as token ids; the workload's own answer was resent instead" for row in subs]
    blind = [row for row in rows
             if row["predicted_cached_tokens"] == 0 and row["cached_tokens"] > 0]
    notes += [f"- {row['policy']}: the gateway predicted no cached tokens for any request "
              "while the replicas served some: its index saw no KV events" for row in blind]
    if notes:
        lines += ["", "Notes:", "", *notes]
    files = ReportFiles(results_json, out / "report.md")
    if plots:
        files.plots = _plots([run for run in runs if run.round == 0], out, time_scale)
        lines += ["", *[f"![{p.stem}]({p.name})" for p in files.plots]]
    files.table_md.write_text("\n".join(lines) + "\n")
    return files


def _run_key(run: PolicyRun) -> str:
    """results.json's key for a run's requests: the policy, with its round after the first."""
    return run.policy if run.round == 0 else f"{run.policy}@round{run.round}"
