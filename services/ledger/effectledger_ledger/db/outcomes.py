"""The outcome inbox: dedup by message id, guarded state change and journal, one transaction.

Outcomes are set-based like claims: a group-committed batch of outcomes is deduplicated with
one INSERT, its operations locked (in id order) with their attempts in one statement (on
PostgreSQL the INSERT and the locking read are one statement together), and
decided in order against the state the earlier outcomes of the batch left. Changes that only
touch the operation (a success, a failure without retry) are written together through a
`transitions.Batch`; the rarer ones that write commands (ambiguous, accepted, retry) go through
`transitions.apply` one by one. A single outcome is a batch of one: there is one code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.failures import Failure, Idempotency, policy_digest
from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    DeadLetter,
    Outcome,
    OutcomeAmbiguous,
)
from effectledger_core.retry_policy import RetryDecision
from effectledger_core.states import Event, JournalKind, State, sources
from effectledger_core.subjects import Subjects

from . import hot
from .calls import BatchCall
from .common import (
    LOCKED_TABLES,
    Locked,
    LockedOp,
    append_journal,
    execute_rows,
    journal_row,
    lock_with_attempts,
    lock_with_attempts_stmt,
    locked_rows,
)
from .reads import ATTEMPT_PREFIX
from .resolution import RetryDecider, WebhookBinding, settle_from_stored_webhooks
from .rows import JournalRow, OperationRow, Recorded
from .schema import UTCDateTime, attempts, dead_letters, inbox, operations
from .transitions import (
    Batch,
    Change,
    Dispatch,
    Reconcile,
    Then,
    alone_statement,
    apply,
    apply_alone,
    writes_commands,
)

_RESULT = {"result"}
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


@dataclass(frozen=True, slots=True)
class OutcomeCall(BatchCall[Recorded]):
    """One outcome message, as group commit batches it."""

    outcome: Outcome
    consumer: str
    message_id: str
    subjects: Subjects
    now: datetime
    ambiguous_outbox_id: str  # the id of the command it may cause (reconcile, or a retry)
    decide_retry: RetryDecider | None = None
    webhook_binding: WebhookBinding | None = None  # which stored webhooks may settle it
    traceparent: str | None = None  # the outcome message's trace context, for the journal

    @classmethod
    async def many(cls, conn: AsyncConnection, calls: Sequence[OutcomeCall]
                   ) -> Sequence[Recorded | Exception]:
        return await _record(conn, calls)

    async def alone(self, conn: AsyncConnection) -> Recorded | None:
        """A success applied by one statement (see `_success_alone`)."""
        return await _success_alone(conn, self)


async def record_outcome_txn(conn: AsyncConnection, outcome: Outcome, *, consumer: str,
                             message_id: str, subjects: Subjects, now: datetime,
                             ambiguous_outbox_id: str,
                             decide_retry: RetryDecider | None = None) -> Recorded:
    return await OutcomeCall(outcome, consumer, message_id, subjects, now, ambiguous_outbox_id,
                             decide_retry).one(conn)


def _rejection(outcome: Outcome, op: _Op | None, held: tuple[str, str | None] | None,
               event: Event) -> str | None:
    if op is None:
        return "unknown_operation"
    if held is None or held[0] != outcome.attempt_id:
        return "not_the_claimed_attempt"
    if held[1] != outcome.dispatcher_id and not isinstance(outcome, OutcomeAmbiguous):
        # Only the claim's holder may say what its call did. Any dispatcher may say that the
        # holder was lost mid-attempt (ambiguous): that sends the operation to reconciliation,
        # which decides on evidence, so it cannot make anything succeed or fail.
        return "not_the_claim_holder"
    if op.epoch != outcome.epoch:
        return "stale_epoch"
    if State(op.state) not in sources(event):
        return f"state_{op.state}_does_not_accept_{event.value}"
    return None


# Built once (see common._LOCK_WITH_ATTEMPTS).
_FINISH_ATTEMPT = (attempts.update().where(attempts.c.id == sa.bindparam("b_id"))
                   .values(status=sa.bindparam("b_status"), finished_at=sa.bindparam("b_now"),
                           http_status=sa.bindparam("b_http"), provider_ref=sa.bindparam("b_ref"),
                           response_digest=sa.bindparam("b_digest"),
                           outcome=sa.bindparam("b_detail")))
# One statement whatever the batch's size, executed with a list of rows: a multi-row VALUES
# built per batch was compiled again for every batch (it has no cache key).
_INBOX_INSERT = (sqlite.insert(inbox).on_conflict_do_nothing()
                 .returning(inbox.c.consumer, inbox.c.message_id))
# On PostgreSQL the batch's rows go as three arrays (one statement text for any count, see hot).
_INBOX_ROWS = sa.func.unnest(
    sa.bindparam("consumers", type_=postgresql.ARRAY(sa.String)),
    sa.bindparam("message_ids", type_=postgresql.ARRAY(sa.String)),
    sa.bindparam("received", type_=postgresql.ARRAY(UTCDateTime)),
).table_valued("consumer", "message_id", "received_at").render_derived()
_INBOX_INSERT_PG = (postgresql.insert(inbox)
                    .from_select(["consumer", "message_id", "received_at"],
                                 sa.select(_INBOX_ROWS))
                    .on_conflict_do_nothing()
                    .returning(inbox.c.consumer, inbox.c.message_id))
# PostgreSQL: the inbox INSERT and the locking read in one statement (one round trip fewer per
# outcome transaction). The INSERT is a data-modifying CTE whose new keys come back in every row;
# the locking read is a LATERAL subquery on the nullable side of a join with one row, so that
# row comes back (with no operation) even when the batch names no known operation.
_INSERTED = _INBOX_INSERT_PG.cte("inserted")
_LOCKED = lock_with_attempts_stmt(hot.one_of(operations.c.id, "ids", "postgresql")
                                  ).subquery("locked").lateral()
_ONE = sa.select(sa.literal_column("1").label("one")).subquery("one")
_INBOX_THEN_LOCK = sa.select(
    sa.select(sa.func.array_agg(postgresql.array([_INSERTED.c.consumer,
                                                  _INSERTED.c.message_id])))
    .scalar_subquery().label("inserted"),
    *_LOCKED.c,
).select_from(_ONE.outerjoin(_LOCKED, sa.true()))
_FULL_ROWS = {d: sa.select(operations).where(hot.one_of(operations.c.id, "ids", d))
              for d in hot.DIALECTS}


# ---- a success alone: one statement ------------------------------------------------------------
#
# An outcome alone in its transaction (the agent's path) was four round trips: BEGIN, the inbox
# INSERT with the locking read, the fused writes, COMMIT. A success that the locked path would
# apply is one statement (`transitions.alone_statement`) whose guard is `_rejection` finding
# nothing, in SQL: the operation at the outcome's epoch, in a state that accepts a success
# (the table's own guard), its attempt at that epoch the outcome's, held by the outcome's
# sender; and the message not in the inbox yet. The inbox row is written from the moved
# operation, without ON CONFLICT: a copy of the message recorded meanwhile fails the whole
# statement on the inbox's key, and leaves nothing behind. Anything else (a duplicate, a
# rejection, a failure, which asks the retry policy, and ambiguity, which writes commands)
# writes nothing and is decided under the lock as before.

def _success_writes(moved: sa.CTE) -> Then:
    """The attempt closed and the inbox row, from the moved operation; the statement returns
    the operation's view as it leaves it (rows for `reads.view_of`), so a waiter it wakes
    needs no read: the closed attempt as written, the others as they were."""
    moved_exists = sa.select(moved.c.id).exists()
    finished = (attempts.update()
                .where(attempts.c.id == sa.bindparam("f_attempt"), moved_exists)
                .values(status=sa.bindparam("f_status"), finished_at=sa.bindparam("b_now"),
                        http_status=sa.bindparam("f_http"),
                        provider_ref=sa.bindparam("b_provider_ref"),
                        response_digest=sa.bindparam("b_response_digest"),
                        outcome=sa.bindparam("b_last_outcome"))
                .returning(*attempts.c).cte("finished"))
    noted = inbox.insert().from_select(
        ["consumer", "message_id", "received_at"],
        sa.select(sa.bindparam("i_consumer", type_=inbox.c.consumer.type),
                  sa.bindparam("i_message", type_=inbox.c.message_id.type),
                  sa.bindparam("b_now", type_=inbox.c.received_at.type)).where(moved_exists)
    ).cte("noted")
    others = sa.select(*attempts.c).where(attempts.c.operation_id == sa.bindparam("b_id"),
                                          attempts.c.id != sa.bindparam("f_attempt"))
    every = sa.union_all(sa.select(*finished.c), others).subquery("every")
    view = (sa.select(*(moved.c[c.name].label(c.name) for c in operations.c),
                      *(every.c[c.name].label(ATTEMPT_PREFIX + c.name) for c in attempts.c))
            .select_from(moved.outerjoin(every, sa.true()))
            .order_by(every.c.epoch))
    return [finished, noted], view


_SUCCESS_COLUMNS = ("last_outcome", "provider_ref", "response_digest", "result")
_SUCCESS_ALONE = alone_statement(Event.OUTCOME_SUCCEEDED, columns=_SUCCESS_COLUMNS, guard=[
    sa.exists().where(attempts.c.operation_id == operations.c.id,
                      attempts.c.epoch == operations.c.epoch,
                      attempts.c.id == sa.bindparam("f_attempt"),
                      attempts.c.dispatcher_id == sa.bindparam("f_dispatcher")),
    ~sa.exists().where(inbox.c.consumer == sa.bindparam("i_consumer"),
                       inbox.c.message_id == sa.bindparam("i_message")),
], then=_success_writes)


async def _success_alone(conn: AsyncConnection, it: OutcomeCall) -> Recorded | None:
    """The success applied by one statement (see above); None: nothing written, decide
    under the lock."""
    outcome = it.outcome
    if not isinstance(outcome, AttemptSucceeded):
        return None
    detail = outcome.model_dump(mode="json", exclude=_RESULT)
    change = Change(operation_id=outcome.operation_id, epoch=outcome.epoch,
                    from_state=State.IN_FLIGHT, event=Event.OUTCOME_SUCCEEDED, at=it.now,
                    actor=outcome.dispatcher_id, detail=detail,
                    values=_values(outcome, detail), traceparent=it.traceparent)
    applied = await apply_alone(conn, change, _SUCCESS_ALONE, {
        "f_attempt": outcome.attempt_id, "f_dispatcher": outcome.dispatcher_id,
        "f_status": outcome.type, "f_http": outcome.http_status,
        "i_consumer": it.consumer, "i_message": it.message_id})
    if applied is None:
        return None
    step, rows = applied
    return Recorded("applied", to_state=step.to.value, view_rows=rows)


@dataclass
class _Op:
    state: str
    epoch: int


def _firsts(items: Sequence[OutcomeCall]
            ) -> tuple[list[Recorded | None], dict[tuple[str, str], int]]:
    """Each message's first occurrence in the batch; a repeat is a duplicate already."""
    results: list[Recorded | None] = [None] * len(items)
    first: dict[tuple[str, str], int] = {}
    for i, it in enumerate(items):
        if (it.consumer, it.message_id) in first:
            results[i] = Recorded("duplicate")
        else:
            first[(it.consumer, it.message_id)] = i
    return results, first


