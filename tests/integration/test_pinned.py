"""The group commit's worker keeps its connection between transactions (`pgtx.Pinned`) and
gives it back whenever that connection may not be sound: PostgreSQL only (SQLite's one
connection is the pool)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_ledger.db import hot, pgtx
from effectledger_ledger.db.batch import GroupCommit
from effectledger_ledger.db.common import append_journal
from effectledger_ledger.db.store import Store
from tests.support.ledger import NOW


async def write(conn: AsyncConnection, n: int) -> int:
    await append_journal(conn, operation_id=None, at=NOW, kind="t", actor="test",
                         detail={"n": n})
    return n


async def fail(conn: AsyncConnection, n: int) -> int:
    await write(conn, n)
    raise ValueError("refused")


async def backend(conn: AsyncConnection) -> int:
    return int((await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one())


@contextmanager
def checkouts(store: Store) -> Iterator[list[int]]:
    """The pool checkouts made meanwhile (one entry each)."""
    seen: list[int] = []

    def on_checkout(*_: Any) -> None:
        seen.append(1)

    event.listen(store.engine.sync_engine, "checkout", on_checkout)
    try:
        yield seen
    finally:
        event.remove(store.engine.sync_engine, "checkout", on_checkout)


async def written(store: Store) -> list[int]:
    async with store.read() as conn:
        rows = (await conn.execute(sa.text("SELECT detail FROM journal"))).scalars().all()
    return sorted(r["n"] for r in rows)


@pytest.fixture
def pg(store: Store) -> Store:
    if not store.is_postgres:
        pytest.skip("SQLite has one connection: the pool is that connection")
    return store


async def test_one_transaction_after_another_checks_out_once(pg: Store) -> None:
    group = GroupCommit(pg, name="t", max_batch=64)
    try:
        with checkouts(pg) as seen:
            pids = [await group.run(backend) for _ in range(10)]
            for i in range(5):
                assert await group.run(write, i) == i
    finally:
        await group.close()
    assert len(seen) == 1 and len(set(pids)) == 1
    assert await written(pg) == list(range(5))


async def test_a_failed_transaction_gives_its_connection_back(pg: Store) -> None:
    group = GroupCommit(pg, name="t", max_batch=64)
    try:
        with checkouts(pg) as seen:
            assert await group.run(write, 1) == 1
            with pytest.raises(ValueError, match="refused"):
                await group.run(fail, 2)
            assert await group.run(write, 3) == 3
            assert await group.run(write, 4) == 4
        # Given back rolled back, to the pool: only the fresh one is still out.
        assert pg.engine.sync_engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    finally:
        await group.close()
    assert len(seen) == 2  # the first, and a fresh one after the failure
    assert await written(pg) == [1, 3, 4]  # nothing of the failed call


async def test_a_connection_lost_anywhere_makes_the_worker_take_a_fresh_one(pg: Store) -> None:
    group = GroupCommit(pg, name="t", max_batch=64)
    try:
        first = await group.run(backend)
        pg._guard.lost()  # another transaction lost its connection: the pool is replaced
        second = await group.run(backend)
    finally:
        await group.close()
    assert first != second


async def test_a_killed_pinned_connection_costs_a_retry_not_the_call(pg: Store) -> None:
    group = GroupCommit(pg, name="t", max_batch=64)
    try:
        victim = await group.run(backend)
        async with pg.read() as conn:
            await conn.execute(sa.text(f"SELECT pg_terminate_backend({victim})"))
        assert await group.run(write, 7) == 7  # Store.run retried on a fresh connection
        assert await group.run(backend) != victim
    finally:
        await group.close()
    assert await written(pg) == [7]


async def test_closing_the_group_gives_the_connection_back(pg: Store) -> None:
    group = GroupCommit(pg, name="t", max_batch=64)
    await group.run(write, 1)
    assert pg.engine.sync_engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    await group.close()
    assert pg.engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]


# ---- the writer's connection plans its one-statement transactions once ---------------------

SHOW = sa.text("SELECT current_setting('plan_cache_mode') AS mode")


async def plan_modes(conn: AsyncConnection) -> tuple[str, str]:
    """(outside a BEGIN, inside one) on `conn`: a statement first that may be planned once,
    sent as a call alone's one statement is, then a read inside the transaction."""
    [alone] = await hot.fetch(conn, SHOW, {}, lockless=True, once=True)
    [inside] = await hot.fetch(conn, SHOW, {})
    return alone["mode"], inside["mode"]


async def lockless_mode(conn: AsyncConnection) -> str:
    """A lockless read that does not say it may be planned once (an intent's key read)."""
    [row] = await hot.fetch(conn, SHOW, {}, lockless=True)
    return str(row["mode"])


async def session_mode(store: Store) -> str:
    async with store.read() as conn:
        return str((await conn.execute(sa.text("SHOW plan_cache_mode"))).scalar_one())


async def test_the_writers_statements_alone_are_planned_once_the_others_each_time(
        pg: Store) -> None:
    group = GroupCommit(pg, name="t", max_batch=64)
    try:
        assert await group.run(plan_modes) == ("force_generic_plan", "force_custom_plan")
        assert await group.run(plan_modes) == ("force_generic_plan", "force_custom_plan")
        assert await group.run(lockless_mode) == "force_custom_plan"  # it began first
        # Every other connection of the store plans each execution.
        assert await session_mode(pg) == "force_custom_plan"
        async with pg.transaction() as conn:
            assert await plan_modes(conn) == ("force_custom_plan", "force_custom_plan")
    finally:
        await group.close()


async def test_a_connection_given_back_plans_each_time_again(pg: Store) -> None:
    group = GroupCommit(pg, name="t", max_batch=64)
    try:
        pid = await group.run(backend)
        with pytest.raises(ValueError, match="refused"):
            await group.run(fail, 1)  # gives the connection back to the pool
    finally:
        await group.close()
    async with pg.read() as conn:  # the pool's only idle connection: the writer's
        assert await backend(conn) == pid
        assert (await conn.execute(sa.text("SHOW plan_cache_mode"))).scalar_one() == (
            "force_custom_plan")


async def test_a_connection_that_could_not_be_reset_never_serves_again(
        pg: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async def unreachable(conn: AsyncConnection) -> None:
        raise OSError("the server went away")

    monkeypatch.setattr(pgtx, "_plan_each_time", unreachable)
    group = GroupCommit(pg, name="t", max_batch=64)
    try:
        pid = await group.run(backend)
    finally:
        await group.close()  # gives it back: the reset fails, so it is closed for good
    async with pg.read() as conn:
        assert await backend(conn) != pid
        assert (await conn.execute(sa.text("SHOW plan_cache_mode"))).scalar_one() == (
            "force_custom_plan")


async def test_the_pool_refuses_a_connection_that_came_back_unreset(pg: Store) -> None:
    """Should a writer's connection reach the pool still planning once (its reset skipped),
    the pool's checkout replaces it rather than hand it out."""
    pinned = pg.pinned()
    assert pinned is not None
    conn = await pinned.connection()
    pid = await backend(conn)
    await conn.close()  # to the pool without `Pinned.release`: not reset
    assert await session_mode(pg) == "force_custom_plan"
    async with pg.read() as again:
        assert await backend(again) != pid
