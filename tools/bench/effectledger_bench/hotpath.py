"""The ledger's hot path alone on PostgreSQL: submit, claim and outcome through `LedgerService`.

No NATS, no HTTP, no dispatcher: the service's own calls (group commit, the hot statements, the
real store) on a fresh database, for `-n` operations one at a time (each the agent's three
calls in turn) and then at `--concurrency` operations in flight. Prints one JSON line: the
medians of the three calls' latencies one at a time, the operations per second both ways, and
the process CPU per operation. Meant for A/B runs of two checkouts in one session (run this
file with the other checkout's PYTHONPATH, alternating; docs/benchmark.md):

    python tools/bench/effectledger_bench/hotpath.py -n 2000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import asyncpg
import sqlalchemy as sa

from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.ids import new_id, utcnow
from effectledger_core.messages import AttemptSucceeded, ClaimAttempt, SubmitIntent
from effectledger_core.subjects import Subjects
from effectledger_ledger.db.store import Store
from effectledger_ledger.migrate import upgrade
from effectledger_ledger.service import LedgerService

DEFAULT_ADMIN = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"


async def _admin(url: str, sql: str) -> None:
    conn = await asyncpg.connect(sa.make_url(url).set(drivername="postgresql")
                                 .render_as_string(hide_password=False))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _operation(svc: LedgerService, i: int, times: list[tuple[float, float, float]] | None
                     ) -> None:
    """One agent call's ledger work: a keyed intent, its claim, its success outcome."""
    t0 = time.perf_counter()
    sub = await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": f"ticket {i}"},
                                        idempotency_key=new_id()))
    op = sub.operation
    t1 = time.perf_counter()
    attempt = new_id()
    await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=op["epoch"], attempt_id=attempt,
                                 dispatcher_id="bench", tool=op["tool"],
                                 arguments_digest=op["arguments_digest"]))
    t2 = time.perf_counter()
    await svc.record_outcome(AttemptSucceeded(
        operation_id=op["id"], epoch=op["epoch"], attempt_id=attempt, dispatcher_id="bench",
        at=utcnow(), response_digest="sha256:00"), consumer="bench", message_id=new_id())
    if times is not None:
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))


async def _phase(svc: LedgerService, n: int, concurrency: int,
                 times: list[tuple[float, float, float]] | None) -> dict[str, float]:
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            await _operation(svc, i, times)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"ops_per_s": round(n / wall, 1), "cpu_ms_per_op": round(cpu / n * 1000, 3)}


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


async def run(admin: str, n: int, concurrency: int, warmup: int) -> dict[str, Any]:
    name = "hotbench_" + uuid.uuid4().hex[:10]
    await _admin(admin, f'CREATE DATABASE "{name}"')
    store = Store(sa.make_url(admin).set(database=name).render_as_string(hide_password=False))
    try:
        await upgrade(store)
        svc = LedgerService(store=store, catalog=Catalog.load(DEMO_CATALOG),
                            subjects=Subjects(prefix="bench", stream_prefix="BENCH"))
        try:
            await _phase(svc, warmup, concurrency, None)  # connections, prepared statements
            times: list[tuple[float, float, float]] = []
            alone = await _phase(svc, n, 1, times)
            together = await _phase(svc, n, concurrency, None)
        finally:
            await svc.close()
    finally:
        await store.close()
        await _admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return {
        "n": n, "concurrency": concurrency,
        "alone_ops_per_s": alone["ops_per_s"], "alone_cpu_ms_per_op": alone["cpu_ms_per_op"],
        "submit_p50_ms": _ms([t[0] for t in times]), "claim_p50_ms": _ms([t[1] for t in times]),
        "outcome_p50_ms": _ms([t[2] for t in times]),
        "op_p50_ms": _ms([sum(t) for t in times]),
        "concurrent_ops_per_s": together["ops_per_s"],
        "concurrent_cpu_ms_per_op": together["cpu_ms_per_op"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", default=DEFAULT_ADMIN,
                   help="a PostgreSQL where a scratch database may be created (SQLAlchemy URL)")
    p.add_argument("-n", type=int, default=2000, help="operations per phase")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(args.database_url, args.n, args.concurrency,
                                     args.warmup))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
