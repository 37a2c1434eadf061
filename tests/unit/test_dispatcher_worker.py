"""The dispatcher's `handle` with fakes: what it claims, calls, publishes, acks and naks.

The ledger fake follows the claim rule (first claimer of an epoch holds it, the same attempt id
is granted again); the publisher fake deduplicates by message id like JetStream; the provider
fake counts calls. A test states what happened, never which methods were called.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import count
from typing import Any

import pytest

from effectledger_bus.testing import FakeDelivery, FakeLedger, FakePublisher
from effectledger_core.catalog import Catalog, Tool
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.messages import (
    AttemptFailed,
    AttemptSucceeded,
    ClaimAnswer,
    ClaimAttempt,
    DeadLetter,
    DispatchAttempt,
    FailureClass,
    Outcome,
    OutcomeAmbiguous,
    encode,
    parse,
    parse_outcome,
)
from effectledger_core.send_deadline import NOT_SENT_CODE, send_deadline_s
from effectledger_core.subjects import Subjects
from effectledger_core.unsafe import NO_SEND_DEADLINE
from effectledger_dispatcher.decision import LOST_GRACE_S
from effectledger_dispatcher.worker import UNSAFE_SKIP_CLAIM_ENV, Dispatcher
from effectledger_providers.calls import SendRefused

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SUBJECTS = Subjects(prefix="t", stream_prefix="T")
CATALOG = Catalog.load(DEMO_CATALOG)
TOOL = "create_ticket"


@dataclass
class MonotonicClock:
    """The dispatcher's monotonic clock, moved by the test (a pause is a jump)."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeProvider:
    """Answers 2xx; `hold` makes a call wait until the event is set (a slow provider).

    Like `call_provider`, it runs `on_sent`, then `before_write` right before the request
    would be written; a `SendRefused` there means nothing reaches the provider (not in
    `calls`) and the attempt is a transient failure. `pause_s` moves `clock` forward between
    the two: the process frozen after its claim, before its send."""

    calls: list[str] = field(default_factory=list)
    hold: asyncio.Event | None = None
    clock: MonotonicClock = field(default_factory=MonotonicClock)
    pause_s: float = 0.0

    async def __call__(self, tool: Tool, cmd: DispatchAttempt, *, attempt_id: str,
                       dispatcher_id: str, on_sent: Callable[[], None],
                       before_write: Callable[[], None]) -> Outcome:
        on_sent()
        self.clock.now += self.pause_s
        try:
            before_write()
        except SendRefused as exc:
            return AttemptFailed(operation_id=cmd.operation_id, epoch=cmd.epoch,
                                 attempt_id=attempt_id, dispatcher_id=dispatcher_id, at=NOW,
                                 failure_class=FailureClass.TRANSIENT, code=exc.code,
                                 message=exc.message, idempotency="yes")
        self.calls.append(attempt_id)
        if self.hold is not None:
            await asyncio.wait_for(self.hold.wait(), 10)
        return AttemptSucceeded(operation_id=cmd.operation_id, epoch=cmd.epoch,
                                attempt_id=attempt_id, dispatcher_id=dispatcher_id, at=NOW,
                                http_status=201, response_digest="sha256:00")


def command(tool: str = TOOL, epoch: int = 1) -> bytes:
    return encode(DispatchAttempt(
        operation_id="op1", operation_key="ck_1", epoch=epoch, tool=tool, arguments={},
        arguments_digest="sha256:a", catalog_digest="sha256:c", contract_revision="1"))


@dataclass
class World:
    ledger: FakeLedger[Any]
    publisher: FakePublisher
    provider: FakeProvider
    dispatcher: Dispatcher

    def outcomes(self) -> list[tuple[Outcome, str]]:
        return [(parse_outcome(p), i) for s, p, i in self.publisher.messages
                if s.startswith(f"{SUBJECTS.prefix}.ledger.v1.outcome.")]

    def dead_letters(self) -> list[DeadLetter]:
        return [parse(DeadLetter, p) for p, _ in self.publisher.on(SUBJECTS.deadletter)]


