"""Redis as operators run it, for tests: password, TLS, a replica and Sentinel.

Every process is a real redis-server on a free loopback port, started by the test and
stopped by pid when it ends (`RedisTopology.stop`). Nothing is persisted.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from servers import free_port, wait_for_port

from replica.processes import stop_process


@dataclass
class RedisTopology:
    """Redis processes one test owns; `stop()` ends them all."""

    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cacheroute-redis-")))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def _start(self, name: str, args: list[str], port: int) -> subprocess.Popen[bytes]:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed"
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=self.tmp)
        log.close()
        self.procs[name] = proc
        try:
            wait_for_port(port, 15, proc=proc)
        except BaseException as exc:
            raise RuntimeError(f"{name}: {exc}\n{self.log(name)}") from None
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def server(self, name: str, *, password: str | None = None, replica_of: int | None = None,
               extra: list[str] | None = None, port: int | None = None) -> int:
        """A redis-server (optionally a replica of 127.0.0.1:replica_of); returns its port."""
        port = free_port() if port is None else port
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.tmp)]
        if password is not None:
            args += ["--requirepass", password, "--masterauth", password]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self._start(name, [*args, *(extra or [])], port)
        return port

    def tls_server(self, name: str) -> tuple[int, Path]:
        """A TLS-only redis-server with a certificate for 127.0.0.1; (port, CA file)."""
        ca, cert, key = self._certificates()
        port = free_port()
        self._start(name, ["--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                           "--save", "", "--appendonly", "no", "--tls-cert-file", str(cert),
                           "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                           "--tls-auth-clients", "no"], port)
        return port, ca

    def sentinel(self, name: str, master_port: int, *, master: str = "primary",
                 password: str | None = None, down_after_ms: int = 500) -> int:
        """A sentinel watching 127.0.0.1:master_port as `master` (quorum 1); its port."""
        port = free_port()
        conf = self.tmp / f"{name}.conf"  # sentinels rewrite their config: it must be a file
        lines = [f"port {port}", "bind 127.0.0.1", f"dir {self.tmp}",
                 f"sentinel monitor {master} 127.0.0.1 {master_port} 1",
                 f"sentinel down-after-milliseconds {master} {down_after_ms}",
                 f"sentinel failover-timeout {master} 3000"]
        if password is not None:
            lines.append(f"sentinel auth-pass {master} {password}")
        conf.write_text("\n".join(lines) + "\n")
        self._start(name, [str(conf), "--sentinel"], port)
        return port

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crashed primary), and reap it."""
        proc = self.procs[name]
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                stop_process(proc, grace_s=5)

    def _certificates(self) -> tuple[Path, Path, Path]:
        ca_key, ca, key, csr, cert = (self.tmp / n for n in
                                      ("ca.key", "ca.crt", "server.key", "server.csr",
                                       "server.crt"))
        ext = self.tmp / "server.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")
        for cmd in (
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key,
             "-out", ca, "-days", "2", "-subj", "/CN=cacheroute-test-ca"],
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
             "-subj", "/CN=127.0.0.1"],
            ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
             "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext],
        ):
            subprocess.run([str(c) for c in cmd], check=True, capture_output=True, timeout=60)
        return ca, cert, key
