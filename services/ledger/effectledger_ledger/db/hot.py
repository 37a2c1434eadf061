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
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.util import await_

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


async def _driver(conn: AsyncConnection, *, begin: bool = True) -> tuple[Any, Any]:
    """The asyncpg connection, inside the transaction SQLAlchemy has begun on it.

    SQLAlchemy's asyncpg adapter sends BEGIN lazily, with its first statement; a statement
    sent here first must start that same transaction, or it would run (and commit) on its own
    and the adapter's COMMIT would find nothing to commit. With `begin=False` a first statement
    does run on its own, on purpose (see `finish` and `fetch`).
    """
    raw = await conn.get_raw_connection()
    adapter = raw.dbapi_connection
    if adapter is None:  # pragma: no cover - a checked-out connection always has one
        raise RuntimeError("no DBAPI connection")
    if begin and getattr(adapter, "_transaction", None) is None:
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
    driver's executemany, which costs more for a single row. Inside `Store.transaction` on
    PostgreSQL a write may instead wait to be sent with the transaction's next statement
    (see `defer_writes`).
    """
    if not rows:
        return
    if not _direct(conn):
        params: Any = rows[0] if len(rows) == 1 else list(rows)
        await conn.execute(stmt, params)
        return
    c = _compiled(stmt, conn.dialect, tuple(rows[0]))
    target = _written(stmt)
    pending: list[_Write] | None = conn.info.get(_PENDING)
    if pending is not None and target is not None and (
            len(rows) == 1 or (target[1] and len(rows) <= FUSE_ROWS)):
        table, insert = target
        if any(w.table == table and not (insert and w.insert) for w in pending):
            await flush(conn)  # see `_Write`: only INSERTs share a statement with its writes
        args = tuple(a for r in rows for a in _args(c, r))
        pending.append(_Write(_rows_sql(c.sql, len(c.names), len(rows)), args, table, insert))
        return
    await flush(conn)
    if len(rows) == 1:
        await _send(conn, (c.sql, _args(c, rows[0])))
        return
    adapter, driver = await _driver(conn)
    try:
        await driver.executemany(c.sql, [_args(c, r) for r in rows])
    except Exception as exc:
        raise await _translated(conn, adapter, exc, c.sql) from exc


# ---- deferred writes ---------------------------------------------------------------------
#
# A group-committed transaction on the hot path is a few reads followed by writes whose results
# nobody reads (INSERTs of the operation, journal, outbox and attempt rows; the fenced UPDATEs
# of operations and outbox). Sent one by one, each write was a round trip of its own, and at
# moderate load, where a batch holds one or two calls, round trips are what a transaction is
# made of: an intent was BEGIN, three INSERTs and COMMIT. So inside `Store.transaction` such
# writes are kept and sent together as one statement (data-modifying CTEs), just before the
# transaction's next statement of any other kind or its COMMIT. A transaction made only of
# such writes (an intent without a caller key) sends no BEGIN and no COMMIT at all: its one
# statement is its own transaction, committed (and flushed to the WAL) when it returns.

_PENDING = "effectledger_pending_writes"  # conn.info: the writes not sent yet (list)
# A multi-row INSERT up to this many rows is written as one VALUES list and may be fused;
# larger ones (saturation: round trips are shared by many calls already) use executemany.
FUSE_ROWS = 8


class _Write(NamedTuple):
    """A write waiting to be sent. Writes in one statement all see the snapshot from before
    any of them, and PostgreSQL applies only one of two changes to the same row, so a write is
    fused only with writes to other tables, or an INSERT with other INSERTs into its own
    (each of those sees no row of the others either way); otherwise what waits goes first."""
    sql: str  # parameters numbered from $1
    args: tuple[Any, ...]
    table: str
    insert: bool


def _written(stmt: sa.Executable) -> tuple[str, bool] | None:
    """The table `stmt` writes and whether it only inserts; None for any other statement
    (a read, or a write with RETURNING or ON CONFLICT, whose result someone reads)."""
    if isinstance(stmt, sa.Insert):
        if stmt._returning or stmt._post_values_clause is not None:
            return None
    elif not isinstance(stmt, (sa.Update, sa.Delete)) or stmt._returning:
        return None
    name = getattr(stmt.table, "name", None)
    return (name, isinstance(stmt, sa.Insert)) if isinstance(name, str) else None


_PARAM = re.compile(r"\$(\d+)")


@functools.lru_cache(maxsize=512)
def _shifted(sql: str, offset: int) -> str:
    return sql if not offset else _PARAM.sub(lambda m: f"${int(m[1]) + offset}", sql)


@functools.lru_cache(maxsize=512)
def _rows_sql(sql: str, per_row: int, n: int) -> str:
    """A one-row `INSERT ... VALUES (...)` as `n` rows, without the RETURNING SQLAlchemy adds
    for a server-made key (nobody reads it); any other statement unchanged."""
    head, sep, values = sql.rpartition(" VALUES ")
    if not sep:
        return sql
    values = values.partition(" RETURNING ")[0]
    if not (values.startswith("(") and values.endswith(")")):
        raise ValueError(f"not a plain INSERT: {sql[:80]}")
    return head + sep + ", ".join(_shifted(values, i * per_row) for i in range(n))


@functools.lru_cache(maxsize=512)
def _fused(parts: tuple[tuple[str, int], ...]) -> str:
    """One statement of several (their SQL and parameter counts): all but the last as
    data-modifying CTEs, which PostgreSQL runs whether or not anything reads them."""
    out, offset = [], 0
    for sql, n in parts:
        out.append(_shifted(sql, offset))
        offset += n
    if len(out) == 1:
        return out[0]
    return "WITH " + ", ".join(f"w{i} AS ({s})" for i, s in enumerate(out[:-1])) + " " + out[-1]


def defer_writes(conn: AsyncConnection) -> None:
    """Let this transaction's writes wait for its next statement (PostgreSQL; see above)."""
    if _direct(conn):
        conn.info[_PENDING] = []


