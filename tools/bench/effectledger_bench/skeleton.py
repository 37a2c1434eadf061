"""The chain's floor: an agent's call through the same hops with none of the product's logic.

`bench-agent`'s latency budget puts each hop beside its floor measured alone (one commit, one
request-reply, ...). Those floors are measured with warm processes in tight loops; an agent's
call is a chain of processes each woken by the one before, and the chain itself costs more than
the sum of its hops on a small machine (docs/benchmark.md, round fourteen: one call is CPU,
wake-ups and the libraries' per-message work). This module measures that chain directly: two
processes doing what the ledger and the dispatcher do for one call, on the same PostgreSQL,
nats-server and sandbox provider, with the same libraries (uvloop, uvicorn with httptools,
asyncpg, nats-py, aiohttp), and nothing else:

1. the client POSTs the call and waits for its answer (aiohttp, as `effectledger_client`);
2. the skeleton ledger commits the intent in one statement, publishes the command to a
   JetStream stream (file storage) and waits for the outcome;
3. the skeleton dispatcher, on a pull consumer, asks the ledger for the claim (NATS
   request-reply; the ledger commits it in one guarded statement), calls the provider once
   with the same headers as the dispatcher, reports the outcome (request-reply; one guarded
   statement), and acks the command;
4. the ledger wakes the waiting request with the outcome and answers it.

Every commit is synchronous (the cluster's `synchronous_commit`), one writer connection as in
the ledger. What it leaves out is all of ours: the journal, the outbox rows, the inbox, the
catalog, argument schemas, authentication, metrics, traces, logs, pydantic models. So
`ours - skeleton` is what our code costs an agent on top of the chain; the skeleton itself is
what the chain costs with these processes and libraries on this machine, whatever the code.

    python -m effectledger_bench.skeleton ledger --database-url URL --nats-url URL --port P
    python -m effectledger_bench.skeleton dispatcher --nats-url URL --provider-url URL --api-key K

(`bench-agent` starts both beside its stack and interleaves their calls with the real ones.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PREFIX = "skeleton"
STREAM = "SKELETON"
TABLE = "bench_skeleton_ops"
DDL = (f"CREATE TABLE IF NOT EXISTS {TABLE} (id text PRIMARY KEY, idempotency_key text UNIQUE "
       "NOT NULL, arguments jsonb NOT NULL, state text NOT NULL, holder text, result jsonb, "
       "created_at timestamptz NOT NULL DEFAULT now())")
INTENT = (f"INSERT INTO {TABLE} (id, idempotency_key, arguments, state) "
          "VALUES ($1, $2, $3, 'pending')")
# The guards are the claim's and the outcome's in miniature: only a pending operation can be
# claimed, and only its holder's outcome moves it; a second claim is refused.
CLAIM = (f"UPDATE {TABLE} SET state = 'in_flight', holder = $2 "
         "WHERE id = $1 AND state = 'pending' RETURNING id")
OUTCOME = (f"UPDATE {TABLE} SET state = 'succeeded', result = $3 "
           "WHERE id = $1 AND state = 'in_flight' AND holder = $2 RETURNING id")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def asyncpg_dsn(url: str) -> str:
    """A libpq DSN for asyncpg from a SQLAlchemy URL (`postgresql+asyncpg://...`)."""
    from sqlalchemy import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class SkeletonLedger:
    """Intents over HTTP, claims and outcomes over NATS request-reply, one writer connection."""

    def __init__(self, db: Any, nc: Any, js: Any, prefix: str) -> None:
        self.db, self.nc, self.js, self.prefix = db, nc, js, prefix
        self.writer = asyncio.Lock()  # one writer, as the ledger's group commit
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        # The budget's stamps (budget.py), taken where the ledger's journal takes them: when
        # each transaction is built, just before its statement.
        self.stamps: dict[str, list[list[Any]]] = {}

    async def _write(self, sql: str, *args: Any) -> Any:
        async with self.writer:
            return await self.db.fetchval(sql, *args)

    async def intent(self, body: dict[str, Any]) -> dict[str, Any]:
        op = uuid.uuid4().hex
        self.stamps[op] = [["intent_accepted", _now(), {}]]
        await self._write(INTENT, op, str(body["idempotency_key"]),
                          json.dumps(body.get("arguments") or {}))
        answered: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[op] = answered
        try:
            await self.js.publish(f"{self.prefix}.command", json.dumps(
                {"id": op, "arguments": body.get("arguments") or {}}).encode(),
                headers={"Nats-Msg-Id": op})
            result = await asyncio.wait_for(answered, float(body.get("wait_s", 10)))
        finally:
            self.waiting.pop(op, None)
            journal = self.stamps.pop(op, [])
        return {"id": op, "state": "succeeded", "result": result, "journal": journal}

    async def claim(self, msg: Any) -> None:
        req = json.loads(msg.data)
        self._stamp(req["id"], "attempt_claimed", {})
        granted = await self._write(CLAIM, req["id"], req["holder"]) is not None
        await msg.respond(json.dumps({"granted": granted}).encode())

    async def outcome(self, msg: Any) -> None:
        req = json.loads(msg.data)
        self._stamp(req["id"], "outcome_recorded", {"at": req.get("at"),
                                                    "duration_ms": req.get("duration_ms")})
        result = json.dumps(req["result"])
        recorded = await self._write(OUTCOME, req["id"], req["holder"], result) is not None
        waiter = self.waiting.get(req["id"]) if recorded else None
        if waiter is not None and not waiter.done():
            waiter.set_result(req["result"])  # woken first, as the ledger's waiters are
        await msg.respond(json.dumps({"recorded": recorded}).encode())

    def _stamp(self, op: str, kind: str, detail: dict[str, Any]) -> None:
        if op in self.stamps:
            self.stamps[op].append([kind, _now(), detail])

    async def asgi(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await _answer(send, 200, {"ok": True})
            return
        raw = b""
        while True:
            event = await receive()
            raw += event.get("body", b"")
            if not event.get("more_body"):
                break
        try:
            await _answer(send, 200, await self.intent(json.loads(raw)))
        except Exception as exc:  # a benchmark tool: the client sees what went wrong
            await _answer(send, 500, {"error": f"{type(exc).__name__}: {exc}"})


def _now() -> str:
    return datetime.now(UTC).isoformat()


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def serve_ledger(database_url: str, nats_url: str, port: int, prefix: str) -> None:
    import asyncpg
    import nats
    import uvicorn
    from nats.js.api import StorageType

    db = await asyncpg.connect(asyncpg_dsn(database_url))
    await db.execute(DDL)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(name=f"{STREAM}_{prefix}".upper(), subjects=[f"{prefix}.command"],
                        storage=StorageType.FILE)
    ledger = SkeletonLedger(db, nc, js, prefix)
    await nc.subscribe(f"{prefix}.claim", queue="ledger", cb=ledger.claim)
    await nc.subscribe(f"{prefix}.outcome", queue="ledger", cb=ledger.outcome)
    server = uvicorn.Server(uvicorn.Config(ledger.asgi, host="127.0.0.1", port=port,
                                           http="httptools", lifespan="off", interface="asgi3",
                                           log_level="warning", access_log=False))
    try:
        await server.serve()
    finally:
        await nc.drain()
        await db.close()


async def serve_dispatcher(nats_url: str, provider_url: str, api_key: str, prefix: str) -> None:
    import aiohttp
    import nats
    from nats.errors import TimeoutError as NatsTimeout

    holder = f"skeleton-{os.getpid()}"
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    sub = await js.pull_subscribe(f"{prefix}.command", durable=f"{prefix}_dispatch",
                                  stream=f"{STREAM}_{prefix}".upper())
    headers = {"Authorization": f"Bearer {api_key}", "Fencing-Token": "1"}
    # A signal ends the loop where it waits (an idle fetch waits up to its timeout).
    me = asyncio.current_task()
    assert me is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, me.cancel)
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    msgs = await sub.fetch(1, timeout=2)
                except NatsTimeout:
                    continue
                for msg in msgs:
                    await _dispatch(nc, http, msg, holder, headers, provider_url, prefix)
    except asyncio.CancelledError:
        pass
    await nc.drain()


async def _dispatch(nc: Any, http: Any, msg: Any, holder: str, headers: dict[str, str],
                    provider_url: str, prefix: str) -> None:
    cmd = json.loads(msg.data)
    ask = json.dumps({"id": cmd["id"], "holder": holder}).encode()
    claim = json.loads((await nc.request(f"{prefix}.claim", ask, timeout=5)).data)
    if not claim["granted"]:
        await msg.ack()  # taken: never a second call
        return
    started = time.perf_counter()
    async with http.post(f"{provider_url}/v1/idempotent/effects", json=cmd["arguments"],
                         headers={**headers, "Idempotency-Key": cmd["id"]}) as resp:
        result = await resp.json()
    # The call's end and length, as the dispatcher's outcome carries them (`at`, duration).
    took_ms = (time.perf_counter() - started) * 1000
    report = json.dumps({"id": cmd["id"], "holder": holder, "result": result, "at": _now(),
                         "duration_ms": took_ms}).encode()
    await nc.request(f"{prefix}.outcome", report, timeout=5)
    await msg.ack()


class Skeleton:
    """The two skeleton processes, started beside a stack (or any PostgreSQL and NATS)."""

    def __init__(self, *, database_url: str, nats_url: str, provider_url: str, api_key: str,
                 port: int, logs: Path, prefix: str = PREFIX) -> None:
        self.url = f"http://127.0.0.1:{port}"
        common = ["--nats-url", nats_url, "--prefix", prefix]
        self._argv = {
            "ledger": ["ledger", "--database-url", database_url, "--port", str(port), *common],
            "dispatcher": ["dispatcher", "--provider-url", provider_url, "--api-key", api_key,
                           *common]}
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, timeout_s: float = 30.0) -> None:
        import httpx

        self.logs.mkdir(parents=True, exist_ok=True)
        for name in ("ledger", "dispatcher"):
            with open(self.logs / f"skeleton-{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "effectledger_bench.skeleton", *self._argv[name]],
                    stdout=log, stderr=subprocess.STDOUT)
            if name == "ledger":  # the stream exists before the dispatcher's consumer
                deadline = time.monotonic() + timeout_s
                while True:
                    self._check()
                    try:
                        httpx.get(self.url, timeout=1).raise_for_status()
                        break
                    except httpx.HTTPError:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"skeleton ledger not up: see {self.logs}") from None
                        time.sleep(0.1)

    def _check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"skeleton {name} exited with {proc.returncode}: see "
                                   f"{self.logs / f'skeleton-{name}.log'}")

    def pids(self) -> dict[str, int]:
        return {f"skeleton-{name}": proc.pid for name, proc in self.procs.items()}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def call(http: Any, url: str, key: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One call through the skeleton, answered once its outcome is recorded."""
    async with http.post(url, json={"idempotency_key": key, "arguments": arguments,
                                    "wait_s": 10}) as resp:
        body: dict[str, Any] = await resp.json()
        if resp.status != 200 or body.get("state") != "succeeded":
            raise RuntimeError(f"skeleton call {key}: {resp.status} {body}")
        return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m effectledger_bench.skeleton",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("role", choices=["ledger", "dispatcher"])
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--database-url")
    ap.add_argument("--port", type=int)
    ap.add_argument("--provider-url")
    ap.add_argument("--api-key", default="")
    args = ap.parse_args(argv)
    import uvloop

    if args.role == "ledger":
        if not args.database_url or not args.port:
            ap.error("ledger needs --database-url and --port")
        uvloop.run(serve_ledger(args.database_url, args.nats_url, args.port, args.prefix))
    else:
        if not args.provider_url:
            ap.error("dispatcher needs --provider-url")
        uvloop.run(serve_dispatcher(args.nats_url, args.provider_url, args.api_key,
                                    args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
