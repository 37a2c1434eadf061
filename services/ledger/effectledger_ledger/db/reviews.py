"""Human review of operations no machine could decide.

A review binds to the operation's epoch. `completed` closes the operation as succeeded with the
operator's evidence (no provider result is invented); `uncertain` keeps it in review; and
`not_executed` is recorded so that an explicit retry plan may be prepared (the contracts rules
still apply: admission re-runs every check).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.recovery import Conclusion, Review
from effectledger_core.states import EVIDENCE_KINDS, Event, JournalKind, State
from effectledger_core.subjects import Subjects

from .common import append_journal
from .reads import _row
from .recovery import ActionRejected, load_op, move
from .schema import inbox, journal, operations, reviews, webhook_events


async def record_review_txn(conn: AsyncConnection, operation_id: str, *, review: Review,
                            review_id: str, subjects: Subjects, now: datetime) -> dict[str, Any]:
    op = await load_op(conn, operation_id)
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
        evidence = {"source": "operator", "at": now.isoformat(), **detail}
        return (await move(conn, op, Event.REVIEW_COMPLETED, now=now, actor=actor,
                           detail=detail, subjects=subjects, extra={"evidence": evidence})
                ).as_dict()
    if review.conclusion is Conclusion.UNCERTAIN:
        return (await move(conn, op, Event.REVIEW_UNCERTAIN, now=now, actor=actor,
                           detail=detail, subjects=subjects)).as_dict()
    # not_executed changes no state: it is recorded so that a retry plan may build on it.
    await append_journal(conn, operation_id=operation_id, at=now,
                         kind=JournalKind.REVIEW_RECORDED, actor=actor, epoch=op.epoch,
                         from_state=op.state, to_state=op.state, detail=detail)
    return op.as_dict()


async def latest_review(conn: AsyncConnection, operation_id: str, epoch: int) -> Review | None:
    row = (await conn.execute(
        sa.select(reviews).where(reviews.c.operation_id == operation_id,
                                 reviews.c.epoch == epoch)
        .order_by(reviews.c.at.desc()).limit(1))).mappings().first()
    if row is None:
        return None
    return Review(operator=row["operator"], evidence_ref=row["evidence_ref"],
                  conclusion=Conclusion(row["conclusion"]), epoch=row["epoch"])


async def review_queue(conn: AsyncConnection, *, limit: int) -> list[dict[str, Any]]:
    """Operations in needs_review, each with the evidence gathered so far."""
    ops = (await conn.execute(
        sa.select(operations).where(operations.c.state == State.NEEDS_REVIEW.value)
        .order_by(operations.c.updated_at).limit(limit))).mappings().all()
    out = []
    for op in ops:
        entries = (await conn.execute(
            sa.select(journal).where(journal.c.operation_id == op["id"],
                                     journal.c.kind.in_([k.value for k in sorted(EVIDENCE_KINDS)]))
            .order_by(journal.c.id))).mappings().all()
        hooks = (await conn.execute(
            sa.select(webhook_events).where(webhook_events.c.operation_key
                                            == op["operation_key"]))).mappings().all()
        out.append({"operation": _row(op), "evidence": [_row(e) for e in entries],
                    "webhooks": [_row(h) for h in hooks]})
    return out


async def purge_expired_txn(conn: AsyncConnection, *, now: datetime, inbox_retention_s: float,
                            webhook_retention_s: float) -> dict[str, int]:
    """Bounded dedup state: inbox ids outlive the stream's max age, webhook ids the provider's
    retry schedule; older ones can no longer be redelivered and are dropped."""
    a = await conn.execute(inbox.delete().where(
        inbox.c.received_at < now - timedelta(seconds=inbox_retention_s)))
    b = await conn.execute(webhook_events.delete().where(
        webhook_events.c.received_at < now - timedelta(seconds=webhook_retention_s)))
    return {"inbox": int(a.rowcount), "webhook_events": int(b.rowcount)}
