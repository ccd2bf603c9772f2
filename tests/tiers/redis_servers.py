"""Real ``redis-server`` processes on loopback ports, for the Redis tier's tests and
benchmark: one server, or a 3-master Redis Cluster made with ``redis-cli --cluster
create``. Nothing is persisted (``--save '' --appendonly no``); each process lives in a
directory of its own under the given one.

Readiness is polled with a bounded loop (a PING every few milliseconds, for at most
``START_TIMEOUT_S``): that is waiting for a process to start, not synchronisation.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT_S = 20.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = False) -> int:
    """A loopback port nobody listens on now (the kernel's pick). ``cluster``: one whose
    cluster bus port (+10000) is free too, so at most 55535."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster or (port <= 55535 and _bindable(port + 10000)):
            return port
    raise RuntimeError("no free loopback port for a cluster node")


class _PortTaken(RuntimeError):
    """redis-server could not bind its port (or its cluster bus port)."""


def redis_available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def _ping(port: int, password: str | None) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
        if password is not None:
            s.sendall(f"AUTH {password}\r\n".encode())
            s.recv(64)
        s.sendall(b"PING\r\n")
        return s.recv(64)


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port`` (a free port unless given).

    ``extra`` are more ``redis-server`` arguments (``--requirepass``, ``--maxmemory``...).
    :meth:`kill` ends it at once (SIGKILL, as a crash); :meth:`start` again brings it
    back on the same port.
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        password: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.directory = directory
        self._cluster = "--cluster-enabled" in extra
        self._picked = port is None
        """The port is this object's own pick: a first start may take another (below)."""
        self.port = port or free_port(cluster=self._cluster)
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f"default:{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait until it answers. A port picked here can be taken by another
        process between the pick and the start (a cluster's bus port, +10000, is in the
        kernel's range for outgoing connections): the first start then picks another,
        a few times. A given port, or a restart, keeps its port. Read ``port`` and
        ``url`` after it."""
        for attempt in range(5):
            try:
                self._start()
                break
            except _PortTaken:
                if not self._picked or attempt == 4:
                    raise
                self.port = free_port(cluster=self._cluster)
        self._picked = False  # started once: a restart comes back on this port

    def _start(self) -> None:
        assert self.proc is None, "already running"
        args = [
            "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
            *(("--requirepass", self.password) if self.password else ()),
            *self.extra,
        ]  # fmt: skip
        log_file = self.directory / "redis.log"
        seen = log_file.stat().st_size if log_file.exists() else 0  # an earlier start's
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                self.proc = None
                log = log_file.read_bytes()[seen:].decode(errors="replace")[-2000:]
                error = _PortTaken if "Address already in use" in log else RuntimeError
                raise error(f"redis-server on port {self.port} exited: {log}")
            try:
                if b"PONG" in _ping(self.port, self.password):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)  # polling a starting process, bounded above

    def kill(self) -> None:
        """End the server at once (SIGKILL) and reap it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def cli(self, *args: str) -> str:
        """``redis-cli`` against this server; its output."""
        auth = ("--no-auth-warning", "-a", self.password) if self.password else ()
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *auth, *args],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return out.stdout.decode()


class RedisClusterProcs:
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback ports."""

    def __init__(self, directory: Path, *, masters: int = 3, node_timeout_ms: int = 2000) -> None:
        self.nodes = [
            RedisServer(
                directory / f"node{i}",
                extra=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                ),
            )  # fmt: skip
            for i in range(masters)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self) -> None:
        for n in self.nodes:
            n.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],  # fmt: skip
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()

    def wait_ok(self) -> None:
        """Until every node says ``cluster_state:ok`` (bounded: START_TIMEOUT_S)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)  # polling the cluster's own convergence, bounded above

    def node_of(self, redis_key: bytes) -> RedisServer:
        """The node that serves ``redis_key``'s slot (from ``CLUSTER NODES``)."""
        slot = int(self.nodes[0].cli("cluster", "keyslot", redis_key.decode()).strip())
        by_port = {n.port: n for n in self.nodes}
        for line in self.nodes[0].cli("cluster", "nodes").splitlines():
            fields = line.split()
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for span in fields[8:]:
                lo, _, hi = span.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return by_port[port]
        raise LookupError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()
