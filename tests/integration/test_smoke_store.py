"""Smoke: the migrated schema accepts an intent and a claim on both databases."""

from __future__ import annotations

from datetime import UTC, datetime

from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.messages import ClaimAttempt, ClaimStatus, SubmitIntent
from effectledger_core.subjects import Subjects
from effectledger_ledger.db.claims import claim_txn
from effectledger_ledger.db.intents import submit_intent_txn

NOW = datetime(2026, 11, 30, tzinfo=UTC)


async def test_intent_then_claim_is_granted_once(store) -> None:  # type: ignore[no-untyped-def]
    catalog = Catalog.load(DEMO_CATALOG)
    intent = SubmitIntent(tool="create_ticket", arguments={"title": "x"})
    sub = await store.run(submit_intent_txn, catalog=catalog, intent=intent, subjects=Subjects(),
                          operation_id="op1", outbox_id="ob1", now=NOW)
    assert sub.created and sub.operation["state"] == "pending"
    c1 = ClaimAttempt(operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1")
    c2 = ClaimAttempt(operation_id="op1", epoch=1, attempt_id="a2", dispatcher_id="d2")
    assert (await store.run(claim_txn, c1, now=NOW)).status is ClaimStatus.GRANTED
    assert (await store.run(claim_txn, c1, now=NOW)).status is ClaimStatus.GRANTED
    r2 = await store.run(claim_txn, c2, now=NOW)
    assert r2.status is ClaimStatus.ALREADY_CLAIMED and r2.attempt_id == "a1"
