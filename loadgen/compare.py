"""`python -m loadgen compare`: run one seeded workload through each routing policy.

For every policy the harness starts a fresh router over the same fleet, with every
replica's prefix cache reset (and the reset announced: target_fleet.py) and the shared
index emptied first, and our indexer caught up with the replicas' event histories before
the first request, so each policy starts cold and sees the same request stream: our
gateway (`python -m router serve`, gateway_under_test.py) for our policies, and the
peers (peers.py) for theirs: vllm-router, and SMG on chat traffic. `--repeats N` runs
every policy once per round, N rounds interleaved, and the report (report.py,
rounds.py) gives each figure's median and spread over rounds and cache_aware's ratios
against the best peer policy, TTFT always beside hit rate and the stream's oracle bounds
(oracle.py).

`--api tokens` sends token ids to /v1/completions; `--api chat` sends the same prompts as
chat (messages, and tools for agents) to /v1/chat/completions (workloads/chat_text.py).

Replicas are simulated (`python -m replica sim`, the default) or real vLLM
(`--replica-kind vllm`; target_fleet.py). Sims may run faster than real time
(`--time-scale K`): arrivals are compressed by K and every measured time is multiplied
back by K, so figures are in simulated seconds; the client's and the routers' own
overhead is multiplied too, which the report says.

`--gateways N` (issue #16) runs every router N times over the same fleet, requests
spread over the N instances round-robin by plan index (a conversation's turns land on
different instances): our gateways as N processes sharing one Redis index (fed by one
indexer), vllm-router as N independent instances, SMG as N instances joined by its mesh
(--enable-mesh, cache trees gossiped). A policy named `NAME*N` runs as N instances
whatever --gateways says, so one run can interleave 1 and 4 gateways of the same router
(`--policies cache_aware,cache_aware*4 --vllm-router cache_aware,cache_aware*4`): the
comparison the machine's noise between runs would otherwise blur. The report holds
`cache_aware*N` against the peers' `*N` policies only, and the plain name against the
plain ones.

`--policy-set KEY=VALUE` and `--index-set KEY=VALUE` change one key of our gateways'
`policy:` or `index:` config for a control run; the report names them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.driver import Driver, DriverConfig, RequestRecord, RunResult
from loadgen.floor import ttft_floor
from loadgen.gateway_under_test import (
    DEFAULT_GATEWAY_PROFILE,
    GATEWAY_PROFILES,
    GatewayProfile,
    choose_profile,
    gateways,
    overrides_note,
    policy_variant,
)
from loadgen.harness import (
    MODEL_NAME,
    REPO,
    HarnessError,
    parse_cpus,
    unbuilt_c_paths,
    unbuilt_warning,
)
from loadgen.oracle import OracleRequest, bounds
from loadgen.peers import PEERS, SMG, VLLM_ROUTER, peer_routers, skip_reason, split_policy
from loadgen.report import PolicyRun, ReportFiles, summarize, write_report
from loadgen.target_fleet import (
    DEFAULT_MODEL_DIR,
    TargetFleet,
    ensure_model_dir,
    flush_index,
    start_sim_fleet,
    start_vllm_fleet,
)
from loadgen.workload_flags import (
    DEFAULT_TRACE,
    add_workload_arguments,
    build_workload,
    chat_lexicon,
)
from loadgen.workloads import TOKEN_LOW
from replica.processes import cpu_seconds, descendants, redis_server
from replica.profiles import load_profile
from router.cli.arg_types import positive_int

__all__ = ["DEFAULT_TRACE", "Comparison", "HarnessError", "add_arguments", "run",
           "run_comparison"]

POLICIES = ("random", "round_robin", "least_loaded", "session_affinity", "cache_aware")
# The prefix of a policy run with --baseline-repo's code.
BASELINE = "baseline~"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Fleet, policies, peers, pacing, workload and output flags."""
    parser.add_argument("--replicas", type=positive_int, default=4)
    parser.add_argument("--policies", default="round_robin,least_loaded,cache_aware",
                        help=f"comma-separated: {', '.join(POLICIES)}; 'vllm-router:NAME' or "
                             "'smg:NAME' runs a peer's policy NAME; NAME@KEY=VALUE[@...] one of "
                             "ours with policy settings of its own (e.g. "
                             "cache_aware@work_weight=0; SECTION.KEY for a key of health, "
                             "proxy, limits, listen or index, e.g. cache_aware@listen.workers=2), "
                             "run interleaved with the rest; NAME*N runs N instances")
    parser.add_argument("--replica-kind", choices=("sim", "vllm"), default="sim",
                        help="vllm: real servers of --model-dir (on CPU the block size must "
                             "be a multiple of 32)")
    parser.add_argument("--vllm-kv-gib", type=int, default=1,
                        help="vllm on CPU: KV cache GiB per replica (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--index", choices=("memory", "redis", "auto"), default="auto",
                        help="auto: a private redis-server when one is installed")
    parser.add_argument("--vllm-router", default="auto",
                        help="vllm-router peer policies to add when it is installed "
                             "(comma-separated, 'none' to skip; auto: "
                             f"{','.join(VLLM_ROUTER.default_policies)})")
    parser.add_argument("--smg", default="auto",
                        help="SMG peer policies to add on --api chat when it is installed "
                             "(comma-separated: cache_aware, prefix_hash, least_load, "
                             "power_of_two, round_robin, ...; 'none' to skip; auto: "
                             f"{','.join(SMG.default_policies)})")
    parser.add_argument("--gateways", type=int, default=1, metavar="N",
                        help="router instances per policy, requests spread round-robin: ours "
                             "share one Redis index, vllm-router's are independent, SMG's "
                             "join its mesh (issue #16)")
    parser.add_argument("--router-cpus", metavar="CPUS",
                        help="run the routers under test (our gateways, indexer and Redis; "
                             "the peers) on these CPUs, e.g. 0, and the replicas and the "
                             "client on the rest: production's layout, where a gateway does "
                             "not share cores with the engines it routes to (default: "
                             "everything shares every CPU)")
    parser.add_argument("--index-cpus", metavar="CPUS",
                        help="run Redis and the indexer on these CPUs (with --router-cpus; "
                             "default: with the routers). In a cluster they are pods of "
                             "their own: a gateway that looks up in its own mirror of the "
                             "KV events (index.mirror_events) shares no core with them")
    parser.add_argument("--baseline-repo", type=Path, metavar="DIR",
                        help="also run each of our policies from this checkout (a git "
                             "worktree of an earlier commit), as baseline~NAME, interleaved "
                             "with the rest: a before/after comparison in one run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds: every policy runs once per round, interleaved; the "
                             "report gives medians and min-max over rounds")
    parser.add_argument("--gateway-profile", choices=GATEWAY_PROFILES,
                        default=DEFAULT_GATEWAY_PROFILE,
                        help="our gateway's prefill profile: calibrated (`replica calibrate` "
                             "against a replica, as a user would), default (the gateway's "
                             "built-in), exact (the sims' own coefficients, a control)")
    parser.add_argument("--out", type=Path, required=True, help="report folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=65_536, help="KV tokens per replica")
    parser.add_argument("--max-model-len", type=int, default=16_384)
    parser.add_argument("--prefill-profile", default="h100-llama3.1-8b",
                        help="the sims' cost profile (built-in name or JSON file)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="sims run this many times faster than real time")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="tokenizer (and model for vllm) directory; built if missing")
    parser.add_argument("--sim-tokenizer", action="store_true",
                        help="load the tokenizer in each sim even for token ids (slow start)")
    parser.add_argument("--api", choices=("tokens", "chat"), default="tokens",
                        help="tokens: token ids to /v1/completions; chat: the same prompts as "
                             "chat messages (and tools) to /v1/chat/completions (the sims "
                             "then load the tokenizer)")
    parser.add_argument("--mode", choices=("closed", "open"), default="closed")
    parser.add_argument("--concurrency", type=positive_int, default=8)
    parser.add_argument("--rate", type=float, default=None,
                        help="open loop: Poisson req/s for workloads without arrival times")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="replay the workload's arrival times this many times faster")
    parser.add_argument("--deadline-s", type=float, default=600.0,
                        help="wall-clock bound per policy run")
    parser.add_argument("--warmup", type=int, default=None,
                        help="cache-neutral requests sent to each router before measuring "
                             "(default: 2 x max(concurrency, replicas); 0 for none)")
    parser.add_argument("--warm-shared-prefixes", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="before measuring, let each of our gateways tokenize once what "
                             "several conversations share before their first question "
                             "(system prompt, tools; chat only), in a request its context "
                             "check refuses: a long-running gateway has seen it, a fresh one "
                             "pays its first encoding on the first burst")
    parser.add_argument("--warm-run", action=argparse.BooleanOptionalAction, default=None,
                        help="before round 1, run round 1's first policy once in full and "
                             "discard it (default: on with --repeats above 1), so that no "
                             "counted run is the fleet's first: three agent compares once "
                             "placed their first run unevenly (imbalance 1.31-1.38, later "
                             "runs 1.00-1.12); later ones did not repeat it, so this is "
                             "insurance, at one run's time")
    parser.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a key of our gateways' policy config (docs/POLICY.md), e.g. "
                             "load_cost_s=0.25; repeatable; peers are unaffected")
    parser.add_argument("--index-set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a key of our gateways' index config, e.g. deadline_ms=100")
    parser.add_argument("--no-plots", action="store_true")
    add_workload_arguments(parser)


