"""The ledger's own transaction on PostgreSQL, on the asyncpg connection, through public APIs.

The hot path (`hot.py`) needs three things SQLAlchemy's asyncpg adapter does only privately: a
statement sent straight to asyncpg must join the transaction (the adapter sends BEGIN lazily,
with its own first statement); a transaction of one statement, or one starting with a lockless
read, must send no BEGIN at all; and an asyncpg error must come out as the error SQLAlchemy
would raise, the connection taken out of service when it is lost. So on PostgreSQL
`Store.transaction` checks its connection out in AUTOCOMMIT mode, where the adapter never
begins a transaction, and `PgTransaction` begins, commits and rolls back on the asyncpg
connection itself. A statement through SQLAlchemy's execute runs on that same asyncpg
connection, hence inside this transaction (`hot.before_sqlalchemy` begins it first when such a
statement comes first). Everything used is public: `execution_options(isolation_level=...)`,
`AsyncConnection.get_raw_connection().driver_connection`, `AsyncConnection.invalidate()`,
pool events and `InvalidatePoolError`, and asyncpg's `Connection`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

import asyncpg
from sqlalchemy import event, exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

T = TypeVar("T")
TX_KEY = "effectledger_pg_transaction"  # conn.info: the open PgTransaction (hot.py reads it)
# conn.info on a `Store.read()` connection: a PgTransaction that never begins (`hot.read_rows`
# sends each read as a statement of its own, as the AUTOCOMMIT connection would).
READ_KEY = "effectledger_pg_read"
# conn.info on a writer's `Pinned` connection: its session plans statements once (generic
# plans); its transactions begin with `BEGIN_CUSTOM`. See `Pinned`.
GENERIC_KEY = "effectledger_generic_plans"
BEGIN = "BEGIN;"
# One simple-query message, so no round trip more than a BEGIN; SET LOCAL ends with the
# transaction, whether it commits or rolls back.
BEGIN_CUSTOM = "BEGIN; SET LOCAL plan_cache_mode = force_custom_plan;"

# asyncpg's errors as SQLAlchemy's, the same classes its asyncpg dialect maps them to (most
# specific first): IntegrityError is what makes the service retry a lost race, and the
# original error (`orig`) keeps its `sqlstate`, which `store.is_retryable` reads.
_ERRORS: tuple[tuple[type[BaseException], type[exc.DBAPIError]], ...] = (
    (asyncpg.exceptions.IntegrityConstraintViolationError, exc.IntegrityError),
    (asyncpg.exceptions.SyntaxOrAccessError, exc.ProgrammingError),
    (asyncpg.exceptions.InvalidCachedStatementError, exc.NotSupportedError),
    (asyncpg.exceptions.InternalServerError, exc.InternalError),
    (asyncpg.exceptions.InternalClientError, exc.InternalError),
    (asyncpg.exceptions.InterfaceError, exc.InterfaceError),
    (asyncpg.exceptions.PostgresError, exc.DBAPIError),
)


def translated(error: Exception, sql: str, *, lost: bool) -> Exception:
    """`error` as SQLAlchemy's exception for it; an error not asyncpg's is left as it is (a
    socket's OSError: `Store.transaction` makes it StoreUnavailable)."""
    for pg_class, sa_class in _ERRORS:
        if isinstance(error, pg_class):
            return sa_class(sql, None, error, connection_invalidated=lost)
    return error


class PgTransaction:
    """One transaction, begun only when a statement needs it (see `execute`)."""

    __slots__ = ("_begin", "_on_lost", "began", "driver", "lost", "pending", "plans_once")

    def __init__(self, driver: Any, on_lost: Callable[[], None], *, begin: str = BEGIN) -> None:
        self.driver = driver  # the asyncpg Connection
        self._begin = begin
        # A statement sent outside a BEGIN gets a generic plan (`Pinned`): only those that
        # say they may (`hot.fetch(once=True)`, an INSERT-only lone write) are sent so.
        self.plans_once = begin == BEGIN_CUSTOM
        self.began = False
        self.lost = False
        self.pending: list[Any] = []  # hot.py's writes waiting to be sent (hot._Write)
        self._on_lost = on_lost

    async def begin(self) -> None:
        if not self.began:
            self.began = True  # first: a BEGIN cut short is still rolled back (or invalidated)
            await self._guarded(self._begin, self.driver.execute(self._begin))

    async def execute(self, sql: str, args: Sequence[Any], *, begin: bool = True) -> None:
        """Run one statement; with `begin=False` before anything else, as its own
        transaction (committed when it returns), with no BEGIN."""
        if begin:
            await self.begin()
        await self._guarded(sql, self.driver.execute(sql, *args))

    async def fetch(self, sql: str, args: Sequence[Any], *, begin: bool = True) -> Any:
        if begin:
            await self.begin()
        return await self._guarded(sql, self.driver.fetch(sql, *args))

    async def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        await self.begin()
        await self._guarded(sql, self.driver.executemany(sql, rows))

    async def commit(self) -> None:
        if self.began:
            self.began = False  # whatever COMMIT answers, the transaction is over
            await self._guarded("COMMIT;", self.driver.execute("COMMIT;"))

    async def _guarded(self, sql: str, op: Awaitable[T]) -> T:
        try:
            return await op
        except Exception as error:
            # asyncpg closes its connection when the link or the server went away: what
            # SQLAlchemy's asyncpg dialect calls a disconnect, too.
            self.lost = self.driver.is_closed()
            if self.lost:
                self._on_lost()
            raise translated(error, sql, lost=self.lost) from error

    async def end_after_error(self, conn: AsyncConnection) -> None:
        """Roll back; a connection lost, or one that cannot be rolled back, is invalidated
        (closed and never handed out again), as SQLAlchemy's own execute does."""
        if not self.lost and not self.driver.is_closed():
            if not (self.began or self.driver.is_in_transaction()):
                return
            with suppress(Exception):
                await _to_completion(self.driver.execute("ROLLBACK;"))
                self.began = False
                return
        with suppress(Exception):  # already invalidated by SQLAlchemy's own execute, maybe
            await conn.invalidate()


async def _to_completion(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end even if the caller is cancelled meanwhile (then re-raised): a
    rollback abandoned halfway would leave the connection inside a transaction."""
    task = asyncio.ensure_future(coro)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError as err:
            if task.done():
                raise
            cancelled = err
    if cancelled is not None:
        raise cancelled
    return result


@asynccontextmanager
async def transaction(engine: AsyncEngine, guard: PoolGuard, pinned: Pinned | None = None
                      ) -> AsyncIterator[AsyncConnection]:
    """A connection of `engine` (an AUTOCOMMIT view of the store's engine) with a
    `PgTransaction` in `conn.info`, committed when the block finishes, rolled back on any
    exception (cancellation included). With `pinned`, on the connection it holds."""
    if pinned is None:
        async with engine.connect() as conn:
            async with _begun(conn, guard):
                yield conn
        return
    conn = await pinned.connection()
    done = False
    try:
        async with _begun(conn, guard):
            yield conn
        done = True
    finally:
        if not done:  # whatever went wrong, the next transaction starts on a fresh checkout
            await pinned.release()


@asynccontextmanager
async def _begun(conn: AsyncConnection, guard: PoolGuard) -> AsyncIterator[None]:
    driver = (await conn.get_raw_connection()).driver_connection
    # Kept, not looked up again: an invalidated connection's `info` would reconnect.
    info = conn.info
    tx = PgTransaction(driver, guard.lost,
                       begin=BEGIN_CUSTOM if info.get(GENERIC_KEY) else BEGIN)
    info[TX_KEY] = tx
    try:
        yield
        await tx.commit()
    except BaseException:
        await tx.end_after_error(conn)
        raise
    finally:
        info.pop(TX_KEY, None)


class Pinned:
    """One pooled connection kept by one writer between its transactions.

    Each transaction checked a connection out of SQLAlchemy's pool and back in, about 87 us of
    the ledger's CPU each time (the checkout's events and connection characteristics, the
    check-in's reset), three times on an agent's call, on its critical path. The group
    commit's worker runs one transaction at a time, so it keeps its connection instead.

    A held connection is only ever one whose last transaction committed: a transaction that
    fails in any way (an error, a lost connection, cancellation) gives it back, rolled back or
    invalidated as before, and the next one checks out afresh. It is given back, too, when a
    connection was lost anywhere since it was taken (the guard's generation: the pool is
    being replaced) and after `recycle_s`, as the pool itself recycles its connections.

    **Its one-statement transactions are planned once.** The store's connections plan every
    execution afresh (`plan_cache_mode=force_custom_plan`, `store.py`: generic plans of the
    batch statements, chosen while the tables were small, grew costly as they filled). On an
    agent's call alone, that planning was a third of PostgreSQL's work: about 0.12, 0.30 and
    0.43 ms for the intent's, the claim's and the success's one statement, against 0.17-0.28
    ms to execute each (`pg_stat_statements`, docs/benchmark.md). So the held connection's
    session uses generic plans, built at a statement's first execution on it and kept, and
    every transaction it begins (`BEGIN_CUSTOM`) returns to a custom plan for each statement
    inside it. Only two kinds of statement are sent outside a BEGIN there: a call alone's one
    statement (`hot.fetch(once=True)`), which finds its rows by keys only (a status guard is
    checked on the row, `common.on_the_row`), and a lone write made only of INSERTs, which
    reads no table; so their plan is the same whatever the tables hold, an empty table
    included (`tests/integration/test_plans.py` checks the generic plans on an empty
    database and behind a backlog). Anything else that would go without a BEGIN (the intent's
    lockless key reads, `= ANY($1)` whose generic plan, made on a small table, scanned it:
    2.5 ms each in a quick benchmark run) begins the transaction first there. Before the
    connection goes back to the pool its session is reset, and one that cannot be is closed
    (`release`, and `PoolGuard` refuses one that comes back unreset).
    """

    def __init__(self, engine: AsyncEngine, guard: PoolGuard, *, recycle_s: float = 1800.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._engine, self._guard = engine, guard
        self._recycle_s, self._monotonic = recycle_s, monotonic
        self._conn: AsyncConnection | None = None
        self._generation = 0
        self._since = 0.0

    async def connection(self) -> AsyncConnection:
        conn = self._conn
        if conn is not None and (conn.closed or conn.invalidated
                                 or self._generation != self._guard.generation
                                 or self._monotonic() - self._since > self._recycle_s):
            await self.release()
        if self._conn is None:
            conn = await self._engine.connect()  # the guard's checkout event runs
            try:
                driver: Any = (await conn.get_raw_connection()).driver_connection
                await driver.execute("SET plan_cache_mode = force_generic_plan")
                conn.info[GENERIC_KEY] = True
            except BaseException:
                with suppress(Exception):  # never to the pool with an unknown session
                    await _to_completion(conn.invalidate())
                with suppress(Exception):
                    await _to_completion(conn.close())
                raise
            self._conn = conn
            self._generation = self._guard.generation
            self._since = self._monotonic()
        return self._conn

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await _to_completion(_plan_each_time(conn))
        except Exception:
            # A session that may still plan once must not serve anyone else: closed for good.
            with suppress(Exception):
                await _to_completion(conn.invalidate())
        with suppress(Exception):  # a dead connection is closed all the same
            await _to_completion(conn.close())


async def _plan_each_time(conn: AsyncConnection) -> None:
    """Back to the store's default (`force_custom_plan`, the session's startup value)."""
    if conn.closed or conn.invalidated:
        return
    driver: Any = (await conn.get_raw_connection()).driver_connection
    await driver.execute("RESET plan_cache_mode")
    conn.info.pop(GENERIC_KEY, None)


@asynccontextmanager
async def reads(engine: AsyncEngine, guard: PoolGuard) -> AsyncIterator[AsyncConnection]:
    """A connection of `engine` (the AUTOCOMMIT view) for reads, with no transaction: each
    statement is its own. `hot.read_rows` sends its reads straight to asyncpg through a
    `PgTransaction` that is never begun, so an error comes out translated, and a lost
    connection replaces the pool, exactly as in `transaction`."""
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        info = conn.info
        info[READ_KEY] = PgTransaction(driver, guard.lost)
        try:
            yield conn
        finally:
            info.pop(READ_KEY, None)


class PoolGuard:
    """After a lost connection, the whole pool is replaced, as SQLAlchemy's own execute does on
    a disconnect: a database restart or a reset link closed all of them, and one by one each
    transaction drew the next dead one (1.9 s without intake after a reset of eight).

    `lost` only marks it; the pool's next checkout raises `InvalidatePoolError` from the
    `checkout` event, SQLAlchemy's public way to have a pool drop every connection older than
    now. The same event refuses a connection still inside a transaction (one whose rollback
    could not run) and clears what a transaction that could not clean up left in its `info`.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._stale = False
        # Counts the losses: a `Pinned` connection taken before the latest gives itself back.
        self.generation = 0
        event.listen(engine.sync_engine, "checkout", self._checkout)

    def lost(self) -> None:
        self._stale = True
        self.generation += 1

    def _checkout(self, dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        record.info.pop(TX_KEY, None)
        record.info.pop(READ_KEY, None)
        if record.info.pop(GENERIC_KEY, None):
            # A writer's connection given back without its session reset (`Pinned.release`
            # could not): it would plan everything once. Replaced, never handed out.
            raise exc.DisconnectionError("a connection still planning once came back")
        if self._stale:
            self._stale = False
            raise exc.InvalidatePoolError("a connection was lost: replacing the pool's")
        if dbapi_conn.driver_connection.is_in_transaction():
            raise exc.DisconnectionError("connection left inside a transaction")
