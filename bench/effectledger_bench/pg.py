"""A private PostgreSQL cluster for the benchmark, and the counters read from it.

PostgreSQL refuses to run as root, so when we are root the cluster is initialised and started
as the `postgres` system user (`runuser`), in a temporary folder it owns, on a free port.
Durability stays on: `fsync=on`, `synchronous_commit=on`, `full_page_writes=on`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effectledger_cli.embedded import as_postgres, free_port, pg_bindir

DURABLE_SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_connections": "300",
    "shared_buffers": "256MB",
    # Keep WAL between checkpoints so pg_waldump can count the commit records of a phase.
    "wal_keep_size": "4GB",
    "max_wal_size": "4GB",
    "listen_addresses": "127.0.0.1",
}


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): "
                           f"{(out.stderr or out.stdout).strip()[-2000:]}")


@dataclass
class PrivatePostgres:
    """initdb + pg_ctl in `root`; `url(db)` gives SQLAlchemy URLs, `dsn(db)` libpq ones."""

    root: Path
    port: int = 0
    bindir: Path | None = None

    def __post_init__(self) -> None:
        self.bindir = self.bindir or pg_bindir()
        if self.bindir is None:
            raise FileNotFoundError("PostgreSQL's initdb not found (pg_config --bindir)")
        self.port = self.port or free_port()
        self.data = self.root / "data"
        self.sock = self.root / "sock"
        self.log = self.root / "postgres.log"

    def bin(self, name: str) -> str:
        assert self.bindir is not None
        return str(self.bindir / name)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.sock, "postgres", "postgres")
            os.chmod(self.root, 0o755)
        _run(as_postgres([self.bin("initdb"), "-D", str(self.data), "-U", "postgres",
                           "--auth=trust", "-E", "UTF8", "--no-sync"]))
        opts = " ".join(f"-c {k}={v}" for k, v in DURABLE_SETTINGS.items())
        opts += f" -p {self.port} -k {self.sock}"
        _run(as_postgres([self.bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                           "-o", opts, "-w", "-t", "60", "start"]))

    def stop(self) -> None:
        if not (self.data / "postmaster.pid").exists():
            return
        subprocess.run(as_postgres([self.bin("pg_ctl"), "-D", str(self.data), "-m", "fast",
                                     "-w", "-t", "60", "stop"]), capture_output=True)

    def url(self, db: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{db}"

    def dsn(self, db: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def psql(self, sql: str, db: str = "postgres") -> str:
        out = subprocess.run([self.bin("psql"), "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                              "-d", self.dsn(db), "-c", sql],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    def create_database(self, db: str) -> str:
        self.psql(f'CREATE DATABASE "{db}"')
        return self.url(db)

    def set_system(self, **settings: str) -> None:
        """ALTER SYSTEM + reload: applies to every session, including pooled ones."""
        for name, value in settings.items():
            self.psql(f"ALTER SYSTEM SET {name} = '{value}'")
        self.psql("SELECT pg_reload_conf()")


def parse_lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


@dataclass(frozen=True)
class PgCounters:
    xact_commit: int
    lsn: int

    def delta(self, later: PgCounters) -> dict[str, int]:
        return {"xact_commit": later.xact_commit - self.xact_commit,
                "wal_bytes": later.lsn - self.lsn}


def read_counters(dsn_postgres: str, db: str, psql: str) -> PgCounters:
    """xact_commit of `db` (pg_stat_database) and the current WAL position."""
    sql = (f"SELECT xact_commit, pg_current_wal_lsn() FROM pg_stat_database "
           f"WHERE datname = '{db}'")
    out = subprocess.run([psql, "-X", "-A", "-t", "-F", " ", "-d", dsn_postgres, "-c", sql],
                         capture_output=True, text=True, check=True).stdout.split()
    return PgCounters(int(out[0]), parse_lsn(out[1]))


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