def parse_policies(args: argparse.Namespace) -> list[str]:
    """Our policies, then the peers' (PEER:POLICY) asked for, or installed under auto."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        peer, _ = split_policy(p)
        if peer is None and policy_variant(instances(p, 1)[0])[0] not in POLICIES:
            raise SystemExit(f"compare: unknown policy {p!r}; choose from {', '.join(POLICIES)}"
                             f" or PEER:NAME with PEER one of {', '.join(PEERS)}")
    if getattr(args, "baseline_repo", None) is not None:
        repo = args.baseline_repo
        if not (repo / "router" / "__main__.py").is_file():
            raise SystemExit(f"compare: --baseline-repo {repo}: not a cacheroute checkout")
        policies += [f"{BASELINE}{p}" for p in policies if split_policy(p)[0] is None]
    for peer, flag in ((VLLM_ROUTER, args.vllm_router), (SMG, getattr(args, "smg", "none"))):
        if flag == "none":
            continue
        names = (peer.default_policies if flag == "auto"
                 else tuple(n.strip() for n in flag.split(",") if n.strip()))
        # auto adds a peer only where it can run: installed, and on traffic it takes.
        if flag == "auto" and skip_reason(peer, args.api) is not None:
            continue
        policies += [f"{peer.name}:{n}" for n in names]
    return policies


def runnable(policies: Sequence[str], api: str) -> tuple[list[str], list[str]]:
    """The policies this run can compare, and why each of the others is skipped."""
    keep: list[str] = []
    skipped: list[str] = []
    for policy in policies:
        peer, _ = split_policy(policy)
        reason = None if peer is None else skip_reason(peer, api)
        if reason is None:
            keep.append(policy)
        else:
            skipped.append(f"{policy}: {reason}")
    return keep, skipped


@dataclass
class Comparison:
    """Everything one compare run produced."""

    runs: list[PolicyRun]
    files: ReportFiles
    index: str
    skipped: list[str]
    gateway_profile: GatewayProfile | None = None
    # The discarded first run (--warm-run), or None.
    warm_run: PolicyRun | None = None


def oracle_stream(records: Sequence[RequestRecord],
                  chat_tokens: Callable[[dict[str, Any]], list[int]] | None = None
                  ) -> list[OracleRequest]:
    """The stream the oracles replay: completed requests in plan order, answers included.

    A chat request whose server sent no prompt ids is tokenized here, with the template
    the replicas render (`chat_tokens`), so the oracle sees the prompt the replicas saw.
    """
    out = []
    for r in records:
        if not r.ok:
            continue
        prompt: Sequence[int] = r.prompt_token_ids
        if r.chat_request is not None and not r.prompt_from_server and chat_tokens is not None:
            prompt = chat_tokens({"model": MODEL_NAME, **r.chat_request})
        out.append(OracleRequest(prompt, r.output_token_ids, r.cache_salt))
    return out


def shared_prefix_bodies(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Chat bodies carrying what two or more conversations share before their first
    question (the system prompt and tools an agent's sessions all send), each once, with
    the question replaced by a word and max_tokens over the context.

    A gateway of ours tokenizes such a body, then refuses it with vLLM's context rule:
    its tokenizer's segment cache holds the shared text afterwards and nothing else is
    left behind (no replica sees it; warm_up checks that no pending prefix stays). What
    one conversation alone sends is not included: a gateway meets it first on that
    conversation's first turn, in production as here."""
    if args.api != "chat":
        return []
    workload = build_workload(args)
    users: dict[str, set[str]] = {}
    bodies: dict[str, dict[str, Any]] = {}
    for planned in workload.plan():
        if planned.turn != 0:
            continue
        req = workload.render(planned)
        if not req.messages or req.messages[-1].role != "user":
            continue
        messages = [{"role": m.role, "content": m.content} for m in req.messages[:-1]]
        messages.append({"role": "user", "content": "hi"})
        body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages,
                                "max_tokens": args.max_model_len + 1}
        if req.tools:
            body["tools"] = list(req.tools)
        key = json.dumps(body, sort_keys=True)
        users.setdefault(key, set()).add(planned.conversation_id)
        bodies[key] = body
    return [bodies[key] for key, who in users.items() if len(who) > 1]


