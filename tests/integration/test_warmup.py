"""A new ledger warms its connections and hot statements before it listens (db/warmup.py).

The warm-up runs an intent, its claim and its outcome on each connection, alone and as a
batch of two, and rolls them back:
it must leave no row behind, leave the statements prepared on the pooled connections (on
PostgreSQL, where asyncpg prepares per connection), and never stop a ledger from starting.
"""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from effectledger_core.catalog import Catalog
from effectledger_ledger.db.schema import metadata
from effectledger_ledger.db.store import Store
from effectledger_ledger.db.warmup import warm
from tests.integration.test_set_based import CATALOG, SUBJECTS


async def _row_counts(store: Store) -> dict[str, int]:
    async with store.transaction() as conn:
        return {t.name: int((await conn.execute(
            sa.select(sa.func.count()).select_from(t))).scalar_one())
            for t in metadata.sorted_tables}


async def test_the_warm_up_runs_the_hot_path_and_leaves_no_row(store: Store) -> None:
    before = await _row_counts(store)
    assert await warm(store, CATALOG, SUBJECTS, connections=1) == 1
    assert await _row_counts(store) == before


async def test_each_pooled_connection_has_the_hot_statements_prepared(store: Store) -> None:
    if not store.is_postgres:
        pytest.skip("SQLite has one connection and no server-side prepared statements")
    assert await warm(store, CATALOG, SUBJECTS, connections=3) == 3
    pool = store.engine.sync_engine.pool
    assert pool.checkedin() == 3  # type: ignore[attr-defined]
    # Hold three connections at once: they are the three the warm-up left in the pool.
    conns = [await store.engine.connect() for _ in range(3)]
    try:
        assert pool.checkedin() == 0  # type: ignore[attr-defined]
        for conn in conns:
            statements = list((await conn.execute(sa.text(
                "SELECT statement FROM pg_prepared_statements"))).scalars())
            # The tables each prepared statement inserts into (fused writes insert into several).
            prepared = {table for statement in statements
                        for table in re.findall(r"INSERT INTO (\w+)", statement)}
            assert {"operations", "outbox", "journal", "attempts", "inbox"} <= prepared
            # The calls alone (one statement each: intent, claim, success) and the locked path.
            assert sum(s.startswith("WITH new_op") for s in statements) == 1
            assert sum(s.startswith("WITH moved") for s in statements) == 2
            assert any("FOR UPDATE" in s for s in statements)
            # A batch of several writes its rows over arrays (`hot._unnested`): prepared
            # here, with their array types looked up, not in the first real batch.
            assert any("FROM unnest(" in s for s in statements)
    finally:
        for conn in conns:
            await conn.close()


async def test_a_catalog_of_approval_tools_only_has_nothing_to_warm(store: Store) -> None:
    approval_only = Catalog({"wire_money": CATALOG.tools["wire_money"]})
    assert await warm(store, approval_only, SUBJECTS, connections=2) == 0


async def test_an_unreachable_database_skips_the_warm_up_without_raising() -> None:
    # Port 1 on loopback: nothing listens, the connection is refused at once.
    store = Store("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    try:
        assert await warm(store, CATALOG, SUBJECTS, connections=2) == 0
    finally:
        await store.close()
