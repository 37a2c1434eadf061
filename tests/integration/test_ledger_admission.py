"""Admission checks arguments against the tool's input schema (issue 12): an intent that can
never be sent gets 422 with the JSON pointer of each bad field, and nothing is stored or
enqueued. Driven through the HTTP API on both databases."""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from effectledger_core.catalog import Catalog
from effectledger_ledger.api import create_app
from effectledger_ledger.db.schema import metadata
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.support.ledger import NOW, SUBJECTS

CATALOG = Catalog.from_mapping(tomllib.loads("""
[tools.charge_card]
endpoint = "https://p.test/v1/charges"
body = { amount = "{args.amount}", currency = "{args.currency}", ref = "{operation_key}" }
contract_revision = "r1"

[tools.update_customer]
endpoint = "https://p.test/v1/customers/{args.customer_id}"
contract_revision = "r1"
[tools.update_customer.input_schema]
type = "object"
required = ["customer_id", "email"]
additionalProperties = false
[tools.update_customer.input_schema.properties.customer_id]
type = "string"
pattern = "^cus_"
[tools.update_customer.input_schema.properties.email]
type = "string"
[tools.update_customer.input_schema.properties.address]
type = "object"
properties = { zip = { type = "string", maxLength = 10 } }
"""))


async def _ready() -> dict[str, Any]:
    return {"database": True}


@pytest.fixture
async def client(store: Store) -> AsyncIterator[httpx.AsyncClient]:
    ids = itertools.count(1)
    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: NOW,
                        ids=lambda: f"id{next(ids):05d}")
    app = create_app(svc, ready=_ready)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://ledger.test") as c:
        yield c


async def row_counts(store: Store) -> dict[str, int]:
    async with store.transaction() as conn:
        return {t.name: (await conn.execute(sa.select(sa.func.count()).select_from(t))
                         ).scalar_one() for t in metadata.sorted_tables}


async def refused(client: httpx.AsyncClient, tool: str, arguments: Any) -> list[dict[str, str]]:
    r = await client.post("/v1/intents", json={"tool": tool, "arguments": arguments})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_arguments"
    assert error["details"]["tool"] == tool
    return list(error["details"]["errors"])


async def test_missing_placeholder_arguments_are_refused_with_pointers(
        client: httpx.AsyncClient, store: Store) -> None:
    """`charge_card {}` used to be accepted and fail at dispatch; now it is a 422."""
    errors = await refused(client, "charge_card", {})
    assert [e["pointer"] for e in errors] == ["/amount", "/currency"]
    assert all(v == 0 for v in (await row_counts(store)).values())


async def test_declared_schema_points_at_each_bad_field(client: httpx.AsyncClient,
                                                        store: Store) -> None:
    errors = await refused(client, "update_customer", {
        "customer_id": "42", "address": {"zip": "x" * 11}, "nickname": "bob"})
    assert [e["pointer"] for e in errors] == ["/address/zip", "/customer_id", "/email",
                                              "/nickname"]
    assert all(v == 0 for v in (await row_counts(store)).values())


async def test_valid_arguments_are_admitted(client: httpx.AsyncClient, store: Store) -> None:
    r = await client.post("/v1/intents", json={"tool": "update_customer", "arguments": {
        "customer_id": "cus_1", "email": "a@b.test"}})
    assert r.status_code == 201, r.text
    counts = await row_counts(store)
    assert counts["operations"] == 1 and counts["outbox"] == 1


async def test_tools_list_shows_each_schema(client: httpx.AsyncClient) -> None:
    tools = {t["name"]: t for t in (await client.get("/v1/tools")).json()["tools"]}
    assert tools["charge_card"]["input_schema"]["required"] == ["amount", "currency"]
    assert tools["update_customer"]["input_schema"]["additionalProperties"] is False