async def warm_shared_prefixes(url: str, bodies: Sequence[dict[str, Any]]) -> None:
    """Send each of shared_prefix_bodies to one of our gateways: each must be refused by
    its context check (400), and no prefix may stay pending (a gateway that kept the
    refused request's prefix as pending on some replica would route the first turn after
    it: a warm-up that is not neutral fails the run instead)."""
    if not bodies:
        return
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for body in bodies:
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                text = await resp.text()
                if resp.status != 400:
                    raise HarnessError(
                        f"warm-up of a shared prefix at {url}: expected the gateway's "
                        f"context check to refuse it (400), got {resp.status}: {text[:300]}")
        async with session.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    prefix = 'cacheroute_bounded_entries{structure="pending"} '
    pending = sum(float(line[len(prefix):]) for line in metrics.splitlines()
                  if line.startswith(prefix))
    if pending:
        raise HarnessError(
            f"warm-up of shared prefixes left {pending:.0f} pending blocks at {url}: this "
            "gateway keeps the prefix of a refused request (a checkout before 6652aa2?); "
            "run with --no-warm-shared-prefixes")


async def warm_up(url: str, args: argparse.Namespace) -> None:
    """Send a few requests that leave no cache behind before measuring a router.

    A freshly started router pays one-off costs on its first requests (connections,
    lazy initialisation): a few hundred ms each on this machine, which would land on the
    first turn of whichever policy ran. Each warm-up prompt stays under one block (a
    token-id prompt of block_size - 1 tokens; a one-word chat, about ten tokens once
    rendered) and asks for 1 token, so no replica caches anything from it.
    """
    n = args.warmup if args.warmup is not None else 2 * max(args.concurrency, args.replicas)
    if n <= 0:
        return
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0.0}
    if args.api == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        path = "/v1/completions"
        body["prompt"] = list(range(TOKEN_LOW, TOKEN_LOW + args.block_size - 1))
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one() -> None:
            async with session.post(f"{url}{path}", json=body) as resp:
                if resp.status != 200:
                    raise HarnessError(f"warm-up request to {url} answered {resp.status}: "
                                       f"{(await resp.text())[:300]}")
                await resp.read()

        batch = max(1, args.concurrency)
        for start in range(0, n, batch):
            await asyncio.gather(*(one() for _ in range(min(batch, n - start))))


