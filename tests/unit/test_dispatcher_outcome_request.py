"""The outcome by request (issue 30): the dispatcher acks without the stream copy only when the
ledger answered that it committed the outcome; anything else publishes the JetStream copy under
the same message id, so the request can shorten the path but never lose an outcome."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from effectledger_bus.testing import FakeDelivery
from effectledger_core import crash
from effectledger_core.crash import CrashPointHit
from effectledger_core.messages import (
    AttemptSucceeded,
    ErrorDetail,
    ErrorReply,
    Outcome,
    OutcomeAnswer,
)
from tests.unit.test_dispatcher_worker import World, command, make_world

MSG_ID = "attempt_succeeded:a1"


@pytest.fixture
def world() -> World:
    return make_world(outcome_request_s=2.0)


@pytest.fixture(autouse=True)
def _disarmed() -> Iterator[None]:
    crash.disarm_all()
    yield
    crash.disarm_all()


async def test_an_outcome_the_ledger_committed_is_acked_without_the_stream_copy(
        world: World) -> None:
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    assert world.provider.calls == ["a1"]
    [(msg_id, outcome)] = world.ledger.reported.items()
    assert msg_id == MSG_ID and isinstance(outcome, AttemptSucceeded)
    assert world.outcomes() == [] and world.publisher.publishes == 0
    assert d.acked and not d.naks
    assert (world.dispatcher.stats["outcome_by_request"],
            world.dispatcher.stats["outcome_by_stream"]) == (1, 0)


async def test_no_reply_publishes_the_stream_copy_under_the_same_message_id(
        world: World) -> None:
    world.ledger.reports_unanswered = 1
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    assert world.ledger.reported == {}
    [(outcome, msg_id)] = world.outcomes()
    assert msg_id == MSG_ID and outcome.attempt_id == "a1"
    assert d.acked and world.dispatcher.stats["outcome_by_stream"] == 1


async def test_a_lost_answer_still_publishes_the_copy_the_inbox_will_find_a_duplicate(
        world: World) -> None:
    """Committed, but the answer never came back: the dispatcher cannot know, so it publishes
    the copy, whose message id is the committed one (the inbox's dedupe settles it)."""
    world.ledger.reports_unanswered, world.ledger.reports_lost = 1, True
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    [(_, msg_id)] = world.outcomes()
    assert list(world.ledger.reported) == [msg_id] == [MSG_ID]
    assert d.acked


@pytest.mark.parametrize("retryable", [True, False])
async def test_an_error_reply_publishes_the_stream_copy_and_a_refusal_is_logged(
        world: World, retryable: bool, caplog: pytest.LogCaptureFixture) -> None:
    world.ledger.report_error = ErrorReply(error=ErrorDetail(
        code="store_unavailable" if retryable else "invalid_request",
        message="no" if retryable else "outcome from 'd1' names dispatcher 'd9'",
        retryable=retryable))
    d = FakeDelivery(command())
    with caplog.at_level(logging.INFO, logger="effectledger_dispatcher.worker"):
        await world.dispatcher.handle(d)
    [(_, msg_id)] = world.outcomes()
    assert msg_id == MSG_ID and d.acked
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    if retryable:
        assert errors == []
    else:
        [record] = errors
        assert "refused" in record.getMessage() and "invalid_request" in record.getMessage()


async def test_an_unexpected_failure_of_the_request_publishes_the_stream_copy(
        world: World) -> None:
    """A bug or a closed connection (not NoReply): the claim worked, only the report fails."""

    async def report(outcome: Outcome, *, timeout_s: float) -> OutcomeAnswer:
        raise RuntimeError("connection reset")

    world.ledger.report = report  # type: ignore[method-assign]
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    [(_, msg_id)] = world.outcomes()
    assert msg_id == MSG_ID and d.acked


async def test_an_answer_for_another_outcome_is_not_taken_for_this_one(world: World) -> None:
    real = world.ledger.report

    async def report(outcome: Outcome, *, timeout_s: float) -> OutcomeAnswer:
        answer = await real(outcome, timeout_s=timeout_s)
        return answer.model_copy(update={"message_id": "attempt_succeeded:other"})

    world.ledger.report = report  # type: ignore[method-assign]
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    [(_, msg_id)] = world.outcomes()
    assert msg_id == MSG_ID and d.acked


async def test_with_the_request_switched_off_every_outcome_goes_by_the_stream() -> None:
    world = make_world(outcome_request_s=0.0)
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    assert world.ledger.reported == {}  # never asked
    [(_, msg_id)] = world.outcomes()
    assert msg_id == MSG_ID and d.acked


async def test_the_wait_for_the_answer_is_short_and_never_outlasts_the_ack_wait(
        world: World) -> None:
    await world.dispatcher.handle(FakeDelivery(command()))
    world.dispatcher.ack_wait_s = 0.3  # no heartbeat runs while the dispatcher waits
    await world.dispatcher.handle(FakeDelivery(command(epoch=2)))
    assert world.ledger.report_timeouts == [2.0, pytest.approx(0.1)]


async def test_no_answer_and_no_stream_leaves_the_command_unacked(world: World) -> None:
    world.ledger.reports_unanswered = 1
    world.publisher.down = True
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    assert not d.acked and not d.naks and world.ledger.reported == {}


async def test_a_crash_after_the_committed_request_ends_in_one_call_and_one_outcome(
        world: World) -> None:
    """Committed by request, then the process dies before its ack: the redelivered command's
    claim is refused (already claimed, outcome recorded), so it is acked with no second call
    and no second outcome."""
    crash.arm("dispatcher.after_outcome_request")
    first = FakeDelivery(command())
    with pytest.raises(CrashPointHit):
        await world.dispatcher.handle(first)
    assert not first.acked and list(world.ledger.reported) == [MSG_ID]
    crash.disarm_all()
    again = FakeDelivery(command(), deliveries=2)
    await world.dispatcher.handle(again)
    assert again.acked and world.provider.calls == ["a1"]
    assert list(world.ledger.reported) == [MSG_ID] and world.outcomes() == []
