"""Reads for the operator console: the overview's figures, filtered operation lists with
newest-first keyset pagination, and the evidence shown on review pages.

Read-only: nothing here writes. Agents' reads pass their tenant and see only its rows; figures
that are not per tenant (the outbox, dead letters) are left out for them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.errors import InvalidRequest
from effectledger_core.limits import MAX_IDENTIFIER_BYTES
from effectledger_core.states import (
    EVIDENCE_KINDS,
    UNRESOLVED,
    JournalKind,
    OutboxStatus,
    State,
)

from .reads import _decode_cursor as decode_api_cursor
from .schema import dead_letters, journal, operations, outbox

# The journal kind a readback or the duplicate audit records when one key shows more than one
# effect at the provider.
DUPLICATE_KIND = JournalKind.DUPLICATE_DETECTED.value
# Journal kinds the review page shows a reviewer: the core's evidence kinds and the outcomes
# the ledger refused (a late or stale report is worth a human's look, not the queue's).
REVIEW_PAGE_KINDS = EVIDENCE_KINDS | {JournalKind.OUTCOME_REJECTED}


@dataclass(frozen=True)
class Backlog:
    """How many operations wait in some condition, and since when the oldest one does."""

    count: int
    oldest: datetime | None

    def age_s(self, now: datetime) -> float | None:
        return None if self.oldest is None else max(0.0, (now - self.oldest).total_seconds())


@dataclass(frozen=True)
class Overview:
    by_state: dict[str, int]
    unresolved: Backlog  # ambiguous or awaiting confirmation: the reconciler's backlog
    review: Backlog
    approval: Backlog
    duplicates: int
    # Not per tenant: None for agents.
    outbox_unpublished: Backlog | None  # due and not yet published
    outbox_by_status: dict[str, int] | None
    dead_letters: Backlog | None


def _tenant(stmt: Any, tenant: str | None) -> Any:
    return stmt if tenant is None else stmt.where(operations.c.tenant == tenant)


async def _backlog(conn: AsyncConnection, states: Collection[State],
                   tenant: str | None) -> Backlog:
    stmt = sa.select(sa.func.count(), sa.func.min(operations.c.updated_at)).where(
        operations.c.state.in_(sorted(s.value for s in states)))
    count, oldest = (await conn.execute(_tenant(stmt, tenant))).one()
    return Backlog(int(count), oldest)


async def overview(conn: AsyncConnection, *, tenant: str | None, now: datetime) -> Overview:
    by_state_stmt = sa.select(operations.c.state, sa.func.count()).group_by(operations.c.state)
    by_state = {r[0]: int(r[1]) for r in (await conn.execute(_tenant(by_state_stmt, tenant)))}
    dup_stmt = sa.select(sa.func.count()).select_from(journal).where(
        journal.c.kind == DUPLICATE_KIND)
    if tenant is not None:
        dup_stmt = dup_stmt.where(journal.c.operation_id.in_(
            sa.select(operations.c.id).where(operations.c.tenant == tenant)))
    duplicates = int((await conn.execute(dup_stmt)).scalar_one())
    unpublished = by_status = letters = None
    if tenant is None:
        # Lag counts from when a row became due: a row held back by a publish retry's backoff
        # (available_at in the future) is waiting on purpose, not lagging.
        count, oldest = (await conn.execute(
            sa.select(sa.func.count(), sa.func.min(outbox.c.available_at))
            .where(outbox.c.status.in_((OutboxStatus.PENDING.value,
                                        OutboxStatus.PUBLISHING.value)),
                   outbox.c.available_at <= now))).one()
        unpublished = Backlog(int(count), oldest)
        by_status = {r[0]: int(r[1]) for r in await conn.execute(
            sa.select(outbox.c.status, sa.func.count()).group_by(outbox.c.status))}
        count, latest = (await conn.execute(
            sa.select(sa.func.count(), sa.func.max(dead_letters.c.at)))).one()
        letters = Backlog(int(count), latest)
    return Overview(
        by_state=by_state,
        unresolved=await _backlog(conn, UNRESOLVED, tenant),
        review=await _backlog(conn, {State.NEEDS_REVIEW}, tenant),
        approval=await _backlog(conn, {State.AWAITING_APPROVAL}, tenant),
        duplicates=duplicates, outbox_unpublished=unpublished, outbox_by_status=by_status,
        dead_letters=letters)


@dataclass(frozen=True)
class OperationFilter:
    """The console's list filters; every field optional. `text` matches inside the operation
    key or the caller's idempotency key."""

    states: tuple[str, ...] = ()
    tool: str | None = None
    tenant: str | None = None
    task: str | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    text: str | None = None
    duplicates: bool = False
    oldest_first: bool = False

    def __post_init__(self) -> None:
        known = {s.value for s in State}
        for s in self.states:
            if s not in known:
                raise InvalidRequest(f"unknown state {s!r}", known=sorted(known))
        for name in ("tool", "tenant", "task", "text"):
            value = getattr(self, name)
            if value is not None and len(value.encode()) > MAX_IDENTIFIER_BYTES:
                raise InvalidRequest(f"filter {name!r} exceeds {MAX_IDENTIFIER_BYTES} bytes")
        if (self.created_from and self.created_to and self.created_from > self.created_to):
            raise InvalidRequest("the time range ends before it starts")


