"""A verified webhook speaks only for the tools bound to its provider (issues 12 and 28), on
both databases: another provider's event for the same operation key changes nothing, now or
later, and a tool that names no provider is decided by no webhook (bound by default)."""

from __future__ import annotations

import itertools
from typing import Literal

import sqlalchemy as sa

from effectledger_core.catalog import Catalog
from effectledger_core.messages import (
    ClaimAttempt,
    OutcomeAmbiguous,
    SubmitIntent,
    WebhookReceived,
)
from effectledger_core.subjects import Subjects
from effectledger_core.views import OperationView
from effectledger_ledger.db.resolution import Recorded
from effectledger_ledger.db.schema import journal, webhook_events
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from effectledger_obs import metrics
from tests.support.ledger import NOW

CATALOG = Catalog.from_mapping({
    "tools": {
        "pay": {"endpoint": "https://p.test/pay", "contract_revision": "r",
                "effect_class": "non_idempotent", "webhook_provider": "stripe",
                "capabilities": {"webhooks": True}},
        # Names no webhook provider: no webhook may decide it (before issue 28, any provider
        # configured outside the catalog could).
        "legacy": {"endpoint": "https://p.test/legacy", "contract_revision": "r",
                   "effect_class": "non_idempotent"},
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


async def ambiguous_op(svc: LedgerService, tool: str) -> OperationView:
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
    assert (await hook(svc, "stripe", op.operation_key)).to_state == "succeeded"


async def test_another_provider_never_speaks_for_a_bound_tool(store: Store) -> None:
    svc = service(store)
    op = await ambiguous_op(svc, "pay")
    result = await hook(svc, "sandbox", op.operation_key)
    assert (result.status, result.reason) == ("rejected", "provider_not_bound")
    assert (await svc.operation(op.id)).state == "ambiguous"
    assert "webhook_refused" in await kinds(store, op.id)
    async with store.transaction() as conn:
        [row] = (await conn.execute(sa.select(webhook_events))).mappings().all()
    # Marked used: no later state change can pick it up as early evidence.
    assert row["applied"] == "refused:provider_not_bound"


async def test_a_catalog_declared_provider_never_speaks_for_an_unbound_tool(
        store: Store) -> None:
    svc = service(store)
    op = await ambiguous_op(svc, "legacy")
    assert (await hook(svc, "stripe", op.operation_key)).reason == "provider_not_bound"
    assert (await svc.operation(op.id)).state == "ambiguous"


async def test_no_configured_provider_speaks_for_a_tool_that_names_none(store: Store) -> None:
    """Issue 28's attack: provider `acme`, configured only through the reconciler's webhook
    secrets, signs `effect.applied` (and the like) for an operation of a tool that names no
    provider. It used to mark the operation succeeded although its own provider never applied
    it; now it is refused, journaled and counted, and the operation stays for its oracle."""
    svc = service(store)
    op = await ambiguous_op(svc, "legacy")
    before = metrics.child(metrics.WEBHOOKS_UNBOUND, "other")._value.get()
    for provider in ("acme", "sandbox"):
        result = await hook(svc, provider, op.operation_key)
        assert (result.status, result.reason) == ("rejected", "provider_not_bound"), result
    assert (await svc.operation(op.id)).state == "ambiguous"
    assert (await kinds(store, op.id)).count("webhook_refused") == 2
    assert metrics.child(metrics.WEBHOOKS_UNBOUND, "other")._value.get() == before + 2
    async with store.transaction() as conn:
        rows = (await conn.execute(sa.select(webhook_events.c.applied))).scalars().all()
    assert sorted(rows) == ["refused:provider_not_bound"] * 2


async def test_an_early_webhook_from_another_provider_is_refused_when_its_operation_appears(
        store: Store) -> None:
    """Operation keys are predictable: an event planted before the operation exists is kept
    (unmatched), then refused (and journaled) once the operation turns out to be another
    provider's, never used."""
    svc = service(store)
    planted = await svc.submit(SubmitIntent(tool="pay", arguments={}, idempotency_key="k"))
    key = planted.operation["operation_key"]
    # Stored as the ledger keeps an event that arrived while no state was waiting for it.
    async with store.transaction() as conn:
        await conn.execute(webhook_events.insert().values(
            provider="acme", webhook_id="early", event_type="charge.succeeded",
            operation_key=key, outcome="applied", final=True, body_digest="sha256:b",
            signed_at=NOW, received_at=NOW))
    op_id = planted.operation["id"]
    await svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id="a1",
                                 dispatcher_id="d"))
    await svc.record_outcome(OutcomeAmbiguous(
        operation_id=op_id, epoch=1, attempt_id="a1", dispatcher_id="d", at=NOW,
        reason="timeout"), consumer="ledger", message_id="m-early")
    assert (await svc.operation(op_id)).state == "ambiguous"
    assert "webhook_refused" in await kinds(store, op_id)
    async with store.transaction() as conn:
        [row] = (await conn.execute(sa.select(webhook_events))).mappings().all()
    assert row["applied"] == "refused:provider_not_bound"
