"""The claim: the durable start of an attempt, recorded before any provider call.

Claims are set-based: `claim_many` decides a whole group-committed batch from two reads (the
operations, locked in id order, and their attempts) and writes the grants with one statement per
table, so a batch of N claims costs a handful of statements rather than 6 N. A single claim is a
batch of one: there is one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.messages import ClaimAttempt, ClaimReply, ClaimStatus
from effectledger_core.states import Event, State, sources

from .batch import Calls, batchable
from .common import execute_rows, insert_journal, journal_row, lock_with_attempts
from .schema import OUTBOX_CONSUMED, attempts, operations, outbox

_CLAIMABLE = frozenset(s.value for s in sources(Event.CLAIM))
# Built once (see common._LOCK_WITH_ATTEMPTS).
_GRANT = (operations.update()
          .where(operations.c.id == sa.bindparam("b_id"),
                 operations.c.epoch == sa.bindparam("b_epoch"),
                 operations.c.state == sa.bindparam("b_from"))
          .values(state=State.IN_FLIGHT.value, updated_at=sa.bindparam("b_now")))
_INSERT_ATTEMPT = attempts.insert()
_CONSUME_DISPATCH = (outbox.update()
                     .where(outbox.c.operation_id == sa.bindparam("b_id"),
                            outbox.c.epoch == sa.bindparam("b_epoch"),
                            outbox.c.kind == "dispatch")
                     .values(status=OUTBOX_CONSUMED))


@dataclass
class _Held:
    attempt_id: str
    status: str
    claimed_at: datetime | None
    granted_here: dict[str, Any] | None = None  # the attempt row this batch is about to insert


async def _claims(conn: AsyncConnection, items: list[tuple[ClaimAttempt, datetime]]
                  ) -> list[ClaimReply]:
    op_ids = sorted({c.operation_id for c, _ in items})
    ops, held = await lock_with_attempts(conn, op_ids)
    ops_state: dict[str, list[Any]] = {k: [v.state, v.epoch] for k, v in ops.items()}
    claims_held: dict[tuple[str, int], _Held] = {
        k: _Held(a.id, a.status, a.claimed_at) for k, a in held.items()}

    replies: list[ClaimReply] = []
    grants: list[dict[str, Any]] = []
    journal: list[dict[str, Any]] = []
    for claim, now in items:
        base = dict(operation_id=claim.operation_id, epoch=claim.epoch)
        op = ops_state.get(claim.operation_id)
        if op is None:
            replies.append(ClaimReply(status=ClaimStatus.NOT_FOUND, **base))
            continue
        state, epoch = op
        h = claims_held.get((claim.operation_id, claim.epoch))
        if h is not None:
            replies.append(await _held_reply(conn, h, claim, state, epoch, now, journal))
            continue
        if epoch != claim.epoch or state not in _CLAIMABLE:
            journal.append(journal_row(
                operation_id=claim.operation_id, at=now, kind="claim_rejected",
                actor=claim.dispatcher_id, epoch=claim.epoch,
                detail={"attempt_id": claim.attempt_id, "current_epoch": epoch, "state": state}))
            status = ClaimStatus.NOT_CLAIMABLE if epoch == claim.epoch else ClaimStatus.STALE_EPOCH
            replies.append(ClaimReply(status=status, current_epoch=epoch, state=state, **base))
            continue
        row = dict(id=claim.attempt_id, operation_id=claim.operation_id, epoch=claim.epoch,
                   dispatcher_id=claim.dispatcher_id, status="claimed", claimed_at=now)
        grants.append(dict(b_id=claim.operation_id, b_epoch=claim.epoch, b_from=state,
                           b_now=now, row=row))
        claims_held[(claim.operation_id, claim.epoch)] = _Held(claim.attempt_id, "claimed", now,
                                                               row)
        op[0] = State.IN_FLIGHT.value
        journal.append(journal_row(
            operation_id=claim.operation_id, at=now, kind="attempt_claimed",
            actor=claim.dispatcher_id, epoch=claim.epoch, from_state=state,
            to_state=State.IN_FLIGHT.value, detail={"attempt_id": claim.attempt_id}))
        replies.append(ClaimReply(status=ClaimStatus.GRANTED, attempt_id=claim.attempt_id,
                                  current_epoch=claim.epoch, state=State.IN_FLIGHT.value,
                                  **base))

    if grants:
        # The guard repeats the decision in SQL; under the row locks it cannot fail.
        await execute_rows(conn, _GRANT, [
            {k: g[k] for k in ("b_id", "b_epoch", "b_from", "b_now")} for g in grants])
        # A unique violation here (a claim racing on another connection, which the lock above
        # rules out on PostgreSQL) aborts the batch; each claim is then retried on its own.
        await execute_rows(conn, _INSERT_ATTEMPT, [g["row"] for g in grants])
        await execute_rows(conn, _CONSUME_DISPATCH, [
            {"b_id": g["b_id"], "b_epoch": g["b_epoch"]} for g in grants])
    await insert_journal(conn, journal)
    return replies


async def _held_reply(conn: AsyncConnection, held: _Held, claim: ClaimAttempt, state: str,
                      epoch: int, now: datetime, journal: list[dict[str, Any]]) -> ClaimReply:
    base = dict(operation_id=claim.operation_id, epoch=claim.epoch, current_epoch=epoch,
                state=state, attempt_id=held.attempt_id)
    if held.attempt_id == claim.attempt_id:
        # The same attempt asking again (its first reply was lost): still its claim while the
        # attempt is open. Its dispatcher may only now start sending, so the attempt starts
        # now: reconciliation counts the provider's processing horizon from claimed_at, and must
        # not count it from a grant whose reply was lost (found by the chaos harness).
        if held.granted_here is not None:
            held.granted_here["claimed_at"] = now
            return ClaimReply(status=ClaimStatus.GRANTED, **base)
        if held.status == "claimed":
            await conn.execute(
                attempts.update().where(attempts.c.id == held.attempt_id,
                                        attempts.c.status == "claimed")
                .values(claimed_at=now))
            held.claimed_at = now
            return ClaimReply(status=ClaimStatus.GRANTED, **base)
        # The attempt is over for the ledger (outcome recorded, presumed lost, superseded):
        # re-granting it would start a provider call for an epoch already being reconciled.
        journal.append(journal_row(
            operation_id=claim.operation_id, at=now, kind="claim_rejected",
            actor=claim.dispatcher_id, epoch=claim.epoch,
            detail={"attempt_id": claim.attempt_id, "reason": "attempt_closed",
                    "attempt_status": held.status, "state": state}))
        status = ClaimStatus.NOT_CLAIMABLE if epoch == claim.epoch else ClaimStatus.STALE_EPOCH
        return ClaimReply(status=status, current_epoch=epoch, state=state,
                          operation_id=claim.operation_id, epoch=claim.epoch)
    # The claim's age lets the asker tell a dispatcher that is still working (a duplicate
    # delivery arrived meanwhile) from one that died; ages are the ledger's own clock.
    age = (max(0.0, (now - held.claimed_at).total_seconds())
           if held.claimed_at is not None else None)
    return ClaimReply(status=ClaimStatus.ALREADY_CLAIMED,
                      outcome_recorded=held.status != "claimed", claim_age_s=age, **base)


async def claim_many(conn: AsyncConnection, calls: Calls) -> list[ClaimReply]:
    return await _claims(conn, [(args[0], kwargs["now"]) for args, kwargs in calls])


@batchable(claim_many)
async def claim_txn(conn: AsyncConnection, claim: ClaimAttempt, *, now: datetime) -> ClaimReply:
    return (await _claims(conn, [(claim, now)]))[0]
