"""Outcomes by request (issue 30) against real NATS and the ledger service on both databases:
the request is committed once, under the inbox id its JetStream copy carries, so a copy that
comes later through the real inbox consumer is a duplicate (and the other way round); a request
naming another dispatcher is refused, kept as a dead letter, and cannot take the genuine
outcome's inbox id."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import nats
import pytest
import sqlalchemy as sa
from nats.aio.client import Client as NatsClient

from effectledger_bus import catalogue
from effectledger_bus.publish import JetStreamPublisher
from effectledger_bus.streams import ensure_streams
from effectledger_core.config import Settings
from effectledger_core.messages import (
    AttemptSucceeded,
    ClaimAttempt,
    ClaimStatus,
    ErrorReply,
    Outcome,
    OutcomeRecorded,
    SubmitIntent,
    encode,
)
from effectledger_dispatcher.ports import NatsLedgerClient
from effectledger_ledger.db.rows import Recorded
from effectledger_ledger.db.schema import dead_letters, inbox
from effectledger_ledger.db.store import Store
from effectledger_ledger.messaging import INBOX_CONSUMER, build_inbox, serve_requests
from effectledger_ledger.service import LedgerService
from tests.support.cluster import wait_until
from tests.support.ledger import DEMO as CATALOG
from tests.support.ledger import NOW


@dataclass
class Wired:
    svc: LedgerService
    nc: NatsClient
    settings: Settings
    # What the ledger made of each outcome, by request or from the inbox consumer, in order.
    recorded: list[tuple[str, Recorded]] = field(default_factory=list)

    def client(self, dispatcher_id: str) -> NatsLedgerClient:
        return NatsLedgerClient(self.nc, self.settings.subjects, dispatcher_id=dispatcher_id)

    async def in_flight(self, title: str, dispatcher_id: str = "d1") -> AttemptSucceeded:
        """An operation claimed by `dispatcher_id`, and the outcome its call would report."""
        op = (await self.svc.submit(SubmitIntent(tool="create_ticket",
                                                 arguments={"title": title}))).operation
        attempt = f"{op['id']}-a"
        reply = await self.svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1,
                                                  attempt_id=attempt,
                                                  dispatcher_id=dispatcher_id))
        assert reply.status is ClaimStatus.GRANTED
        return AttemptSucceeded(operation_id=op["id"], epoch=1, attempt_id=attempt,
                                dispatcher_id=dispatcher_id, at=NOW, http_status=201,
                                response_digest="sha256:beef", provider_ref="tk_1")

    async def stream_copy(self, outcome: Outcome, sender: str | None = None) -> None:
        """Publish the JetStream copy exactly as the dispatcher's fallback does."""
        subject = self.settings.subjects.outcome_by(sender or outcome.dispatcher_id,
                                                    outcome.type)
        await JetStreamPublisher(self.nc.jetstream()).publish(
            subject, encode(outcome), msg_id=catalogue.message_id(outcome))

    async def rows(self, table: sa.Table, *where: Any) -> list[dict[str, Any]]:
        async with self.svc.store.transaction() as conn:
            return [dict(r) for r in (await conn.execute(sa.select(table).where(*where)))
                    .mappings().all()]

    async def outcome_entries(self, op_id: str) -> int:
        journal = await self.svc.journal(op_id)
        return sum(1 for e in journal.entries if e.kind == "outcome_recorded")


@pytest.fixture
async def wired(settings: Settings, store: Store) -> AsyncIterator[Wired]:
    svc = LedgerService(store=store, catalog=CATALOG, subjects=settings.subjects,
                        wait_recheck_s=0)
    nc = await nats.connect(settings.nats_url)
    await ensure_streams(nc.jetstream(), settings)
    w = Wired(svc, nc, settings)
    record = svc.record_outcome

    async def recording(outcome: Outcome, *, consumer: str, message_id: str) -> Recorded:
        result = await record(outcome, consumer=consumer, message_id=message_id)
        w.recorded.append((message_id, result))
        return result

    svc.record_outcome = recording  # type: ignore[method-assign]  # a spy on the real one
    server = await serve_requests(nc, settings, svc)
    consumer = build_inbox(nc, settings, svc)
    await consumer.start()
    try:
        yield w
    finally:
        await consumer.stop()
        await server.close()
        await nc.close()
        await svc.close()


