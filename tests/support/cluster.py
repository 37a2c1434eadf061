"""The real services as separate processes, for end-to-end and crash tests.

`Cluster` starts the sandbox provider, the ledger and dispatchers with
`python -m effectledger_cli <service>`, configured only through `EFFECTLEDGER_*` environment
variables, exactly as an operator would run them. Each incarnation of a service logs to its own
file under the test's tmp folder; `log_tails()` prints them when a test fails.

Readiness is observed, never slept for: the sandbox's `/healthz`, the ledger's `/readyz/relay`,
the dispatcher's "dispatcher ready" line (it has no HTTP port). Crash points are armed per process
with `EFFECTLEDGER_CRASH_POINTS`; an armed process SIGKILLs itself when it reaches the point.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from effectledger_cli.embedded import free_port
from effectledger_core.config import Settings

DEFAULT_CATALOG_TEMPLATE = Path(__file__).resolve().parents[1] / "e2e" / "catalog.toml"
SANDBOX_URL_TOKEN = "@SANDBOX_URL@"
AT_REST = frozenset({"succeeded", "failed", "cancelled", "needs_review"})


async def wait_until(predicate: Callable[[], Any], timeout_s: float, *,
                     interval: float = 0.05, what: str = "condition") -> Any:
    """Poll `predicate` (sync or async) until it returns something truthy; fail at the deadline.

    Polling an observable condition with a deadline is the synchronisation here; the interval
    only bounds how busy the poll is.
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        last = value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)


