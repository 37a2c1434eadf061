"""The messaging edge's pure parts and fakes: ids, nak backoff, dead letters, heartbeats,
publish retries."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from effectledger_bus import catalogue
from effectledger_bus.backoff import nak_backoff
from effectledger_bus.delivery import dead_letter, heartbeat
from effectledger_bus.publish import publish_with_retries
from effectledger_bus.testing import FakeDelivery, FakePublisher
from effectledger_core.errors import BrokerUnavailable
from effectledger_core.messages import (
    AttemptFailed,
    FailureClass,
    VerdictReached,
    WebhookReceived,
)

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def test_message_ids_keep_their_wire_formats() -> None:
    """Changing any of these would let a republish through the duplicate window."""
    failed = AttemptFailed(operation_id="op", epoch=2, attempt_id="a9", dispatcher_id="d",
                           at=NOW, failure_class=FailureClass.PERMANENT, message="no", code="x")
    verdict = VerdictReached(operation_id="op", epoch=2, verdict="not_applied",
                             reconciler_id="r1", at=NOW)
    hook = WebhookReceived(provider="sandbox", webhook_id="msg_1", event_type="t",
                           outcome="applied", body_digest="d", signed_at=NOW, received_at=NOW)
    assert catalogue.dispatch_id("ob1", 0) == "ob1"
    assert catalogue.dispatch_id("ob1", 2) == "ob1.r2"
    assert catalogue.message_id(failed) == "attempt_failed:a9"
    assert catalogue.message_id(verdict) == "verdict:op:2:not_applied"
    assert catalogue.message_id(hook) == "webhook:sandbox:msg_1"


def test_equal_verdicts_of_two_replicas_share_one_message_id() -> None:
    a, b = (VerdictReached(operation_id="op", epoch=1, verdict="applied", reconciler_id=r,
                           at=NOW) for r in ("r1", "r2"))
    assert catalogue.message_id(a) == catalogue.message_id(b)


@pytest.mark.parametrize(("deliveries", "delay"),
                         [(0, 0.5), (1, 0.5), (2, 1.0), (4, 4.0), (7, 30.0), (10_000, 30.0)])
def test_nak_backoff_doubles_from_the_delivery_count_and_is_capped(
        deliveries: int, delay: float) -> None:
    assert nak_backoff(deliveries, base_s=0.5, cap_s=30.0) == delay


def test_a_dead_letter_names_its_source_and_is_bounded() -> None:
    d = FakeDelivery(b"x" * 10_000, deliveries=4, subject="t." + "s" * 2000,
                     headers={"Nats-Msg-Id": "m" * 3000})
    letter = dead_letter(d, consumer="dispatcher", error="e" * 5000)
    assert (letter.consumer, letter.deliveries) == ("dispatcher", 4)
    assert len(letter.subject) == len(letter.error) == len(letter.message_id or "") == 1024
    assert len(letter.payload_excerpt) == 2048
    assert catalogue.message_id(letter).startswith("deadletter:dispatcher:mmm")


def test_a_dead_letter_without_a_message_id_says_so() -> None:
    letter = dead_letter(FakeDelivery(b"{}", headers={}), consumer="c", error="bad")
    assert letter.message_id is None
    assert catalogue.message_id(letter) == f"deadletter:c:{letter.subject}:1"


async def test_heartbeat_sends_in_progress_while_the_work_runs_and_stops_after() -> None:
    d = FakeDelivery(b"")
    async with heartbeat(d, 0.01):
        await asyncio.wait_for(d.beaten.wait(), 10)
    beats = d.beats
    d.beaten.clear()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(d.beaten.wait(), 0.05)
    assert d.beats == beats


async def test_a_beat_that_ends_as_the_body_ends_arms_no_further_beat() -> None:
    # The body leaves right after a beat: the beat's task is done, but its callback (which
    # arms the next timer) has not run yet. It must not arm one for a finished body.
    d = FakeDelivery(b"")
    async with heartbeat(d, 0.01):
        await d.beaten.wait()
    beats = d.beats
    d.beaten.clear()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(d.beaten.wait(), 0.1)
    assert d.beats == beats


async def test_publish_retries_an_outage_under_one_message_id() -> None:
    publisher = FakePublisher()
    publisher.failures = 2
    beats: list[int] = []

    async def before_retry() -> None:
        beats.append(1)

    duplicate = await publish_with_retries(publisher, "s", b"p", msg_id="m1", attempts=3,
                                           first_wait_s=0.001, before_retry=before_retry)
    assert not duplicate and publisher.messages == [("s", b"p", "m1")]
    assert publisher.publishes == 3 and len(beats) == 2  # a heartbeat before each retry
    assert await publish_with_retries(publisher, "s", b"p", msg_id="m1", attempts=1)


async def test_publish_gives_up_with_the_brokers_error() -> None:
    publisher = FakePublisher()
    publisher.down = True
    with pytest.raises(BrokerUnavailable):
        await publish_with_retries(publisher, "s", b"p", msg_id="m1", attempts=2,
                                   first_wait_s=0.001)
    assert publisher.publishes == 2 and not publisher.messages


async def test_publish_needs_a_limit() -> None:
    with pytest.raises(ValueError, match="attempts"):
        await publish_with_retries(FakePublisher(), "s", b"p", msg_id="m")
