"""Group commit on both databases: shared transactions, per-call results, isolation on failure."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_ledger.db.batch import EXPRESS_AFTER, URGENT_TOP_UP, GroupCommit
from effectledger_ledger.db.calls import BatchCall
from effectledger_ledger.db.common import append_journal
from effectledger_ledger.db.outbox import mark_published_txn
from effectledger_ledger.db.schema import OUTBOX_PUBLISHING, journal, outbox
from effectledger_ledger.db.store import Store
from tests.support.ledger import NOW


async def write(conn: AsyncConnection, n: int) -> int:
    await append_journal(conn, operation_id=None, at=NOW, kind="t", actor="test",
                         detail={"n": n})
    return n * 10


async def write_then_fail(conn: AsyncConnection, n: int) -> int:
    await append_journal(conn, operation_id=None, at=NOW, kind="t", actor="test",
                         detail={"n": n})
    raise ValueError(f"call {n} refuses")


async def written(store: Store) -> list[int]:
    async with store.transaction() as conn:
        rows = (await conn.execute(sa.select(journal.c.detail))).scalars().all()
    return sorted(r["n"] for r in rows)


async def test_concurrent_calls_share_one_transaction_and_get_their_own_results(
        store: Store) -> None:
    group = GroupCommit(store, name="t", max_batch=64, workers=2)
    try:
        results = await asyncio.gather(*(group.run(write, i) for i in range(50)))
    finally:
        await group.close()
    assert results == [i * 10 for i in range(50)]
    assert await written(store) == list(range(50))
    # All 50 were queued before a worker ran: one transaction, one commit.
    assert (group.stats.batches, group.stats.calls, group.stats.largest) == (1, 50, 50)


async def test_batches_never_exceed_max_batch(store: Store) -> None:
    group = GroupCommit(store, name="t", max_batch=4)
    try:
        results = await asyncio.gather(*(group.run(write, i) for i in range(10)))
    finally:
        await group.close()
    assert results == [i * 10 for i in range(10)]
    assert group.stats.largest == 4 and group.stats.calls == 10
    assert await written(store) == list(range(10))


async def test_a_failing_call_fails_alone_and_half_applies_nothing(store: Store) -> None:
    group = GroupCommit(store, name="t", max_batch=64)
    calls = [group.run(write_then_fail if i == 3 else write, i) for i in range(8)]
    try:
        results = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await group.close()
    assert isinstance(results[3], ValueError) and str(results[3]) == "call 3 refuses"
    assert [r for i, r in enumerate(results) if i != 3] == [i * 10 for i in range(8) if i != 3]
    # The failing call's own write was rolled back with the batch and not replayed.
    assert await written(store) == [0, 1, 2, 4, 5, 6, 7]
    assert group.stats.fallbacks == 1


async def test_close_fails_running_and_queued_calls_and_commits_nothing(store: Store) -> None:
    group = GroupCommit(store, name="t", max_batch=2)
    entered, release = asyncio.Event(), asyncio.Event()

    async def blocked(conn: AsyncConnection, n: int) -> int:
        await write(conn, n)
        entered.set()
        await release.wait()  # never set: the batch is cancelled mid-transaction
        return n

    calls = [asyncio.ensure_future(group.run(blocked if i == 0 else write, i))
             for i in range(5)]
    await entered.wait()
    await group.close()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert await written(store) == []


@dataclass(frozen=True, slots=True)
class UrgentWrite(BatchCall[int]):
    """A typed call someone waits for (like an intent or a claim)."""

    urgent: ClassVar[bool] = True
    n: int

    @classmethod
    async def many(cls, conn: AsyncConnection, calls: Sequence[UrgentWrite]) -> list[int]:
        return [await write(conn, c.n) for c in calls]


class Gate:
    """A transaction function that holds the group-commit worker until released."""

    def __init__(self) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def blocked(self, conn: AsyncConnection, n: int) -> int:
        self.entered.set()
        await self.release.wait()
        return await write(conn, n)


async def test_urgent_calls_go_ahead_of_queued_background_calls(store: Store) -> None:
    """An intent queued behind a backlog of outcomes runs in the next batch, not after them."""
    group = GroupCommit(store, name="t", max_batch=4)
    gate = Gate()
    order: list[int] = []

    def done(n: int) -> None:
        order.append(n)

    try:
        first = asyncio.ensure_future(group.run(gate.blocked, 0))
        await gate.entered.wait()  # the worker holds batch 1; everything below queues behind it
        background = [asyncio.ensure_future(group.run(write, i)) for i in range(1, 9)]
        urgent = asyncio.ensure_future(group.call(UrgentWrite(100)))
        for n, fut in [(0, first), *zip(range(1, 9), background, strict=True), (100, urgent)]:
            fut.add_done_callback(lambda _f, n=n: done(n))
        gate.release.set()
        results = await asyncio.gather(first, *background, urgent)
    finally:
        await group.close()
    assert results == [0, *(i * 10 for i in range(1, 9)), 1000]
    # Batches: [0], then [100, 1, 2, 3] (the urgent call first, topped up), [4..7], [8].
    assert order[:2] == [0, 100], order
    assert sorted(order) == [0, *range(1, 9), 100]
    assert group.stats.batches == 4, group.stats
    assert group.stats.largest == 4
    assert await written(store) == [*range(9), 100]


async def test_a_batch_with_urgent_calls_takes_few_background_calls(store: Store) -> None:
    """An intent is not made to wait for the commit of a backlog of outcomes topped up beside it,
    and the backlog still moves with every urgent batch (it cannot starve)."""
    group = GroupCommit(store, name="t", max_batch=64)
    gate = Gate()
    committed: list[int] = []

    try:
        first = asyncio.ensure_future(group.run(gate.blocked, 0))
        await gate.entered.wait()  # everything below queues behind the worker's first batch
        background = [asyncio.ensure_future(group.run(write, i)) for i in range(1, 41)]
        urgent = [asyncio.ensure_future(group.call(UrgentWrite(n))) for n in (100, 101, 102)]
        for n, fut in [*zip(range(1, 41), background, strict=True),
                       *zip((100, 101, 102), urgent, strict=True)]:
            fut.add_done_callback(lambda _f, n=n: committed.append(n))
        gate.release.set()
        await asyncio.gather(first, *background, *urgent)
    finally:
        await group.close()
    # Batches: [0], [100, 101, 102, 1..8] (URGENT_TOP_UP = 8 > 2 x 3; not 3 + 40), [9..40].
    assert URGENT_TOP_UP == 8
    assert group.stats.batches == 3, group.stats
    assert sorted(committed[:11]) == [*range(1, 9), 100, 101, 102], committed
    assert group.stats.largest == 32
    assert sorted(await written(store)) == [*range(41), 100, 101, 102]


async def test_an_urgent_call_runs_beside_a_large_background_batch(store: Store) -> None:
    """An intent arriving while the worker commits a backlog of outcomes does not wait for it."""
    if not store.is_postgres:
        pytest.skip("one connection on SQLite: a second transaction would only wait for it")
    group = GroupCommit(store, name="t", max_batch=64)
    gate = Gate()
    try:
        # One batch of background calls, held open inside its transaction by the first.
        backlog = [asyncio.ensure_future(group.run(gate.blocked, 0)),
                   *(asyncio.ensure_future(group.run(write, i)) for i in range(1, EXPRESS_AFTER))]
        await gate.entered.wait()
        assert await asyncio.wait_for(group.call(UrgentWrite(100)), 10) == 1000
        assert not any(f.done() for f in backlog)  # the backlog's batch is still open
        gate.release.set()
        await asyncio.gather(*backlog)
    finally:
        await group.close()
    assert (group.stats.batches, group.stats.largest) == (2, EXPRESS_AFTER)
    assert await written(store) == [*range(EXPRESS_AFTER), 100]


async def test_max_batch_one_is_plain_store_run(store: Store) -> None:
    group = GroupCommit(store, name="t", max_batch=1)
    assert await asyncio.gather(*(group.run(write, i) for i in range(3))) == [0, 10, 20]
    assert group.stats.batches == 0  # never queued
    with pytest.raises(ValueError):
        GroupCommit(store, name="t", max_batch=0)


async def test_mark_published_skips_a_row_a_claim_holds_instead_of_waiting(
        store: Store) -> None:
    """A row locked by a claim batch is skipped (the claim consumes it), never waited for."""
    if not store.is_postgres:
        pytest.skip("row locks: PostgreSQL only (SQLite has one writer at a time)")
    async with store.transaction() as conn:
        for row_id in ("a", "b"):
            await conn.execute(outbox.insert().values(
                id=row_id, operation_id=f"op-{row_id}", epoch=1, kind="dispatch", subject="s",
                payload="{}", status=OUTBOX_PUBLISHING, created_at=NOW, available_at=NOW,
                lease_until=NOW + timedelta(seconds=30), publish_count=0))
    holder = await store.engine.connect()
    try:
        await holder.begin()
        await holder.execute(outbox.update().where(outbox.c.id == "a").values(status="consumed"))
        # Without SKIP LOCKED this waits for `holder` forever; the timeout turns that into a
        # failure instead of a hung test run.
        n = await asyncio.wait_for(
            store.run(mark_published_txn, ["a", "b"], now=NOW, seqs={"a": 7, "b": 8}), 30)
        await holder.commit()
    finally:
        await holder.close()
    assert n == 1
    async with store.transaction() as conn:
        got = {r.id: (r.status, r.stream_seq) for r in
               (await conn.execute(sa.select(outbox.c.id, outbox.c.status, outbox.c.stream_seq)))}
    assert got == {"a": ("consumed", None), "b": ("published", 8)}


async def test_with_two_writers_a_call_does_not_wait_for_another_transactions_commit(
        store: Store) -> None:
    """While one writer's transaction is held open, a second call is served and committed by
    the other writer (the reason PostgreSQL's default is two, config.default_batch_workers)."""
    if not store.is_postgres:
        pytest.skip("SQLite has one connection: its ledger has one writer")
    entered, release = asyncio.Event(), asyncio.Event()

    async def held(conn: AsyncConnection, n: int) -> int:
        entered.set()
        await release.wait()
        return await write(conn, n)

    group = GroupCommit(store, name="t", max_batch=64, workers=2)
    try:
        first = asyncio.create_task(group.run(held, 1))
        await entered.wait()
        assert await asyncio.wait_for(group.run(write, 2), 10) == 20
        assert await written(store) == [2]  # committed while the first is still open
        release.set()
        assert await first == 10
    finally:
        release.set()
        await group.close()
    assert await written(store) == [1, 2]


async def test_the_ledger_has_two_writers_on_postgresql_one_on_sqlite_unless_told(
        store: Store) -> None:
    from effectledger_core.catalog import Catalog
    from effectledger_core.config import DEMO_CATALOG
    from effectledger_ledger.service import LedgerService
    from tests.support.ledger import SUBJECTS

    catalog = Catalog.load(DEMO_CATALOG)
    default = LedgerService(store=store, catalog=catalog, subjects=SUBJECTS)
    told = LedgerService(store=store, catalog=catalog, subjects=SUBJECTS, batch_workers=3)
    try:
        assert default.writes.workers == (2 if store.is_postgres else 1)
        assert told.writes.workers == 3
    finally:
        await default.close()
        await told.close()


async def test_a_call_wakes_one_idle_writer_and_not_the_express_lane(store: Store) -> None:
    """One call at a time (an agent's), with both writers and the express lane idle: the call
    wakes one writer. Waking them all cost a task step each that found nothing to do: the
    express lane opens only beside a large background batch (`test_an_urgent_call_runs_beside_
    a_large_background_batch`), and the other writer has no call to take."""
    group = GroupCommit(store, name="t", max_batch=64, workers=2)
    try:
        for n in range(5):
            assert await group.call(UrgentWrite(n)) == n * 10
            assert await group.run(write, 100 + n) == (100 + n) * 10
    finally:
        await group.close()
    assert (group.stats.batches, group.stats.idle_wakes) == (10, 0)
