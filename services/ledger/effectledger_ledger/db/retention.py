"""Retention of the outbox: rows nobody will publish again are deleted after a period.

An outbox row is read for one purpose only, publishing it: the relay and the sweeper select
`pending`, `publishing` and `published` rows. Once a row is `consumed` (its claim or verdict
recorded) or `obsolete` (cancelled, or superseded by a new epoch) nothing reads its payload
again: the operation, its attempts and its journal are the record, and the inbox deduplicates
a late redelivery by message id whether or not the row still exists. Such rows are kept for
`outbox_retention_s` (for diagnosis) and then deleted, a bounded batch per transaction so the
purge never holds many row locks or one long transaction beside the hot path.

Live rows are never touched, however old: an old `published` row is exactly what the sweeper
looks for when the broker lost a message.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.states import OUTBOX_SETTLED

from .schema import outbox

_SETTLED = [s.value for s in OUTBOX_SETTLED]


async def purge_outbox_txn(conn: AsyncConnection, *, now: datetime, retention_s: float,
                           limit: int = 1000) -> int:
    """Delete at most `limit` settled rows created more than `retention_s` ago."""
    cutoff = now - timedelta(seconds=retention_s)
    # A bounded victim list by the partial index (ix_outbox_settled), then one DELETE by key:
    # both dialects, and no DELETE ... LIMIT (which PostgreSQL lacks).
    victims = (sa.select(outbox.c.id)
               .where(outbox.c.status.in_(_SETTLED), outbox.c.created_at < cutoff)
               .order_by(outbox.c.created_at).limit(limit).scalar_subquery())
    result = await conn.execute(outbox.delete().where(outbox.c.id.in_(victims)))
    return int(result.rowcount)
