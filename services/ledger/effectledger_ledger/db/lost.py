"""Repair of lost outcomes: a claimed attempt whose outcome message never arrived.

JetStream can lose acknowledged messages (power loss, corrupted files). The outbox sweeper
covers dispatch commands (unclaimed) and reconcile commands (unanswered); this covers the third
hop. A dispatcher acks its command once the outcome's publish is acknowledged, so if the stream
then loses the outcome nothing would ever be redelivered, and the operation would stay
`in_flight` forever. After `older_than_s` (far beyond any attempt's deadline) the ledger treats
the attempt as it treats a dispatcher lost mid-attempt: ambiguous, handed to reconciliation.
Never a retry: the provider may well have applied the effect.

A real outcome that still arrives later is judged like any late outcome: a success resolves the
ambiguity, anything else is rejected and journaled, and the reconciler decides.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.states import AttemptStatus, Event, JournalKind, State
from effectledger_core.subjects import Subjects

from .resolution import RetryDecider, WebhookBinding, settle_from_stored_webhooks
from .rows import OperationRow, Recorded
from .schema import attempts, operations
from .transitions import Change, Reconcile, apply

ATTEMPT_LOST = AttemptStatus.OUTCOME_LOST.value  # attempts.status once the ledger gave up


def _stuck_since(cutoff: datetime | sa.BindParameter[datetime]) -> sa.ColumnElement[bool]:
    """An operation in flight whose attempt at its epoch is still only claimed, since before
    `cutoff`: claimed, and no outcome ever recorded (the join is on the operation's epoch)."""
    return sa.and_(operations.c.state == State.IN_FLIGHT.value,
                   attempts.c.status == AttemptStatus.CLAIMED.value,
                   attempts.c.claimed_at < cutoff)


_ON_EPOCH = sa.and_(attempts.c.operation_id == operations.c.id,
                    attempts.c.epoch == operations.c.epoch)
# What `sweep_lost_outcomes_txn` selects, as one lockless question; built once.
_ANY_STUCK = (sa.select(sa.literal(1)).select_from(operations.join(attempts, _ON_EPOCH))
              .where(_stuck_since(sa.bindparam("cutoff", type_=attempts.c.claimed_at.type)))
              .limit(1))


async def any_lost_outcomes(conn: AsyncConnection, *, now: datetime,
                            older_than_s: float) -> bool:
    """Whether `sweep_lost_outcomes_txn` at `now` would find an attempt: the sweeper asks
    this first, so an idle sweep is one lockless read, not a locking transaction. An attempt
    that becomes old enough just after it waits for the next sweep, as one would that became
    old enough just after the transaction's own SELECT."""
    cutoff = now - timedelta(seconds=older_than_s)
    return (await conn.execute(_ANY_STUCK, {"cutoff": cutoff})).first() is not None


async def sweep_lost_outcomes_txn(conn: AsyncConnection, *, now: datetime, older_than_s: float,
                                  subjects: Subjects, new_id: Callable[[], str],
                                  decide_retry: RetryDecider | None = None,
                                  webhook_binding: WebhookBinding | None = None,
                                  limit: int = 100) -> int:
    cutoff = now - timedelta(seconds=older_than_s)
    stuck = (await conn.execute(
        sa.select(operations, attempts.c.id.label("attempt_id"),
                  attempts.c.claimed_at.label("attempt_claimed_at"))
        .join(attempts, _ON_EPOCH)
        .where(_stuck_since(cutoff))
        .limit(limit).with_for_update(of=operations, skip_locked=True))).mappings().all()
    repaired = 0
    for found in stuck:
        op = OperationRow.of(found)
        attempt_id: str = found["attempt_id"]
        waited = round((now - found["attempt_claimed_at"]).total_seconds(), 3)
        settle_id = new_id()

        async def settle(conn: AsyncConnection, row: OperationRow,
                         outbox_id: str = settle_id) -> Recorded | None:
            return await settle_from_stored_webhooks(
                conn, row, now=now, subjects=subjects, outbox_id=outbox_id,
                decide_retry=decide_retry, binding=webhook_binding)

        applied = await apply(conn, Change(
            operation_id=op.id, epoch=op.epoch, from_state=op.state,
            event=Event.OUTCOME_AMBIGUOUS, at=now, actor="ledger.sweeper",
            kind=JournalKind.OUTCOME_PRESUMED_LOST, row=op,
            detail={"attempt_id": attempt_id, "waited_s": waited,
                    "reason": "no outcome arrived for the claimed attempt"},
            reconcile=Reconcile(
                new_id(), subjects, attempt_id=attempt_id, cause="ambiguous",
                reason=f"outcome lost: none arrived {waited:.0f}s after the claim",
                settle=settle)))
        if applied is None:
            continue
        await conn.execute(attempts.update().where(attempts.c.id == attempt_id)
                           .values(status=ATTEMPT_LOST, finished_at=now))
        repaired += 1
    return repaired