async def _drive(urls: Sequence[str], args: argparse.Namespace,
                 on_record: Callable[[RequestRecord], None]) -> tuple[RunResult, list[int]]:
    """The run's result and how many requests each router instance was sent."""
    config = DriverConfig(
        base_url=urls[0], model=MODEL_NAME, api=args.api, mode=args.mode,
        concurrency=args.concurrency,
        rate=None if args.rate is None else args.rate * args.time_scale,
        speedup=args.speedup * args.time_scale, deadline_s=args.deadline_s,
        request_timeout_s=min(args.deadline_s, 600.0), seed=args.seed)
    driver = SpreadDriver(config, urls, on_record=on_record)
    return await driver.run(build_workload(args)), driver.sent_to


class SpreadDriver(Driver):
    """A Driver sending request i to router i mod N (--gateways N), round-robin."""

    def __init__(self, config: DriverConfig, urls: Sequence[str],
                 on_record: Callable[[RequestRecord], None] | None = None) -> None:
        super().__init__(config, on_record=on_record)
        self._urls = list(urls)
        self.sent_to = [0] * len(self._urls)

    async def _stream(self, session: aiohttp.ClientSession, req: Any,
                      rec: RequestRecord) -> None:
        # Driver._stream reads config.base_url before its first await, so setting it
        # here, on the one event loop, gives this request its own router.
        i = rec.index % len(self._urls)
        self.config = dataclasses.replace(self.config, base_url=self._urls[i])
        self.sent_to[i] += 1
        await super()._stream(session, req, rec)


