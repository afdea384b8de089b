"""End-to-end fixtures: simulated replicas, gateways (in-process or as processes), indexers.

Every process a fixture starts is stopped when the test ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from replica.fleet import RunningReplica
from replica.processes import stop_process, wait_until_async
from replica.processes import wait_until as wait_until_sync
from router.app import GATEWAY, Gateway, build_app, running_gateway
from router.config import build_config
from router.hashing import HashConfig, chain_hashes, event_key
from router.index import PrefixIndex
from router.tenants import derive_salt

REPO = Path(__file__).resolve().parents[2]
SECRET = "e2e-salt-secret-0123456789abcdef"
ENV = {"CACHEROUTE_SALT_SECRET": SECRET}
TENANT_KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
BLOCK_SIZE = 16
SEED = "0"


def tenant_salt(tenant: str) -> str:
    return derive_salt(SECRET.encode(), tenant)


def gateway_config(replicas: Sequence[RunningReplica], *, model: str, port: int,
                   index: str = "memory", events: bool = True, model_dir: Path | None = None,
                   policy: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    """A raw gateway config (as YAML would hold it) for a sim fleet."""
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {"url": r.url, "models": [model], "block_size": BLOCK_SIZE, "hash_seed": SEED,
             **({"kv_events": r.kv_events_endpoint, "kv_replay": r.replay_endpoint}
                if events and r.kv_events_endpoint else {})}
            for r in replicas],
        # Generous: a loaded 2-core test machine must not turn lookups into fallbacks.
        "index": {"backend": index, "deadline_ms": 500},
        "policy": {"name": "cache_aware", "seed": 7, **(policy or {})},
        "tenants": {"secret_env": "CACHEROUTE_SALT_SECRET",
                    "keys": [{"key": k, "tenant": t} for k, t in TENANT_KEYS.items()]},
        "proxy": {"expose_routing_headers": True},
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "scrape_interval_s": 0.25},
    }
    if model_dir is not None:
        raw["models"] = {model: {"tokenizer": str(model_dir)}}
    for name, value in sections.items():
        raw[name] = {**raw.get(name, {}), **value}
    return raw


@dataclass
class Reply:
    """One gateway response, with what the tests compare."""

    status: int
    headers: dict[str, str]
    body: Any

    @property
    def replica(self) -> str:
        return self.headers["x-cacheroute-replica"]

    @property
    def predicted(self) -> int:
        return int(self.headers["x-cacheroute-predicted-cached-tokens"])

    @property
    def cached(self) -> int:
        return int(self.body["usage"]["prompt_tokens_details"]["cached_tokens"])


@dataclass
class GatewayClient:
    """HTTP access to one gateway, as a tenant."""

    url: str
    session: aiohttp.ClientSession
    app_gateway: Gateway | None = None  # set for in-process gateways
    replies: list[Reply] = field(default_factory=list)

    async def post(self, path: str, body: dict[str, Any], key: str = "sk-alpha",
                   headers: dict[str, str] | None = None) -> Reply:
        async with self.session.post(
                self.url + path, json=body,
                headers={"Authorization": f"Bearer {key}", **(headers or {})}) as resp:
            data = await resp.json(content_type=None)
            reply = Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, data)
        self.replies.append(reply)
        return reply

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


async def wait_until(condition: Callable[[], Awaitable[bool]], within_s: float = 10.0,
                     what: str = "condition") -> None:
    """Poll `condition` until it holds, or fail after `within_s` seconds."""
    await wait_until_async(condition, within_s, what)


def chain_keys(tokens: Sequence[int], salt: str | None) -> list[int]:
    config = HashConfig(block_size=BLOCK_SIZE, seed=SEED)
    return [event_key(d) for d in chain_hashes(config, tokens, cache_salt=salt)]


async def wait_indexed(index: PrefixIndex, model: str, replica: str, tokens: Sequence[int],
                       salt: str | None, within_s: float = 10.0) -> None:
    """Wait until the index knows `replica` holds every full block of `tokens`."""
    keys = chain_keys(tokens, salt)

    async def held() -> bool:
        return (await index.lookup(model, keys)).get(replica, 0) >= len(keys)

    await wait_until(held, within_s, f"{replica} to hold {len(keys)} blocks in the index")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
async def start_gateway(http: aiohttp.ClientSession,
                        ) -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[GatewayClient]]]:
    """Start an in-process gateway for a raw config; stopped after the test."""
    stack = contextlib.AsyncExitStack()

    async def start(raw: dict[str, Any]) -> GatewayClient:
        config = build_config(raw, ENV)
        app = build_app(config)
        await stack.enter_async_context(
            running_gateway(app, config.listen.host, config.listen.port, shutdown_timeout=2))
        return GatewayClient(f"http://{config.listen.host}:{config.listen.port}", http,
                             app[GATEWAY])

    async with stack:
        yield start


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class ProcessGroup:
    """Router processes (gateways, indexers) started by one test; all stopped at the end."""

    procs: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cacheroute-e2e-")))
    # INFO where a failing test prints the logs (stream clears, replays, handshakes).
    log_level: str = "WARNING"

    def write_config(self, raw: dict[str, Any], name: str) -> Path:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log_path = self.tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "router", *args], cwd=REPO,
                                    env={**os.environ, **ENV}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((proc, log_path))
        return proc

    def gateway(self, raw: dict[str, Any], name: str) -> str:
        """Start a gateway process and wait until it is ready (for sync fixtures)."""
        proc, url = self._spawn_gateway(raw, name)
        try:
            wait_until_sync(lambda: _ready(url), 60, f"gateway {name} to be ready", proc=proc)
        except Exception as exc:
            raise RuntimeError(f"{exc}:\n{self.log(proc)}") from None
        return url

    async def start_gateway(self, raw: dict[str, Any], name: str) -> str:
        """`gateway` for async tests: waits without blocking the event loop."""
        proc, url = self._spawn_gateway(raw, name)

        async def ready() -> bool:
            return await asyncio.to_thread(_ready, url)

        try:
            await wait_until_async(ready, 60, f"gateway {name} to be ready", proc=proc)
        except Exception as exc:
            raise RuntimeError(f"{exc}:\n{self.log(proc)}") from None
        return url

    def _spawn_gateway(self, raw: dict[str, Any], name: str
                       ) -> tuple[subprocess.Popen[bytes], str]:
        path = self.write_config(raw, name)
        proc = self.spawn(["serve", "--config", str(path), "--log-level", self.log_level], name)
        return proc, f"http://127.0.0.1:{raw['listen']['port']}"

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        for p, path in self.procs:
            if p is proc:
                return path.read_text(errors="replace")[-4000:]
        return ""

    def logs(self) -> str:
        """The tail of every process's log, by name: for a failing assertion's message."""
        return "\n".join(f"--- {path.stem}:\n{path.read_text(errors='replace')[-3000:]}"
                         for _, path in self.procs)

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()  # all at once: they shut down in parallel
        for proc, _ in self.procs:
            stop_process(proc, grace_s=15)


@pytest.fixture
def processes() -> Any:
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.stop()
