"""Peer: DBOS Transact on the same PostgreSQL, making the same provider call.

A durable workflow whose single step POSTs to the sandbox's idempotent route with the same
headers the dispatcher sends (`Idempotency-Key`, `Fencing-Token`, bearer key). Two modes:
- `direct`: workflows started from asyncio tasks, `concurrency` at a time;
- `queue`: all workflows enqueued on a DBOS queue (worker concurrency `concurrency`, short
  polling interval), then awaited.
Run as its own process (`python -m effectledger_bench.peer_dbos ...`) because DBOS is a
per-process singleton; it prints one JSON line with its figures.

Latency here is measured in-process (workflow start to result), not from ledger timestamps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from .peer_provider import PeerProvider


def _pct(values: list[float], p: float) -> float | None:
    from .measure import percentile

    return percentile(values, p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db-url", required=True, help="postgresql://... for DBOS's system DB")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--mode", choices=["direct", "queue"], required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prefix", required=True, help="idempotency-key prefix")
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args(argv)

    import logging

    from dbos import DBOS, DBOSConfig, SetWorkflowID

    config: DBOSConfig = {"name": "effectledger-bench-peer", "system_database_url": args.db_url,
                          "log_level": "WARNING", "sys_db_pool_size": max(20, args.concurrency),
                          "max_executor_threads": 64}
    DBOS(config=config)
    logging.getLogger("dbos").setLevel(logging.WARNING)
    provider = PeerProvider(args.endpoint, args.api_key, args.concurrency)

    @DBOS.step()
    async def provider_call(key: str, title: str) -> str:
        return await provider.call(key, title)

    @DBOS.workflow()
    async def effect(key: str, title: str) -> str:
        return await provider_call(key, title)

    DBOS.launch()
    queue = DBOS.register_queue("effectledger-bench", worker_concurrency=args.concurrency,
                                polling_interval_sec=0.05)

    async def run(tag: str, n: int) -> dict[str, Any]:
        lat: list[float] = []
        gate = asyncio.Semaphore(args.concurrency)
        errors = 0

        async def one_direct(i: int) -> None:
            nonlocal errors
            key = f"{args.prefix}{tag}-{i}"
            async with gate:
                t = time.perf_counter()
                try:
                    with SetWorkflowID(key):
                        await effect(key, f"{tag} #{i}")
                except Exception:
                    errors += 1
                    return
                lat.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        if args.mode == "direct":
            await asyncio.gather(*(one_direct(i) for i in range(n)))
        else:
            starts: dict[str, float] = {}
            handles = []
            for i in range(n):
                key = f"{args.prefix}{tag}-{i}"
                starts[key] = time.perf_counter()
                with SetWorkflowID(key):
                    handles.append((key, await queue.enqueue_async(effect, key, f"{tag} #{i}")))

            async def wait(key: str, h: Any) -> None:
                nonlocal errors
                try:
                    await h.get_result()
                except Exception:
                    errors += 1
                    return
                lat.append((time.perf_counter() - starts[key]) * 1000)

            await asyncio.gather(*(wait(k, h) for k, h in handles))
        wall = time.perf_counter() - t0
        return {"n": n, "errors": errors, "wall_s": round(wall, 3),
                "ops_per_s": round((n - errors) / wall, 1) if wall else None,
                "latency_ms": {"p50": _pct(lat, 50), "p95": _pct(lat, 95), "p99": _pct(lat, 99),
                               "p99_9": _pct(lat, 99.9)}}

    async def body() -> dict[str, Any]:
        try:
            if args.warmup:
                await run("warm", args.warmup)
            return await run("run", args.n)
        finally:
            await provider.aclose()

    try:
        result = asyncio.run(body())
    finally:
        DBOS.destroy()
    result.update({"mode": args.mode, "concurrency": args.concurrency})
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
