"""Engine, unit of work and retry policy for the ledger database.

`Store.transaction()` is the unit of work: it commits only when its block finishes, and rolls
back on any exception (including cancellation). Transaction functions (`*_txn(conn, ...)`) take
the open connection so they compose; `Store.run()` opens the transaction and retries only
errors that are retryable (connection loss, serialization failure, SQLite busy).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from effectledger_core.errors import StoreUnavailable

from . import hot, pgtx
from .common import NOTIFY_FLAG, TRANSITIONS_KEY
from .rows import JournalRow

log = logging.getLogger(__name__)
T = TypeVar("T")
# Called with the journal rows that changed a state, once their transaction has committed.
OnCommit = Callable[[list[JournalRow]], None]

_NOTIFY = sa.text("SELECT pg_notify('effectledger_outbox', '')")

# SQLSTATEs worth retrying on PostgreSQL: serialization failure, deadlock, connection errors.
_RETRYABLE_SQLSTATES = {"40001", "40P01", "08000", "08003", "08006", "57P01", "57P02", "57P03"}


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = exc.orig
        sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if sqlstate in _RETRYABLE_SQLSTATES:
            return True
        if isinstance(exc, OperationalError):
            text = str(orig).lower()
            return "locked" in text or "busy" in text or "connection" in text
    return isinstance(exc, (ConnectionError, OSError, TimeoutError))


def _unavailable(exc: DBAPIError | OSError) -> StoreUnavailable | None:
    """`StoreUnavailable` (retryable, 503) for a database error of a unit of work when the
    database is unreachable or asks for a retry; None: the error stands as it is. asyncpg
    raises the socket's own error when it cannot connect (refused, reset): unavailable too,
    not an internal error."""
    if isinstance(exc, OSError):
        return StoreUnavailable(f"database unavailable: {type(exc).__name__}")
    if is_retryable(exc):
        return StoreUnavailable(f"database unavailable: {type(exc.orig).__name__}")
    return None


def _sqlite_file(url: sa.URL) -> Path | None:
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db)


# Store.run's waits between tries (see its docstring for why these figures).
RETRY_WAIT = wait_exponential_jitter(multiplier=0.05, max=0.5, jitter=0.05)
RETRY_ATTEMPTS = 10


class Store:
    def __init__(self, url: str, *, pool_size: int = 10, echo: bool = False) -> None:
        parsed = sa.make_url(url)
        self.url = parsed
        self.dialect = parsed.get_backend_name()
        if self.dialect == "sqlite":
            path = _sqlite_file(parsed)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
            # One connection: SQLite has one writer; serialising in the pool avoids
            # "database is locked" from read-to-write lock upgrades.
            self.engine: AsyncEngine = create_async_engine(
                parsed, echo=echo, pool_size=1, max_overflow=0, pool_timeout=60)
            _sqlite_setup(self.engine)
        elif self.dialect == "postgresql":
            # No pool_pre_ping: it costs a round trip per transaction (a quarter of all
            # statements on the hot path). A connection found dead raises a disconnect error,
            # SQLAlchemy invalidates the pool, and `run` retries it as StoreUnavailable.
            # A custom plan for every execution: asyncpg keeps each statement prepared, and
            # PostgreSQL's generic plan for the hot statements, chosen while the tables were
            # small, cost more PostgreSQL CPU the more rows they held (a throwaway harness:
            # claims 0.31 -> 0.84 ms of backend CPU each over 5,000 operations; 0.26-0.38
            # throughout with custom plans). The group commit's held connection is the one
            # exception: what it sends outside a BEGIN finds rows by keys only and is planned
            # once (`pgtx.Pinned`).
            self.engine = create_async_engine(
                parsed, echo=echo, pool_size=pool_size, max_overflow=pool_size,
                pool_recycle=1800,
                connect_args={"server_settings": {"plan_cache_mode": "force_custom_plan"}})
            # `transaction` on PostgreSQL: the ledger's own transaction on the asyncpg
            # connection (pgtx.py), on connections of this same pool in AUTOCOMMIT mode, so
            # SQLAlchemy's adapter never begins one of its own; `read` uses them with no
            # transaction at all (no BEGIN, no COMMIT).
            self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            self._guard = pgtx.PoolGuard(self.engine)
            # A statement through SQLAlchemy's execute joins that transaction, after the
            # writes the hot path deferred (hot.before_sqlalchemy).
            event.listen(self.engine.sync_engine, "before_cursor_execute",
                         hot.before_sqlalchemy)
        else:
            raise ValueError(f"unsupported database {self.dialect!r}: use postgresql or sqlite")
        self.on_commit: OnCommit | None = None  # set by the ledger (observe.Observer)

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    def pinned(self) -> pgtx.Pinned | None:
        """A connection a writer may keep between its transactions (`pgtx.Pinned`); None on
        SQLite, whose one connection is the pool."""
        return pgtx.Pinned(self._autocommit, self._guard) if self.is_postgres else None

    @asynccontextmanager
    async def transaction(self, pinned: pgtx.Pinned | None = None
                          ) -> AsyncIterator[AsyncConnection]:
        changed: list[JournalRow] | None = None
        try:
            begin = (pgtx.transaction(self._autocommit, self._guard, pinned)
                     if self.is_postgres else self.engine.begin())
            async with begin as conn:
                conn.info.pop(NOTIFY_FLAG, None)  # info outlives a checkout: start clean
                conn.info.pop(TRANSITIONS_KEY, None)
                yield conn
                notify = conn.info.pop(NOTIFY_FLAG, False)
                await hot.finish(conn, _NOTIFY if notify else None)
                changed = conn.info.pop(TRANSITIONS_KEY, None)
            if changed and self.on_commit is not None:
                try:
                    self.on_commit(changed)
                except Exception:  # observing must never fail a committed transaction
                    log.exception("commit observer failed")
        except (DBAPIError, OSError) as exc:
            unavailable = _unavailable(exc)
            if unavailable is None:
                raise
            raise unavailable from exc

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A connection for reads only; writes through it would commit one by one.

        On PostgreSQL it runs in autocommit: a read in `transaction()` paid two round trips
        (BEGIN, COMMIT) besides its statements, and submit-and-wait reads twice on an
        operation's critical path. Nothing is lost by it: at READ COMMITTED (the ledger's
        level) every statement takes its own snapshot inside a transaction too, so a read of
        several statements sees what it saw before. SQLite keeps its transaction (one
        connection, and its BEGIN costs no round trip)."""
        if not self.is_postgres:
            async with self.transaction() as conn:
                yield conn
            return
        try:
            async with pgtx.reads(self._autocommit, self._guard) as conn:
                yield conn
        except (DBAPIError, OSError) as exc:
            unavailable = _unavailable(exc)
            if unavailable is None:
                raise
            raise unavailable from exc

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any, attempts: int = RETRY_ATTEMPTS,
                  pinned: pgtx.Pinned | None = None, **kwargs: Any) -> T:
        """Run `fn(conn, *args)` in a fresh transaction, retrying retryable failures (on the
        connection `pinned` holds, if given: a failed try gives it back, so a retry draws a
        fresh one).

        Waits of 0.05, 0.1, 0.2, 0.4 s, then 0.5 s each (plus up to 0.05 s of jitter): about
        3.3 s in all, so a database restart of a few seconds is ridden out, and once it is back
        the next try comes within half a second. tenacity's default jitter (up to 1 s on every
        wait) made the first intent after a database restart wait about a second more than
        the database did; the proving ground counted that as intake unavailable.

        The first try runs outside tenacity: its machinery cost about 50 us of CPU per
        transaction here (three on an agent's call), and nearly every transaction succeeds at
        its first try. Only when that one raised StoreUnavailable does tenacity take over, its
        first attempt re-raising that error, so the tries, waits and stop are tenacity's as
        before.
        """
        async def once() -> T:
            async with self.transaction(pinned) as conn:
                return await fn(conn, *args, **kwargs)

        try:
            return await once()
        except StoreUnavailable as exc:
            failed: StoreUnavailable | None = exc
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(StoreUnavailable),
            stop=stop_after_attempt(attempts),
            wait=RETRY_WAIT,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if failed is not None:
                    first, failed = failed, None
                    raise first  # the first try, made above: tenacity counts it and waits
                return await once()
        raise AssertionError("unreachable")  # pragma: no cover

    async def ping(self) -> bool:
        try:
            async with self.engine.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
            return True
        except Exception:  # readiness probes must answer, not raise
            log.warning("database ping failed", exc_info=True)
            return False

    async def close(self) -> None:
        await self.engine.dispose()


def _sqlite_setup(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take over transaction control from the driver so BEGIN IMMEDIATE is ours to emit.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed intent survives power loss, not only a process crash.
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
