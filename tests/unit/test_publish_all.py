"""`relay.publish_all`: one command is published in the caller's own task; several at once,
each failure handed back in its place, as `asyncio.gather(return_exceptions=True)` does."""

from __future__ import annotations

import asyncio

import pytest

from effectledger_bus.testing import FakeAck, FakeJetStream
from effectledger_ledger.db.outbox import OutboxItem
from effectledger_ledger.relay import publish_all


def item(n: int) -> OutboxItem:
    return OutboxItem(id=f"ob-{n}", subject=f"cmd.{n}", payload=b"{}", publish_count=1,
                      kind="dispatch")


class TaskRecordingJetStream(FakeJetStream):
    """Records the task each publish ran in; subjects listed in `failing` raise."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.failing = failing
        self.tasks: list[asyncio.Task[object] | None] = []

    async def publish(self, subject: str, payload: bytes, timeout: float,  # noqa: ASYNC109
                      headers: dict[str, str]) -> FakeAck:
        self.tasks.append(asyncio.current_task())
        if subject in self.failing:
            raise TimeoutError(f"no publish ack for {subject}")
        return await super().publish(subject, payload, timeout, headers)


async def test_one_item_is_published_in_the_callers_task() -> None:
    js = TaskRecordingJetStream()
    results = await publish_all(js, [item(1)], 5.0)  # type: ignore[arg-type]
    assert results == [1]
    assert js.tasks == [asyncio.current_task()]  # no task of its own, no loop turn to wait
    assert js.published[0][1]["Nats-Msg-Id"] == item(1).message_id


async def test_one_failing_item_hands_its_exception_back() -> None:
    js = TaskRecordingJetStream(failing=frozenset({"cmd.1"}))
    [result] = await publish_all(js, [item(1)], 5.0)  # type: ignore[arg-type]
    assert isinstance(result, TimeoutError)


async def test_several_items_go_at_once_with_each_failure_in_its_place() -> None:
    js = TaskRecordingJetStream(failing=frozenset({"cmd.2"}))
    results = await publish_all(js, [item(1), item(2), item(3)], 5.0)  # type: ignore[arg-type]
    assert results[0] == 1 and results[2] == 2
    assert isinstance(results[1], TimeoutError)
    assert asyncio.current_task() not in js.tasks  # each in a task of its own: concurrent


async def test_a_cancelled_publish_is_not_turned_into_a_result() -> None:
    class Stuck(FakeJetStream):
        async def publish(self, subject: str, payload: bytes, timeout: float,  # noqa: ASYNC109
                          headers: dict[str, str]) -> FakeAck:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    task = asyncio.create_task(publish_all(Stuck(), [item(1)], 5.0))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # let it start: a loop turn, not a wait for time
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
