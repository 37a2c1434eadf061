"""A verified webhook speaks only for the tools bound to its provider (issue 12), on both
databases: another provider's event for the same operation key changes nothing, now or later."""

from __future__ import annotations

import itertools
from typing import Any, Literal

import sqlalchemy as sa

from effectledger_core.catalog import Catalog
from effectledger_core.messages import (
    ClaimAttempt,
    OutcomeAmbiguous,
    SubmitIntent,
    WebhookReceived,
)
from effectledger_core.subjects import Subjects
from effectledger_ledger.db.resolution import Recorded
from effectledger_ledger.db.schema import journal, webhook_events
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.support.ledger import NOW

CATALOG = Catalog.from_mapping({
    "tools": {
        "pay": {"endpoint": "https://p.test/pay", "contract_revision": "r",
                "effect_class": "non_idempotent", "webhook_provider": "stripe",
                "capabilities": {"webhooks": True}},
        "legacy": {"endpoint": "https://p.test/legacy", "contract_revision": "r",
                   "effect_class": "non_idempotent", "capabilities": {"webhooks": True}},
    },
    "webhooks": {"stripe": {"scheme": "stripe", "secrets": ["${S}"],
                            "events": {"charge.succeeded": "applied"},
                            "operation_key_path": "$.data.object.metadata.k"}},
})


def service(store: Store) -> LedgerService:
    ids = itertools.count(1)
    return LedgerService(store=store, catalog=CATALOG,
                         subjects=Subjects(prefix="tst", stream_prefix="TST"),
                         clock=lambda: NOW, ids=lambda: f"id{next(ids):05d}")


async def ambiguous_op(svc: LedgerService, tool: str) -> dict[str, Any]:
    op = (await svc.submit(SubmitIntent(tool=tool, arguments={}))).operation
    await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1, attempt_id="a1",
                                 dispatcher_id="d"))
    await svc.record_outcome(OutcomeAmbiguous(
        operation_id=op["id"], epoch=1, attempt_id="a1", dispatcher_id="d", at=NOW,
        reason="timeout"), consumer="ledger", message_id=f"m-{op['id']}")
    return await svc.operation(op["id"])


async def hook(svc: LedgerService, provider: str, key: str,
               outcome: Literal["applied", "not_applied"] = "applied") -> Recorded:
    return await svc.record_webhook(WebhookReceived(
        provider=provider, webhook_id=f"{provider}-{key}", event_type="charge.succeeded",
        operation_key=key, outcome=outcome, final=True, body_digest="sha256:b",
        signed_at=NOW, received_at=NOW))


async def kinds(store: Store, op_id: str) -> list[str]:
    async with store.transaction() as conn:
        return list((await conn.execute(sa.select(journal.c.kind).where(
            journal.c.operation_id == op_id).order_by(journal.c.id))).scalars())


async def test_the_bound_provider_decides_its_tool(store: Store) -> None:
    svc = service(store)
    op = await ambiguous_op(svc, "pay")
    assert (await hook(svc, "stripe", op["operation_key"])).to_state == "succeeded"


async def test_another_provider_never_speaks_for_a_bound_tool(store: Store) -> None:
    svc = service(store)
    op = await ambiguous_op(svc, "pay")
    result = await hook(svc, "sandbox", op["operation_key"])
    assert (result.status, result.reason) == ("rejected", "provider_not_bound")
    assert (await svc.operation(op["id"]))["state"] == "ambiguous"
    assert "webhook_refused" in await kinds(store, op["id"])
    async with store.transaction() as conn:
        [row] = (await conn.execute(sa.select(webhook_events))).mappings().all()
    # Marked used: no later state change can pick it up as early evidence.
    assert row["applied"] == "refused:provider_not_bound"


async def test_a_catalog_declared_provider_never_speaks_for_an_unbound_tool(
        store: Store) -> None:
    svc = service(store)
    op = await ambiguous_op(svc, "legacy")
    assert (await hook(svc, "stripe", op["operation_key"])).reason == "provider_not_bound"
    assert (await svc.operation(op["id"]))["state"] == "ambiguous"
    # The provider configured outside the catalog still decides unbound tools, as before.
    assert (await hook(svc, "sandbox", op["operation_key"])).to_state == "succeeded"
