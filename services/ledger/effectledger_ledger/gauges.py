"""Gauges read from the ledger's database when `/metrics` is scraped.

What is waiting (operations not at rest, the ambiguous backlog, the review queue, approvals,
the outbox) is a property of the database, not of one ledger process, so it is read from the
database rather than counted in memory: every replica reports the same figures (dashboards
take `max`). The queries use the partial indexes on active operations and unpublished outbox
rows, so their cost follows what is waiting, not the table's history; a scrape reads them at
most once per `min_interval_s` however many scrapers ask.

Terminal states are not counted here (a full count grows with history): their rate is
`effectledger_transitions_total{to_state=...}`.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

import sqlalchemy as sa
from prometheus_client import Gauge

from effectledger_core.ids import Clock, utcnow
from effectledger_core.states import UNRESOLVED, State

from .db.schema import ACTIVE_STATES, OUTBOX_PENDING, OUTBOX_PUBLISHING, operations, outbox
from .db.store import Store

log = logging.getLogger(__name__)

OPERATIONS = Gauge(
    "effectledger_operations", "Operations not at rest, by state (read from the database).",
    ["state"])
OLDEST_AGE = Gauge(
    "effectledger_operations_oldest_age_seconds",
    "Age of the longest-waiting operation in each active state, since its last change.",
    ["state"])
AMBIGUOUS = Gauge(
    "effectledger_ambiguous_operations",
    "Operations whose outcome nobody knows yet (ambiguous or awaiting confirmation).")
AMBIGUOUS_OLDEST_AGE = Gauge(
    "effectledger_ambiguous_oldest_age_seconds",
    "Seconds since the oldest unresolved operation became ambiguous (0: none).")
REVIEW_QUEUE = Gauge(
    "effectledger_review_queue_operations", "Operations waiting for a human review.")
REVIEW_OLDEST_AGE = Gauge(
    "effectledger_review_oldest_age_seconds",
    "Seconds the oldest operation in the review queue has waited (0: none).")
AWAITING_APPROVAL = Gauge(
    "effectledger_awaiting_approval_operations", "Operations waiting for an operator's approval.")
OUTBOX_UNPUBLISHED = Gauge(
    "effectledger_outbox_unpublished_rows", "Outbox rows not yet published (pending or leased).")
OUTBOX_OLDEST_AGE = Gauge(
    "effectledger_outbox_oldest_unpublished_age_seconds",
    "Seconds since the oldest unpublished outbox row was written (0: none).")
RECONCILE_DEADLINE = Gauge(
    "effectledger_reconcile_deadline_seconds",
    "The configured reconcile deadline (EFFECTLEDGER_RECONCILE_DEADLINE_S), for alert rules.")
DB_GAUGES_UP = Gauge(
    "effectledger_db_gauges_up", "1 when the last database read for these gauges succeeded.")

_BY_STATE = (sa.select(operations.c.state, sa.func.count(), sa.func.min(operations.c.updated_at))
             .where(operations.c.state.in_(ACTIVE_STATES))
             .group_by(operations.c.state))
_OUTBOX = (sa.select(sa.func.count(), sa.func.min(outbox.c.created_at))
           .where(outbox.c.status.in_((OUTBOX_PENDING, OUTBOX_PUBLISHING))))


def _age(now: datetime, since: datetime | None) -> float:
    return max(0.0, (now - since).total_seconds()) if since is not None else 0.0


class DbGauges:
    def __init__(self, store: Store, *, reconcile_deadline_s: float,
                 min_interval_s: float = 1.0, clock: Clock = utcnow) -> None:
        self.store, self.clock, self.min_interval_s = store, clock, min_interval_s
        self._read_at: float | None = None
        RECONCILE_DEADLINE.set(reconcile_deadline_s)

    async def refresh(self) -> None:
        """Read the figures unless they were read less than `min_interval_s` ago."""
        if self._read_at is not None and time.monotonic() - self._read_at < self.min_interval_s:
            return
        self._read_at = time.monotonic()
        try:
            async with self.store.transaction() as conn:
                by_state = (await conn.execute(_BY_STATE)).all()
                unpublished, oldest_row = (await conn.execute(_OUTBOX)).one()
        except Exception as exc:  # a scrape must answer; the gauge says the read failed
            log.warning("metrics: database gauges not read (%s)", type(exc).__name__)
            DB_GAUGES_UP.set(0)
            return
        DB_GAUGES_UP.set(1)
        now = self.clock()
        counts: dict[str, tuple[int, datetime | None]] = {s: (0, None) for s in ACTIVE_STATES}
        for state, count, oldest in by_state:
            counts[state] = (int(count), _as_utc(oldest))
        for state, (count, oldest) in counts.items():
            OPERATIONS.labels(state).set(count)
            OLDEST_AGE.labels(state).set(_age(now, oldest))
        AMBIGUOUS.set(sum(counts[s][0] for s in UNRESOLVED))
        olds: list[datetime] = [o for s in UNRESOLVED if (o := counts[s][1]) is not None]
        AMBIGUOUS_OLDEST_AGE.set(_age(now, min(olds)) if olds else 0.0)
        REVIEW_QUEUE.set(counts[State.NEEDS_REVIEW][0])
        REVIEW_OLDEST_AGE.set(_age(now, counts[State.NEEDS_REVIEW][1]))
        AWAITING_APPROVAL.set(counts[State.AWAITING_APPROVAL][0])
        OUTBOX_UNPUBLISHED.set(int(unpublished))
        OUTBOX_OLDEST_AGE.set(_age(now, _as_utc(oldest_row)))


def _as_utc(value: datetime | str | None) -> datetime | None:
    # Aggregates bypass the column type on SQLite (text) and may come back naive.
    from datetime import UTC

    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value