def _inbox_rows(items: Sequence[OutcomeCall], first: dict[tuple[str, str], int]
                ) -> dict[str, Any]:
    return {"consumers": [c for c, _m in first], "message_ids": [m for _c, m in first],
            "received": [items[i].now for i in first.values()]}


def _mark_duplicates(results: list[Recorded | None], first: dict[tuple[str, str], int],
                     new: set[tuple[str, str]]) -> None:
    for key, i in first.items():
        if key not in new:
            results[i] = Recorded("duplicate")


async def _dedup_and_lock(conn: AsyncConnection, items: Sequence[OutcomeCall]
                          ) -> tuple[list[Recorded | None], Locked]:
    """Duplicates (in the inbox already, or earlier in this batch) get their result; the
    operations of the others are locked with their attempts (`lock_with_attempts`).

    On PostgreSQL both are one statement, which locks a duplicate's operation too (a duplicate
    in the inbox is rare: a redelivery; locking its operation as well changes nothing but who
    waits). On SQLite they are two, and only new messages' operations are read.
    """
    results, first = _firsts(items)
    if conn.dialect.name == "postgresql":
        params = _inbox_rows(items, first)
        params["ids"] = sorted({items[i].outcome.operation_id for i in first.values()})
        # Reads the inbox (its INSERT ... ON CONFLICT) and the operations it locks.
        rows = await hot.fetch(conn, _INBOX_THEN_LOCK, params, reads=hot.Reads(
            LOCKED_TABLES | {"inbox"}, frozenset(params["ids"])))
        _mark_duplicates(results, first,
                         {(c, m) for c, m in (rows[0]["inserted"] or ())} if rows else set())
        return results, locked_rows(rows)
    inbox_rows = [dict(consumer=c, message_id=m, received_at=items[i].now)
                  for (c, m), i in first.items()]
    inserted = (await conn.execute(
        _INBOX_INSERT, inbox_rows[0] if len(inbox_rows) == 1 else inbox_rows)).mappings().all()
    _mark_duplicates(results, first, {(r["consumer"], r["message_id"]) for r in inserted})
    op_ids = sorted({items[i].outcome.operation_id for i, r in enumerate(results) if r is None})
    return results, (await lock_with_attempts(conn, op_ids) if op_ids else ({}, {}))