async def test_an_outcome_by_request_is_committed_once_and_its_stream_copy_is_a_duplicate(
        wired: Wired) -> None:
    outcome = await wired.in_flight("by request")
    msg_id = catalogue.message_id(outcome)
    answer = await wired.client("d1").report(outcome, timeout_s=5)
    assert isinstance(answer, OutcomeRecorded), answer
    assert (answer.status, answer.message_id) == ("applied", msg_id)
    # Answered after the commit: the state is there when the answer is.
    assert (await wired.svc.operation(outcome.operation_id)).state == "succeeded"

    await wired.stream_copy(outcome)  # the dispatcher's fallback, had the answer been lost
    await wait_until(lambda: len(wired.recorded) == 2, 30, interval=0.05,
                     what="the stream copy to reach the inbox")
    assert [(m, r.status) for m, r in wired.recorded] == [(msg_id, "applied"),
                                                          (msg_id, "duplicate")]
    assert await wired.outcome_entries(outcome.operation_id) == 1
    assert len(await wired.rows(inbox, inbox.c.message_id == msg_id,
                                inbox.c.consumer == INBOX_CONSUMER)) == 1


async def test_a_request_after_its_stream_copy_is_answered_as_a_duplicate(
        wired: Wired) -> None:
    outcome = await wired.in_flight("stream first")
    await wired.stream_copy(outcome)
    await wait_until(lambda: len(wired.recorded) == 1, 30, interval=0.05,
                     what="the stream copy to be committed")
    answer = await wired.client("d1").report(outcome, timeout_s=5)
    assert isinstance(answer, OutcomeRecorded) and answer.status == "duplicate", answer
    assert await wired.outcome_entries(outcome.operation_id) == 1


async def test_a_forged_outcome_request_is_refused_and_cannot_take_the_genuine_ones_id(
        wired: Wired) -> None:
    """Dispatcher d2, on its own request subject, reports d1's attempt as d1 would: refused
    (invalid_request, not retryable), dead-lettered with the subject it came on, nothing
    committed in the inbox; d1's genuine outcome is then applied, not a duplicate."""
    outcome = await wired.in_flight("forged")
    answer = await wired.client("d2").report(outcome, timeout_s=5)
    assert isinstance(answer, ErrorReply), answer
    assert (answer.error.code, answer.error.retryable) == ("invalid_request", False)
    assert "'d2'" in answer.error.message and "'d1'" in answer.error.message
    assert wired.recorded == [] and await wired.outcome_entries(outcome.operation_id) == 0
    assert (await wired.svc.operation(outcome.operation_id)).state == "in_flight"
    [letter] = await wired.rows(dead_letters)
    assert letter["subject"] == wired.settings.subjects.rpc_outcome_by("d2")
    assert letter["message_id"] == catalogue.message_id(outcome)

    genuine = await wired.client("d1").report(outcome, timeout_s=5)
    assert isinstance(genuine, OutcomeRecorded) and genuine.status == "applied", genuine


async def test_an_outcome_request_that_is_not_an_outcome_gets_an_error_reply(
        wired: Wired) -> None:
    for raw in (b"{", b'{"type": "attempt_succeeded"}', b"x" * (300 * 1024)):
        msg = await wired.nc.request(wired.settings.subjects.rpc_outcome_by("d1"), raw,
                                     timeout=5)
        answer = ErrorReply.model_validate_json(msg.data)
        assert answer.error.code in ("poison_message", "payload_too_large"), answer
    assert wired.recorded == [] and await wired.rows(dead_letters) == []
