"""The hot path's statements on PostgreSQL: compiled by SQLAlchemy once, run by asyncpg.

Intents, claims and outcomes write with a handful of statements per group-commit batch, and
on PostgreSQL most of the ledger's time in them went to SQLAlchemy's execution layer (building
an execution context, processing parameters and results per call), not to asyncpg or the
database. Here a statement built once with SQLAlchemy Core is compiled once per column shape
(SQLAlchemy's own SQL, casts and bind processors, so values are stored exactly as before) and
then sent straight to the asyncpg connection, inside the transaction `pgtx.PgTransaction`
holds on it: asyncpg prepares it once per connection and `executemany` sends a batch's rows in
one round trip. Only SQLAlchemy's and asyncpg's public APIs are used (see `pgtx.py`).

Outside such a transaction (SQLite, or a connection not from `Store.transaction`) the same
calls take SQLAlchemy's ordinary path: `execute_rows` and `fetch` are one code path for the
callers, with two implementations behind them. The statements themselves stay where they are
built (the UPDATE of `operations` in `transitions.py`); this module only executes them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import AdaptedConnection, Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler

from .pgtx import READ_KEY, TX_KEY, PgTransaction
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
    target: tuple[str, bool] | None  # see `_written`
    stmt: sa.Executable  # kept alive, so its id is not reused by another statement
    unnest: _Unnest | None  # the statement for many rows at once, see `_unnested`
    op_param: str | None  # the parameter naming the operation of each row written, if known


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
    binds = compiled.binds
    # Each parameter's bind processor as SQLAlchemy's execute applies it: the dialect's
    # implementation of its type (asyncpg's JSON, ARRAY, ...), not the generic type's.
    processors = tuple(binds[n].type.dialect_impl(dialect).bind_processor(dialect)
                       for n in names)
    fixed = {n: binds[n].effective_value for n in names
             if n not in keys and not binds[n].required}
    target = _written(stmt, compiled.string)
    found = _Compiled(compiled.string, names, processors, fixed, target, stmt,
                      _unnested(compiled.string, names, keys, binds, dialect, target),
                      _operation_param(compiled.string, names, keys, target))
    _COMPILED[(id(stmt), keys)] = found
    return found


def _args(c: _Compiled, row: Mapping[str, Any]) -> tuple[Any, ...]:
    out = []
    for name, proc in zip(c.names, c.processors, strict=True):
        value = row[name] if name in row else c.fixed[name]
        # Always through the processor, None too: a JSON column stores None as JSON null.
        out.append(proc(value) if proc is not None else value)
    return tuple(out)


def direct(conn: AsyncConnection) -> bool:
    """Whether statements on `conn` go straight to asyncpg (PostgreSQL's `Store.transaction`)."""
    return _direct(conn) is not None


def nothing_sent(conn: AsyncConnection) -> bool:
    """Whether `conn`'s transaction (direct, see `direct`) has sent and queued nothing yet: its
    next statement, fetched `lockless`, is then a transaction of its own."""
    tx = _direct(conn)
    return tx is not None and not tx.began and not tx.pending


async def begin(conn: AsyncConnection) -> None:
    """Begin `conn`'s transaction now: every statement after it is inside it, even one that
    would otherwise be a transaction of its own (a rehearsal, which must roll back whole)."""
    tx = _direct(conn)
    if tx:
        await tx.begin()


def _direct(conn: AsyncConnection) -> PgTransaction | None:
    """The transaction statements go straight to asyncpg in (PostgreSQL's `Store.transaction`,
    see `pgtx.py`); None: they go through SQLAlchemy's execute."""
    tx: PgTransaction | None = conn.info.get(TX_KEY)
    return tx


async def execute_rows(conn: AsyncConnection, stmt: sa.Executable, rows: Rows, *,
                       row_key: tuple[str, ...] = ()) -> None:
    """Execute `stmt` once per row of `rows` (nothing for none), in one round trip.

    Every row has the same keys. One row on SQLite goes through a plain execute, not the
    driver's executemany, which costs more for a single row. Inside `Store.transaction` on
    PostgreSQL a write may instead wait to be sent with the transaction's next statement
    (see the deferred writes below).

    `row_key`: for an UPDATE or DELETE, the parameters that pick the table rows each of `rows`
    writes (a primary key, or a key no two of whose values pick the same table row). Given,
    rows with different values of it may wait and be sent with the next statement too.
    """
    if not rows:
        return
    tx = _direct(conn)
    if not tx:
        params: Any = rows[0] if len(rows) == 1 else list(rows)
        await conn.execute(stmt, params)
        return
    c = _compiled(stmt, conn.dialect, tuple(rows[0]))
    parts = _deferrable(c, rows, row_key)
    if parts:
        table, insert = parts[0].table, parts[0].insert
        if any(w.table == table and not (insert and w.insert) for w in tx.pending):
            await _flush(tx)  # see `_Write`: only INSERTs share a statement with its writes
        tx.pending.extend(parts)
        return
    await _flush(tx)
    if len(rows) == 1:
        await tx.execute(c.sql, _args(c, rows[0]))
        return
    await tx.executemany(c.sql, [_args(c, r) for r in rows])


def _deferrable(c: _Compiled, rows: Rows, row_key: tuple[str, ...]) -> list[_Write]:
    """`rows` as writes that may wait (none: send now): one statement for a single row, for
    an INSERT of many (`_unnested`) and for an UPDATE of many whose rows each write a row no
    other writes (`_distinct`, see `_Write`); otherwise, small ones, one VALUES list for an
    INSERT, one part per row for an UPDATE or DELETE of distinct rows."""
    if c.target is None:
        return []
    table, insert = c.target
    if len(rows) > 1 and c.unnest is not None and (insert or _distinct(rows, row_key)):
        return [_Write(c.unnest.sql, _unnest_args(c, c.unnest, rows), table, insert,
                       _operations(c, rows))]
    if len(rows) > FUSE_ROWS:
        return []
    if len(rows) == 1 or insert:
        args = tuple(a for r in rows for a in _args(c, r))
        return [_Write(_rows_sql(c.sql, len(c.names), len(rows)), args, table, insert,
                       _operations(c, rows))]
    if _distinct(rows, row_key):
        return [_Write(c.sql, _args(c, r), table, False, _operations(c, [r])) for r in rows]
    return []


def _distinct(rows: Rows, key: tuple[str, ...]) -> bool:
    """Whether each of `rows` names another table row by `key` (none given: not known)."""
    if not key:
        return False
    names = {tuple(cast(Mapping[str, Any], r)[k] for k in key) for r in rows}
    return len(names) == len(rows)


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

# A multi-row INSERT up to this many rows is written as one VALUES list and may be fused;
# larger ones (saturation: round trips are shared by many calls already) use executemany.
FUSE_ROWS = 8


class _Write(NamedTuple):
    """A write waiting to be sent. Writes in one statement all see the snapshot from before
    any of them, and PostgreSQL applies only one of two changes to the same row, so a write is
    fused only with writes to other tables, an INSERT with other INSERTs into its own (each of
    those sees no row of the others either way), or the rows of one UPDATE with each other
    when each names a different table row (`execute_rows`' `row_key`: a batch of claims moves
    each operation once); otherwise what waits goes first. Unfused, such an UPDATE was an
    executemany of its own: with two claims and two outcomes in a batch, four round trips of
    the twelve a mixed batch made."""
    sql: str  # parameters numbered from $1
    args: tuple[Any, ...]
    table: str
    insert: bool
    operations: frozenset[str] | None  # whose rows it writes (None: not known), see `Reads`


def _written(stmt: sa.Executable, sql: str) -> tuple[str, bool] | None:
    """The table `stmt` writes and whether it only inserts; None for any other statement
    (a read, or a write with RETURNING or ON CONFLICT, whose result someone reads).
    `exported_columns` are a DML statement's own RETURNING columns (not the one the compiler
    adds for a server-made key, see `_rows_sql`); ON CONFLICT is read from the compiled SQL."""
    if isinstance(stmt, sa.Insert):
        if stmt.exported_columns or " ON CONFLICT " in sql:
            return None
    elif not isinstance(stmt, (sa.Update, sa.Delete)) or stmt.exported_columns:
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


# ---- reads that carry the writes before them ----------------------------------------------
#
# A read flushes the writes that wait before it, so it sees them: one more round trip. In a
# mixed group-commit batch that was two of its eight (the intents' writes before the claims'
# locking read, the claims' writes before the outcomes' inbox-and-lock statement), on the one
# writer whose round trips bound the ledger's throughput. A read that says which rows it reads
# (`Reads`: its tables, and the operations whose rows it reads there) instead takes the
# waiting writes along as CTEs of its own statement, when none of them writes a row it reads:
# the read then sees the snapshot from before them, which holds the same rows it would have
# seen after them. A write whose operations are not known (`_Write.operations` None) to a
# table the read reads keeps the flush first.


class Reads(NamedTuple):
    """What a read reads: in these tables, only rows of these operations."""
    tables: frozenset[str]
    operations: frozenset[str]


def _operation_param(sql: str, names: tuple[str, ...], keys: tuple[str, ...],
                     target: tuple[str, bool] | None) -> str | None:
    """The parameter holding the operation of each row the statement writes: an INSERT's
    `id` (into operations) or `operation_id` column, an UPDATE's `= $n` on one of them in its
    WHERE; None if the statement names its rows otherwise (an attempt by its own id)."""
    if target is None:
        return None
    table, insert = target
    column = "id" if table == "operations" else "operation_id"
    if insert:
        return column if column in keys else None
    found = re.search(rf"\b{table}\.{column} = \$(\d+)", sql.partition(" WHERE ")[2])
    name = names[int(found[1]) - 1] if found else None
    return name if name in keys else None


def _operations(c: _Compiled, rows: Sequence[Any]) -> frozenset[str] | None:
    if c.op_param is None:
        return None
    values = {cast(Mapping[str, Any], r)[c.op_param] for r in rows}
    return frozenset(values) if all(isinstance(v, str) for v in values) else None


def _independent(pending: list[_Write], reads: Reads) -> bool:
    """Whether no write in `pending` writes a row `reads` reads."""
    return all(w.table not in reads.tables
               or (w.operations is not None and w.operations.isdisjoint(reads.operations))
               for w in pending)


# ---- many rows, one statement ------------------------------------------------------------
#
# A write of many rows (a batch's journal entries, attempts, operations moved) was sent with
# the driver's executemany: one Bind and Execute per row, and PostgreSQL planned and ran each
# row as a statement of its own (the store plans every execution afresh). At saturation that
# planning was about a third of the server's time in those statements. Written instead as one
# statement over `unnest` of one array per column, the rows are one execution, planned once,
# whatever their number, and the statement may wait to be fused like any other write.
# An UPDATE joins its rows by the same WHERE, so it is only written so when no two rows pick
# the same table row (`execute_rows`' `row_key`): the join would apply one of the two.


class _Unnest(NamedTuple):
    sql: str
    scalars: tuple[int, ...]  # positions (in `_Compiled.names`) sent once, as before
    arrays: tuple[int, ...]  # positions sent as one array of every row's value


def _unnested(sql: str, names: tuple[str, ...], keys: tuple[str, ...], binds: Any,
              dialect: Dialect, target: tuple[str, bool] | None) -> _Unnest | None:
    """`sql` (one row's INSERT ... VALUES, or UPDATE ... WHERE) taking every row's values of
    the parameters in `keys` as arrays: `INSERT INTO t (...) SELECT v.p1, ... FROM unnest(...)
    AS v(p1, ...)`, `UPDATE t SET ... FROM unnest(...) AS v(...) WHERE ...`. Parameters the
    statement carries itself stay single values. None: a shape this does not rewrite (a
    DELETE, a subquery, an array parameter, a statement whose result someone reads)."""
    if target is None or dialect.name != "postgresql":
        return None
    per_row = tuple(i for i, n in enumerate(names) if n in keys)
    scalars = tuple(i for i, n in enumerate(names) if n not in keys)
    types = [binds[names[i]].type for i in per_row]
    if not per_row or any(isinstance(t, sa.ARRAY) for t in types):
        return None
    renamed = {i + 1: f"${j + 1}" for j, i in enumerate(scalars)}
    renamed.update({i + 1: f"v.p{i + 1}" for i in per_row})
    body = _PARAM.sub(lambda m: renamed[int(m[1])], sql)
    arrays = ", ".join(f"${len(scalars) + k + 1}::{dialect.type_compiler_instance.process(t)}[]"
                       for k, t in enumerate(types))
    source = f"unnest({arrays}) AS v({', '.join(f'p{i + 1}' for i in per_row)})"
    if "SELECT" in body or " FROM " in body.partition(" WHERE ")[0]:
        return None
    if target[1]:
        head, sep, values = body.rpartition(" VALUES ")
        values = values.partition(" RETURNING ")[0]  # the server-made key: nobody reads it
        if not sep or not (values.startswith("(") and values.endswith(")")):
            return None
        return _Unnest(f"{head} SELECT {values[1:-1]} FROM {source}", scalars, per_row)
    if not body.startswith("UPDATE ") or body.count(" WHERE ") != 1 or " RETURNING " in body:
        return None
    head, _, where = body.partition(" WHERE ")
    return _Unnest(f"{head} FROM {source} WHERE {where}", scalars, per_row)


def _unnest_args(c: _Compiled, u: _Unnest, rows: Rows) -> tuple[Any, ...]:
    each = [_args(c, r) for r in rows]
    return (*(each[0][i] for i in u.scalars), *([a[i] for a in each] for i in u.arrays))


@functools.lru_cache(maxsize=512)
def _fused(parts: tuple[tuple[str, int], ...]) -> str:
    """One statement of several (their SQL and parameter counts): all but the last as
    data-modifying CTEs, which PostgreSQL runs whether or not anything reads them. A last
    statement with CTEs of its own (a read, `Reads`) gets them after these."""
    out, offset = [], 0
    for sql, n in parts:
        out.append(_shifted(sql, offset))
        offset += n
    if len(out) == 1:
        return out[0]
    ctes = ", ".join(f"w{i} AS ({s})" for i, s in enumerate(out[:-1]))
    last = out[-1]
    # RECURSIVE belongs to the whole list, and plain CTEs may stand in a recursive one.
    head = next((h for h in ("WITH RECURSIVE ", "WITH ") if last.startswith(h)), None)
    if head is not None:
        return f"{head}{ctes}, {last.removeprefix(head)}"
    return f"WITH {ctes} {last}"


def _take(tx: PgTransaction, tail: tuple[str, tuple[Any, ...]] | None = None
          ) -> tuple[str, tuple[Any, ...]] | None:
    """What waits, with `tail`, as one statement (None: nothing waits)."""
    writes = [(w.sql, w.args) for w in tx.pending]
    tx.pending.clear()
    if tail is not None:
        writes.append(tail)
    if not writes:
        return None
    sql = _fused(tuple((s, len(a)) for s, a in writes))
    return sql, tuple(a for _s, args in writes for a in args)


async def _flush(tx: PgTransaction) -> None:
    taken = _take(tx)
    if taken is not None:
        await tx.execute(*taken)


async def flush(conn: AsyncConnection) -> None:
    """Send the writes that wait, as one statement, inside the transaction."""
    tx = _direct(conn)
    if tx:
        await _flush(tx)


async def finish(conn: AsyncConnection, tail: sa.Executable | None = None) -> None:
    """Before the commit: send what waits, with `tail` (a statement run for its side effect,
    the NOTIFY) as the last part of the same statement.

    When nothing else has been sent in this transaction, no BEGIN is sent either: the one
    statement is a transaction of its own, and there is nothing left to commit.
    """
    tx = _direct(conn)
    if not tx:
        if tail is not None:
            await conn.execute(tail)
        return
    end = None
    if tail is not None:
        c = _compiled(tail, conn.dialect, ())
        end = (c.sql, _args(c, {}))
    # Planned once where the connection plans outside a BEGIN once (`pgtx.Pinned`): only
    # INSERTs, which read no table (the tail, a NOTIFY, reads none either).
    begin = tx.plans_once and not all(w.insert for w in tx.pending)
    taken = _take(tx, end)
    if taken is not None:
        await tx.execute(*taken, begin=begin)


def before_sqlalchemy(conn: sa.Connection, *_event: Any) -> None:
    """SQLAlchemy's `before_cursor_execute`: a statement sent through SQLAlchemy's own execute
    (a read, a write whose row count is checked) runs inside the transaction, begun first if it
    comes first, and after the writes that wait, so it sees them, as written. The event runs
    in SQLAlchemy's greenlet: `AdaptedConnection.run_async` awaits from there. An error is
    raised as SQLAlchemy's exception (`pgtx.translated`), which its execute passes on."""
    tx: PgTransaction | None = conn.info.get(TX_KEY)
    if tx is None or (tx.began and not tx.pending):
        return
    adapted = cast(AdaptedConnection, conn.connection.dbapi_connection)
    adapted.run_async(lambda _driver: _ready(tx))


async def _ready(tx: PgTransaction) -> None:
    await tx.begin()
    await _flush(tx)


async def fetch(conn: AsyncConnection, stmt: sa.Executable, params: dict[str, Any], *,
                lockless: bool = False, once: bool = False, reads: Reads | None = None
                ) -> Sequence[Mapping[Any, Any]]:
    """The rows `stmt` returns for `params`, as mappings of column name to value.

    On PostgreSQL the values are asyncpg's (timestamps come back aware, in UTC, which is what
    the ledger's UTCDateTime makes of them too); expanding IN parameters are not supported
    there (see `one_of`).

    `lockless`: a plain read (no FOR UPDATE) whose answer a constraint re-checks at the write
    (the intent's read of caller keys: a key committed meanwhile fails the INSERT with a unique
    violation, and the service retries). First in its transaction, it is sent without a BEGIN,
    as a statement of its own: at READ COMMITTED every statement takes its own snapshot, so it
    reads exactly what it would have read inside, and the round trip of the BEGIN is saved.
    Also a write that is all its transaction needs when it comes first
    (`transitions.apply_alone`): it commits when it returns; later, it is part of the
    transaction.

    `once`: `stmt` finds its rows by keys only, so a plan made once for any arguments is as
    good as one made for these. On the writer's connection, which plans once what it sends
    outside a BEGIN (`pgtx.Pinned`), a lockless statement without it begins the transaction
    first.

    `reads`: which rows the read reads; given, the writes that wait may go in its statement
    (see `Reads`), else they are sent first.
    """
    tx = _direct(conn)
    if not tx:
        return (await conn.execute(stmt, params)).mappings().all()
    c = _compiled(stmt, conn.dialect, tuple(params))
    sql, args = c.sql, _args(c, params)
    alone = lockless and (once or not tx.plans_once)
    if tx.pending and reads is not None and _independent(tx.pending, reads):
        taken = _take(tx, (sql, args))  # the writes that wait, as CTEs of this read
        assert taken is not None  # a tail was given
        (sql, args), alone = taken, False  # it writes: inside the transaction
    else:
        await _flush(tx)  # a read sees the writes before it
    rows: Sequence[Mapping[Any, Any]] = await tx.fetch(sql, args, begin=not alone)
    return rows


async def read_rows(conn: AsyncConnection, stmt: sa.Executable, params: dict[str, Any]
                    ) -> Sequence[Mapping[Any, Any]]:
    """The rows of a read, as `fetch` gives them, on any connection of the store.

    On a `Store.read()` connection on PostgreSQL the statement goes straight to asyncpg, as a
    statement of its own (no transaction, as the connection's AUTOCOMMIT says): SQLAlchemy's
    execution layer cost a submit-and-wait's answer more than the database did (the two reads
    of an operation's view: 1.6 ms through it against 0.4 ms direct, one at a time on an idle
    2-core VM). Inside `Store.transaction` it is `fetch`; elsewhere SQLAlchemy's execute.
    """
    if _direct(conn):
        return await fetch(conn, stmt, params)
    reader: PgTransaction | None = conn.info.get(READ_KEY)
    if reader is None:
        return (await conn.execute(stmt, params)).mappings().all()
    c = _compiled(stmt, conn.dialect, tuple(params))
    rows: Sequence[Mapping[Any, Any]] = await reader.fetch(c.sql, _args(c, params), begin=False)
    return rows
