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
        return await _held_reply(conn, held, claim, op, now)

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
            return await _held_reply(conn, held, claim, op, now)
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
        sa.select(attempts.c.id, attempts.c.status, attempts.c.claimed_at)
        .where(attempts.c.operation_id == claim.operation_id, attempts.c.epoch == claim.epoch)
    )).first()


async def _held_reply(conn: AsyncConnection, held: Any, claim: ClaimAttempt, op: Any,
                      now: datetime) -> ClaimReply:
    base = dict(operation_id=claim.operation_id, epoch=claim.epoch, current_epoch=op[1],
                state=op[0], attempt_id=held[0])
    if held[0] == claim.attempt_id:
        # The same attempt asking again (its first reply was lost): still its claim while the
        # attempt is open. Its dispatcher may only now start sending, so the attempt starts
        # now: reconciliation counts the provider's processing horizon from claimed_at, and must
        # not count it from a grant whose reply was lost (found by the chaos harness). Guarded
        # on the attempt row, which every outcome (and the lost-outcome sweep) updates in the
        # transaction that moves the operation on.
        regranted = await conn.execute(
            attempts.update().where(attempts.c.id == held[0], attempts.c.status == "claimed")
            .values(claimed_at=now))
        if regranted.rowcount == 1:
            return ClaimReply(status=ClaimStatus.GRANTED, **base)
        # The attempt is over for the ledger (outcome recorded, presumed lost, superseded):
        # re-granting it would start a provider call for an epoch already being reconciled.
        await append_journal(conn, operation_id=claim.operation_id, at=now,
                             kind="claim_rejected", actor=claim.dispatcher_id, epoch=claim.epoch,
                             detail={"attempt_id": claim.attempt_id, "reason": "attempt_closed",
                                     "attempt_status": held[1], "state": op[0]})
        status = (ClaimStatus.NOT_CLAIMABLE if op[1] == claim.epoch
                  else ClaimStatus.STALE_EPOCH)
        return ClaimReply(status=status, current_epoch=op[1], state=op[0],
                          operation_id=claim.operation_id, epoch=claim.epoch)
    # The claim's age lets the asker tell a dispatcher that is still working (a duplicate
    # delivery arrived meanwhile) from one that died; ages are the ledger's own clock.
    age = max(0.0, (now - held[2]).total_seconds()) if held[2] is not None else None
    return ClaimReply(status=ClaimStatus.ALREADY_CLAIMED, outcome_recorded=held[1] != "claimed",
                      claim_age_s=age, **base)
