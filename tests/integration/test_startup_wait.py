"""A starting ledger waits for a database that is not reachable yet, instead of exiting."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError

from effectledger_cli.embedded import free_port
from effectledger_ledger.db.store import Store
from effectledger_ledger.migrate import head_revision, upgrade_when_reachable


def closed_port() -> int:
    return free_port()  # free, below the ephemeral range, so nothing else takes it: refused


async def test_an_unreachable_database_is_waited_for_then_reported() -> None:
    store = Store(f"postgresql+asyncpg://nobody@127.0.0.1:{closed_port()}/none")
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)  # no real waiting: tenacity's clock still advances a little

    try:
        with pytest.raises((OSError, DBAPIError)):
            await upgrade_when_reachable(store, wait_s=0.5, sleep=fake_sleep)
    finally:
        await store.close()
    # Refused connections were retried (not a crash at the first one), then given up.
    assert waits, "no retry happened"


async def test_a_reachable_database_is_migrated_at_once(db_url: str) -> None:
    store = Store(db_url)
    try:
        assert await upgrade_when_reachable(store, wait_s=5) == head_revision()
    finally:
        await store.close()


async def test_errors_other_than_reachability_fail_at_once(pg_url: str) -> None:
    url = pg_url.rsplit("/", 1)[0] + "/no_such_database_for_effectledger"
    store = Store(url)
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    try:
        with pytest.raises(Exception) as info:
            await upgrade_when_reachable(store, wait_s=60, sleep=fake_sleep)
    finally:
        await store.close()
    assert "no_such_database" in str(info.value)
    assert waits == []  # a missing database is a configuration error: no waiting
