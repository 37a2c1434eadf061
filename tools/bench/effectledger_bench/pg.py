"""The benchmark's private PostgreSQL cluster (durability on), and the counters read from it.

The cluster itself is `effectledger_testkit.postgres.PrivatePostgres`, shared with the proving
ground. Durability stays on: `fsync=on`, `synchronous_commit=on`, `full_page_writes=on`.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effectledger_testkit.postgres import PrivatePostgres

SLOW_STATEMENT_MS = 15

DURABLE_SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_connections": "300",
    "shared_buffers": "256MB",
    # Keep WAL between checkpoints so pg_waldump can count the commit records of a phase.
    "wal_keep_size": "4GB",
    "max_wal_size": "4GB",
    # Statements slower than this go to the server's log: the tail section counts the slow
    # COMMITs of each phase (a WAL flush that stalled holds every call queued behind it).
    "log_min_duration_statement": str(SLOW_STATEMENT_MS),
    # Every autovacuum and checkpoint goes to the log with its time and cost, so a tail can be
    # set beside them (docs/benchmark.md, round sixteen: autovacuum runs about once a minute,
    # ~1.2 s and ~0.6 s of CPU at these table sizes, and explains some clusters, not most).
    "log_autovacuum_min_duration": "0",
    "log_checkpoints": "on",
    "listen_addresses": "127.0.0.1",
}


def private_postgres(root: Path) -> PrivatePostgres:
    """The benchmark's cluster, initialised and started with durability on."""
    pg = PrivatePostgres(root, DURABLE_SETTINGS)
    pg.init()
    pg.start()
    return pg


def parse_lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


@dataclass(frozen=True)
class PgCounters:
    xact_commit: int
    lsn: int
    checkpoints: int = 0  # timed and requested (pg_stat_bgwriter), begun so far

    def delta(self, later: PgCounters) -> dict[str, int]:
        return {"xact_commit": later.xact_commit - self.xact_commit,
                "wal_bytes": later.lsn - self.lsn,
                "checkpoints": later.checkpoints - self.checkpoints}


# A statement the server logged for its duration (`log_min_duration_statement`): a simple
# query ("statement: COMMIT;") or an extended-protocol one ("execute <name>: ...").
_SLOW_RE = re.compile(r"duration: ([0-9.]+) ms\s+(?:statement|execute [^:]*): (.*)")


def slow_statements(log_text: str) -> dict[str, Any]:
    """The slow statements in a stretch of the server's log: how many COMMITs and others, and
    the longest COMMIT (ms)."""
    commits: list[float] = []
    others = 0
    for m in _SLOW_RE.finditer(log_text):
        if m.group(2).strip().upper().startswith("COMMIT"):
            commits.append(float(m.group(1)))
        else:
            others += 1
    return {"over_ms": SLOW_STATEMENT_MS, "commits": len(commits),
            "commit_max_ms": round(max(commits), 1) if commits else None, "others": others}


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_since(path: Path, offset: int) -> str:
    """What the server logged after `offset` bytes ("" if the log is gone)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def read_counters(dsn_postgres: str, db: str, psql: str) -> PgCounters:
    """xact_commit of `db` (pg_stat_database), the current WAL position and the checkpoints
    begun (a checkpoint in a phase is a suspect for its tail: it writes the dirty pages and
    the WAL records after it carry full pages)."""
    sql = (f"SELECT xact_commit, pg_current_wal_lsn(), "
           f"(SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter) "
           f"FROM pg_stat_database WHERE datname = '{db}'")
    out = subprocess.run([psql, "-X", "-A", "-t", "-F", " ", "-d", dsn_postgres, "-c", sql],
                         capture_output=True, text=True, check=True).stdout.split()
    return PgCounters(int(out[0]), parse_lsn(out[1]), int(out[2]))


_COMMIT_RE = re.compile(r"^Transaction/COMMIT\s+(\d+)", re.M)


def wal_commit_records(waldump: str, wal_dir: Path, start_lsn: int, end_lsn: int) -> int | None:
    """Commit records written between two LSNs (every durable commit of every database).

    pg_stat_database's counters are flushed lazily by idle backends (up to 10 s late in
    PostgreSQL 15), so the WAL is the exact count of write transactions in a phase.
    """
    if end_lsn <= start_lsn:
        return 0

    def fmt(lsn: int) -> str:
        return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"

    try:
        out = subprocess.run([waldump, "--stats=record", "-p", str(wal_dir), "-s", fmt(start_lsn),
                              "-e", fmt(end_lsn)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = _COMMIT_RE.search(out.stdout)
    if m is None:
        return 0 if out.returncode == 0 else None
    return int(m.group(1))


def describe(pg: PrivatePostgres | None, url: str | None) -> dict[str, Any]:
    if pg is None:
        return {"external_url": url}
    version = pg.psql("SHOW server_version")
    return {"private": True, "port": pg.port, "version": version,
            "settings": {k: pg.psql(f"SHOW {k}") for k in ("fsync", "synchronous_commit",
                                                           "full_page_writes", "wal_level",
                                                           "shared_buffers")}}


def wait_stats_flush(seconds: float = 11.0) -> None:
    """Idle backends flush pg_stat counters within 10 s (PostgreSQL 15's idle interval)."""
    time.sleep(seconds)
