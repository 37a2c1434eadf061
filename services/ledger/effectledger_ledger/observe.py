"""What the ledger tells about its operations: transition counts, latency, one log line each.

Every state change writes a journal row; the transaction functions note those rows on their
connection (`db.common.note_transitions`) and `Store` hands them here only once the
transaction has committed, so a rolled-back group commit (replayed call by call) is never
counted twice, and nothing is logged that did not happen.

Latency needs each operation's acceptance time. Reading it back from the database on every
transition would cost a query per operation, so the ledger keeps it in a bounded table for
the operations accepted by this process; an operation accepted before a restart, or pushed
out of the table by a long backlog, is counted in `effectledger_latency_untracked_total`
instead of being observed with a wrong figure.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.states import AT_REST, State
from effectledger_obs import metrics

from .db import duplicates
from .db.rows import JournalRow
from .db.schema import OUTBOX_PENDING, outbox

log = logging.getLogger("effectledger.ledger.transitions")


def _count_duplicate(tool: str, _matches: int) -> None:
    metrics.inc(metrics.DUPLICATES_DETECTED, tool)  # tool names come from the catalog


# Once per process: the duplicate detector reports each committed detection here.
if _count_duplicate not in duplicates.observers:
    duplicates.observers.append(_count_duplicate)

_AT_REST = frozenset(s.value for s in AT_REST)
NEW = "none"  # from_state of an operation's first journal entry


@dataclass
class _Tracked:
    tool: str
    accepted_at: datetime
    claimed_at: datetime | None = None


class Observer:
    """Fed committed journal rows; counts, times and logs them."""

    def __init__(self, *, capacity: int = 50_000) -> None:
        self.capacity = capacity
        self._ops: OrderedDict[str, _Tracked] = OrderedDict()

    def accepted(self, operation: Mapping[str, Any]) -> None:
        """A new operation committed by this process (its tool and acceptance time)."""
        self._ops[operation["id"]] = _Tracked(operation["tool"], operation["created_at"])
        if len(self._ops) > self.capacity:
            self._ops.popitem(last=False)

    def committed(self, rows: Iterable[JournalRow]) -> None:
        for row in rows:
            to_state, op_id = row["to_state"], row["operation_id"]
            if to_state is None or op_id is None:  # noted rows always have both
                continue
            from_state = row.get("from_state") or NEW
            metrics.child(metrics.TRANSITIONS, from_state, to_state).inc()
            self._time(row, op_id, from_state, to_state)
            if log.isEnabledFor(logging.INFO):
                detail = row.get("detail") or {}
                extra = {"operation_id": op_id, "epoch": row.get("epoch"),
                         "actor": row.get("actor")}
                for key in ("attempt_id", "trace_id"):  # when the entry names them
                    if detail.get(key):
                        extra[key] = detail[key]
                log.info("%s: %s -> %s", row["kind"], from_state, to_state, extra=extra)

    def outcome_reported(self, *, operation_id: str, at: datetime, now: datetime) -> None:
        """An outcome message from a dispatcher, stamped `at` (its clock), recorded `now`."""
        metrics.child(metrics.STAGE_DURATION, "outcome_to_recorded").observe(
            max(0.0, (now - at).total_seconds()))
        tracked = self._ops.get(operation_id)
        if tracked is not None and tracked.claimed_at is not None:
            metrics.child(metrics.STAGE_DURATION, "claimed_to_outcome").observe(
                max(0.0, (at - tracked.claimed_at).total_seconds()))

    def _time(self, row: JournalRow, op_id: str, from_state: str, to_state: str) -> None:
        if to_state == State.IN_FLIGHT:
            tracked = self._ops.get(op_id)
            if tracked is not None:
                tracked.claimed_at = row["at"]
                if row.get("epoch") == 1:  # a retry's claim is not the intent's first wait
                    metrics.child(metrics.STAGE_DURATION, "accepted_to_claimed").observe(
                        max(0.0, (row["at"] - tracked.accepted_at).total_seconds()))
        elif to_state in _AT_REST and from_state != to_state:
            tracked = self._ops.pop(op_id, None)
            if tracked is None:
                metrics.LATENCY_UNTRACKED.inc()
                return
            metrics.child(metrics.OPERATION_DURATION, tracked.tool, to_state).observe(
                max(0.0, (row["at"] - tracked.accepted_at).total_seconds()))


async def keep_trace_txn(conn: AsyncConnection, outbox_id: str, traceparent: str) -> None:
    """Store a trace context on an outbox row that has none and is not yet published."""
    await conn.execute(outbox.update().where(outbox.c.id == outbox_id,
                                             outbox.c.status == OUTBOX_PENDING,
                                             outbox.c.traceparent.is_(None))
                       .values(traceparent=traceparent))
