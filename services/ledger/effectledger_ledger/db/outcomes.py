"""The outcome inbox: dedup by message id, guarded state change and journal, one transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
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

from .batch import Calls, batchable
from .common import (
    append_journal,
    execute_rows,
    insert_ignore,
    insert_journal,
    journal_row,
    lock_with_attempts,
)
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


async def record_outcomes_many(conn: AsyncConnection, calls: Calls) -> list[Recorded]:
    """A group-committed batch of outcomes: successes set-based, the rest one by one."""
    results: list[Recorded | None] = [None] * len(calls)
    fast = [i for i, (args, _) in enumerate(calls) if isinstance(args[0], AttemptSucceeded)]
    if fast:
        done = await _record_successes(conn, [
            (calls[i][0][0], calls[i][1]["consumer"], calls[i][1]["message_id"],
             calls[i][1]["now"]) for i in fast])
        for i, recorded in zip(fast, done, strict=True):
            results[i] = recorded
    for i, (args, kwargs) in enumerate(calls):
        if results[i] is None:
            results[i] = await _record_one(conn, *args, **kwargs)
    return [r for r in results if r is not None]


@batchable(record_outcomes_many)
async def record_outcome_txn(conn: AsyncConnection, outcome: Outcome, *, consumer: str,
                             message_id: str, subjects: Subjects, now: datetime,
                             ambiguous_outbox_id: str,
                             decide_retry: RetryDecider | None = None) -> Recorded:
    if isinstance(outcome, AttemptSucceeded):
        return (await _record_successes(conn, [(outcome, consumer, message_id, now)]))[0]
    return await _record_one(conn, outcome, consumer=consumer, message_id=message_id,
                             subjects=subjects, now=now, ambiguous_outbox_id=ambiguous_outbox_id,
                             decide_retry=decide_retry)


def _rejection(outcome: Outcome, op: Any, held: str | None, event: Event) -> str | None:
    if op is None:
        return "unknown_operation"
    if held != outcome.attempt_id:
        return "not_the_claimed_attempt"
    if op.epoch != outcome.epoch:
        return "stale_epoch"
    if State(op.state) not in sources(event):
        return f"state_{op.state}_does_not_accept_{event.value}"
    return None


# Built once (see common._LOCK_WITH_ATTEMPTS).
_SUCCEED = (operations.update()
            .where(operations.c.id == sa.bindparam("b_id"),
                   operations.c.epoch == sa.bindparam("b_epoch"),
                   operations.c.state == sa.bindparam("b_from"))
            .values(state=sa.bindparam("b_state"), updated_at=sa.bindparam("b_now"),
                    last_outcome=sa.bindparam("b_detail"), provider_ref=sa.bindparam("b_ref"),
                    response_digest=sa.bindparam("b_digest")))
_FINISH_ATTEMPT = (attempts.update().where(attempts.c.id == sa.bindparam("b_id"))
                   .values(status=sa.bindparam("b_status"), finished_at=sa.bindparam("b_now"),
                           http_status=sa.bindparam("b_http"), provider_ref=sa.bindparam("b_ref"),
                           response_digest=sa.bindparam("b_digest"),
                           outcome=sa.bindparam("b_detail")))


@dataclass
class _Op:
    state: str
    epoch: int


async def _record_successes(conn: AsyncConnection,
                            items: list[tuple[AttemptSucceeded, str, str, datetime]]
                            ) -> list[Recorded]:
    """Successes, the common outcome, in a handful of statements however many there are.

    The same decisions as `_record_one` (which the other outcome types take): deduplicate by
    message id, lock the operations (in id order), check attempt, epoch and state, then update
    operations and attempts and journal, each with one statement for the whole batch.
    """
    results: list[Recorded | None] = [None] * len(items)
    first: dict[tuple[str, str], int] = {}
    for i, (_, consumer, message_id, _now) in enumerate(items):
        if (consumer, message_id) in first:
            results[i] = Recorded("duplicate")
        else:
            first[(consumer, message_id)] = i
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    new = {(r.consumer, r.message_id) for r in await conn.execute(
        dialect.insert(inbox).values([
            dict(consumer=c, message_id=m, received_at=items[i][3])
            for (c, m), i in first.items()])
        .on_conflict_do_nothing().returning(inbox.c.consumer, inbox.c.message_id))}
    for key, i in first.items():
        if key not in new:
            results[i] = Recorded("duplicate")
    live = [i for i, r in enumerate(results) if r is None]
    if not live:
        return [r for r in results if r is not None]

    op_ids = sorted({items[i][0].operation_id for i in live})
    locked, attempts_by_epoch = await lock_with_attempts(conn, op_ids)
    ops = {k: _Op(r.state, r.epoch) for k, r in locked.items()}
    held = {k: a.id for k, a in attempts_by_epoch.items()}
    op_rows: list[dict[str, Any]] = []
    attempt_rows: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    for i in live:
        outcome, _, message_id, now = items[i]
        detail = outcome.model_dump(mode="json")
        op = ops.get(outcome.operation_id)
        reason = _rejection(outcome, op, held.get((outcome.operation_id, outcome.epoch)),
                            Event.OUTCOME_SUCCEEDED)
        if reason is not None:
            entries.append(journal_row(
                operation_id=outcome.operation_id, at=now, kind="outcome_rejected",
                actor=outcome.dispatcher_id, epoch=outcome.epoch,
                detail={"reason": reason, "outcome": detail, "message_id": message_id}))
            results[i] = Recorded("rejected", reason=reason)
            continue
        assert op is not None
        step = transition(State(op.state), Event.OUTCOME_SUCCEEDED)
        # A success ends the operation: no new epoch, no reconciliation (see _record_one).
        assert not step.new_epoch and step.to is State.SUCCEEDED, step
        op_rows.append(dict(b_id=outcome.operation_id, b_epoch=outcome.epoch, b_from=op.state,
                            b_state=step.to.value, b_now=now, b_detail=detail,
                            b_ref=outcome.provider_ref, b_digest=outcome.response_digest))
        attempt_rows.append(dict(b_id=outcome.attempt_id, b_status=outcome.type, b_now=now,
                                 b_http=outcome.http_status, b_ref=outcome.provider_ref,
                                 b_digest=outcome.response_digest, b_detail=detail))
        entries.append(journal_row(
            operation_id=outcome.operation_id, at=now, kind="outcome_recorded",
            actor=outcome.dispatcher_id, epoch=outcome.epoch, from_state=op.state,
            to_state=step.to.value, detail=detail))
        op.state = step.to.value
        results[i] = Recorded("applied", to_state=step.to.value)
    if op_rows:
        # The guard repeats the checks in SQL; under the row locks it cannot fail.
        await execute_rows(conn, _SUCCEED, op_rows)
        await execute_rows(conn, _FINISH_ATTEMPT, attempt_rows)
    await insert_journal(conn, entries)
    return [r for r in results if r is not None]


async def _record_one(conn: AsyncConnection, outcome: Outcome, *, consumer: str,
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
    reason = _rejection(outcome, op, held, event)
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