def discard_writes(conn: AsyncConnection) -> None:
    """Forget what waits (the transaction is rolled back) and stop deferring."""
    with contextlib.suppress(Exception):  # an invalidated connection refuses even `info`
        conn.info.pop(_PENDING, None)


def forget_on_checkout(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """The pool's `checkout` event: a connection starts every checkout deferring nothing, even
    when the transaction that last used it could not clean up (its connection was lost)."""
    record.info.pop(_PENDING, None)


def _take(conn: AsyncConnection | sa.Connection, tail: tuple[str, tuple[Any, ...]] | None = None
          ) -> tuple[str, tuple[Any, ...]] | None:
    pending: list[_Write] | None = conn.info.get(_PENDING)
    writes = [(w.sql, w.args) for w in pending or ()]
    if pending:
        pending.clear()
    if tail is not None:
        writes.append(tail)
    if not writes:
        return None
    sql = _fused(tuple((s, len(a)) for s, a in writes))
    return sql, tuple(a for _s, args in writes for a in args)


async def flush(conn: AsyncConnection) -> None:
    """Send the writes that wait, as one statement, inside the transaction."""
    taken = _take(conn)
    if taken is not None:
        await _send(conn, taken)


async def _send(conn: AsyncConnection, taken: tuple[str, tuple[Any, ...]], *,
                begin: bool = True) -> None:
    """Run one statement; with `begin=False` and no transaction begun yet, as its own."""
    sql, args = taken
    adapter, driver = await _driver(conn, begin=begin)
    try:
        await driver.execute(sql, *args)
    except Exception as exc:
        raise await _translated(conn, adapter, exc, sql) from exc


async def finish(conn: AsyncConnection, tail: sa.Executable | None = None) -> None:
    """Before the commit: send what waits, with `tail` (a statement run for its side effect,
    the NOTIFY) as the last part of the same statement (`Store.transaction` then stops
    deferring, with `discard_writes`, whether or not this raised).

    When nothing else has been sent in this transaction, no BEGIN is sent either: the one
    statement is a transaction of its own, and SQLAlchemy's COMMIT finds nothing to commit.
    """
    if not _direct(conn):
        if tail is not None:
            await conn.execute(tail)
        return
    end = None
    if tail is not None:
        c = _compiled(tail, conn.dialect, ())
        end = (c.sql, _args(c, {}))
    taken = _take(conn, end)
    if taken is not None:
        await _send(conn, taken, begin=False)


def flush_before_sqlalchemy(conn: sa.Connection, *_event: Any) -> None:
    """SQLAlchemy's `before_cursor_execute`: a statement sent through SQLAlchemy's own execute
    (a read, a write whose row count is checked) first sends the writes that wait, so it sees
    them and runs after them, as written. It runs in SQLAlchemy's greenlet, hence `await_`;
    an error is raised as the driver's, which SQLAlchemy's execute translates as its own."""
    taken = _take(conn)
    if taken is not None:
        await_(_send_raw(conn.connection.dbapi_connection, taken))


async def _send_raw(adapter: Any, taken: tuple[str, tuple[Any, ...]]) -> None:
    try:
        if getattr(adapter, "_transaction", None) is None:
            await adapter._start_transaction()  # private: see `_driver`
        await adapter._connection.execute(taken[0], *taken[1])
    except Exception as exc:
        if not isinstance(exc, adapter.dbapi.Error):
            adapter._handle_exception(exc)  # raises the DBAPI-level error
        raise


async def fetch(conn: AsyncConnection, stmt: sa.Executable, params: dict[str, Any], *,
                lockless: bool = False) -> Sequence[Mapping[Any, Any]]:
    """The rows `stmt` returns for `params`, as mappings of column name to value.

    On PostgreSQL the values are asyncpg's (timestamps come back aware, in UTC, which is what
    the ledger's UTCDateTime makes of them too); expanding IN parameters are not supported
    there (see `one_of`).

    `lockless`: a plain read (no FOR UPDATE) whose answer a constraint re-checks at the write
    (the intent's read of caller keys: a key committed meanwhile fails the INSERT with a unique
    violation, and the service retries). First in its transaction, it is sent without a BEGIN,
    as a statement of its own: at READ COMMITTED every statement takes its own snapshot, so it
    reads exactly what it would have read inside, and the round trip of the BEGIN is saved.
    """
    if not _direct(conn):
        return (await conn.execute(stmt, params)).mappings().all()
    await flush(conn)  # a read sees the writes before it
    c = _compiled(stmt, conn.dialect, tuple(params))
    adapter, driver = await _driver(conn, begin=not lockless)
    try:
        return await driver.fetch(c.sql, *_args(c, params))  # type: ignore[no-any-return]
    except Exception as exc:
        raise await _translated(conn, adapter, exc, c.sql) from exc
