"""The outbox: the commands transitions write, and the relay's and sweeper's queries.

`dispatch_row` builds the row carrying a DispatchAttempt; intents and the transition applier
both write it, so it lives here, below both.

Rows are claimed by status with a short lease, never by "last seen id": ids are allocated at
insert but become visible at commit, so a row with a smaller id can appear later. The lease is
committed before publishing, so no row lock is held across the network; a relay that dies
mid-publish simply lets its lease run out and another relay republishes (same Nats-Msg-Id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_bus import catalogue
from effectledger_core.messages import DispatchAttempt, encode
from effectledger_core.states import UNRESOLVED, JournalKind, OutboxKind, State
from effectledger_core.subjects import Subjects

from .calls import BatchCall
from .common import append_journal, on_the_row
from .rows import OperationRow
from .schema import (
    OUTBOX_CONSUMED,
    OUTBOX_OBSOLETE,
    OUTBOX_PENDING,
    OUTBOX_PUBLISHED,
    OUTBOX_PUBLISHING,
    operations,
    outbox,
)


@dataclass(frozen=True)
class OutboxItem:
    id: str
    subject: str
    payload: bytes
    publish_count: int
    kind: str
    traceparent: str | None = None

    @property
    def message_id(self) -> str:
        # Each publish generation gets its own Nats-Msg-Id: a relay retry of the same
        # generation is deduplicated by JetStream, while a sweeper republish after message loss
        # must not be swallowed by the duplicate window. Consumers dedup by claim/inbox anyway.
        return catalogue.dispatch_id(self.id, self.publish_count)


def dispatch_row(op: OperationRow, *, subjects: Subjects, outbox_id: str,
                 now: datetime) -> dict[str, Any]:
    """The outbox row carrying the DispatchAttempt command for `op` at its current epoch."""
    cmd = DispatchAttempt(
        operation_id=op.id, operation_key=op.operation_key, epoch=op.epoch,
        tool=op.tool, arguments=op.arguments, arguments_digest=op.arguments_digest,
        catalog_digest=op.tool_digest, contract_revision=op.contract_revision)
    return dict(id=outbox_id, operation_id=op.id, epoch=op.epoch,
                kind=OutboxKind.DISPATCH.value,
                subject=subjects.dispatch(op.tool), payload=encode(cmd).decode(),
                status=OUTBOX_PENDING, created_at=now, available_at=now, publish_count=0)


def _due(now: datetime | sa.BindParameter[datetime]) -> sa.ColumnElement[bool]:
    """Rows a relay should publish now: never leased, or leased by a publisher that has let
    its lease run out, and not held back by a retry delay."""
    return sa.and_(sa.or_(
        outbox.c.status == OUTBOX_PENDING,
        sa.and_(outbox.c.status == OUTBOX_PUBLISHING, outbox.c.lease_until < now),
    ), outbox.c.available_at <= now)


# Built once, with the moment as a parameter: one statement for SQLAlchemy's cache.
_ANY_DUE = sa.select(sa.literal(1)).where(
    _due(sa.bindparam("now", type_=outbox.c.available_at.type))).limit(1)


async def any_due(conn: AsyncConnection, *, now: datetime) -> bool:
    """Whether any row is due, by one lockless statement: the relay's poll asks this before
    it begins a lease transaction, so an idle poll costs one round trip instead of three
    (BEGIN, the locking SELECT, COMMIT). A row committed right after this read waits for
    the relay's next wake-up, as one committed right after the locking SELECT would."""
    return (await conn.execute(_ANY_DUE, {"now": now})).first() is not None


async def lease_batch_txn(conn: AsyncConnection, *, now: datetime, limit: int,
                          lease_s: float) -> list[OutboxItem]:
    rows = (await conn.execute(
        sa.select(outbox.c.id, outbox.c.subject, outbox.c.payload, outbox.c.publish_count,
                  outbox.c.kind, outbox.c.traceparent)
        .where(_due(now))
        .order_by(outbox.c.available_at)
        .limit(limit)
        .with_for_update(skip_locked=True))).all()
    if not rows:
        return []
    await conn.execute(
        outbox.update().where(outbox.c.id.in_([r.id for r in rows]))
        .values(status=OUTBOX_PUBLISHING, lease_until=now + timedelta(seconds=lease_s)))
    return [OutboxItem(r.id, r.subject, r.payload.encode(), r.publish_count, r.kind,
                       r.traceparent) for r in rows]