def _encode_cursor(created_at: datetime, op_id: str) -> str:
    return base64.urlsafe_b64encode(
        json.dumps([created_at.isoformat(), op_id]).encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    # The same [created_at, id] document as the API's cursors, with the same checks (an
    # unpaired surrogate or NUL in the id is a 4xx page, never a failed query).
    return decode_api_cursor(cursor)


async def list_operations(conn: AsyncConnection, f: OperationFilter, *, limit: int,
                          cursor: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """One page (newest first unless `f.oldest_first`) and the cursor of the next, if any."""
    if not 1 <= limit <= 500:
        raise InvalidRequest("limit must be between 1 and 500")
    o = operations.c
    q = sa.select(o.id, o.tenant, o.task_id, o.caller_key, o.operation_key, o.tool, o.state,
                  o.epoch, o.effect_class, o.created_at, o.updated_at)
    if f.states:
        q = q.where(o.state.in_(f.states))
    if f.tool:
        q = q.where(o.tool == f.tool)
    if f.tenant is not None:
        q = q.where(o.tenant == f.tenant)
    if f.task:
        q = q.where(o.task_id == f.task)
    if f.created_from is not None:
        q = q.where(o.created_at >= f.created_from)
    if f.created_to is not None:
        q = q.where(o.created_at <= f.created_to)
    if f.text:
        q = q.where(sa.or_(o.operation_key.contains(f.text, autoescape=True),
                           o.caller_key.contains(f.text, autoescape=True)))
    if f.duplicates:
        q = q.where(o.id.in_(sa.select(journal.c.operation_id)
                             .where(journal.c.kind == DUPLICATE_KIND)))
    if cursor:
        created, op_id = _decode_cursor(cursor)
        if f.oldest_first:
            q = q.where(sa.or_(o.created_at > created,
                               sa.and_(o.created_at == created, o.id > op_id)))
        else:
            q = q.where(sa.or_(o.created_at < created,
                               sa.and_(o.created_at == created, o.id < op_id)))
    order = ((o.created_at, o.id) if f.oldest_first
             else (o.created_at.desc(), o.id.desc()))
    rows = (await conn.execute(q.order_by(*order).limit(limit + 1))).mappings().all()
    items = [dict(r) for r in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        next_cursor = _encode_cursor(items[-1]["created_at"], items[-1]["id"])
    return items, next_cursor


async def tools_in_use(conn: AsyncConnection, *, tenant: str | None) -> list[str]:
    stmt = sa.select(operations.c.tool).distinct().order_by(operations.c.tool)
    return [r[0] for r in await conn.execute(_tenant(stmt, tenant))]


async def recent_dead_letters(conn: AsyncConnection, *, limit: int = 50) -> list[dict[str, Any]]:
    rows = (await conn.execute(
        sa.select(dead_letters).order_by(dead_letters.c.id.desc()).limit(limit))).mappings()
    return [dict(r) for r in rows]
