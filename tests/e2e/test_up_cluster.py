"""`effectledger up` with a NATS cluster and several replicas of each service, as real
processes: streams get three replicas, the demo completes, and SIGTERM leaves nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.servers import postgres_database
from tests.support.upproc import (
    free_ports_in_a_row,
    lines_until,
    reaped,
    stop_and_check,
    up_args,
    up_ports,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def running_up() -> Iterator[list[subprocess.Popen[str]]]:
    with reaped() as started:
        yield started


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
    # every NATS user has a password, and no password is on any command line or in a file
    nats_env = [k.environ() for k in kids if "nats-server" in " ".join(k.cmdline())]
    passwords = {v for env in nats_env for n, v in env.items() if n.startswith("EL_NATS_")}
    assert len(passwords) == 4
    written = "".join(p.read_text() for p in (tmp_path / "data").glob("*.conf"))
    assert not [p for p in passwords if any(p in n for n in names) or p in written]
    all_ports = [ports["ledger"], ports["sandbox"], ports["reconciler"], ports["reconciler"] + 1,
                 *(ports["nats"] + i for i in range(3))]
    stop_and_check(proc, signal.SIGTERM, all_ports)


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