def make_world(env: dict[str, str] | None = None, *, outcome_request_s: float = 0.0) -> World:
    ledger: FakeLedger[Any] = FakeLedger(now=NOW)
    publisher = FakePublisher()
    provider = FakeProvider()
    ids = count(1)
    dispatcher = Dispatcher(ledger=ledger, publisher=publisher, call=provider, catalog=CATALOG,
                            subjects=SUBJECTS, dispatcher_id="d1", env=env or {},
                            clock=lambda: NOW, ids=lambda: f"a{next(ids)}",
                            publish_within_s=0.05, monotonic=provider.clock,
                            outcome_request_s=outcome_request_s)
    return World(ledger, publisher, provider, dispatcher)


@pytest.fixture
def world() -> World:
    return make_world()


async def test_a_granted_claim_calls_once_publishes_the_outcome_then_acks(world: World) -> None:
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    assert world.provider.calls == ["a1"]
    [(outcome, msg_id)] = world.outcomes()
    assert isinstance(outcome, AttemptSucceeded) and outcome.attempt_id == "a1"
    assert msg_id == "attempt_succeeded:a1"
    assert d.acked and not d.naks
    assert world.dispatcher.stats["granted"] == 1


async def test_a_redelivered_finished_command_is_acked_without_a_second_call(
        world: World) -> None:
    await world.dispatcher.handle(FakeDelivery(command()))
    world.ledger.outcomes.add(("op1", 1))
    again = FakeDelivery(command(), deliveries=2)
    await world.dispatcher.handle(again)
    assert world.provider.calls == ["a1"] and len(world.outcomes()) == 1
    assert again.acked


async def test_a_poison_command_is_dead_lettered_and_acked_without_a_claim(
        world: World) -> None:
    d = FakeDelivery(b'{"type": "dispatch_attempt", "operation_id": 7}', deliveries=3)
    await world.dispatcher.handle(d)
    [letter] = world.dead_letters()
    assert (letter.consumer, letter.message_id, letter.deliveries) == \
        ("dispatcher", "outbox-1", 3)
    assert d.acked and not world.ledger.requests and not world.provider.calls


async def test_an_unknown_tool_waits_for_a_rollout_then_is_dead_lettered(world: World) -> None:
    early = FakeDelivery(command("not_in_our_catalog"), deliveries=1)
    await world.dispatcher.handle(early)
    assert early.naks == [10.0] and not early.acked and not world.dead_letters()
    last = FakeDelivery(command("not_in_our_catalog"),
                        deliveries=world.dispatcher.max_deliver)
    await world.dispatcher.handle(last)
    assert last.acked and len(world.dead_letters()) == 1
    assert not world.ledger.requests and not world.provider.calls


async def test_an_unanswered_claim_naks_and_the_redelivery_asks_with_the_same_attempt_id(
        world: World) -> None:
    world.ledger.unanswered = 3  # every try of the first delivery
    first = FakeDelivery(command())
    await world.dispatcher.handle(first)
    assert first.naks == [1.0] and not first.acked and not world.provider.calls
    assert first.beats == 2  # kept ours between the tries
    second = FakeDelivery(command(), deliveries=2)
    await world.dispatcher.handle(second)
    assert {r.attempt_id for r in world.ledger.requests} == {"a1"}
    assert world.provider.calls == ["a1"] and second.acked
    assert world.dispatcher.stats["claim_unavailable"] == 1


async def test_a_claim_held_by_a_live_claimer_is_naked_until_its_call_must_have_ended(
        world: World) -> None:
    world.ledger.hold("op1", 1, "other", age_s=1.0)
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    tool_timeout = CATALOG.get(TOOL).timeout_s
    assert len(d.naks) == 1 and d.naks[0] > tool_timeout + LOST_GRACE_S - 1.0
    assert not d.acked and not world.provider.calls and not world.outcomes()


async def test_a_claim_whose_claimer_never_reported_is_declared_lost_never_called(
        world: World) -> None:
    world.ledger.hold("op1", 1, "other", age_s=3600.0)
    d = FakeDelivery(command(), deliveries=2)
    await world.dispatcher.handle(d)
    [(outcome, msg_id)] = world.outcomes()
    assert isinstance(outcome, OutcomeAmbiguous)
    assert (outcome.reason, outcome.attempt_id) == ("dispatcher_lost_mid_attempt", "other")
    assert msg_id == "outcome_ambiguous:other"
    assert not world.provider.calls and d.acked
    assert world.dispatcher.stats["lost_mid_attempt"] == 1


