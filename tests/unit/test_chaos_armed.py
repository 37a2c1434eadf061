"""The crash-point faults: when an armed process was last seen alive (availability), and when
`pause_before_send` may arm."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from effectledger_chaos import faults
from effectledger_chaos.faults import FaultRunner
from effectledger_chaos.schedule import Schedule
from effectledger_chaos.stack import Stack


class FakeProcess:
    def __init__(self) -> None:
        self.alive = True


class FakeService:
    """A process that dies at `dies_at` (runner time), between two of the runner's looks."""

    kind = "dispatcher"

    def __init__(self, runner: FaultRunner, dies_at: float) -> None:
        self.runner, self.dies_at = runner, dies_at
        self.current = FakeProcess()

    @property
    def alive(self) -> bool:
        self.current.alive = self.runner.now() < self.dies_at
        return self.current.alive

    def ready(self) -> bool:
        return True


class FakeLedger:
    kind = "ledger"

    def __init__(self) -> None:
        self.up = True

    def ready(self) -> bool:
        return self.up


class FakeStack:
    def __init__(self) -> None:
        self.exits: list[Any] = []
        self.down = False
        self.ledger = FakeLedger()
        self.services: dict[str, Any] = {"ledger": self.ledger}

    def record_exit(self, s: Any) -> None:
        self.exits.append(s)

    def broker_down(self) -> bool:
        return self.down


async def test_died_at_is_no_later_than_the_death() -> None:
    runner = FaultRunner(cast(Stack, FakeStack()), cast(Schedule, None), log=lambda _m: None)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    # Dies 0.25 s from now: between the runner's looks (every 0.1 s), never at one.
    service = FakeService(runner, dies_at=runner.now() + 0.25)
    rec: dict[str, Any] = {"armed_listening_at": runner.now()}
    assert await runner._wait_armed(cast(Any, service), rec)
    # The record says when it was last seen alive: before the death, by at most a poll.
    assert rec["died_at"] < service.dies_at
    assert service.dies_at - rec["died_at"] < 0.5


async def test_a_process_dead_at_the_first_look_died_after_it_listened() -> None:
    runner = FaultRunner(cast(Stack, FakeStack()), cast(Schedule, None), log=lambda _m: None)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    listened = runner.now()
    service = FakeService(runner, dies_at=listened)
    rec: dict[str, Any] = {"armed_listening_at": listened}
    assert await runner._wait_armed(cast(Any, service), rec)
    assert rec["died_at"] == listened


async def test_pause_before_send_waits_until_the_broker_has_been_up_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "STEADY_S", 0.3)
    stack = FakeStack()
    stack.down = True
    runner = FaultRunner(cast(Stack, stack), cast(Schedule, None), log=lambda _m: None)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    waiting = asyncio.create_task(runner._wait_steady())
    with pytest.raises(TimeoutError):  # the broker is down: it keeps waiting
        await asyncio.wait_for(asyncio.shield(waiting), 0.6)
    stack.down = False
    back = time.monotonic()
    await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - back >= 0.3  # up for STEADY_S first, not at once


async def test_pause_before_send_arms_at_once_long_after_the_last_outage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "STEADY_S", 30.0)
    runner = FaultRunner(cast(Stack, FakeStack()), cast(Schedule, None), log=lambda _m: None)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    runner.records.append({"kind": "nats_restart", "started_at": 10.0, "ended_at": 20.0})
    await asyncio.wait_for(runner._wait_steady(), 5)  # up for 80 s already: no wait


async def test_an_armed_point_nothing_can_reach_is_disarmed_once_all_is_quiet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The workload over and every operation at rest: the point is given up after the calm,
    not after the whole window (which would have held the process for ARMED_TIMEOUT_S)."""
    monkeypatch.setattr(faults, "QUIET_CALM_S", 0.3)
    monkeypatch.setattr(faults, "QUIET_POLL_S", 0.05)
    looks: list[float] = []

    async def quiet() -> bool:
        looks.append(time.monotonic())
        return True

    runner = FaultRunner(cast(Stack, FakeStack()), cast(Schedule, None), log=lambda _m: None,
                         quiet=quiet)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    service = FakeService(runner, dies_at=runner.now() + 1000.0)
    rec: dict[str, Any] = {"armed_listening_at": runner.now()}
    started = time.monotonic()
    assert not await asyncio.wait_for(runner._wait_armed(cast(Any, service), rec), 5)
    assert rec["not_reached"] == "nothing left to reach it"
    assert 0.3 <= time.monotonic() - started < faults.ARMED_TIMEOUT_S
    assert looks[-1] - looks[0] >= 0.3  # quiet at every look for the whole calm


async def test_traffic_between_quiet_looks_starts_the_calm_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One look that finds work in flight: the calm counts from the next quiet look, and a
    process that reaches its point meanwhile is a hit."""
    monkeypatch.setattr(faults, "QUIET_CALM_S", 0.25)
    monkeypatch.setattr(faults, "QUIET_POLL_S", 0.05)
    answers = iter([True, True, False])  # then quiet again

    async def quiet() -> bool:
        return next(answers, True)

    runner = FaultRunner(cast(Stack, FakeStack()), cast(Schedule, None), log=lambda _m: None,
                         quiet=quiet)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    # Looks about every 0.1 s. Dies 0.45 s from now: a calm counted from the first look would
    # have given the point up at the fourth (~0.4 s); counted again from it, the death comes
    # first.
    service = FakeService(runner, dies_at=runner.now() + 0.45)
    rec: dict[str, Any] = {"armed_listening_at": runner.now()}
    assert await asyncio.wait_for(runner._wait_armed(cast(Any, service), rec), 5)
    assert "not_reached" not in rec


async def test_a_dispatchers_window_does_not_count_while_no_ledger_is_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dispatcher crash point comes after a claim the ledger grants: while the ledger
    restarts, the armed window stands still (it ran out during a chain of ledger restarts
    in CI, with nothing tried), and it counts again once a ledger is ready."""
    monkeypatch.setattr(faults, "ARMED_TIMEOUT_S", 0.3)
    stack = FakeStack()
    stack.ledger.up = False
    runner = FaultRunner(cast(Stack, stack), cast(Schedule, None), log=lambda _m: None)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    service = FakeService(runner, dies_at=runner.now() + 1000.0)
    waiting = asyncio.create_task(runner._wait_armed(cast(Any, service), {}))
    with pytest.raises(TimeoutError):  # three windows' worth with the ledger down: still armed
        await asyncio.wait_for(asyncio.shield(waiting), 0.9)
    stack.ledger.up = True
    back = time.monotonic()
    assert not await asyncio.wait_for(waiting, 5)  # not reached, once its window has run
    assert time.monotonic() - back >= 0.15  # two looks at least: counted from the return