class _Decider:
    """The batch's decisions, in order, on the state the earlier ones left."""

    def __init__(self, conn: AsyncConnection, locked: dict[str, LockedOp],
                 rows: dict[str, OperationRow],
                 held: dict[tuple[str, int], tuple[str, str | None]]) -> None:
        self.conn = conn
        self.ops = {k: _Op(r.state, r.epoch) for k, r in locked.items()}
        self.rows, self.held = rows, held
        self.batch = Batch()
        self.finish: list[dict[str, Any]] = []  # attempts to close, with the batch

    async def flush(self) -> None:
        await self.batch.write(self.conn)
        await execute_rows(self.conn, _FINISH_ATTEMPT, self.finish, row_key=("b_id",))
        self.finish = []

    async def decide(self, it: OutcomeCall) -> Recorded:
        outcome, now = it.outcome, it.now
        event = _EVENT[type(outcome)]
        # The provider's answer is stored once, in `operations.result`, not again in the
        # journal, the attempt and `last_outcome` (up to 128 KiB each time).
        detail = outcome.model_dump(mode="json", exclude=_RESULT)
        op = self.ops.get(outcome.operation_id)
        reason = _rejection(outcome, op, self.held.get((outcome.operation_id, outcome.epoch)),
                            event)
        decision: RetryDecision | None = None
        if reason is None and isinstance(outcome, AttemptFailed) and it.decide_retry is not None:
            # The ledger decides about retries, never the dispatcher on its own.
            decision = it.decide_retry(self.rows[outcome.operation_id], failure_of(outcome))
            if decision.retry:
                event = Event.OUTCOME_RETRY
        if reason is not None:
            self._reject(it, reason, detail)
            return Recorded("rejected", reason=reason)
        assert op is not None
        values = _values(outcome, detail)
        change = Change(operation_id=outcome.operation_id, epoch=outcome.epoch,
                        from_state=State(op.state), event=event, at=now,
                        actor=outcome.dispatcher_id, detail=detail, values=values,
                        row=self.rows.get(outcome.operation_id), traceparent=it.traceparent)
        finish = dict(b_id=outcome.attempt_id, b_status=outcome.type, b_now=now,
                      b_http=outcome.http_status, b_ref=outcome.provider_ref,
                      b_digest=getattr(outcome, "response_digest", None), b_detail=detail)
        if not writes_commands(event):
            step = self.batch.add(change)
            self.finish.append(finish)
            op.state = step.to.value
            if decision is not None:
                self.batch.note(_retry_entry(change, decision))
            return Recorded("applied", to_state=step.to.value)
        return await self._apply(it, change, finish, decision, op)

    async def _apply(self, it: OutcomeCall, change: Change, finish: dict[str, Any],
                     decision: RetryDecision | None, op: _Op) -> Recorded:
        # Written now, after what the batch decided before it, so the journal keeps its order.
        await self.flush()
        outcome, now = it.outcome, it.now
        if decision is not None:
            change = _with(change, dispatch=Dispatch(
                it.ambiguous_outbox_id, it.subjects,
                available_at=now + timedelta(seconds=decision.delay_s)))
        else:
            decide, binding = it.decide_retry, it.webhook_binding

            async def settle(conn: AsyncConnection, row: OperationRow) -> Recorded | None:
                return await settle_from_stored_webhooks(
                    conn, row, now=now, subjects=it.subjects, outbox_id=it.ambiguous_outbox_id,
                    decide_retry=decide, binding=binding, traceparent=it.traceparent)

            accepted = change.event is Event.OUTCOME_ACCEPTED
            change = _with(change, reconcile=Reconcile(
                it.ambiguous_outbox_id, it.subjects, attempt_id=outcome.attempt_id,
                cause="accepted" if accepted else "ambiguous",
                reason=str(getattr(outcome, "reason", "accepted asynchronously")),
                settle=settle))
        applied = await apply(self.conn, change)
        if applied is None:  # the guard repeats every check, so a concurrent writer cannot slip
            self._reject(it, "concurrent_change", change.detail)
            return Recorded("rejected", reason="concurrent_change")
        await execute_rows(self.conn, _FINISH_ATTEMPT, [finish])
        if decision is not None:
            self.batch.note(_retry_entry(change, decision))
        assert applied.row is not None
        row = applied.row
        if applied.settled is not None:
            # Stored evidence moved it on at once: read where it stands for later outcomes.
            [fresh] = await hot.fetch(self.conn, _FULL_ROWS[self.conn.dialect.name],
                                      {"ids": [row.id]})
            row = OperationRow.of(fresh)
        self.rows[row.id] = row
        op.state, op.epoch = row.state.value, row.epoch
        return applied.settled or Recorded("applied", to_state=applied.step.to.value)

    def _reject(self, it: OutcomeCall, reason: str, detail: dict[str, Any]) -> None:
        self.batch.note(journal_row(
            operation_id=it.outcome.operation_id, at=it.now, kind=JournalKind.OUTCOME_REJECTED,
            actor=it.outcome.dispatcher_id, epoch=it.outcome.epoch, traceparent=it.traceparent,
            detail={"reason": reason, "outcome": detail, "message_id": it.message_id}))


