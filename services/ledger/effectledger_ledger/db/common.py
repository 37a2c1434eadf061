"""Helpers shared by the transaction functions."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.states import JournalKind, State

from . import hot
from .rows import JournalRow
from .schema import attempts, journal, operations


def on_the_row(*guard: sa.ColumnElement[bool]) -> sa.ColumnElement[bool]:
    """`guard` checked on the row that a key found, never used to find it.

    A guard on a status column (`operations.state`, `outbox.status`) is indexable: by the state
    indexes and by the partial indexes on live rows. PostgreSQL's planner weighs it by
    statistics that lag: a table with a history has next to nothing `pending` (or
    `publishing`) at its last ANALYZE, so the planner scanned every such entry of a partial
    index and filtered them by id instead of using the key. Behind a backlog, each claim read
    every queued operation and each publish mark every unpublished row: the drain grew with
    the square of the backlog (24,000 queued: one claim's UPDATE 16.9 ms instead of 0.4, one
    mark 14.6 ms). `(...) IS TRUE` is no index condition on a column that is not boolean and
    proves no partial index's predicate, so the key is the only way in. In a WHERE it keeps
    the same rows: NULL and false are both left out. `tests/integration/test_plans.py`
    EXPLAINs the statements behind a backlog.
    """
    return sa.and_(*guard).is_(sa.true())


async def insert_ignore(conn: AsyncConnection, table: sa.Table, values: dict[str, Any]) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING; True when the row was inserted."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(table).values(**values).on_conflict_do_nothing()
    result = await conn.execute(stmt)
    return bool(result.rowcount == 1)


def trace_ids(traceparent: str) -> dict[str, str]:
    """The trace and span ids of a W3C `traceparent`, as a journal entry's detail keys."""
    parts = traceparent.split("-")
    return {"trace_id": parts[1], "span_id": parts[2]} if len(parts) == 4 else {}


def journal_row(*, operation_id: str | None, at: datetime, kind: JournalKind | str, actor: str,
                epoch: int | None = None, from_state: State | str | None = None,
                to_state: State | str | None = None, detail: dict[str, Any] | None = None,
                traceparent: str | None = None) -> JournalRow:
    """A journal entry. `traceparent`: the context of the request or message that caused it
    (its ids join the detail, so an entry can be found from a trace and a trace from an
    entry); None when not traced, which costs nothing."""
    if traceparent is not None:
        detail = {**(detail or {}), **trace_ids(traceparent)}
    # Stored as plain strings: drivers and JSON see names, never enum members.
    return JournalRow(operation_id=operation_id, at=at, kind=_PLAIN.get(kind, kind),
                      actor=actor[:1024], epoch=epoch,
                      from_state=None if from_state is None else _PLAIN.get(from_state, from_state),
                      to_state=None if to_state is None else _PLAIN.get(to_state, to_state),
                      detail=detail or {})


# Enum members to their plain names: a dict lookup is much cheaper than str() on an enum, and
# journal rows are built on the hot path. A plain name maps to itself.
_PLAIN: dict[str, str] = {m: m.value for e in (State, JournalKind) for m in e}


TRANSITIONS_KEY = "effectledger_transitions"


def note_transitions(conn: AsyncConnection, rows: Sequence[JournalRow]) -> None:
    """Remember this transaction's state changes; `Store` reports them after the commit."""
    changed = [r for r in rows if r["to_state"] is not None and r["operation_id"] is not None]
    if changed:
        conn.info.setdefault(TRANSITIONS_KEY, []).extend(changed)


async def append_journal(conn: AsyncConnection, *, operation_id: str | None, at: datetime,
                         kind: JournalKind | str, actor: str, epoch: int | None = None,
                         from_state: State | str | None = None,
                         to_state: State | str | None = None,
                         detail: dict[str, Any] | None = None,
                         traceparent: str | None = None) -> None:
    row = journal_row(operation_id=operation_id, at=at, kind=kind, actor=actor, epoch=epoch,
                      from_state=from_state, to_state=to_state, detail=detail,
                      traceparent=traceparent)
    await conn.execute(journal.insert().values(**row))
    note_transitions(conn, [row])


