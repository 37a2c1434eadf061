"""`up`'s supervisor on fake children and a fake clock: a death is named and restarted after
a backoff that grows, the others are left alone, and a crash loop stops with the child named."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from effectledger_cli.children import Child
from effectledger_cli.supervisor import CrashLoop, RestartPolicy, Supervisor, describe_exit


@dataclass
class FakeProc:
    pid: int
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _child(name: str, pid: int, tmp_path: Path) -> Child:
    log = tmp_path / f"{name}.log"
    log.write_text(f"{name} started\n{name}: boom\n")
    return Child(name, cast(Any, FakeProc(pid)), log)


def _proc(child: Child) -> FakeProc:
    return cast(FakeProc, child.proc)


def test_a_dead_child_is_named_and_restarted_after_a_growing_backoff(tmp_path: Path) -> None:
    clock, out = Clock(), io.StringIO()
    procs = {n: _child(n, i, tmp_path) for i, n in enumerate(["nats", "ledger", "dispatcher"])}
    pids = iter(range(100, 200))
    started: list[str] = []

    def respawn(child: Child) -> Child:
        started.append(child.name)
        return Child(child.name, cast(Any, FakeProc(next(pids))), child.log)

    sup = Supervisor(procs, respawn, RestartPolicy(max_restarts=3, window_s=60), clock, out)
    sup.tick()
    assert started == [] and out.getvalue() == ""
    _proc(procs["dispatcher"]).code = -9
    sup.tick()
    assert "up: dispatcher was killed by SIGKILL; restarting it in 0.5s" in out.getvalue()
    assert started == []  # not before its backoff
    clock.now += 0.5
    sup.tick()
    assert started == ["dispatcher"] and procs["dispatcher"].proc.pid == 100
    assert procs["nats"].proc.pid == 0 and procs["ledger"].proc.pid == 1  # left alone
    _proc(procs["dispatcher"]).code = 1
    sup.tick()
    assert "up: dispatcher exited with 1; restarting it in 1.0s" in out.getvalue()
    clock.now += 0.9
    sup.tick()
    assert started == ["dispatcher"]
    clock.now += 0.1
    sup.tick()
    assert started == ["dispatcher", "dispatcher"]


def test_a_crash_loop_stops_naming_the_child_and_old_deaths_are_forgotten(
        tmp_path: Path) -> None:
    clock = Clock()
    procs = {"reconciler": _child("reconciler", 1, tmp_path)}

    def respawn(child: Child) -> Child:
        return Child(child.name, cast(Any, FakeProc(child.proc.pid + 1)), child.log)

    sup = Supervisor(procs, respawn, RestartPolicy(max_restarts=2, window_s=30), clock,
                     io.StringIO())

    def die_and_restart() -> None:
        _proc(procs["reconciler"]).code = 3
        sup.tick()  # the death, seen
        clock.now += 10
        sup.tick()  # the restart, after its backoff

    die_and_restart()  # t=1000
    die_and_restart()  # t=1010: two deaths within 30 s, still allowed
    clock.now += 30  # both are out of the window now
    die_and_restart()  # t=1050
    die_and_restart()  # t=1060
    _proc(procs["reconciler"]).code = 3
    with pytest.raises(CrashLoop, match="reconciler exited with 3 and died 3 times within 30s"):
        sup.tick()  # t=1070: the third death within 30 s


def test_the_crash_loop_message_names_the_child_its_exit_and_its_log(tmp_path: Path) -> None:
    procs = {"sandbox": _child("sandbox", 1, tmp_path)}
    sup = Supervisor(procs, lambda c: c, RestartPolicy(max_restarts=0), Clock(), io.StringIO())
    _proc(procs["sandbox"]).code = 2
    with pytest.raises(CrashLoop) as info:
        sup.tick()
    text = str(info.value)
    assert text.startswith("effectledger up: sandbox exited with 2 and died 1 times")
    assert "sandbox: boom" in text and str(tmp_path / "sandbox.log") in text


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy()
    assert [policy.backoff_s(n) for n in (1, 2, 3, 6, 10)] == [0.5, 1.0, 2.0, 10.0, 10.0]
    assert describe_exit(-15) == "was killed by SIGTERM" and describe_exit(0) == "exited with 0"
