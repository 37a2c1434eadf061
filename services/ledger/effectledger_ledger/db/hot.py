"""The hot path's statements on PostgreSQL: compiled by SQLAlchemy once, run by asyncpg.

Intents, claims and outcomes write with a handful of statements per group-commit batch, and
on PostgreSQL most of the ledger's time in them went to SQLAlchemy's execution layer (building
an execution context, processing parameters and results per call), not to asyncpg or the
database. Here a statement built once with SQLAlchemy Core is compiled once per column shape
(SQLAlchemy's own SQL, casts and bind processors, so values are stored exactly as before) and
then sent straight to the asyncpg connection, inside the transaction SQLAlchemy holds: asyncpg
prepares it once per connection and `executemany` sends a batch's rows in one round trip.

SQLite takes SQLAlchemy's ordinary path: `execute_rows` and `fetch` are one code path for the
callers, with two implementations behind them. The statements themselves stay where they are
built (the UPDATE of `operations` in `transitions.py`); this module only executes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler

from .rows import JournalRow

Rows = Sequence[dict[str, Any]] | Sequence[JournalRow]
DIALECTS = ("postgresql", "sqlite")


def one_of(column: sa.ColumnElement[Any], name: str, dialect: str) -> sa.ColumnElement[bool]:
    """`column` in the list parameter `name`: on PostgreSQL `= ANY(array)`, one statement text
    for any length (an expanding IN renders, and asyncpg prepares, one per length)."""
    if dialect == "postgresql":
        return column == sa.any_(sa.bindparam(name, type_=postgresql.ARRAY(column.type)))
    return column.in_(sa.bindparam(name, expanding=True))


class _Compiled(NamedTuple):
    sql: str
    names: tuple[str, ...]  # the parameters, in positional order
    processors: tuple[Callable[[Any], Any] | None, ...]
    fixed: dict[str, Any]  # values the statement carries itself (literals bound as parameters)
    stmt: sa.Executable  # kept alive, so its id is not reused by another statement


_COMPILED: dict[tuple[int, tuple[str, ...]], _Compiled] = {}


def _compiled(stmt: sa.Executable, dialect: Dialect, keys: tuple[str, ...]) -> _Compiled:
    found = _COMPILED.get((id(stmt), keys))
    if found is not None and found.stmt is stmt:
        return found
    # The column keys matter for an INSERT: it names only the columns its rows carry, so a
    # server default (the journal's id) applies to the others, as with SQLAlchemy's execute.
    compiled = cast(SQLCompiler, cast(sa.ClauseElement, stmt).compile(
        dialect=dialect, column_keys=list(keys)))
    names = tuple(compiled.positiontup or ())
    bind: dict[str, Any] = dict(compiled._bind_processors)  # SQLAlchemy's own, per type
    fixed = {n: compiled.binds[n].effective_value for n in names
             if n not in keys and not compiled.binds[n].required}
    found = _Compiled(compiled.string, names, tuple(bind.get(n) for n in names), fixed, stmt)
    _COMPILED[(id(stmt), keys)] = found
    return found


def _args(c: _Compiled, row: Mapping[str, Any]) -> tuple[Any, ...]:
    out = []
    for name, proc in zip(c.names, c.processors, strict=True):
        value = row[name] if name in row else c.fixed[name]
        # Always through the processor, None too: a JSON column stores None as JSON null.
        out.append(proc(value) if proc is not None else value)
    return tuple(out)


def _direct(conn: AsyncConnection) -> bool:
    """Whether statements go straight to asyncpg (PostgreSQL) or through SQLAlchemy."""
    return conn.dialect.name == "postgresql"


async def _driver(conn: AsyncConnection) -> tuple[Any, Any]:
    """The asyncpg connection, inside the transaction SQLAlchemy has begun on it.

    SQLAlchemy's asyncpg adapter sends BEGIN lazily, with its first statement; a statement
    sent here first must start that same transaction, or it would run (and commit) on its own
    and the adapter's COMMIT would find nothing to commit.
    """
    raw = await conn.get_raw_connection()
    adapter = raw.dbapi_connection
    if adapter is None:  # pragma: no cover - a checked-out connection always has one
        raise RuntimeError("no DBAPI connection")
    if getattr(adapter, "_transaction", None) is None:
        try:
            await adapter._start_transaction()  # private: see the docstring
        except Exception as exc:  # BEGIN is the first thing to find a connection gone
            raise await _translated(conn, adapter, exc, "BEGIN") from exc
    return adapter, raw.driver_connection


async def _translated(conn: AsyncConnection, adapter: Any, exc: Exception, sql: str
                      ) -> Exception:
    """An asyncpg error as SQLAlchemy would raise it (IntegrityError, retryable sqlstates).

    A lost connection is also handled as SQLAlchemy's own execute does: the connection is
    invalidated (never handed out again by the pool) and the error says so, which is what makes
    `Store.run` retry it. Without that, a connection a database restart had closed went back to
    the pool and every transaction that drew it answered 500 ("connection is closed"): 118
    refused intents in one proving-ground seed.
    """
    try:
        if isinstance(exc, adapter.dbapi.Error):
            raise exc  # the adapter has translated it already (its BEGIN does)
        adapter._handle_exception(exc)  # raises the DBAPI-level error
    except Exception as dbapi_exc:
        lost = conn.dialect.is_disconnect(cast(Any, dbapi_exc), adapter, None)
        if lost:
            with contextlib.suppress(Exception):
                # What SQLAlchemy's own execute does on a disconnect: the whole pool, not just
                # this connection (a database restart or a reset link closed all of them; one
                # by one, each transaction drew the next dead one: 1.9 s without intake after
                # a reset of eight connections). Private: `Pool._invalidate`.
                raw = await conn.get_raw_connection()
                conn.sync_engine.pool._invalidate(raw, dbapi_exc)
                await conn.invalidate(dbapi_exc)
        return DBAPIError.instance(sql, None, dbapi_exc, adapter.dbapi.Error,
                                   connection_invalidated=lost)
    return exc  # pragma: no cover - _handle_exception always raises


async def execute_rows(conn: AsyncConnection, stmt: sa.Executable, rows: Rows) -> None:
    """Execute `stmt` once per row of `rows` (nothing for none), in one round trip.

    Every row has the same keys. One row on SQLite goes through a plain execute, not the
    driver's executemany, which costs more for a single row.
    """
    if not rows:
        return
    if not _direct(conn):
        params: Any = rows[0] if len(rows) == 1 else list(rows)
        await conn.execute(stmt, params)
        return
    c = _compiled(stmt, conn.dialect, tuple(rows[0]))
    adapter, driver = await _driver(conn)
    try:
        if len(rows) == 1:
            await driver.execute(c.sql, *_args(c, rows[0]))
        else:
            await driver.executemany(c.sql, [_args(c, r) for r in rows])
    except Exception as exc:
        raise await _translated(conn, adapter, exc, c.sql) from exc


async def fetch(conn: AsyncConnection, stmt: sa.Executable, params: dict[str, Any]
                ) -> Sequence[Mapping[Any, Any]]:
    """The rows `stmt` returns for `params`, as mappings of column name to value.

    On PostgreSQL the values are asyncpg's (timestamps come back aware, in UTC, which is what
    the ledger's UTCDateTime makes of them too); expanding IN parameters are not supported
    there (see `one_of`).
    """
    if not _direct(conn):
        return (await conn.execute(stmt, params)).mappings().all()
    c = _compiled(stmt, conn.dialect, tuple(params))
    adapter, driver = await _driver(conn)
    try:
        return await driver.fetch(c.sql, *_args(c, params))  # type: ignore[no-any-return]
    except Exception as exc:
        raise await _translated(conn, adapter, exc, c.sql) from exc
