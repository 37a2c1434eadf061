"""Repair of lost outcomes: a claimed attempt whose outcome message never arrived.

JetStream can lose acknowledged messages (DESIGN.md section 2, rule 1). The outbox sweeper
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

from effectledger_core.states import Event, State, transition
from effectledger_core.subjects import Subjects

from .common import append_journal
from .resolution import RetryDecider, apply_stored_webhooks, hand_to_reconciler
from .schema import attempts, operations

ATTEMPT_LOST = "outcome_lost"  # attempts.status once the ledger gave up waiting for it


async def sweep_lost_outcomes_txn(conn: AsyncConnection, *, now: datetime, older_than_s: float,
                                  subjects: Subjects, new_id: Callable[[], str],
                                  decide_retry: RetryDecider | None = None,
                                  limit: int = 100) -> int:
    cutoff = now - timedelta(seconds=older_than_s)
    stuck = (await conn.execute(
        sa.select(operations.c.id, operations.c.epoch, attempts.c.id.label("attempt_id"),
                  attempts.c.claimed_at)
        .join(attempts, sa.and_(attempts.c.operation_id == operations.c.id,
                                attempts.c.epoch == operations.c.epoch))
        .where(operations.c.state == State.IN_FLIGHT.value, attempts.c.status == "claimed",
               attempts.c.claimed_at < cutoff)
        .limit(limit).with_for_update(of=operations, skip_locked=True))).all()
    repaired = 0
    step = transition(State.IN_FLIGHT, Event.OUTCOME_AMBIGUOUS)
    for row in stuck:
        updated = await conn.execute(
            operations.update()
            .where(operations.c.id == row.id, operations.c.epoch == row.epoch,
                   operations.c.state == State.IN_FLIGHT.value)
            .values(state=step.to.value, updated_at=now))
        if updated.rowcount != 1:
            continue
        await conn.execute(attempts.update().where(attempts.c.id == row.attempt_id)
                           .values(status=ATTEMPT_LOST, finished_at=now))
        waited = round((now - row.claimed_at).total_seconds(), 3)
        await append_journal(conn, operation_id=row.id, at=now, kind="outcome_presumed_lost",
                             actor="ledger.sweeper", epoch=row.epoch,
                             from_state=State.IN_FLIGHT.value, to_state=step.to.value,
                             detail={"attempt_id": row.attempt_id, "waited_s": waited,
                                     "reason": "no outcome arrived for the claimed attempt"})
        op = dict((await conn.execute(sa.select(operations).where(
            operations.c.id == row.id))).mappings().one())
        early = await apply_stored_webhooks(conn, op, now=now, subjects=subjects,
                                            outbox_id=new_id(), decide_retry=decide_retry)
        if early is None:
            await hand_to_reconciler(
                conn, op=op, attempt_id=row.attempt_id, cause="ambiguous",
                reason=f"outcome lost: none arrived {waited:.0f}s after the claim", now=now,
                subjects=subjects, outbox_id=new_id())
        repaired += 1
    return repaired
