"""The ledger's readiness split: `/readyz` is ready to accept intents (the database), and names
what else is missing; `/readyz/relay` needs the database, NATS and the relay."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.subjects import Subjects
from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService

Checks = dict[str, bool]


@pytest.fixture
async def readiness(store: Store) -> AsyncIterator[Callable[[Checks], httpx.AsyncClient]]:
    svc = LedgerService(store=store, catalog=Catalog.load(DEMO_CATALOG),
                        subjects=Subjects(prefix="t", stream_prefix="T"))
    clients: list[httpx.AsyncClient] = []

    def make(checks: Checks) -> httpx.AsyncClient:
        async def ready() -> Checks:
            return checks

        app = create_app(svc, ready=ready, auth=Authenticator({}, {}))
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://l.test")
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.aclose()
    await svc.close()


async def test_with_nats_down_the_ledger_is_ready_for_intents_and_names_what_is_missing(
        readiness: Callable[[Checks], httpx.AsyncClient]) -> None:
    client = readiness({"database": True, "nats": False, "relay": False})
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["missing"] == ["nats", "relay"]
    assert body["accepting_intents"] is True and body["relaying"] is False
    assert (await client.get("/readyz/relay")).status_code == 503
    assert (await client.get("/healthz")).status_code == 200


async def test_with_everything_up_both_readiness_checks_pass(
        readiness: Callable[[Checks], httpx.AsyncClient]) -> None:
    client = readiness({"database": True, "nats": True, "relay": True})
    for path in ("/readyz", "/readyz/relay"):
        resp = await client.get(path)
        assert resp.status_code == 200 and resp.json()["missing"] == []


async def test_without_the_database_the_ledger_is_not_ready_for_intents(
        readiness: Callable[[Checks], httpx.AsyncClient]) -> None:
    client = readiness({"database": False, "nats": True, "relay": True})
    ready = await client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["missing"] == ["database"]
    assert ready.json()["accepting_intents"] is False
    assert (await client.get("/readyz/relay")).status_code == 503
