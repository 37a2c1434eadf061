"""`effectledger up` as a supervisor, as real processes: each kind of child is SIGKILLed in
turn (ledger, dispatcher, reconciler, sandbox, nats-server); `up` names it and restarts it,
the other children keep running (same pids), and intents are still accepted and settled.
Under `--nats-cluster 3` the loss of a node stops nothing. A crash loop ends `up` with a
non-zero exit naming the child, and nothing is left behind.

The old `up` stopped every child and exited 1 at the first death. Only processes this test's
own `up` started are killed.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from effectledger_client import Client, Unavailable
from tests.support.upproc import (
    free_ports_in_a_row,
    lines_until,
    stop_and_check,
    up_args,
    up_children,
    up_ports,
)

pytestmark = pytest.mark.slow


def _agent_token(tmp_path: Path) -> str | None:
    path = tmp_path / "data" / "nats-auth" / "api-agent-default.token"
    return path.read_text().strip() if path.exists() else None  # an older `up`: open API


def _settles(url: str, token: str | None, title: str) -> None:
    """An agent's intent is accepted (retried, as an agent would, while a restarted ledger is
    not listening yet) and settles."""
    deadline = time.monotonic() + 60
    with Client(url, token=token, timeout_s=70) as client:
        while True:
            try:
                op = client.submit("create_ticket", {"title": title}, idempotency_key=title,
                                   wait_s=60).operation
                break
            except Unavailable:
                assert time.monotonic() < deadline, "the ledger did not come back within 60s"
                time.sleep(0.2)  # polling a restarting ledger
        if op.state != "succeeded":
            op = client.wait(op.id, 60)
    assert op.state == "succeeded", op


def _kill_and_see_it_restarted(proc: subprocess.Popen[str], name: str) -> None:
    before = up_children(proc)
    victim = before[name]
    victim.send_signal(signal.SIGKILL)
    lines = lines_until(proc, f"up: {name} restarted", 60)
    assert any(line.startswith(f"up: {name} was killed by SIGKILL; restarting it in")
               for line in lines), lines
    after = up_children(proc)
    assert after[name].pid != victim.pid
    others = {n: p.pid for n, p in before.items() if n != name}
    assert {n: after[n].pid for n in others} == others  # nobody else was stopped


def test_each_kind_of_child_killed_is_restarted_and_intents_still_settle_then_a_crash_loop_stops(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    ports = up_ports()
    url = f"http://127.0.0.1:{ports['ledger']}"
    proc = subprocess.Popen(up_args(tmp_path, ports, "--max-restarts", "1",
                                    "--restart-window", "600"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running_up.append(proc)
    lines_until(proc, "try:", 120)
    token = _agent_token(tmp_path)
    assert set(up_children(proc)) == {"nats", "ledger", "dispatcher", "reconciler", "sandbox"}
    _settles(url, token, "before")
    for name in ("ledger", "dispatcher", "reconciler", "sandbox", "nats"):
        _kill_and_see_it_restarted(proc, name)
        _settles(url, token, f"after-{name}")
    assert proc.poll() is None

    # The dispatcher's second death within the window: a crash loop (--max-restarts 1).
    kids = psutil.Process(proc.pid).children(recursive=True)
    up_children(proc)["dispatcher"].send_signal(signal.SIGKILL)
    assert proc.wait(30) == 1
    stderr = proc.stderr.read() if proc.stderr else ""
    assert stderr.startswith("effectledger up: dispatcher was killed by SIGKILL and died 2 "
                             "times within 600s (at most 1 restarts)"), stderr
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, [p.pid for p in alive]


def test_a_clustered_up_survives_the_loss_of_a_nats_node(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    ports = up_ports()
    ports["nats"] = free_ports_in_a_row(3)
    url = f"http://127.0.0.1:{ports['ledger']}"
    proc = subprocess.Popen(up_args(tmp_path, ports, "--nats-cluster", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running_up.append(proc)
    lines_until(proc, "try:", 180)
    token = _agent_token(tmp_path)
    assert {"nats", "nats-2", "nats-3"} <= set(up_children(proc))
    before = {n: p.pid for n, p in up_children(proc).items() if not n.startswith("nats")}
    up_children(proc)["nats-2"].send_signal(signal.SIGKILL)
    # The old `up` stopped every child within 0.5 s of this and exited 1.
    lines_until(proc, "up: nats-2 was killed by SIGKILL", 30)
    assert proc.poll() is None
    assert {n: p.pid for n, p in up_children(proc).items() if n in before} == before
    lines_until(proc, "up: nats-2 restarted", 30)
    _settles(url, token, "node-back")
    assert {n: p.pid for n, p in up_children(proc).items() if n in before} == before
    stop_and_check(proc, signal.SIGTERM, [ports["ledger"], ports["reconciler"],
                                          ports["sandbox"]])
