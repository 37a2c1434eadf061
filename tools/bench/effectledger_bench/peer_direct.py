"""Peer: no durability — the provider's own limit on this machine.

Each process makes the provider call exactly as a dispatcher does: the run's catalog tool,
`effectledger_providers.calls.call_provider` (request built by the tool's adapter, answer read
and classified), through the dispatcher's `HttpProviderCaller` over `make_clients` with the
pool sizes a dispatcher of the same concurrency gets, on uvloop like the services. Nothing is
recorded anywhere: no ledger, no broker.

One process is bounded by its own event loop and HTTP client, not by the provider, so the
harness runs this in 1, 2, … processes at once and takes the best total as the ceiling
(`run_processes`). The processes start their load together: each prints `ready`, then waits
for one line on stdin. Each prints one JSON line with its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .measure import percentile


def _load(catalog: Path, tool_name: str) -> tuple[Any, str]:
    from effectledger_core.catalog import Catalog

    cat = Catalog.load(catalog)
    return cat.get(tool_name), cat.digest()


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from effectledger_core.digest import digest
    from effectledger_core.messages import AttemptSucceeded, DispatchAttempt
    from effectledger_dispatcher.ports import HttpProviderCaller
    from effectledger_providers.calls import make_clients

    tool, catalog_digest = _load(Path(args.catalog), args.tool)
    # The dispatcher's own pool sizing (effectledger_dispatcher.app) for its concurrency.
    caller = HttpProviderCaller(make_clients(max(16, args.concurrency * 2)), env=dict(os.environ))

    def command(key: str, i: int) -> DispatchAttempt:
        arguments = {"title": f"{key} #{i}"}
        return DispatchAttempt(operation_id=key, operation_key=key, epoch=1, tool=tool.name,
                               arguments=arguments, arguments_digest=digest(arguments),
                               catalog_digest=catalog_digest,
                               contract_revision=tool.contract_revision)

    lat: list[float] = []
    errors = 0
    gate = asyncio.Semaphore(args.concurrency)

    async def one(tag: str, i: int) -> None:
        nonlocal errors
        key = f"{args.prefix}{tag}{i}"
        async with gate:
            t = time.perf_counter()
            out = await caller(tool, command(key, i), attempt_id=key, dispatcher_id="direct",
                               on_sent=lambda: None)
            if not isinstance(out, AttemptSucceeded):
                errors += 1
                return
            lat.append((time.perf_counter() - t) * 1000)

    try:
        if args.warmup:
            await asyncio.gather(*(one("w", i) for i in range(args.warmup)))
        lat.clear()
        errors = 0
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        t0 = time.perf_counter()
        await asyncio.gather(*(one("", i) for i in range(args.n)))
        wall = time.perf_counter() - t0
    finally:
        await caller.aclose()
    return {"n": args.n, "errors": errors, "wall_s": round(wall, 3), "latencies": lat}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--catalog", required=True, help="the run's catalog file")
    ap.add_argument("--tool", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--concurrency", type=int, default=32,
                    help="calls in flight (the dispatcher's EFFECTLEDGER_DISPATCHER_CONCURRENCY)")
    ap.add_argument("--prefix", required=True, help="idempotency-key prefix")
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(_run(args))
    else:
        result = uvloop.run(_run(args))
    print(json.dumps(result), flush=True)
    return 0


def run_processes(catalog: Path, tool: str, env: dict[str, str], *, processes: int, n: int,
                  concurrency: int, prefix: str, timeout_s: float = 600) -> dict[str, Any]:
    """`processes` peers at once, `n` calls in all; ops/s = calls that succeeded ÷ the longest
    process's wall time (they start together)."""
    share = -(-n // processes)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "effectledger_bench.peer_direct", "--catalog", str(catalog),
         "--tool", tool, "--n", str(share), "--concurrency", str(concurrency),
         "--prefix", f"{prefix}p{k}-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **env}) for k in range(processes)]
    try:
        for p in procs:  # every process warmed up and connected before any load starts
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                err = p.stderr.read() if p.stderr is not None else ""
                return {"error": (line + err)[-1500:], "processes": processes}
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                return {"error": (err or out)[-1500:], "processes": processes}
            results.append(json.loads(lines[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lat = [v for r in results for v in r["latencies"]]
    errors = sum(r["errors"] for r in results)
    total = sum(r["n"] for r in results)
    wall = max(r["wall_s"] for r in results)
    return {"n": total, "errors": errors, "wall_s": wall, "processes": processes,
            "concurrency": concurrency,
            "ops_per_s": round((total - errors) / wall, 1) if wall else None,
            "latency_ms": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)}}


if __name__ == "__main__":
    sys.exit(main())