async def test_a_stale_epoch_is_acked_without_a_call(world: World) -> None:
    world.ledger.current_epoch["op1"] = 2
    d = FakeDelivery(command(epoch=1))
    await world.dispatcher.handle(d)
    assert d.acked and not world.provider.calls and not world.outcomes()
    assert world.dispatcher.stats["stale"] == 1


async def test_an_outcome_that_cannot_be_stored_leaves_the_command_unacked(
        world: World) -> None:
    world.publisher.down = True
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    assert world.provider.calls == ["a1"]
    assert not d.acked and not d.naks  # redelivery after ack_wait takes the ambiguous path
    assert world.publisher.publishes >= 2  # retried before giving up


async def test_a_slow_provider_call_keeps_the_command_with_heartbeats(world: World) -> None:
    world.dispatcher.ack_wait_s = 0.03
    world.provider.hold = asyncio.Event()
    d = FakeDelivery(command())
    task = asyncio.create_task(world.dispatcher.handle(d))
    await asyncio.wait_for(d.beaten.wait(), 10)  # in_progress while the call is under way
    assert not d.acked
    world.provider.hold.set()
    await task
    assert d.acked and d.beats >= 1


async def test_with_claim_before_call_switched_off_a_held_claim_is_called_again() -> None:
    world = make_world(env={UNSAFE_SKIP_CLAIM_ENV: "1"})
    world.ledger.hold("op1", 1, "other", age_s=3600.0, outcome_recorded=True)
    d = FakeDelivery(command(), deliveries=2)
    await world.dispatcher.handle(d)
    assert world.provider.calls == ["other"] and d.acked


DEADLINE_S = send_deadline_s(CATALOG.get(TOOL).horizon_s)


async def test_a_dispatcher_paused_past_the_send_deadline_sends_nothing_and_reports_not_sent(
        world: World) -> None:
    world.provider.pause_s = DEADLINE_S + 0.001
    d = FakeDelivery(command())
    await world.dispatcher.handle(d)
    assert world.provider.calls == []
    [(outcome, _)] = world.outcomes()
    assert isinstance(outcome, AttemptFailed)
    assert (outcome.failure_class, outcome.code, outcome.attempt_id) == \
        (FailureClass.TRANSIENT, NOT_SENT_CODE, "a1")
    assert d.acked and world.dispatcher.stats["not_sent_deadline"] == 1


async def test_a_pause_shorter_than_the_send_deadline_still_sends(world: World) -> None:
    world.provider.pause_s = DEADLINE_S * 0.99
    await world.dispatcher.handle(FakeDelivery(command()))
    assert world.provider.calls == ["a1"]
    [(outcome, _)] = world.outcomes()
    assert isinstance(outcome, AttemptSucceeded)


async def test_the_send_deadline_counts_from_before_the_claim_request() -> None:
    """A slow claim reply uses up the window: the ledger's claimed_at is later than our start,
    so counting from the reply would under-count what the reconciler's horizon counts."""
    world = make_world()
    clock, claim = world.provider.clock, world.ledger.claim

    async def slow_claim(request: ClaimAttempt) -> ClaimAnswer:
        clock.now += DEADLINE_S  # the reply takes the whole window
        return await claim(request)

    world.ledger.claim = slow_claim  # type: ignore[method-assign]
    await world.dispatcher.handle(FakeDelivery(command()))
    assert world.provider.calls == []
    [(outcome, _)] = world.outcomes()
    assert isinstance(outcome, AttemptFailed) and outcome.code == NOT_SENT_CODE


async def test_with_the_send_deadline_switched_off_a_late_attempt_is_sent() -> None:
    world = make_world(env={NO_SEND_DEADLINE.env: "1"})
    world.provider.pause_s = DEADLINE_S * 10
    await world.dispatcher.handle(FakeDelivery(command()))
    assert world.provider.calls == ["a1"]
    assert world.dispatcher.stats["not_sent_deadline"] == 0