def instances(policy: str, default: int) -> tuple[str, int]:
    """`cache_aware*4` -> ("cache_aware", 4); without `*N`, (policy, default)."""
    name, sep, count = policy.rpartition("*")
    if not sep:
        return policy, default
    if not count.isdigit() or int(count) < 1 or not name:
        raise HarnessError(f"{policy!r}: want NAME*N with N a positive count of instances")
    return name, int(count)


@contextlib.contextmanager
def router(policy: str, fleet: TargetFleet, index: str, profile: GatewayProfile,
           args: argparse.Namespace, log_dir: Path, tag: str
           ) -> Iterator[tuple[list[str], str]]:
    """The routers a policy names (--gateways of them, or N of `NAME*N`), started; their
    URLs and a note."""
    repo, baseline = REPO, policy.startswith(BASELINE)
    if baseline:
        policy, repo = policy.removeprefix(BASELINE), args.baseline_repo.resolve()
        tag = f"-baseline{tag}"
    base, count = instances(policy, getattr(args, "gateways", 1))
    if base != policy:  # its files must not overwrite those of the same router x1
        tag = f"-x{count}{tag}"
    peer, name = split_policy(base)
    policy = base
    if peer is not None:
        with peer_routers(peer, name, fleet, Path(args.model_dir), log_dir, tag,
                          count, getattr(args, "router_cpu_set", None)) as urls:
            yield urls, peer.label + (f"; {count} instances, "
                                      + ("joined by its mesh" if peer is SMG
                                         else "independent") if count > 1 else "")
    else:
        with gateways(policy, fleet, index, profile, args, log_dir, tag, count, repo) as urls:
            note = overrides_note(args)
            if baseline:
                note = "; ".join(filter(None, [note, f"code of {checkout_line(repo)}"]))
            if unbuilt := unbuilt_c_paths(repo):
                note = "; ".join(filter(None, [
                    note, f"not built: {', '.join(unbuilt)} (its pure-Python fallback ran)"]))
            if count > 1:
                note = "; ".join(filter(None, [note, f"{count} gateways sharing the index"]))
            yield urls, note


def checkout_line(repo: Path) -> str:
    """A checkout as the report names it: its commit, or its path if git cannot say."""
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    commit = proc.stdout.strip()
    return f"commit {commit}" if proc.returncode == 0 and commit else str(repo)


def routers_line(policies: Sequence[str], default: int) -> str:
    """How many instances each policy ran as, for the report."""
    counts = {p: instances(p, default)[1] for p in policies}
    base = (f"{default} instances per policy, requests round-robin over them" if default > 1
            else "one instance per policy")
    own = [p for p in policies if instances(p, default)[0] != p]
    if not own:
        return base
    return (f"{base}, except {', '.join(f'{p} ({counts[p]})' for p in own)}; requests "
            "round-robin over a policy's instances")


def round_order(policies: Sequence[str], round_index: int) -> list[str]:
    """Round r runs the policies rotated by r: none always runs first on a fresh machine."""
    k = round_index % len(policies) if policies else 0
    return [*policies[k:], *policies[:k]]


