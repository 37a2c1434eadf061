"""Human review of operations no machine could decide.

A review binds to the operation's epoch. `completed` closes the operation as succeeded with the
operator's evidence (no provider result is invented); `uncertain` keeps it in review; and
`not_executed` is recorded so that an explicit retry plan may be prepared (the contracts rules
still apply: admission re-runs every check).
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.recovery import Conclusion, Review
from effectledger_core.states import EVIDENCE_KINDS, Event, JournalKind, State
from effectledger_core.subjects import Subjects
from effectledger_core.views import JournalEntry, OperationRecord, ReviewItem, WebhookEventView

from .common import append_journal
from .duplicates import open_duplicate, review_duplicate_txn, unreviewed_duplicates
from .recovery import ActionRejected, load_op, move
from .rows import OperationRow
from .schema import inbox, journal, operations, reviews, webhook_events


async def record_review_txn(conn: AsyncConnection, operation_id: str, *, review: Review,
                            review_id: str, subjects: Subjects, now: datetime,
                            traceparent: str | None = None) -> OperationRow:
    op = await load_op(conn, operation_id)
    if op.state is State.SUCCEEDED and open_duplicate(op.evidence):
        return await _review_duplicate(conn, op, review=review, review_id=review_id, now=now,
                                       traceparent=traceparent)
    if review.epoch != op.epoch:
        raise ActionRejected(f"the review is for epoch {review.epoch}; the operation is at "
                             f"{op.epoch}", reason="stale_epoch")
    if op.state is not State.NEEDS_REVIEW:
        raise ActionRejected(f"operation is {op.state.value}, not needs_review",
                             reason="not_in_review")
    await conn.execute(reviews.insert().values(
        id=review_id, operation_id=operation_id, epoch=review.epoch, operator=review.operator,
        evidence_ref=review.evidence_ref, conclusion=review.conclusion.value, at=now))
    detail = {"review_id": review_id, "operator": review.operator,
              "evidence_ref": review.evidence_ref, "conclusion": review.conclusion.value}
    actor = f"operator:{review.operator}"
    if review.conclusion is Conclusion.COMPLETED:
        # The evidence names its epoch, like a verdict's: the view shows the current epoch's.
        evidence = {"source": "operator", "at": now.isoformat(), "epoch": op.epoch, **detail}
        return (await move(conn, op, Event.REVIEW_COMPLETED, now=now, actor=actor,
                           detail=detail, subjects=subjects, extra={"evidence": evidence},
                           traceparent=traceparent))
    if review.conclusion is Conclusion.UNCERTAIN:
        return await move(conn, op, Event.REVIEW_UNCERTAIN, now=now, actor=actor,
                          detail=detail, subjects=subjects, traceparent=traceparent)
    # not_executed changes no state: it is recorded so that a retry plan may build on it.
    await append_journal(conn, operation_id=operation_id, at=now,
                         kind=JournalKind.REVIEW_RECORDED, actor=actor, epoch=op.epoch,
                         from_state=op.state, to_state=op.state, detail=detail,
                         traceparent=traceparent)
    return op


async def _review_duplicate(conn: AsyncConnection, op: OperationRow, *, review: Review,
                            review_id: str, now: datetime,
                            traceparent: str | None) -> OperationRow:
    """A succeeded operation the provider applied twice: `completed` records that the extra
    effect was dealt with (the evidence reference says how); the state stays succeeded."""
    if review.conclusion is not Conclusion.COMPLETED:
        raise ActionRejected("a duplicate on a succeeded operation is closed by a 'completed' "
                             "review whose evidence_ref says how the extra effect was handled",
                             reason="duplicate_needs_completed")
    await conn.execute(reviews.insert().values(
        id=review_id, operation_id=op.id, epoch=op.epoch, operator=review.operator,
        evidence_ref=review.evidence_ref, conclusion=review.conclusion.value, at=now))
    await review_duplicate_txn(conn, op=op, review_id=review_id, operator=review.operator,
                               evidence_ref=review.evidence_ref, now=now)
    await append_journal(conn, operation_id=op.id, at=now, kind=JournalKind.REVIEW_RECORDED,
                         actor=f"operator:{review.operator}", epoch=op.epoch,
                         from_state=op.state, to_state=op.state, traceparent=traceparent,
                         detail={"review_id": review_id, "operator": review.operator,
                                 "evidence_ref": review.evidence_ref, "duplicate": True,
                                 "conclusion": review.conclusion.value})
    return await load_op(conn, op.id)


async def latest_review(conn: AsyncConnection, operation_id: str, epoch: int) -> Review | None:
    row = (await conn.execute(
        sa.select(reviews).where(reviews.c.operation_id == operation_id,
                                 reviews.c.epoch == epoch)
        .order_by(reviews.c.at.desc()).limit(1))).mappings().first()
    if row is None:
        return None
    return Review(operator=row["operator"], evidence_ref=row["evidence_ref"],
                  conclusion=Conclusion(row["conclusion"]), epoch=row["epoch"])


async def review_queue(conn: AsyncConnection, *, limit: int) -> list[ReviewItem]:
    """Operations in needs_review, and succeeded ones with a duplicate_detected (the provider
    applied them more than once), each with the evidence gathered so far."""
    ops = (await conn.execute(
        sa.select(operations).where(sa.or_(
            operations.c.state == State.NEEDS_REVIEW.value, unreviewed_duplicates()))
        .order_by(operations.c.updated_at).limit(limit))).mappings().all()
    out = []
    for op in ops:
        record = OperationRecord.model_validate(op)
        out.append(await review_item(conn, record))
    return out


async def review_item(conn: AsyncConnection, op: OperationRecord, *,
                      kinds: Collection[JournalKind] = EVIDENCE_KINDS) -> ReviewItem:
    """What a reviewer weighs: the machines' evidence entries (journal `kinds`) and the
    provider's webhooks for the operation's key (the review queue and the console's page)."""
    entries = (await conn.execute(
        sa.select(journal).where(journal.c.operation_id == op.id,
                                 journal.c.kind.in_(sorted(k.value for k in kinds)))
        .order_by(journal.c.id))).mappings().all()
    hooks = (await conn.execute(
        sa.select(webhook_events).where(webhook_events.c.operation_key == op.operation_key)
        .order_by(webhook_events.c.received_at, webhook_events.c.id))).mappings().all()
    return ReviewItem(operation=op, evidence=[JournalEntry.model_validate(e) for e in entries],
                      webhooks=[WebhookEventView.model_validate(h) for h in hooks])


async def purge_expired_txn(conn: AsyncConnection, *, now: datetime, inbox_retention_s: float,
                            webhook_retention_s: float) -> dict[str, int]:
    """Bounded dedup state: inbox ids outlive the stream's max age, webhook ids the provider's
    retry schedule; older ones can no longer be redelivered and are dropped."""
    a = await conn.execute(inbox.delete().where(
        inbox.c.received_at < now - timedelta(seconds=inbox_retention_s)))
    b = await conn.execute(webhook_events.delete().where(
        webhook_events.c.received_at < now - timedelta(seconds=webhook_retention_s)))
    return {"inbox": int(a.rowcount), "webhook_events": int(b.rowcount)}