@dataclass(frozen=True, slots=True)
class MarkPublished(BatchCall[int]):
    """One publisher's marks, as group commit batches them."""

    ids: list[str]
    now: datetime
    seqs: dict[str, int] = field(default_factory=dict)  # stream sequence by outbox id

    @classmethod
    async def many(cls, conn: AsyncConnection, calls: Sequence[MarkPublished]
                   ) -> Sequence[int | Exception]:
        """Several publishers' marks in one statement (each call gets the total)."""
        ids: list[str] = []
        seqs: dict[str, int] = {}
        for call in calls:
            ids.extend(call.ids)
            seqs.update(call.seqs)
        n = await mark_published_txn(conn, ids, now=max(c.now for c in calls), seqs=seqs)
        return [n] * len(calls)


async def mark_published_txn(conn: AsyncConnection, ids: list[str], *, now: datetime,
                             seqs: dict[str, int] | None = None) -> int:
    """Mark rows published (with their stream sequence) in one statement.

    Only rows still being published: a fast dispatcher may already have consumed the row. Rows
    locked right now are skipped, not waited for: the lock is a claim (group-committed with
    others) that is about to mark the row consumed, and waiting on it while holding other rows
    could deadlock with that claim batch. Should the claim roll back, the row's lease runs out
    and it is published again under the same Nats-Msg-Id, which JetStream deduplicates.
    """
    ours = (sa.select(outbox.c.id)
            .where(outbox.c.id.in_(ids), on_the_row(outbox.c.status == OUTBOX_PUBLISHING))
            .with_for_update(skip_locked=True))
    # An audit command is answered by nothing: once JetStream holds it, its row is done.
    status = sa.case((outbox.c.kind == OutboxKind.AUDIT.value, OUTBOX_CONSUMED),
                     else_=OUTBOX_PUBLISHED)
    values: dict[str, Any] = dict(status=status, published_at=now, lease_until=None)
    if seqs:
        values["stream_seq"] = sa.case(seqs, value=outbox.c.id, else_=outbox.c.stream_seq)
    result = await conn.execute(
        outbox.update().where(outbox.c.id.in_(ours.scalar_subquery()),
                              on_the_row(outbox.c.status == OUTBOX_PUBLISHING))
        .values(**values))
    return int(result.rowcount)


@dataclass(frozen=True)
class StreamPosition:
    """Where a stream and its consumer stand, read from JetStream before a sweep."""

    first_seq: int
    last_seq: int
    ack_floor: int  # every message at or below it was acknowledged or removed

    def still_queued(self, seq: int | None) -> bool:
        # In a work-queue stream a message between the ack floor and the end that has not
        # been removed is waiting or being worked on: not lost, however old.
        return seq is not None and self.first_seq <= seq <= self.last_seq and seq > self.ack_floor


async def release_txn(conn: AsyncConnection, ids: list[str], *, now: datetime, error: str,
                      retry_after_s: float) -> None:
    """Give rows back after a failed publish, to be retried after a pause."""
    await conn.execute(
        outbox.update().where(outbox.c.id.in_(ids),
                              on_the_row(outbox.c.status == OUTBOX_PUBLISHING))
        .values(status=OUTBOX_PENDING, lease_until=None, last_error=error[:1024],
                available_at=now + timedelta(seconds=retry_after_s)))


def _unanswered(kind: str, cutoff: datetime | sa.BindParameter[datetime]
                ) -> sa.ColumnElement[bool]:
    """The rows a sweep of `kind` selects: published before `cutoff` and still `published`
    (no claim or verdict has answered them, no sweep has found them obsolete)."""
    return sa.and_(outbox.c.status == OUTBOX_PUBLISHED, outbox.c.kind == kind,
                   outbox.c.published_at < cutoff)


