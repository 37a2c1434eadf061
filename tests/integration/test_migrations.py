"""Migrations on both databases: empty → head, idempotent re-run, schema equals the metadata."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event

from effectledger_ledger.db.schema import inbox, metadata
from effectledger_ledger.db.store import Store
from effectledger_ledger.migrate import current_revision, head_revision, upgrade


async def _admin(pg_url: str, sql: str) -> None:
    import asyncpg

    dsn = sa.make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a brand-new, empty database of its own (dropped afterwards)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
        return
    pg_url = str(request.getfixturevalue("pg_url"))
    name = "el_mig_" + uuid.uuid4().hex[:12]
    asyncio.run(_admin(pg_url, f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(_admin(pg_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def empty_store(fresh_db_url: str) -> AsyncIterator[Store]:
    st = Store(fresh_db_url)
    yield st
    await st.close()


async def _tables(st: Store) -> set[str]:
    async with st.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: sa.inspect(c).get_table_names()))


async def test_upgrade_on_an_empty_database_reaches_head(empty_store: Store) -> None:
    """From nothing, upgrade creates every table of the metadata and records the head."""
    assert await current_revision(empty_store) is None
    assert await _tables(empty_store) == set()
    assert await upgrade(empty_store) == head_revision()
    assert await current_revision(empty_store) == head_revision()
    assert await _tables(empty_store) == set(metadata.tables) | {"alembic_version"}


async def test_second_upgrade_is_a_no_op(empty_store: Store) -> None:
    """Running upgrade again issues no DDL, keeps the revision and keeps the data."""
    await upgrade(empty_store)
    async with empty_store.transaction() as conn:
        await conn.execute(inbox.insert().values(
            consumer="c", message_id="m", received_at=datetime(2026, 11, 30, tzinfo=UTC)))

    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    event.listen(empty_store.engine.sync_engine, "before_cursor_execute", record)
    try:
        assert await upgrade(empty_store) == head_revision()
    finally:
        event.remove(empty_store.engine.sync_engine, "before_cursor_execute", record)

    ddl = [s for s in statements
           if s.lstrip().split(None, 1)[0].upper() in {"CREATE", "ALTER", "DROP"}]
    assert ddl == []
    assert statements, "the listener saw nothing: the check would be vacuous"
    async with empty_store.transaction() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(inbox))).scalar() == 1


async def test_migrated_schema_matches_the_metadata(empty_store: Store) -> None:
    """alembic's autogenerate comparison finds no difference between migrations and schema.py
    (tables, columns, types, nullability, server defaults, indexes, constraints)."""
    await upgrade(empty_store)

    def diff(sync_conn: sa.Connection) -> list[Any]:
        ctx = MigrationContext.configure(sync_conn, opts={
            "compare_type": True, "compare_server_default": True})
        return list(compare_metadata(ctx, metadata))

    async with empty_store.engine.connect() as conn:
        assert await conn.run_sync(diff) == []


async def test_comparison_would_notice_a_missing_index(empty_store: Store) -> None:
    """Guard for the test above: dropping one index makes the comparison report it."""
    await upgrade(empty_store)
    async with empty_store.transaction() as conn:
        await conn.execute(sa.text("DROP INDEX ix_outbox_operation"))

    def diff(sync_conn: sa.Connection) -> list[Any]:
        return list(compare_metadata(MigrationContext.configure(sync_conn), metadata))

    async with empty_store.engine.connect() as conn:
        found = await conn.run_sync(diff)
    assert [d[0] for d in found] == ["add_index"]
    assert found[0][1].name == "ix_outbox_operation"
