"""The claim: the durable start of an attempt, recorded before any provider call.

Claims are set-based: `ClaimCall.many` decides a whole group-committed batch from two reads (the
operations, locked in id order, and their attempts) and writes the grants with one statement per
table, so a batch of N claims costs a handful of statements rather than 6 N. A single claim is a
batch of one: there is one code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.commands import arguments_digest, mismatch
from effectledger_core.messages import ClaimAttempt, ClaimReply, ClaimStatus
from effectledger_core.states import AttemptStatus, Event, JournalKind, State, sources

from .calls import BatchCall
from .common import execute_rows, journal_row, lock_with_attempts
from .schema import attempts, operations
from .transitions import Batch, Change, Then, alone_statement, apply_alone

_CLAIMABLE = frozenset(s.value for s in sources(Event.CLAIM))
_CLAIMED = AttemptStatus.CLAIMED.value
# Built once (see common._LOCK_WITH_ATTEMPTS).
_INSERT_ATTEMPT = attempts.insert()


@dataclass
class _Held:
    attempt_id: str
    status: str
    claimed_at: datetime | None
    granted_here: dict[str, Any] | None = None  # the attempt row this batch is about to insert


@dataclass
class _OpState:
    state: str
    epoch: int
    tool: str
    arguments_digest: str


async def _claims(conn: AsyncConnection, items: Sequence[ClaimCall]) -> list[ClaimReply]:
    op_ids = sorted({c.claim.operation_id for c in items})
    ops, held = await lock_with_attempts(conn, op_ids)
    ops_state = {k: _OpState(v.state, v.epoch, v.tool, v.arguments_digest)
                 for k, v in ops.items()}
    claims_held: dict[tuple[str, int], _Held] = {
        k: _Held(a.id, a.status, a.claimed_at) for k, a in held.items()}

    replies: list[ClaimReply] = []
    grants: list[dict[str, Any]] = []
    batch = Batch()
    for item in items:
        claim, now = item.claim, item.now
        op = ops_state.get(claim.operation_id)
        if op is None:
            replies.append(ClaimReply(status=ClaimStatus.NOT_FOUND,
                                      operation_id=claim.operation_id, epoch=claim.epoch))
            continue
        state, epoch = op.state, op.epoch
        wrong = await _command_mismatch(conn, claim, op)
        if wrong is not None:
            # Before anything else, even a held claim: a command carrying another tool or other
            # arguments under this operation's id and epoch is forged or corrupt, and must
            # neither reach a provider nor declare the real attempt lost. Kept as evidence.
            batch.note(journal_row(
                operation_id=claim.operation_id, at=now, kind=JournalKind.CLAIM_REJECTED,
                actor=claim.dispatcher_id, epoch=claim.epoch, traceparent=item.traceparent,
                detail={"attempt_id": claim.attempt_id, "reason": "command_mismatch",
                        "detail": wrong, "state": state}))
            replies.append(ClaimReply(status=ClaimStatus.COMMAND_MISMATCH, reason=wrong,
                                      current_epoch=epoch, state=state,
                                      operation_id=claim.operation_id, epoch=claim.epoch))
            continue
        h = claims_held.get((claim.operation_id, claim.epoch))
        if h is not None:
            replies.append(await _held_reply(conn, h, item, op, batch))
            continue
        if epoch != claim.epoch or state not in _CLAIMABLE:
            batch.note(journal_row(
                operation_id=claim.operation_id, at=now, kind=JournalKind.CLAIM_REJECTED,
                actor=claim.dispatcher_id, epoch=claim.epoch, traceparent=item.traceparent,
                detail={"attempt_id": claim.attempt_id, "current_epoch": epoch, "state": state}))
            status = ClaimStatus.NOT_CLAIMABLE if epoch == claim.epoch else ClaimStatus.STALE_EPOCH
            replies.append(ClaimReply(status=status, current_epoch=epoch, state=state,
                                      operation_id=claim.operation_id, epoch=claim.epoch))
            continue
        row = dict(id=claim.attempt_id, operation_id=claim.operation_id, epoch=claim.epoch,
                   dispatcher_id=claim.dispatcher_id, status=_CLAIMED, claimed_at=now)
        step = batch.add(Change(
            operation_id=claim.operation_id, epoch=claim.epoch, from_state=State(state),
            event=Event.CLAIM, at=now, actor=claim.dispatcher_id,
            detail={"attempt_id": claim.attempt_id}, traceparent=item.traceparent))
        grants.append(row)
        claims_held[(claim.operation_id, claim.epoch)] = _Held(claim.attempt_id, _CLAIMED, now,
                                                               row)
        op.state = step.to.value
        replies.append(ClaimReply(status=ClaimStatus.GRANTED, attempt_id=claim.attempt_id,
                                  current_epoch=claim.epoch, state=step.to.value,
                                  operation_id=claim.operation_id, epoch=claim.epoch,
                                  tool=op.tool,
                                  arguments_digest=claim.arguments_digest or op.arguments_digest))

    # The state changes (and the dispatch commands they consume) and the journal, set-based.
    await batch.write(conn)
    # A unique violation here (a claim racing on another connection, which the lock above
    # rules out on PostgreSQL) aborts the batch; each claim is then retried on its own.
    await execute_rows(conn, _INSERT_ATTEMPT, grants)
    return replies


async def _command_mismatch(conn: AsyncConnection, claim: ClaimAttempt,
                            op: _OpState) -> str | None:
    wrong = mismatch(ledger_tool=op.tool, ledger_digest=op.arguments_digest,
                     tool=claim.tool or op.tool, digest_=claim.arguments_digest)
    if wrong is None or claim.tool != op.tool or claim.arguments_digest is None:
        return wrong
    # A retry's command is rendered from the stored arguments, and PostgreSQL's jsonb may
    # write a number differently (1e16 comes back as an integer), so its digest can differ
    # from the one taken at admission. The arguments as stored are the ledger's too.
    stored = (await conn.execute(sa.select(operations.c.arguments).where(
        operations.c.id == claim.operation_id))).scalar()
    return None if arguments_digest(stored) == claim.arguments_digest else wrong


async def _held_reply(conn: AsyncConnection, held: _Held, item: ClaimCall, op: _OpState,
                      batch: Batch) -> ClaimReply:
    claim, now = item.claim, item.now
    state, epoch = op.state, op.epoch
    base: dict[str, Any] = dict(operation_id=claim.operation_id, epoch=claim.epoch,
                                current_epoch=epoch, state=state, attempt_id=held.attempt_id)
    # The digest the claim was checked against (either form of the stored arguments).
    granted: dict[str, Any] = dict(base, tool=op.tool,
                                   arguments_digest=claim.arguments_digest or op.arguments_digest)
    if held.attempt_id == claim.attempt_id:
        # The same attempt asking again (its first reply was lost): still its claim while the
        # attempt is open. Its dispatcher may only now start sending, so the attempt starts
        # now: reconciliation counts the provider's processing horizon from claimed_at, and must
        # not count it from a grant whose reply was lost (found by the chaos harness).
        if held.granted_here is not None:
            held.granted_here["claimed_at"] = now
            return ClaimReply(status=ClaimStatus.GRANTED, **granted)
        if held.status == _CLAIMED:
            await conn.execute(
                attempts.update().where(attempts.c.id == held.attempt_id,
                                        attempts.c.status == _CLAIMED)
                .values(claimed_at=now))
            held.claimed_at = now
            return ClaimReply(status=ClaimStatus.GRANTED, **granted)
        # The attempt is over for the ledger (outcome recorded, presumed lost, superseded):
        # re-granting it would start a provider call for an epoch already being reconciled.
        batch.note(journal_row(
            operation_id=claim.operation_id, at=now, kind=JournalKind.CLAIM_REJECTED,
            actor=claim.dispatcher_id, epoch=claim.epoch, traceparent=item.traceparent,
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
                      outcome_recorded=held.status != _CLAIMED, claim_age_s=age, **base)


# ---- a claim alone: one statement -------------------------------------------------------------
#
# A claim alone in its transaction (one at a time: the agent's path) is granted by one guarded
# statement when the locked path would grant it (`transitions.alone_statement`). The guard is
# `_claims`' decision to grant, in SQL: the operation exists at the claim's epoch, in a
# claimable state (the table's own guard), for the claim's tool and arguments digest (a
# command that states both: `mismatch` finds nothing then), and no attempt holds its epoch.
# Anything else (a mismatch, a redelivered claim, a stale epoch, the arguments' other stored
# form) writes nothing and goes to the locked path, which decides and explains it. The
# statement locks the operation's row before it inserts the attempt, as every writer of an
# attempt does, and the unique (operation, epoch) key stands behind the NOT EXISTS.

def _attempt_from(moved: sa.CTE) -> Then:
    return [], (attempts.insert().from_select(
        ["id", "operation_id", "epoch", "dispatcher_id", "status", "claimed_at"],
        sa.select(sa.bindparam("a_id", type_=attempts.c.id.type), moved.c.id,
                  sa.bindparam("b_epoch", type_=attempts.c.epoch.type),
                  sa.bindparam("a_dispatcher", type_=attempts.c.dispatcher_id.type),
                  sa.literal_column(f"'{_CLAIMED}'"),
                  sa.bindparam("b_now", type_=attempts.c.claimed_at.type))
    ).returning(attempts.c.id))


_CLAIM_ALONE = alone_statement(Event.CLAIM, guard=[
    operations.c.tool == sa.bindparam("c_tool"),
    operations.c.arguments_digest == sa.bindparam("c_digest"),
    ~sa.exists().where(attempts.c.operation_id == operations.c.id,
                       attempts.c.epoch == operations.c.epoch),
], then=_attempt_from)


async def _claim_alone(conn: AsyncConnection, item: ClaimCall) -> ClaimReply | None:
    """The claim granted by one statement (see above); None: nothing written, decide under
    the lock."""
    claim = item.claim
    if claim.tool is None or claim.arguments_digest is None:
        return None
    change = Change(operation_id=claim.operation_id, epoch=claim.epoch, from_state=State.PENDING,
                    event=Event.CLAIM, at=item.now, actor=claim.dispatcher_id,
                    detail={"attempt_id": claim.attempt_id}, traceparent=item.traceparent)
    applied = await apply_alone(conn, change, _CLAIM_ALONE, {
        "c_tool": claim.tool, "c_digest": claim.arguments_digest,
        "a_id": claim.attempt_id, "a_dispatcher": claim.dispatcher_id})
    if applied is None:
        return None
    return ClaimReply(status=ClaimStatus.GRANTED, attempt_id=claim.attempt_id,
                      current_epoch=claim.epoch, state=applied[0].to.value,
                      operation_id=claim.operation_id, epoch=claim.epoch, tool=claim.tool,
                      arguments_digest=claim.arguments_digest)


@dataclass(frozen=True, slots=True)
class ClaimCall(BatchCall[ClaimReply]):
    """One claim, as group commit batches it."""

    urgent: ClassVar[bool] = True  # a dispatcher holds its command (and ack_wait) open for this

    claim: ClaimAttempt
    now: datetime
    traceparent: str | None = None  # the claim message's trace context, for the journal

    @classmethod
    async def many(cls, conn: AsyncConnection, calls: Sequence[ClaimCall]
                   ) -> list[ClaimReply | Exception]:
        return list(await _claims(conn, calls))

    async def alone(self, conn: AsyncConnection) -> ClaimReply | None:
        """Granted by one statement (see `_claim_alone`)."""
        return await _claim_alone(conn, self)


async def claim_txn(conn: AsyncConnection, claim: ClaimAttempt, *, now: datetime) -> ClaimReply:
    return await ClaimCall(claim, now).one(conn)
