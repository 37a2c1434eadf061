"""The outcome inbox: dedup by message id, guarded state change and journal, one transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.failures import Failure, Idempotency
from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    DeadLetter,
    Outcome,
    OutcomeAmbiguous,
)
from effectledger_core.retry_policy import RetryDecision
from effectledger_core.states import Event, State, sources, transition
from effectledger_core.subjects import Subjects

from .common import append_journal, insert_ignore
from .resolution import (
    Recorded,
    RetryDecider,
    apply_stored_webhooks,
    hand_to_reconciler,
    schedule_retry,
)
from .schema import attempts, dead_letters, inbox, operations

_EVENT = {
    AttemptSucceeded: Event.OUTCOME_SUCCEEDED,
    AttemptAccepted: Event.OUTCOME_ACCEPTED,
    AttemptFailed: Event.OUTCOME_FAILED,
    OutcomeAmbiguous: Event.OUTCOME_AMBIGUOUS,
}


def failure_of(outcome: AttemptFailed) -> Failure:
    return Failure(outcome.failure_class, outcome.code, outcome.message,
                   retry_after_s=outcome.retry_after_s,
                   idempotency=Idempotency(outcome.idempotency))


async def record_outcome_txn(conn: AsyncConnection, outcome: Outcome, *, consumer: str,
                             message_id: str, subjects: Subjects, now: datetime,
                             ambiguous_outbox_id: str,
                             decide_retry: RetryDecider | None = None) -> Recorded:
    if not await insert_ignore(conn, inbox, dict(consumer=consumer, message_id=message_id,
                                                 received_at=now)):
        return Recorded("duplicate")
    event = _EVENT[type(outcome)]
    detail = outcome.model_dump(mode="json")
    # Lock the row before deciding (PostgreSQL; SQLite already serialises writers): a decision
    # made on a state read before a concurrent commit would reject valid evidence, e.g. a late
    # success racing the ambiguity it resolves, and the inbox row would make that permanent.
    op = (await conn.execute(
        sa.select(operations).where(operations.c.id == outcome.operation_id)
        .with_for_update())).first()
    held = (await conn.execute(
        sa.select(attempts.c.id).where(attempts.c.operation_id == outcome.operation_id,
                                       attempts.c.epoch == outcome.epoch))).scalar()
    reason = None
    if op is None:
        reason = "unknown_operation"
    elif held != outcome.attempt_id:
        reason = "not_the_claimed_attempt"
    elif op.epoch != outcome.epoch:
        reason = "stale_epoch"
    elif State(op.state) not in sources(event):
        reason = f"state_{op.state}_does_not_accept_{event.value}"
    decision: RetryDecision | None = None
    if reason is None and isinstance(outcome, AttemptFailed) and decide_retry is not None:
        assert op is not None
        # The ledger decides about retries, never the dispatcher on its own.
        decision = decide_retry(dict(op._mapping), failure_of(outcome))
        if decision.retry:
            event = Event.OUTCOME_RETRY
    if reason is None:
        assert op is not None
        step = transition(State(op.state), event)
        values: dict[str, Any] = dict(state=step.to.value, updated_at=now, last_outcome=detail)
        if step.new_epoch:
            values["epoch"] = op.epoch + 1
        if isinstance(outcome, AttemptSucceeded | AttemptAccepted):
            values.update(provider_ref=outcome.provider_ref,
                          response_digest=outcome.response_digest)
        # The guard repeats every check in SQL so a concurrent writer cannot slip past it.
        updated = await conn.execute(
            operations.update()
            .where(operations.c.id == outcome.operation_id, operations.c.epoch == outcome.epoch,
                   operations.c.state == op.state)
            .values(**values))
        if updated.rowcount != 1:
            reason = "concurrent_change"
    if reason is not None:
        await append_journal(conn, operation_id=outcome.operation_id, at=now,
                             kind="outcome_rejected", actor=outcome.dispatcher_id,
                             epoch=outcome.epoch, detail={"reason": reason, "outcome": detail,
                                                          "message_id": message_id})
        return Recorded("rejected", reason=reason)

    assert op is not None
    await conn.execute(
        attempts.update().where(attempts.c.id == outcome.attempt_id)
        .values(status=outcome.type, finished_at=now, http_status=outcome.http_status,
                provider_ref=outcome.provider_ref,
                response_digest=getattr(outcome, "response_digest", None), outcome=detail))
    await append_journal(conn, operation_id=outcome.operation_id, at=now, kind="outcome_recorded",
                         actor=outcome.dispatcher_id, epoch=outcome.epoch, from_state=op.state,
                         to_state=step.to.value, detail=detail)
    if decision is not None:
        await schedule_retry(conn, op=dict(op._mapping), decision=decision, now=now,
                             subjects=subjects, outbox_id=ambiguous_outbox_id)
    if step.to in (State.AMBIGUOUS, State.AWAITING_CONFIRMATION):
        current = {**dict(op._mapping), **values}
        early = await apply_stored_webhooks(conn, current, now=now, subjects=subjects,
                                            outbox_id=ambiguous_outbox_id,
                                            decide_retry=decide_retry)
        if early is not None:
            return early
        reason = getattr(outcome, "reason", "accepted asynchronously")
        await hand_to_reconciler(
            conn, op=current, attempt_id=outcome.attempt_id,
            cause="ambiguous" if step.to is State.AMBIGUOUS else "accepted", reason=reason,
            now=now, subjects=subjects, outbox_id=ambiguous_outbox_id)
    return Recorded("applied", to_state=step.to.value)


def _storable(text: str | None) -> str | None:
    # PostgreSQL text and jsonb cannot hold NUL, and poison messages often contain one: a dead
    # letter that cannot be stored would leave its message stuck in the stream for good.
    return None if text is None else text.replace("\x00", "\ufffd")


async def record_dead_letter_txn(conn: AsyncConnection, letter: DeadLetter, *,
                                 now: datetime) -> None:
    letter = letter.model_copy(update={
        f: _storable(getattr(letter, f))
        for f in ("consumer", "subject", "message_id", "error", "payload_excerpt")})
    await conn.execute(dead_letters.insert().values(
        at=now, consumer=letter.consumer, subject=letter.subject, message_id=letter.message_id,
        error=letter.error, payload_excerpt=letter.payload_excerpt, deliveries=letter.deliveries))
    await append_journal(conn, operation_id=None, at=now, kind="dead_lettered",
                         actor=letter.consumer, detail=letter.model_dump(mode="json",
                                                                         exclude={"payload_excerpt"}))

