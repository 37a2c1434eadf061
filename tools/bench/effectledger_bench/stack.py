"""The system under test: private PostgreSQL and nats-server, and the services as processes.

Each service runs as `python -m effectledger_cli <service>` configured only through
`EFFECTLEDGER_*` variables, as an operator would run it, with a subject and stream prefix of its
own so that a given (shared) NATS is never disturbed. Readiness is observed: the sandbox's
`/healthz`, the ledger's `/readyz/relay`, the dispatcher's "dispatcher ready" line.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from effectledger_cli.embedded import free_port, start_nats
from effectledger_testkit.postgres import PrivatePostgres

from .pg import private_postgres
from .procs import CpuSample, sample

CATALOG = """\
# The benchmark's catalog: one idempotent tool against the benchmark's own sandbox.
catalog_version = 1

[tools.create_ticket]
description = "Create a ticket; the provider deduplicates by Idempotency-Key."
endpoint = "{sandbox}/v1/idempotent/effects"
effect_class = "idempotent"
contract_revision = "bench-1"
headers = {{ Authorization = "Bearer ${{EFFECTLEDGER_SANDBOX_API_KEY}}" }}
timeout_s = {timeout_s}
max_attempts = 3
capabilities = {{ accepts_idempotency_key = true, readback = true, fencing_token = true }}
readback = {{ url = "{sandbox}/v1/idempotent/effects/by-key/{{operation_key}}" }}
"""
TOOL = "create_ticket"
# Keys the sandbox remembers in a benchmark run (see `start_sandbox`): a full run makes ~140,000.
SANDBOX_MAX_KEYS = 10_000_000


@dataclass
class Service:
    name: str
    kind: str  # ledger | dispatcher | sandbox | nats | postgres
    popen: subprocess.Popen[bytes] | None
    pid: int
    log: Path | None = None
    tree: bool = False
    metrics_url: str | None = None  # a dispatcher's /metrics (its health port)

    @property
    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            os.kill(self.pid, 0)
            return True
        except OSError:
            return False


@dataclass
class Stack:
    workdir: Path
    database_url: str | None = None  # given: use it; else a private PostgreSQL
    nats_url: str | None = None  # given: use it; else a private nats-server
    provider_timeout_s: float = 2.0
    ledger_env: dict[str, str] = field(default_factory=dict)
    dispatcher_env: dict[str, str] = field(default_factory=dict)
    # A command each service of a kind runs under (e.g. valgrind for `instructions.py`), and
    # how many times longer such a service may take to become ready.
    wrappers: dict[str, list[str]] = field(default_factory=dict)
    slow_start: float = 1.0

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o755)  # the postgres user must reach its folder inside
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.pg: PrivatePostgres | None = None
        self.services: dict[str, Service] = {}
        # (name, pid, kind, last sample) of stopped processes, so a phase that stops a
        # process still counts the CPU it used before stopping.
        self.retired: list[tuple[str, int, str, CpuSample]] = []
        self.api_key = "sk_bench_" + secrets.token_hex(12)
        tag = secrets.token_hex(3)
        self.subject_prefix = f"bench{tag}"
        self.stream_prefix = f"BENCH{tag.upper()}"
        self.sandbox_port = free_port()
        self.ledger_port = free_port()
        self.sandbox_url = f"http://127.0.0.1:{self.sandbox_port}"
        self.ledger_url = f"http://127.0.0.1:{self.ledger_port}"
        self.db_name = "effectledger_bench"
        self._launcher: str | None = None
        self._tmp_pg: Path | None = None

    # -- infrastructure --------------------------------------------------------------------

    def start_infra(self) -> None:
        if self.database_url is None:
            self.pg = private_postgres(self._pg_root())
            self.database_url = self.pg.create_database(self.db_name)
            pid = int((self.pg.data / "postmaster.pid").read_text().split()[0])
            self.services["postgres"] = Service("postgres", "postgres", None, pid,
                                                self.pg.log, tree=True)
        if self.nats_url is None:
            port = free_port()
            proc = start_nats(self.workdir / "jetstream", port, log_file=self.logs / "nats.log")
            self.nats_url = f"nats://127.0.0.1:{port}"
            self.services["nats"] = Service("nats", "nats", proc, proc.pid,
                                            self.logs / "nats.log")
        self.catalog_path = self.workdir / "catalog.toml"
        self.catalog_path.write_text(CATALOG.format(sandbox=self.sandbox_url,
                                                    timeout_s=self.provider_timeout_s))

    def _pg_root(self) -> Path:
        """`<workdir>/pg` if the postgres user can reach it, else a fresh folder in /tmp.

        When we are root, PostgreSQL runs as `postgres`, which needs search permission on every
        ancestor folder (pytest's tmp_path, under a 0700 folder, is not reachable).
        """
        root = self.workdir / "pg"
        if os.geteuid() != 0 or all(p.stat().st_mode & 0o001 for p in root.parents):
            return root
        self._tmp_pg = Path(tempfile.mkdtemp(prefix="effectledger-bench-pg-"))
        os.chmod(self._tmp_pg, 0o755)
        return self._tmp_pg / "pg"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
        assert self.database_url and self.nats_url
        env.update({
            "EFFECTLEDGER_DATABASE_URL": self.database_url,
            "EFFECTLEDGER_NATS_URL": self.nats_url,
            "EFFECTLEDGER_SUBJECT_PREFIX": self.subject_prefix,
            "EFFECTLEDGER_STREAM_PREFIX": self.stream_prefix,
            "EFFECTLEDGER_STREAM_STORAGE": "file",
            "EFFECTLEDGER_LEDGER_HOST": "127.0.0.1",
            "EFFECTLEDGER_LEDGER_PORT": str(self.ledger_port),
            "EFFECTLEDGER_CATALOG_PATH": str(self.catalog_path),
            "EFFECTLEDGER_SANDBOX_API_KEY": self.api_key,
            "EFFECTLEDGER_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        })
        env.update(extra or {})
        return env

    def launcher(self) -> str:
        """`effectledger_cli` (as an operator runs it); the fallback only if its CLI is broken."""
        if self._launcher is None:
            ok = subprocess.run([sys.executable, "-m", "effectledger_cli", "--help"],
                                capture_output=True, timeout=60).returncode == 0
            self._launcher = "effectledger_cli" if ok else "effectledger_bench.launch"
        return self._launcher

    def _spawn(self, name: str, kind: str, args: list[str], env: dict[str, str]) -> Service:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen([*self.wrappers.get(kind, []), sys.executable, "-m",
                                      self.launcher(), *args], env=env,
                                     cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        svc = Service(name, kind, popen, popen.pid, log)
        self.services[name] = svc
        return svc

    # -- services --------------------------------------------------------------------------

    def start_sandbox(self) -> None:
        # The effects check reads every key the run made from the sandbox's ground truth: it
        # must forget none (its default, 100,000 keys, is less than a full run makes).
        svc = self._spawn("sandbox", "sandbox", ["sandbox", "--port", str(self.sandbox_port),
                                                 "--api-key", self.api_key,
                                                 "--max-keys", str(SANDBOX_MAX_KEYS)], self.env())
        self._wait_http(svc, f"{self.sandbox_url}/healthz")

    def start_ledger(self) -> None:
        svc = self._spawn("ledger", "ledger", ["ledger"], self.env(self.ledger_env))
        # /readyz/relay: the bench submits over NATS request-reply, which the ledger serves
        # only once its NATS side runs (plain /readyz holds as soon as the database answers).
        self._wait_http(svc, f"{self.ledger_url}/readyz/relay", timeout=90 * self.slow_start)

    def start_replica(self, index: int) -> str:
        """Ledger replica `index` (2, 3, …) beside the first, on the same database and broker,
        as the Kubernetes base runs two; its URL. The load still goes to the first."""
        port = free_port()
        name = f"ledger-{index}"
        svc = self._spawn(name, "ledger", ["ledger"],
                          self.env({**self.ledger_env, "EFFECTLEDGER_LEDGER_PORT": str(port)}))
        url = f"http://127.0.0.1:{port}"
        self._wait_http(svc, f"{url}/readyz/relay", timeout=90 * self.slow_start)
        return url

    def start_dispatcher(self, index: int) -> None:
        name = f"dispatcher-{index}"
        # Its health port serves /metrics: its loop lag and GC pauses are the tail's evidence.
        port = free_port()
        env = self.env({"EFFECTLEDGER_DISPATCHER_ID": name,
                        "EFFECTLEDGER_DISPATCHER_HEALTH_PORT": str(port), **self.dispatcher_env})
        svc = self._spawn(name, "dispatcher", ["dispatcher"], env)
        svc.metrics_url = f"http://127.0.0.1:{port}"
        marker = f"dispatcher ready: {name}".encode()
        limit_s = 60 * self.slow_start
        deadline = time.monotonic() + limit_s
        assert svc.log is not None
        while marker not in svc.log.read_bytes():
            self._check(svc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready in {limit_s:.0f} s; see {svc.log}")
            time.sleep(0.05)  # polling the process's log for its readiness line

    def dispatcher_metrics(self) -> list[str]:
        """The base URLs of the running dispatchers' /metrics."""
        return [s.metrics_url for n, s in sorted(self.services.items())
                if s.kind == "dispatcher" and s.alive and s.metrics_url]

    def dispatchers(self) -> list[str]:
        return sorted(n for n, s in self.services.items() if s.kind == "dispatcher" and s.alive)

    def scale_dispatchers(self, n: int) -> None:
        running = self.dispatchers()
        for name in running[n:]:
            self.stop(name)
        for i in range(1, n + 1):
            name = f"dispatcher-{i}"
            if name not in running:
                self.start_dispatcher(i)

    def stop(self, name: str, timeout: float = 20.0) -> None:
        svc = self.services.get(name)
        if svc is None or svc.popen is None:
            return
        last = sample(svc.pid)
        if svc.popen.poll() is None:
            svc.popen.send_signal(signal.SIGTERM)
            try:
                svc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                svc.popen.kill()
                svc.popen.wait(10)
        if last is not None:
            self.retired.append((name, svc.pid, svc.kind, last))
        del self.services[name]

    def _check(self, svc: Service) -> None:
        if not svc.alive:
            tail = svc.log.read_text(errors="replace")[-3000:] if svc.log else ""
            raise RuntimeError(f"{svc.name} exited before it was ready:\n{tail}")

    def _wait_http(self, svc: Service, url: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check(svc)
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{svc.name} not ready at {url} in {timeout} s")
            time.sleep(0.1)  # polling a readiness endpoint

    def start(self, dispatchers: int = 1) -> None:
        self.start_infra()
        self.start_sandbox()
        self.start_ledger()
        for i in range(1, dispatchers + 1):
            self.start_dispatcher(i)

    def check_alive(self) -> list[str]:
        return [n for n, s in self.services.items() if not s.alive]

    def samples_by_pid(self) -> dict[tuple[str, int], tuple[str, CpuSample]]:
        out: dict[tuple[str, int], tuple[str, CpuSample]] = {}
        for name, svc in self.services.items():
            s = sample(svc.pid, tree=svc.tree)
            if s is not None:
                out[(name, svc.pid)] = (svc.kind, s)
        return out

    def samples(self) -> dict[str, CpuSample]:
        out: dict[str, CpuSample] = {}
        for name, svc in self.services.items():
            s = sample(svc.pid, tree=svc.tree)
            if s is not None:
                out[name] = s
        return out

    def close(self) -> None:
        order = sorted(self.services.values(),
                       key=lambda s: {"dispatcher": 0, "ledger": 1, "sandbox": 2, "nats": 3}
                       .get(s.kind, 4))
        for svc in order:
            if svc.popen is not None and svc.popen.poll() is None:
                svc.popen.send_signal(signal.SIGTERM)
        for svc in order:
            if svc.popen is not None:
                try:
                    svc.popen.wait(15)
                except subprocess.TimeoutExpired:
                    svc.popen.kill()
                    svc.popen.wait(10)
        if self.pg is not None:
            self.pg.stop()
        if self._tmp_pg is not None:
            shutil.rmtree(self._tmp_pg, ignore_errors=True)