def _cutoff_param(kind: str) -> sa.BindParameter[datetime]:
    return sa.bindparam(f"{kind}_cutoff", type_=outbox.c.published_at.type)


# The rows `sweep_unclaimed_txn` selects for either kind, as one lockless question on the
# published rows' partial index (ix_outbox_published). Built once, for SQLAlchemy's cache.
_ANY_UNANSWERED = sa.select(sa.literal(1)).where(sa.or_(*(
    _unanswered(kind, _cutoff_param(kind))
    for kind in (OutboxKind.DISPATCH.value, OutboxKind.RECONCILE.value)))).limit(1)


async def any_unanswered(conn: AsyncConnection, *, now: datetime, dispatch_after_s: float,
                         reconcile_after_s: float) -> bool:
    """Whether a sweep at `now` would select any row: a dispatch command published more than
    `dispatch_after_s` ago, or a reconcile command more than `reconcile_after_s` ago, still
    `published` (no claim or verdict has answered it, no sweep has found it obsolete). The
    sweeper asks this first, so an idle sweep is one lockless read instead of four stream
    and consumer info requests to the broker and two locking transactions. A row that becomes
    old enough just after this read waits for the next sweep, as one published just after the
    sweep's own locking SELECT would."""
    cutoffs = {f"{OutboxKind.DISPATCH.value}_cutoff": now - timedelta(seconds=dispatch_after_s),
               f"{OutboxKind.RECONCILE.value}_cutoff":
                   now - timedelta(seconds=reconcile_after_s)}
    return (await conn.execute(_ANY_UNANSWERED, cutoffs)).first() is not None


async def sweep_unclaimed_txn(conn: AsyncConnection, *, now: datetime, older_than_s: float,
                              limit: int = 1000, kind: str = OutboxKind.DISPATCH.value,
                              position: StreamPosition | None = None) -> int:
    """Republish rows that were published but never answered (broker message loss).

    `dispatch` rows wait for a claim (operation still `pending` at that epoch); `reconcile`
    rows for a verdict (still `ambiguous` / `awaiting_confirmation`). A duplicate is harmless:
    claims and verdicts are guarded by epoch in the ledger.
    """
    cutoff = now - timedelta(seconds=older_than_s)
    waiting = ([State.PENDING.value] if kind == OutboxKind.DISPATCH
               else sorted(s.value for s in UNRESOLVED))
    live = sa.exists().where(operations.c.id == outbox.c.operation_id,
                             operations.c.epoch == outbox.c.epoch,
                             operations.c.state.in_(waiting))
    stale = (await conn.execute(
        sa.select(outbox.c.id, outbox.c.operation_id, outbox.c.epoch, outbox.c.publish_count,
                  outbox.c.stream_seq, live.label("live"))
        .where(_unanswered(kind, cutoff))
        .limit(limit).with_for_update(skip_locked=True))).all()
    republished = 0
    for row in stale:
        if row.live and position is not None and position.still_queued(row.stream_seq):
            continue  # queued behind a backlog, or in a consumer's hands: not lost
        if not row.live:
            # The operation moved on (cancelled, new epoch): this command is no longer wanted.
            await conn.execute(outbox.update().where(outbox.c.id == row.id)
                               .values(status=OUTBOX_OBSOLETE))
            continue
        await conn.execute(
            outbox.update().where(outbox.c.id == row.id,
                                  on_the_row(outbox.c.status == OUTBOX_PUBLISHED))
            .values(status=OUTBOX_PENDING, available_at=now,
                    publish_count=outbox.c.publish_count + 1))
        await append_journal(conn, operation_id=row.operation_id, at=now,
                             kind=JournalKind(f"{kind}_republished"), actor="ledger.sweeper",
                             epoch=row.epoch,
                             detail={"outbox_id": row.id, "unclaimed_for_s": older_than_s,
                                     "generation": row.publish_count + 1})
        republished += 1
    return republished


async def backlog_txn(conn: AsyncConnection) -> dict[str, int]:
    rows = (await conn.execute(
        sa.select(outbox.c.status, sa.func.count()).group_by(outbox.c.status))).all()
    return {r[0]: int(r[1]) for r in rows}