def _meta(args: argparse.Namespace, use_redis: bool, profile: GatewayProfile,
          skipped: Sequence[str], shared_prefixes: int = 0) -> dict[str, Any]:
    workload = build_workload(args)
    meta: dict[str, Any] = {
        "command": "python -m loadgen " + " ".join(getattr(args, "argv", []) or []),
        "workload": json.dumps(workload.describe()),
        "api": ("chat: messages (and tools) to /v1/chat/completions, "
                + chat_lexicon(args).describe()
                if args.api == "chat" else "tokens: token ids to /v1/completions"),
        "replicas": f"{args.replicas} x {args.replica_kind}, block size {args.block_size}, "
                    f"{args.kv_tokens} KV tokens each, profile {args.prefill_profile}",
        "index": "redis (private redis-server)" if use_redis else "memory",
        "routers": routers_line(parse_policies(args), getattr(args, "gateways", 1)),
        "gateway profile": profile.describe(),
        "gateway settings": "defaults (health checks every 2 s, scrapes every 1 s), routing "
                            "headers exposed, and what a policy variant or --policy-set "
                            "names",
        "cpus": _cpus_line(args),
        "rounds": f"{args.repeats} (policies interleaved, rotated each round; caches and "
                  "index emptied before every run)",
        "pacing": (f"closed loop, concurrency {args.concurrency}" if args.mode == "closed"
                   else "open loop at " + (
                       f"a Poisson rate of {args.rate} req/s" if args.rate is not None
                       else "the workload's arrival times")
                   + f", speedup {args.speedup:g} (in simulated time)"),
        "seed": args.seed,
        "warm-up": "each router first served cache-neutral requests (under one block, "
                   "1 output token): one-off start-up costs are not measured"
                   + (f"; each of our gateways then tokenized, once, the {shared_prefixes} "
                      "prefix(es) that several conversations share before their first "
                      "question (system prompt, tools), in requests its context check "
                      "refused (--warm-shared-prefixes)" if shared_prefixes else ""),
    }
    if skipped:
        meta["skipped"] = "; ".join(s.splitlines()[0] for s in skipped)
    return meta


def _cpus_line(args: argparse.Namespace) -> str:
    """Where the routers, the replicas and the client ran, for the report."""
    routers: frozenset[int] | None = getattr(args, "router_cpu_set", None)
    if routers is None:
        return (f"shared: routers, replicas and the client on all "
                f"{len(os.sched_getaffinity(0))} CPUs")
    fleet: frozenset[int] = getattr(args, "fleet_cpu_set", frozenset())
    index: frozenset[int] = getattr(args, "index_cpu_set", None) or routers
    if index == routers:
        return (f"routers (gateways, indexer, Redis; peers) on CPU {_cpu_list(routers)}; "
                f"replicas and the client on CPU {_cpu_list(fleet)}")
    return (f"routers (gateways; peers) on CPU {_cpu_list(routers)}; Redis and the indexer "
            f"on CPU {_cpu_list(index)}; replicas and the client on CPU {_cpu_list(fleet)}")


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


