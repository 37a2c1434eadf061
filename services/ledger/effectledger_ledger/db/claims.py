"""The claim: the durable start of an attempt, recorded before any provider call."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.messages import ClaimAttempt, ClaimReply, ClaimStatus
from effectledger_core.states import Event, sources

from .common import append_journal
from .schema import OUTBOX_CONSUMED, attempts, operations, outbox


async def claim_txn(conn: AsyncConnection, claim: ClaimAttempt, *, now: datetime) -> ClaimReply:
    op = (await conn.execute(
        sa.select(operations.c.state, operations.c.epoch)
        .where(operations.c.id == claim.operation_id))).first()
    base = dict(operation_id=claim.operation_id, epoch=claim.epoch)
    if op is None:
        return ClaimReply(status=ClaimStatus.NOT_FOUND, **base)

    held = await _held(conn, claim)
    if held is not None:
        return _held_reply(held, claim, op)

    updated = await conn.execute(
        operations.update()
        .where(operations.c.id == claim.operation_id, operations.c.epoch == claim.epoch,
               operations.c.state.in_([s.value for s in sources(Event.CLAIM)]))
        .values(state="in_flight", updated_at=now))
    if updated.rowcount != 1:
        # On PostgreSQL a concurrent claim may have committed while we waited for the row
        # lock; this statement sees it, so the answer is "already claimed", not "stale".
        held = await _held(conn, claim)
        if held is not None:
            return _held_reply(held, claim, op)
        await append_journal(conn, operation_id=claim.operation_id, at=now,
                             kind="claim_rejected", actor=claim.dispatcher_id, epoch=claim.epoch,
                             detail={"attempt_id": claim.attempt_id, "current_epoch": op.epoch,
                                     "state": op.state})
        status = (ClaimStatus.NOT_CLAIMABLE if op.epoch == claim.epoch
                  else ClaimStatus.STALE_EPOCH)
        return ClaimReply(status=status, current_epoch=op.epoch, state=op.state, **base)
    # A unique violation here (a racing claim on SQLite) aborts the transaction; the caller
    # retries it and then takes the "already claimed" branch above.
    await conn.execute(attempts.insert().values(
        id=claim.attempt_id, operation_id=claim.operation_id, epoch=claim.epoch,
        dispatcher_id=claim.dispatcher_id, status="claimed", claimed_at=now))
    await conn.execute(
        outbox.update()
        .where(outbox.c.operation_id == claim.operation_id, outbox.c.epoch == claim.epoch,
               outbox.c.kind == "dispatch")
        .values(status=OUTBOX_CONSUMED))
    await append_journal(conn, operation_id=claim.operation_id, at=now, kind="attempt_claimed",
                         actor=claim.dispatcher_id, epoch=claim.epoch, from_state=op.state,
                         to_state="in_flight", detail={"attempt_id": claim.attempt_id})
    return ClaimReply(status=ClaimStatus.GRANTED, attempt_id=claim.attempt_id,
                      current_epoch=claim.epoch, state="in_flight", **base)


async def _held(conn: AsyncConnection, claim: ClaimAttempt) -> Any | None:
    return (await conn.execute(
        sa.select(attempts.c.id, attempts.c.status)
        .where(attempts.c.operation_id == claim.operation_id, attempts.c.epoch == claim.epoch)
    )).first()


def _held_reply(held: Any, claim: ClaimAttempt, op: Any
                ) -> ClaimReply:
    base = dict(operation_id=claim.operation_id, epoch=claim.epoch, current_epoch=op[1],
                state=op[0], attempt_id=held[0])
    if held[0] == claim.attempt_id:
        # The same attempt asking again (its first reply was lost): still its claim.
        return ClaimReply(status=ClaimStatus.GRANTED, **base)
    return ClaimReply(status=ClaimStatus.ALREADY_CLAIMED, outcome_recorded=held[1] != "claimed",
                      **base)
