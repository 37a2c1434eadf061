"""Outbox retention on both databases: settled rows go after their period, live rows never."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG, Settings
from effectledger_core.messages import ClaimAttempt, ClaimStatus, SubmitIntent
from effectledger_core.subjects import Subjects
from effectledger_ledger.app import janitor_pass
from effectledger_ledger.db.claims import claim_txn
from effectledger_ledger.db.intents import submit_intent_txn
from effectledger_ledger.db.outbox import lease_batch_txn
from effectledger_ledger.db.retention import purge_outbox_txn
from effectledger_ledger.db.schema import journal, operations, outbox
from effectledger_ledger.db.store import Store

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
DAY = 86400.0
SUBJECTS = Subjects(prefix="tst", stream_prefix="TST")
CATALOG = Catalog.load(DEMO_CATALOG)


async def submit(store: Store, op_id: str, *, now: datetime = T0) -> None:
    await store.run(submit_intent_txn, catalog=CATALOG,
                    intent=SubmitIntent(tool="create_ticket", arguments={"op": op_id}),
                    subjects=SUBJECTS, operation_id=op_id, outbox_id=f"ob_{op_id}", now=now)


async def set_row(store: Store, op_id: str, **values: Any) -> None:
    async with store.transaction() as conn:
        await conn.execute(outbox.update().where(outbox.c.id == f"ob_{op_id}").values(**values))


async def remaining(store: Store) -> set[str]:
    async with store.transaction() as conn:
        return set((await conn.execute(sa.select(outbox.c.id))).scalars().all())


async def count(store: Store, table: sa.Table) -> int:
    async with store.transaction() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(table))).scalar_one())


async def test_settled_rows_go_after_their_period_and_live_rows_never(store: Store) -> None:
    """A claimed (consumed) and a cancelled (obsolete) row older than the period are deleted;
    a settled row younger than it stays; pending and published rows stay however old; the
    operations and their journal are untouched."""
    for op in ("claimed", "obsolete", "young", "pending", "published"):
        await submit(store, op)
    await store.run(lease_batch_txn, now=T0, limit=10, lease_s=30)
    reply = await store.run(claim_txn, ClaimAttempt(operation_id="claimed", epoch=1,
                                                    attempt_id="a1", dispatcher_id="d1"),
                            now=T0 + timedelta(seconds=1))
    assert reply.status is ClaimStatus.GRANTED
    await set_row(store, "obsolete", status="obsolete")
    await set_row(store, "young", status="consumed", created_at=T0 + timedelta(days=9))
    await set_row(store, "pending", status="pending")
    await set_row(store, "published", status="published")
    journal_before = await count(store, journal)

    purged = await store.run(purge_outbox_txn, now=T0 + timedelta(days=10), retention_s=7 * DAY)

    assert purged == 2
    assert await remaining(store) == {"ob_young", "ob_pending", "ob_published"}
    assert await count(store, operations) == 5
    assert await count(store, journal) == journal_before


async def test_a_purge_takes_a_bounded_batch_and_the_janitor_drains_them_all(
        store: Store, db_url: str) -> None:
    """One transaction deletes at most `limit` rows; the janitor's pass repeats until none is
    left, and a retention of 0 keeps everything."""
    long_ago = datetime.now(UTC) - timedelta(days=30)
    for i in range(5):
        await submit(store, f"op{i}", now=long_ago)
        await set_row(store, f"op{i}", status="consumed")

    assert await store.run(purge_outbox_txn, now=datetime.now(UTC), retention_s=DAY,
                           limit=2) == 2
    assert len(await remaining(store)) == 3

    kept = await janitor_pass(store, Settings(database_url=db_url, outbox_retention_s=0),
                              batch=2)
    assert kept["outbox"] == 0 and len(await remaining(store)) == 3

    drained = await janitor_pass(store, Settings(database_url=db_url, outbox_retention_s=DAY),
                                 batch=2)
    assert drained["outbox"] == 3 and await remaining(store) == set()
