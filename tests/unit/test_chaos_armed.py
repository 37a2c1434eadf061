"""The crash-point fault notes when its armed process was last seen alive (availability)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from effectledger_chaos.faults import FaultRunner
from effectledger_chaos.schedule import Schedule
from effectledger_chaos.stack import Stack


class FakeProcess:
    def __init__(self) -> None:
        self.alive = True


class FakeService:
    """A process that dies after `polls` looks at it, and records when that happened."""

    def __init__(self, runner: FaultRunner, polls: int) -> None:
        self.runner, self.polls = runner, polls
        self.current = FakeProcess()
        self.died_at: float | None = None

    @property
    def alive(self) -> bool:
        self.polls -= 1
        if self.polls < 0 and self.current.alive:
            self.current.alive = False
            self.died_at = self.runner.now()
        return self.current.alive

    def ready(self) -> bool:
        return True


class FakeStack:
    def __init__(self) -> None:
        self.exits: list[Any] = []

    def record_exit(self, s: Any) -> None:
        self.exits.append(s)

    def broker_down(self) -> bool:
        return False


async def test_died_at_is_no_later_than_the_death() -> None:
    runner = FaultRunner(cast(Stack, FakeStack()), cast(Schedule, None), log=lambda _m: None)
    runner.phase_start = asyncio.get_running_loop().time() - 100.0
    service = FakeService(runner, polls=3)
    rec: dict[str, Any] = {}
    assert await runner._wait_armed(cast(Any, service), rec)
    assert service.died_at is not None
    # Found dead up to a poll (0.1 s) later; the record says when it was last seen alive.
    assert rec["died_at"] <= service.died_at
    assert service.died_at - rec["died_at"] < 0.5