@dataclass
class Proc:
    name: str
    service: str
    popen: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class Cluster:
    """Processes of one test's pipeline, on that test's database, subjects and streams."""

    def __init__(self, settings: Settings, workdir: Path, *,
                 catalog_template: Path = DEFAULT_CATALOG_TEMPLATE,
                 env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs = workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.sandbox_port = free_port()
        self.ledger_port = free_port()
        self.sandbox_url = f"http://127.0.0.1:{self.sandbox_port}"
        self.ledger_url = f"http://127.0.0.1:{self.ledger_port}"
        self.api_key = "sk_test_" + secrets.token_hex(12)
        # The reconciler's webhook endpoint and the per-run signing secret it shares with the
        # sandbox (as `effectledger up` wires them); used only when a test asks for webhooks.
        self.reconciler_port = free_port()
        self.reconciler_url = f"http://127.0.0.1:{self.reconciler_port}"
        self.webhook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        self.catalog_template = catalog_template
        self.catalog_path = workdir / "catalog.toml"
        self._write_catalog()
        self.env_defaults: dict[str, str] = {
            "EFFECTLEDGER_DATABASE_URL": settings.database_url,
            "EFFECTLEDGER_NATS_URL": settings.nats_url,
            "EFFECTLEDGER_SUBJECT_PREFIX": settings.subject_prefix,
            "EFFECTLEDGER_STREAM_PREFIX": settings.stream_prefix,
            "EFFECTLEDGER_STREAM_STORAGE": settings.stream_storage,
            "EFFECTLEDGER_LEDGER_HOST": "127.0.0.1",
            "EFFECTLEDGER_LEDGER_PORT": str(self.ledger_port),
            "EFFECTLEDGER_CATALOG_PATH": str(self.catalog_path),
            "EFFECTLEDGER_SANDBOX_API_KEY": self.api_key,
            "EFFECTLEDGER_ACK_WAIT_S": "30",
            "EFFECTLEDGER_LOG_LEVEL": "INFO",
            **(env or {}),
        }
        self.procs: dict[str, Proc] = {}
        self.history: list[Proc] = []  # every incarnation, for the logs
        self.ledger = self._ledger_client()
        self.sandbox = self._sandbox_client()

    def _sandbox_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.sandbox_url, timeout=30.0,
                                 limits=httpx.Limits(keepalive_expiry=2.0))

    def _ledger_client(self) -> httpx.AsyncClient:
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them: reusing one
        # the server is closing at that instant fails with a ReadError, and httpx won't retry.
        return httpx.AsyncClient(base_url=self.ledger_url, timeout=30.0,
                                 limits=httpx.Limits(max_connections=100, keepalive_expiry=2.0))

    # -- processes -------------------------------------------------------------------------

    def _env(self, extra: dict[str, str] | None, crash_points: Iterable[str] | None
             ) -> dict[str, str]:
        # Nothing from the developer's own EFFECTLEDGER_* environment leaks into a test.
        env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
        env.update(self.env_defaults)
        env.update(extra or {})
        if crash_points:
            env["EFFECTLEDGER_CRASH_POINTS"] = ",".join(crash_points)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, name: str, service: str, args: list[str], env: dict[str, str]) -> Proc:
        if name in self.procs and self.procs[name].alive:
            raise RuntimeError(f"{name} is already running")
        incarnation = sum(1 for p in self.history if p.name == name) + 1
        log = self.logs / f"{name}.{incarnation}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "effectledger_cli", *args], env=env, cwd=self.workdir,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = Proc(name, service, popen, log, env)
        self.procs[name] = proc
        self.history.append(proc)
        return proc

    async def start_sandbox(self, name: str = "sandbox", *, timeout_s: float = 30.0,
                            webhook_routes: Iterable[str] | None = None) -> Proc:
        """`webhook_routes`: routes that send signed webhooks to this cluster's reconciler
        (`start_reconciler`); None (the default) starts the sandbox without webhooks."""
        for attempt in range(3):
            args = ["sandbox", "--port", str(self.sandbox_port), "--api-key", self.api_key]
            if webhook_routes is not None:
                args += ["--webhook-url", f"{self.reconciler_url}/v1/webhooks/sandbox",
                         "--webhook-secret", self.webhook_secret,
                         "--webhook-routes", ",".join(webhook_routes)]
            proc = self._spawn(name, "sandbox", args, self._env(None, None))
            try:
                await self._wait_http(proc, self.sandbox, "/healthz", timeout_s)
                return proc
            except RuntimeError:
                # Its free port was taken meanwhile; a new one is fine while no service has
                # read the catalog that names it.
                if attempt == 2 or not self._bind_failed(proc) or any(
                        p.service != "sandbox" for p in self.history):
                    raise
                await self._move_sandbox(free_port())
        raise AssertionError("unreachable")

    async def start_ledger(self, name: str = "ledger", *, crash_points: Iterable[str] | None
                           = None, env: dict[str, str] | None = None,
                           timeout_s: float = 60.0, ready_path: str = "/readyz/relay") -> Proc:
        """`ready_path`: `/readyz/relay` (default) waits for the NATS side too; `/readyz` only
        for accepting intents (the database), which holds while NATS is down."""
        for attempt in range(3):
            if any(p.service == "ledger" for p in self.history):
                # A fresh client after a restart: pooled connections to the old one are dead.
                await self.ledger.aclose()
                self.ledger = self._ledger_client()
            proc = self._spawn(name, "ledger", ["ledger"], self._env(env, crash_points))
            try:
                await self._wait_http(proc, self.ledger, ready_path, timeout_s)
                return proc
            except RuntimeError:
                # Only the tests use the ledger's HTTP port, so it may move at any time.
                if attempt == 2 or not self._bind_failed(proc):
                    raise
                self.ledger_port = free_port()
                self.ledger_url = f"http://127.0.0.1:{self.ledger_port}"
                self.env_defaults["EFFECTLEDGER_LEDGER_PORT"] = str(self.ledger_port)
        raise AssertionError("unreachable")

    @staticmethod
    def _bind_failed(proc: Proc) -> bool:
        if proc.alive:
            return False
        return "address already in use" in proc.log.read_text(errors="replace").lower()

    async def _move_sandbox(self, port: int) -> None:
        self.sandbox_port = port
        self.sandbox_url = f"http://127.0.0.1:{port}"
        self._write_catalog()
        await self.sandbox.aclose()
        self.sandbox = self._sandbox_client()

    def _write_catalog(self) -> None:
        self.catalog_path.write_text(
            self.catalog_template.read_text().replace(SANDBOX_URL_TOKEN, self.sandbox_url))

    async def start_dispatcher(self, name: str = "dispatcher", *,
                               crash_points: Iterable[str] | None = None,
                               env: dict[str, str] | None = None,
                               timeout_s: float = 60.0) -> Proc:
        extra = {"EFFECTLEDGER_DISPATCHER_ID": name, **(env or {})}
        proc = self._spawn(name, "dispatcher", ["dispatcher"], self._env(extra, crash_points))
        # The dispatcher has no HTTP port; it prints one line once its consumer is running.
        marker = f"dispatcher ready: {name}".encode()

        def ready() -> bool:
            self._check_alive(proc)
            return marker in proc.log.read_bytes()

        await wait_until(ready, timeout_s, what=f"{name} to be ready")
        return proc

    async def start_reconciler(self, name: str = "reconciler", *,
                               crash_points: Iterable[str] | None = None,
                               env: dict[str, str] | None = None,
                               timeout_s: float = 60.0) -> Proc:
        """The reconciler with its webhook endpoint on `reconciler_port`, verifying webhooks
        signed with this cluster's `webhook_secret` (provider "sandbox")."""
        extra = {"EFFECTLEDGER_RECONCILER_ID": name,
                 "EFFECTLEDGER_RECONCILER_HOST": "127.0.0.1",
                 "EFFECTLEDGER_RECONCILER_PORT": str(self.reconciler_port),
                 "EFFECTLEDGER_WEBHOOK_SECRETS": json.dumps({"sandbox": [self.webhook_secret]}),
                 **(env or {})}
        proc = self._spawn(name, "reconciler", ["reconciler"], self._env(extra, crash_points))
        marker = b"reconciler ready:"

        def ready() -> bool:
            self._check_alive(proc)
            return marker in proc.log.read_bytes()

        await wait_until(ready, timeout_s, what=f"{name} to be ready")
        return proc

    async def start(self, *, dispatchers: int = 1) -> None:
        """The usual pipeline: sandbox, ledger, and `dispatchers` dispatchers."""
        await self.start_sandbox()
        await self.start_ledger()
        for i in range(dispatchers):
            await self.start_dispatcher("dispatcher" if i == 0 else f"dispatcher-{i + 1}")

    def _check_alive(self, proc: Proc) -> None:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before it was "
                               f"ready:\n{self.tail(proc)}")

    async def _wait_http(self, proc: Proc, client: httpx.AsyncClient, path: str,
                         timeout_s: float) -> None:
        async def ready() -> bool:
            self._check_alive(proc)
            try:
                resp = await client.get(path, timeout=2.0)
            except httpx.TransportError:
                return False
            return resp.status_code == 200

        await wait_until(ready, timeout_s, interval=0.1, what=f"{proc.name} {path}")

    def proc(self, name: str) -> Proc:
        return self.procs[name]

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].alive

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.alive:
            proc.popen.send_signal(sig)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process keeps its connections but answers nothing (a stalled service)."""
        self.kill(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.kill(name, signal.SIGCONT)

    def log_count(self, name: str, text: str) -> int:
        """How often `text` occurs in the current log of `name` (for observable events)."""
        return self.procs[name].log.read_text(errors="replace").count(text)

    async def wait_exit(self, name: str, timeout_s: float = 30.0) -> int:
        """Wait for a process to end (e.g. an armed crash point); returns its exit code."""
        proc = self.procs[name]
        await wait_until(lambda: not proc.alive, timeout_s, interval=0.05,
                         what=f"{name} to exit")
        code = proc.popen.returncode
        assert code is not None
        return code

    async def stop(self, name: str, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not stop in time."""
        proc = self.procs[name]
        if proc.alive:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                return await self.wait_exit(name, timeout_s)
            except TimeoutError:
                proc.popen.kill()
        return await self.wait_exit(name, timeout_s)

    async def stop_all(self) -> None:
        # Consumers first so they stop taking work, the provider last.
        order = sorted(self.procs.values(),
                       key=lambda p: {"dispatcher": 0, "reconciler": 0, "ledger": 1,
                                      "sandbox": 2}[p.service])
        for proc in order:
            if proc.alive:
                proc.popen.send_signal(signal.SIGCONT)  # a paused process must see SIGTERM
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for proc in order:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)

    async def aclose(self) -> None:
        try:
            await self.stop_all()
        finally:
            for proc in self.history:  # nothing outlives the test, whatever happened above
                if proc.alive:
                    proc.popen.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.popen.wait(timeout=10)
            await self.ledger.aclose()
            await self.sandbox.aclose()

    def tail(self, proc: Proc, lines: int = 40) -> str:
        try:
            text = proc.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_tails(self, lines: int = 40) -> str:
        parts = []
        for proc in self.history:
            status = "running" if proc.alive else f"exit {proc.popen.returncode}"
            parts.append(f"----- {proc.log.name} ({status}) -----\n{self.tail(proc, lines)}")
        return "\n".join(parts)

    # -- the ledger API --------------------------------------------------------------------

    async def submit(self, tool: str, arguments: dict[str, Any], *, key: str | None = None,
                     task_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"tool": tool, "arguments": arguments}
        if key is not None:
            body["idempotency_key"] = key
        if task_id is not None:
            body["task_id"] = task_id
        return await self.ledger.post("/v1/intents", json=body)

    async def submit_ok(self, tool: str, arguments: dict[str, Any], *, key: str | None = None
                        ) -> dict[str, Any]:
        resp = await self.submit(tool, arguments, key=key)
        assert resp.status_code == 201, resp.text
        return resp.json()  # type: ignore[no-any-return]

    async def operation(self, op_id: str) -> dict[str, Any]:
        resp = await self.ledger.get(f"/v1/operations/{op_id}")
        resp.raise_for_status()
        return resp.json()  # type: ignore[no-any-return]

    async def journal(self, op_id: str) -> list[dict[str, Any]]:
        resp = await self.ledger.get(f"/v1/operations/{op_id}/journal")
        resp.raise_for_status()
        return resp.json()["entries"]  # type: ignore[no-any-return]

    async def receipt(self, op_id: str) -> dict[str, Any]:
        resp = await self.ledger.get(f"/v1/operations/{op_id}/receipt")
        resp.raise_for_status()
        return resp.json()  # type: ignore[no-any-return]

    async def stats(self) -> dict[str, Any]:
        resp = await self.ledger.get("/v1/stats")
        resp.raise_for_status()
        return resp.json()  # type: ignore[no-any-return]

    async def list_all(self, state: str | None = None) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if state:
                params["state"] = state
            if cursor:
                params["cursor"] = cursor
            resp = await self.ledger.get("/v1/operations", params=params)
            resp.raise_for_status()
            page = resp.json()
            items.extend(page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                return items

    async def wait_state(self, op_id: str, states: str | Iterable[str], timeout_s: float = 60.0
                         ) -> dict[str, Any]:
        wanted = {states} if isinstance(states, str) else set(states)

        async def reached() -> dict[str, Any] | None:
            try:
                op = await self.operation(op_id)
            except httpx.TransportError:
                return None  # the ledger may be restarting
            return op if op["state"] in wanted else None

        op: dict[str, Any] = await wait_until(
            reached, timeout_s, interval=0.1, what=f"operation {op_id} to reach {sorted(wanted)}")
        return op

    # -- the sandbox's ground truth --------------------------------------------------------

    async def truth(self) -> dict[str, Any]:
        resp = await self.sandbox.get("/_truth")
        resp.raise_for_status()
        return resp.json()  # type: ignore[no-any-return]

    async def key_truth(self, key: str) -> dict[str, Any]:
        resp = await self.sandbox.get(f"/_truth/{key}")
        resp.raise_for_status()
        return resp.json()  # type: ignore[no-any-return]

    # -- the database and the broker, read directly ----------------------------------------

    async def db_scalar(self, sql: str, **params: Any) -> Any:
        engine = create_async_engine(self.settings.database_url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                return (await conn.execute(sa.text(sql), params)).scalar()
        finally:
            await engine.dispose()

    async def db_rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        engine = create_async_engine(self.settings.database_url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                return [dict(r) for r in (await conn.execute(sa.text(sql), params)).mappings()]
        finally:
            await engine.dispose()

    async def table_counts(self) -> dict[str, int]:
        names = ("operations", "journal", "outbox", "attempts", "inbox", "dead_letters")
        engine = create_async_engine(self.settings.database_url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                return {n: int((await conn.execute(sa.text(f"SELECT count(*) FROM {n}")))
                               .scalar_one()) for n in names}
        finally:
            await engine.dispose()

    async def stream_stored(self, stream: str) -> int:
        """How many messages `stream` ever stored (its last sequence), acked ones included."""
        import nats

        nc = await nats.connect(self.settings.nats_url)
        try:
            return int((await nc.jetstream().stream_info(stream)).state.last_seq)
        finally:
            await nc.close()

    async def stream_messages(self, stream: str) -> int:
        import nats

        nc = await nats.connect(self.settings.nats_url)
        try:
            info = await nc.jetstream().stream_info(stream)
            return int(info.state.messages)
        finally:
            await nc.close()
