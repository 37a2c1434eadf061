"""`effectledger up` with a NATS cluster and several replicas of each service, as real
processes: streams get three replicas, the demo completes, and SIGTERM leaves nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import nats
import psutil
import pytest

from effectledger_bus.permissions import inbox_prefix
from effectledger_core.config import Settings
from tests.support.cluster import wait_until
from tests.support.servers import postgres_database
from tests.support.upproc import (
    free_ports_in_a_row,
    lines_until,
    stop_and_check,
    up_args,
    up_ports,
)

pytestmark = pytest.mark.slow


def _scaled_ports(ledgers: int, reconcilers: int) -> dict[str, int]:
    ports = up_ports()
    ports["ledger"] = free_ports_in_a_row(ledgers)
    ports["reconciler"] = free_ports_in_a_row(reconcilers)
    ports["nats"] = free_ports_in_a_row(3)
    return ports


def test_a_three_node_nats_cluster_runs_the_demo_on_three_replica_streams(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    ports = _scaled_ports(1, 2)
    proc = subprocess.Popen(
        up_args(tmp_path, ports, "--nats-cluster", "3", "--dispatchers", "2",
                "--reconcilers", "2", "--demo", "6"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    running_up.append(proc)
    lines = lines_until(proc, "demo:", 180)
    assert lines[-1] == 'demo: {"succeeded": 6}', lines
    assert "streams: EFFECTS_DISPATCH (3 replicas), EFFECTS_EVENTS (3 replicas)" in lines
    kids = psutil.Process(proc.pid).children(recursive=True)
    names = [" ".join(k.cmdline()) for k in kids]
    assert sum("nats-server" in n for n in names) == 3
    assert sum(" dispatcher " in n for n in names) == 2
    assert sum(" reconciler " in n for n in names) == 2
    # every node holds the least-privilege users of one node, in files only its owner reads,
    # and no password is on any command line
    confs = sorted((tmp_path / "data").glob("nats*.conf"))
    assert len(confs) == 3
    assert all(stat.S_IMODE(c.stat().st_mode) == 0o600 for c in confs)
    creds = json.loads(Path(_printed(lines, "agent credentials (tenant default, NATS)"))
                       .read_text())
    assert all('"agent-default"' in c.read_text() for c in confs)
    assert not [n for n in names if creds["password"] in n]
    verdict = Settings().subjects.verdict
    assert asyncio.run(_publish_refused(creds, verdict)), "an agent published a verdict"
    all_ports = [ports["ledger"], ports["sandbox"], ports["reconciler"], ports["reconciler"] + 1,
                 *(ports["nats"] + i for i in range(3))]
    stop_and_check(proc, signal.SIGTERM, all_ports)


def _printed(lines: list[str], label: str) -> str:
    return next(line.split(": ", 1)[1] for line in lines if line.startswith(label + ":"))


async def _publish_refused(creds: dict[str, Any], subject: str) -> bool:
    """Whether NATS answers a publish on `subject` with these credentials by a permissions
    violation (it drops the message and tells the sender, who stays connected)."""
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc = await nats.connect(creds["servers"], user=creds["user"], password=creds["password"],
                            inbox_prefix=inbox_prefix(creds["user"]).encode(),
                            error_cb=on_error, allow_reconnect=False)
    try:
        await nc.publish(subject, b'{"operation_id": "forged", "applied": true}')
        await nc.flush()
        await wait_until(lambda: bool(errors), 10, interval=0.05,
                         what="the server's permissions violation")
    finally:
        await nc.close()
    return any("permissions violation" in str(e).lower() for e in errors)


def test_two_ledgers_share_one_postgresql(tmp_path: Path,
                                          running_up: list[subprocess.Popen[str]],
                                          pg_url: str) -> None:
    ports = _scaled_ports(2, 1)
    with postgres_database() as url:
        assert url is not None
        proc = subprocess.Popen(
            up_args(tmp_path, ports, "--ledgers", "2", "--database-url", url, "--demo", "6"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        running_up.append(proc)
        lines = lines_until(proc, "demo:", 180)
        assert lines[-1] == 'demo: {"succeeded": 6}', lines
        ledger_line = next(line for line in lines if line.startswith("ledger:"))
        assert ledger_line == (f"ledger: http://127.0.0.1:{ports['ledger']}, "
                               f"http://127.0.0.1:{ports['ledger'] + 1}")
        stop_and_check(proc, signal.SIGTERM, [ports["ledger"], ports["ledger"] + 1])


def test_several_ledgers_on_sqlite_are_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "effectledger_cli", "up", "--data-dir", str(tmp_path),
         "--ledgers", "2"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip() == ("effectledger up: --ledgers 2 needs PostgreSQL "
                                   "(--database-url postgresql+asyncpg://...): SQLite has a "
                                   "single writer")