# Execute a statement for each of some rows in one call (nothing for none): `hot` runs it.
execute_rows = hot.execute_rows


_INSERT_JOURNAL = journal.insert()


async def insert_journal(conn: AsyncConnection, rows: Sequence[JournalRow]) -> None:
    """Journal entries made by a set-based transaction: one multi-row INSERT."""
    await execute_rows(conn, _INSERT_JOURNAL, rows)
    note_transitions(conn, rows)


NOTIFY_FLAG = "effectledger_notify_outbox"


async def notify_outbox(conn: AsyncConnection) -> None:
    """Wake relays on other ledger replicas (PostgreSQL only; a hint, relays also poll).

    Only marks the transaction: `Store.transaction` sends one NOTIFY just before the commit,
    however many rows a (group-committed) transaction added.
    """
    if conn.dialect.name == "postgresql":
        conn.info[NOTIFY_FLAG] = True


class LockedOp(NamedTuple):
    id: str
    state: str
    epoch: int
    tool: str = ""  # the claim compares its command with these two
    arguments_digest: str = ""


async def lock_with_attempts(conn: AsyncConnection, op_ids: list[str]) -> Locked:
    """Lock operations (in id order) and read their attempts, in one statement.

    Returns the operations by id (id, state, epoch) and their attempts by (operation, epoch)
    (id, status, claimed_at). The lock is on the operation rows only; every writer of an
    attempt locks its operation first, so the attempts cannot change under us either. Locking
    in id order makes concurrent batches queue instead of deadlocking.
    """
    return locked_rows(await hot.fetch(conn, _LOCK_WITH_ATTEMPTS[conn.dialect.name],
                                       {"ids": op_ids}, reads=hot.Reads(
                                           LOCKED_TABLES, frozenset(op_ids))))


# What `lock_with_attempts` reads: these tables, only rows of the operations it locks.
LOCKED_TABLES = frozenset({"operations", "attempts"})


def locked_rows(rows: Sequence[Any]) -> Locked:
    """`lock_with_attempts`'s answer from its rows (a row without an operation is skipped:
    the outcome inbox's fused form returns one when it locked nothing)."""
    ops: dict[str, LockedOp] = {}
    held: dict[tuple[str, int], _Attempt] = {}
    for r in rows:
        op_id = r["id"]
        if op_id is None:
            continue
        ops[op_id] = LockedOp(op_id, r["state"], r["epoch"], r["tool"], r["arguments_digest"])
        if r["attempt_id"] is not None:
            held[(op_id, r["attempt_epoch"])] = _Attempt(
                r["attempt_id"], r["attempt_status"], r["claimed_at"], r["dispatcher_id"])
    return ops, held


# Hot-path statements are built once: constructing and cache-keying a statement on every call
# was a visible share of the ledger's CPU.
def lock_with_attempts_stmt(ids: sa.ColumnElement[bool]) -> sa.Select[Any]:
    return (
        sa.select(operations.c.id, operations.c.state, operations.c.epoch, operations.c.tool,
                  operations.c.arguments_digest, attempts.c.id.label("attempt_id"),
                  attempts.c.epoch.label("attempt_epoch"),
                  attempts.c.status.label("attempt_status"), attempts.c.claimed_at,
                  attempts.c.dispatcher_id)
        .select_from(operations.outerjoin(attempts, attempts.c.operation_id == operations.c.id))
        .where(ids)
        .order_by(operations.c.id)
        .with_for_update(of=operations))


_LOCK_WITH_ATTEMPTS = {d: lock_with_attempts_stmt(hot.one_of(operations.c.id, "ids", d))
                       for d in hot.DIALECTS}


class _Attempt(NamedTuple):
    id: str
    status: str
    claimed_at: datetime | None
    dispatcher_id: str | None = None  # the claim's holder, compared with an outcome's sender


# The locked operations by id, and their attempts by (operation, epoch).
Locked = tuple[dict[str, LockedOp], dict[tuple[str, int], _Attempt]]