def _values(outcome: Outcome, detail: dict[str, Any]) -> dict[str, Any]:
    """The columns an applied outcome writes beside the state (`detail`: the outcome as
    journaled, without the provider's answer)."""
    values: dict[str, Any] = {"last_outcome": detail}
    if isinstance(outcome, AttemptSucceeded | AttemptAccepted):
        values.update(provider_ref=outcome.provider_ref, response_digest=outcome.response_digest)
    if isinstance(outcome, AttemptSucceeded):
        # Always the column, so every success shares one statement in the batch.
        values["result"] = (outcome.result.model_dump(mode="json")
                            if outcome.result is not None else None)
    return values


def _with(change: Change, **kw: Any) -> Change:
    return change._replace(**kw)


def _retry_entry(change: Change, decision: RetryDecision) -> JournalRow:
    """The retry policy's decision, journaled after the outcome it is about."""
    detail: dict[str, Any] = {"reason": decision.reason, "delay_s": round(decision.delay_s, 3),
                              "policy_digest": policy_digest()}
    if not decision.retry:
        return journal_row(operation_id=change.operation_id, at=change.at,
                           kind=JournalKind.RETRY_DECLINED, actor="ledger.retry_policy",
                           epoch=change.epoch, detail=detail, traceparent=change.traceparent)
    assert change.row is not None and change.dispatch is not None
    due = change.dispatch.available_at or change.at
    return journal_row(operation_id=change.operation_id, at=change.at,
                       kind=JournalKind.RETRY_SCHEDULED, actor="ledger.retry_policy",
                       epoch=change.epoch + 1, traceparent=change.traceparent,
                       detail={**detail, "due_at": due.isoformat(),
                               "operation_key": change.row.operation_key})


async def _record(conn: AsyncConnection, items: Sequence[OutcomeCall]
                  ) -> list[Recorded | Exception]:
    results, (locked, attempts_by_epoch) = await _dedup_and_lock(conn, items)
    live = [i for i, r in enumerate(results) if r is None]
    if live:
        # Whole rows only where a decision needs them (retry policy, commands): the common
        # outcome, a success, does without.
        wanted = sorted({items[i].outcome.operation_id for i in live
                         if not isinstance(items[i].outcome, AttemptSucceeded)} & set(locked))
        rows = {} if not wanted else {
            r["id"]: OperationRow.of(r)
            for r in await hot.fetch(conn, _FULL_ROWS[conn.dialect.name], {"ids": wanted})}
        held = {k: (a.id, a.dispatcher_id) for k, a in attempts_by_epoch.items()}
        decider = _Decider(conn, locked, rows, held)
        for i in live:
            results[i] = await decider.decide(items[i])
        await decider.flush()
    return [r for r in results if r is not None]


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
    await append_journal(conn, operation_id=None, at=now, kind=JournalKind.DEAD_LETTERED,
                         actor=letter.consumer, detail=letter.model_dump(mode="json",
                                                                         exclude={"payload_excerpt"}))

