"""Peers run side by side with effectledger: pgbench (the limit), DBOS, and no durability."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from .measure import percentile


async def direct_httpx(endpoint: str, api_key: str, *, n: int, concurrency: int,
                       prefix: str) -> dict[str, Any]:
    """No durability: the same provider call from one async process, `concurrency` at a time."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {api_key}", "Fencing-Token": "1"}
    lat: list[float] = []
    errors = 0
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=10.0) as client:
        async def one(i: int) -> None:
            nonlocal errors
            async with gate:
                t = time.perf_counter()
                try:
                    resp = await client.post(endpoint, json={"title": f"{prefix} #{i}"},
                                             headers={**headers,
                                                      "Idempotency-Key": f"{prefix}{i}"})
                    resp.raise_for_status()
                except httpx.HTTPError:
                    errors += 1
                    return
                lat.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"n": n, "errors": errors, "wall_s": round(wall, 3), "concurrency": concurrency,
            "ops_per_s": round((n - errors) / wall, 1),
            "latency_ms": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)}}


def dbos(db_dsn: str, endpoint: str, api_key: str, *, mode: str, n: int, concurrency: int,
         prefix: str, timeout_s: float = 600) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "effectledger_bench.peer_dbos", "--db-url", db_dsn,
           "--endpoint", endpoint, "--api-key", api_key, "--mode", mode, "--n", str(n),
           "--concurrency", str(concurrency), "--prefix", prefix]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s", "mode": mode}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    return {"error": (out.stderr or out.stdout)[-1500:], "mode": mode}


_TPS = re.compile(r"tps = ([\d.]+) \(without initial connection time\)")
_LAT = re.compile(r"latency average = ([\d.]+) ms")
_FAILED = re.compile(r"number of failed transactions: (\d+)")
_DONE = re.compile(r"number of transactions actually processed: (\d+)")


def pgbench(pgbench_bin: str, dsn: str, script: Path, *, clients: int, seconds: float,
            threads: int = 2) -> dict[str, Any]:
    """pgbench with the captured script; one pgbench transaction = one operation's SQL."""
    cmd = [pgbench_bin, "-n", "-M", "simple", "-f", str(script), "-c", str(clients),
           "-j", str(min(threads, clients)), "-T", str(max(1, int(seconds))), dsn]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    text = out.stdout + out.stderr
    m = _TPS.search(text)
    if out.returncode != 0 or m is None:
        return {"error": text[-1500:], "clients": clients}
    lat = _LAT.search(text)
    failed = _FAILED.search(text)
    done = _DONE.search(text)
    return {"clients": clients, "ops_per_s": round(float(m.group(1)), 1),
            "latency_avg_ms": float(lat.group(1)) if lat else None,
            "transactions": int(done.group(1)) if done else None,
            "failed": int(failed.group(1)) if failed else 0}