@contextlib.contextmanager
def _placed(args: argparse.Namespace) -> Iterator[None]:
    """Apply --router-cpus: this process (the client, and the replicas it starts) moves to
    the other CPUs for the run, and back after; args.router_cpu_set tells the routers'
    starters where theirs go."""
    args.router_cpu_set = args.index_cpu_set = None
    if not getattr(args, "router_cpus", None):
        if getattr(args, "index_cpus", None):
            raise HarnessError("--index-cpus needs --router-cpus")
        yield
        return
    routers = parse_cpus("--router-cpus", args.router_cpus)
    args.index_cpu_set = (parse_cpus("--index-cpus", args.index_cpus)
                          if getattr(args, "index_cpus", None) else routers)
    before = os.sched_getaffinity(0)
    fleet = frozenset(before - routers)
    if not fleet:
        raise HarnessError(f"--router-cpus {args.router_cpus!r} leaves no CPU for the "
                           "replicas and the client")
    args.router_cpu_set, args.fleet_cpu_set = routers, fleet
    os.sched_setaffinity(0, fleet)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_comparison(args: argparse.Namespace, console: Any = None) -> Comparison:
    """Start everything, run every policy each round, stop everything, write the report."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = console or Console(stderr=True)
    if args.repeats < 1:
        raise HarnessError(f"--repeats must be at least 1, got {args.repeats}")
    if getattr(args, "gateways", 1) < 1:
        raise HarnessError(f"--gateways must be at least 1, got {args.gateways}")
    policies, skipped = runnable(parse_policies(args), args.api)
    for policy in policies:
        instances(policy, 1)  # a bad NAME*N fails now, not rounds into the run
    if getattr(args, "smg", "none") == "auto" and args.api != "chat":
        console.print(f"not comparing smg: {skip_reason(SMG, args.api)}")
    for reason in skipped:
        console.print(f"skipping {reason}")
    checkouts = {REPO, *([args.baseline_repo.resolve()] if getattr(args, "baseline_repo", None)
                         and any(p.startswith(BASELINE) for p in policies) else [])}
    for repo in sorted(checkouts):
        if warning := unbuilt_warning(repo):
            console.print(warning)
    args.model_dir = ensure_model_dir(Path(args.model_dir))
    args.out.mkdir(parents=True, exist_ok=True)
    total = len(build_workload(args).plan())
    shared = shared_prefix_bodies(args) if getattr(args, "warm_shared_prefixes", True) else []
    runs: list[PolicyRun] = []
    with tempfile.TemporaryDirectory(prefix="cacheroute-compare-") as tmp, \
            contextlib.ExitStack() as stack, _placed(args):
        log_dir = Path(tmp)
        use_redis = args.index == "redis" or (
            args.index == "auto" and shutil.which("redis-server") is not None)
        index = "memory"
        if use_redis:
            index = stack.enter_context(redis_server(log_dir / "redis.log",
                                                     args.index_cpu_set)).url
        console.print(f"starting {args.replicas} {args.replica_kind} replicas "
                      f"(index: {'redis' if use_redis else 'memory'})")
        fleet = (start_sim_fleet(args) if args.replica_kind == "sim"
                 else start_vllm_fleet(args, log_dir))
        stack.callback(fleet.stop)
        profile = choose_profile(args, fleet, log_dir)
        console.print(f"gateway profile: {profile.describe()}")
        warm = None
        with Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            if warm_run_wanted(args) and policies:
                first = round_order(policies, 0)[0]
                result = _run_policy(first, -1, fleet, index, profile, args, log_dir,
                                     progress, total, shared)
                # A peer that failed to start is skipped, with its reason, in round 1.
                warm = None if isinstance(result, str) else result
            for r in range(args.repeats):
                for policy in round_order(policies, r):
                    run = _run_policy(policy, r, fleet, index, profile, args, log_dir,
                                      progress, total, shared)
                    if isinstance(run, str):
                        skipped.append(run)
                        policies = [p for p in policies if p != policy]
                    else:
                        runs.append(run)
        if not runs:
            raise HarnessError("no policy ran")
        chat_tokens = None
        if args.api == "chat":
            from router.tokenize import PromptTokenizer

            chat_tokens = PromptTokenizer.from_dir(args.model_dir).chat_tokens
        stream = oracle_stream(runs[0].result.records, chat_tokens)
        oracle = bounds(stream, args.block_size, args.replicas * fleet.blocks_per_replica)
        for run in runs:
            run.oracle = oracle
        floor = None
        if args.replica_kind == "sim":  # a real server's step cost is not known exactly
            floor = ttft_floor([len(r.prompt_token_ids) for r in stream],
                               oracle.pooled.per_request, load_profile(args.prefill_profile))
        meta = _meta(args, use_redis, profile, skipped, len(shared))
        if warm is not None:
            row = summarize(warm, args.time_scale)
            p50, imbalance = row["ttft_p50_s"], row["imbalance_max_over_mean"]
            meta["warm-up run"] = (
                f"{warm.policy} ran the whole workload once before round 1, on emptied "
                "caches; not reported (--warm-run); it measured TTFT p50 "
                + (f"{p50 * 1000:.1f} ms" if p50 is not None else "-") + ", imbalance "
                + (f"{imbalance:.2f}" if imbalance is not None else "-"))
        files = write_report(args.out, runs, meta, time_scale=args.time_scale,
                             plots=not args.no_plots, floor=floor)
    return Comparison(runs, files, index, skipped, profile, warm)


def warm_run_wanted(args: argparse.Namespace) -> bool:
    """--warm-run as given, else on exactly when there are rounds to interleave."""
    wanted = getattr(args, "warm_run", None)
    return args.repeats > 1 if wanted is None else bool(wanted)


def _run_policy(policy: str, round_index: int, fleet: TargetFleet, index: str,
                profile: GatewayProfile, args: argparse.Namespace, log_dir: Path,
                progress: Any, total: int,
                shared: Sequence[dict[str, Any]] = ()) -> PolicyRun | str:
    """One policy's run on emptied caches; a peer that fails to start gives its reason.
    `shared`: shared_prefix_bodies, for our gateways' warm-up."""
    label = (f"{policy} (warm-up run, discarded)" if round_index < 0 else
             policy if args.repeats == 1 else f"{policy} (round {round_index + 1})")
    task = progress.add_task(label, total=total)
    fleet.reset_caches()
    if index.startswith("redis://"):
        flush_index(index)
    # The processes the router starts are those below this one that were not there before.
    before_router = set(descendants(os.getpid()))
    try:
        with router(policy, fleet, index, profile, args, log_dir,
                    "-warm" if round_index < 0 else f"-r{round_index}") as (
                urls, note):
            routers = [pid for pid in descendants(os.getpid()) if pid not in before_router]
            for url in urls:
                asyncio.run(warm_up(url, args))
                if split_policy(policy)[0] is None:
                    # Ours only: a peer that tokenizes chat (SMG) would insert the
                    # refused request's text into its cache tree, and vllm-router's
                    # cache_aware does so for any request it routes; vllm-router does not
                    # tokenize chat, and SMG keeps no tokenizer cache by default.
                    asyncio.run(warm_shared_prefixes(url, shared))
            before = fleet.ttft_totals()
            cpu_before = _cpu_of(routers)

            def advance(_record: RequestRecord) -> None:
                progress.advance(task)

            result, sent_to = asyncio.run(_drive(urls, args, advance))
            cpu_after = _cpu_of(routers)
            if len(urls) > 1:
                note = "; ".join(filter(None, [
                    note, "requests per instance " + "/".join(map(str, sent_to))]))
    except HarnessError as exc:
        if split_policy(policy)[0] is not None:
            progress.remove_task(task)
            progress.console.print(f"skipping {policy}: {str(exc).splitlines()[0]}")
            return f"{policy}: {exc}"
        raise
    done = len(result.completed())
    progress.console.print(f"{label}: {done}/{len(result.records)} completed in "
                           f"{result.wall_s:.1f}s")
    after = fleet.ttft_totals()
    counts = {name: after[name][0] - before.get(name, (0, 0.0))[0] for name in after}
    seconds = sum(after[name][1] - before.get(name, (0, 0.0))[1] for name in after)
    return PolicyRun(policy, result, [r.name for r in fleet.replicas], note=note,
                     replica_counts=counts, round=round_index,
                     replica_ttft=(sum(counts.values()), seconds),
                     router_cpu_s=(None if cpu_before is None or cpu_after is None
                                   else cpu_after - cpu_before))


def _cpu_of(pids: Sequence[int]) -> float | None:
    """User + system seconds the processes have used so far; None if one is gone (its
    share would be lost) or there are none."""
    try:
        return sum(cpu_seconds(pid) for pid in pids) if pids else None
    except (OSError, ValueError, IndexError):
        return None


def run(args: argparse.Namespace) -> int:
    """Run the comparison and print the table and where the report is."""
    args.argv = ["compare", *sys.argv[2:]] if sys.argv[1:2] == ["compare"] else []
    try:
        comparison = run_comparison(args)
    except (HarnessError, ValueError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 1
    print(comparison.files.table_md.read_text())
    print(f"report: {comparison.files.table_md}")
    return 0
