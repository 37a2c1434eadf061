"""A set-based step's writes as one statement on PostgreSQL (data-modifying CTEs).

A group-committed claim writes four tables (operations, outbox, journal, attempts), an intent
three: one round trip each, and on the hot path every round trip also waits for the ledger's
event loop. On PostgreSQL the writes of one step go out as one statement instead: each write is
a part of a `WITH` whose rows come from one jsonb parameter (`jsonb_to_recordset`), so the
statement's text depends only on the step's shape, never on how many rows it has. SQLite keeps
the statement-by-statement form (its database is in the process: there is no round trip).

The parts of one statement run on one snapshot, so they must not depend on each other's
writes: an UPDATE does not see a row a sibling part inserts, and a row two parts (or two rows
of one part) update is updated once. `Write.key` names the row each update touches; when two
updates of one statement would touch the same row, `write_all` uses the statement-by-statement
form, which applies them in order as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from .common import INSERT_JOURNAL, execute_rows
from .rows import JournalRow
from .schema import JSONType, UTCDateTime, journal

Row = Mapping[str, Any]


def pg_type(column: sa.Column[Any]) -> str:
    """The recordset type a parameter for `column` is read as.

    Strings are read as text so that the target column's own length check applies (a cast to
    varchar(n) would truncate silently); JSON is read as its serialized text and cast, so that
    a present None is stored as JSON null and an absent key as SQL NULL, as SQLAlchemy does.
    """
    t = column.type
    if isinstance(t, UTCDateTime):
        return "timestamptz"
    if isinstance(t, sa.JSON) or t is JSONType:
        return "text"
    if isinstance(t, sa.BigInteger):
        return "bigint"
    if isinstance(t, sa.Integer):
        return "int"
    return "text"


def is_json(column: sa.Column[Any]) -> bool:
    return isinstance(column.type, sa.JSON) or column.type is JSONType


@dataclass(frozen=True, slots=True)
class Part:
    """One write as a CTE part: `sql` reads its rows from `{rows}`, declared as `params`.

    `params` are (parameter name, recordset type); `json` names the parameters holding JSON
    values (sent serialized, cast to jsonb in `sql`).
    """

    sql: str
    params: tuple[tuple[str, str], ...]
    json: frozenset[str] = frozenset()
    table: str | None = None  # the table an UPDATE part writes (None for an INSERT)


@dataclass(frozen=True, slots=True)
class Write:
    """A write in both forms: `stmt` row by row (executemany), `part` in one statement."""

    stmt: sa.Executable
    part: Part
    rows: Sequence[Row] | Sequence[JournalRow]
    # The row an UPDATE touches, from one parameter row (None for an INSERT).
    key: Callable[[Row], Hashable] | None = None


def insert_part(table: sa.Table, columns: Sequence[str]) -> Part:
    """INSERT INTO table (columns) from the recordset; parameters named like the columns."""
    cols = [table.c[c] for c in columns]
    exprs = ", ".join(f"r.{c.name}::jsonb" if is_json(c) else f"r.{c.name}" for c in cols)
    names = ", ".join(c.name for c in cols)
    return Part(f"INSERT INTO {table.name} ({names}) SELECT {exprs} FROM {{rows}}",
                tuple((c.name, pg_type(c)) for c in cols),
                frozenset(c.name for c in cols if is_json(c)))


def update_part(table: sa.Table, *, lookup: tuple[str, str], where: Mapping[str, str],
                values: Mapping[str, str], params: Mapping[str, sa.Column[Any]],
                guards: Sequence[str] = ()) -> Part:
    """UPDATE table t SET ... FROM the recordset WHERE ...; expressions use `t.` and `r.`.

    `where` and `values` map a column to an SQL expression; `params` declares each parameter
    by the column whose type it has; `guards` are further conditions. `lookup` (an indexed
    column, the parameter it equals) is repeated as `= ANY(ARRAY(...))`: the planner takes a
    recordset for 100 rows and would join a non-unique index's table by scanning all of it
    (seen on outbox: a sequential scan per claim batch); an array condition is an index scan.
    """
    column, param = lookup
    sets = ", ".join(f"{c} = {e}" for c, e in values.items())
    find = (f"t.{column} = ANY(ARRAY(SELECT k.{param} FROM jsonb_to_recordset({{param}}::jsonb)"
            f" AS k({param} {pg_type(params[param])})))")
    conds = " AND ".join([find, *(f"t.{c} = {e}" for c, e in where.items()), *guards])
    return Part(f"UPDATE {table.name} t SET {sets} FROM {{rows}} WHERE {conds}",
                tuple((p, pg_type(c)) for p, c in params.items()),
                frozenset(p for p, c in params.items() if is_json(c)), table.name)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the ledger")
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"cannot send {type(value).__name__} in a fused statement")


def _encode(part: Part, rows: Sequence[Row] | Sequence[JournalRow]) -> str:
    if part.json:
        rows = [{k: json.dumps(v) if k in part.json else v for k, v in r.items()} for r in rows]
    return json.dumps(rows, default=_plain, separators=(",", ":"))


# The statement text by the shape of its parts, built once per shape.
_SQL: dict[tuple[Part, ...], str] = {}


def _sql(parts: tuple[Part, ...]) -> str:
    sql = _SQL.get(parts)
    if sql is None:
        ctes = []
        for n, part in enumerate(parts, start=1):
            decl = ", ".join(f"{p} {t}" for p, t in part.params)
            rows = f"jsonb_to_recordset(${n}::jsonb) AS r({decl})"
            ctes.append(f"w{n} AS ({part.sql.format(rows=rows, param=f'${n}')})")
        sql = _SQL[parts] = "WITH " + ", ".join(ctes) + " SELECT 1"
    return sql


def _collide(writes: Sequence[Write]) -> bool:
    seen: set[tuple[str | None, Hashable]] = set()
    for w in writes:
        if w.key is None:
            continue
        for r in w.rows:
            k = (w.part.table, w.key(r))
            if k in seen:
                return True
            seen.add(k)
    return False


_ONE_BY_ONE: ContextVar[bool] = ContextVar("effectledger_fused_off", default=False)


@contextmanager
def statement_by_statement() -> Iterator[None]:
    """Within this block, writes go out one statement each (to compare the two forms)."""
    token = _ONE_BY_ONE.set(True)
    try:
        yield
    finally:
        _ONE_BY_ONE.reset(token)


async def write_all(conn: AsyncConnection, writes: Sequence[Write]) -> None:
    """Run `writes` (in this order, when one at a time); one statement on PostgreSQL."""
    writes = [w for w in writes if w.rows]
    if not writes:
        return
    if (conn.dialect.name != "postgresql" or len(writes) == 1 or _ONE_BY_ONE.get()
            or _collide(writes)):
        for w in writes:
            await execute_rows(conn, w.stmt, w.rows)
        return
    parts = tuple(w.part for w in writes)
    await conn.exec_driver_sql(_sql(parts), tuple(_encode(w.part, w.rows) for w in writes))


_JOURNAL_PART = insert_part(journal, list(JournalRow.__annotations__))


def journal_write(rows: Sequence[JournalRow]) -> Write:
    """Journal entries as a write (the caller notes the transitions: `note_transitions`)."""
    return Write(INSERT_JOURNAL, _JOURNAL_PART, rows)
