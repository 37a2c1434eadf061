"""Webhooks that cannot move an operation they do not speak for, on both databases: a tokenless
"not applied" counts only for the attempt it names, so resending it under a new webhook id once
the next epoch has started changes nothing; stored early webhooks count only from the provider
bound to the tool."""

from __future__ import annotations

import itertools

from effectledger_core.catalog import Catalog
from effectledger_core.messages import (
    AttemptAccepted,
    ClaimAttempt,
    ClaimStatus,
    OutcomeAmbiguous,
    SubmitIntent,
    WebhookReceived,
)
from effectledger_core.subjects import Subjects
from effectledger_core.views import OperationView
from effectledger_ledger.db.rows import Recorded
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.support.ledger import NOW

CATALOG = Catalog.from_mapping({"tools": {
    "post": {"endpoint": "https://p.test/post", "contract_revision": "r",
             "effect_class": "non_idempotent", "webhook_provider": "sandbox",
             "capabilities": {"webhooks": True}},
}})


def service(store: Store) -> LedgerService:
    ids = itertools.count(1)
    return LedgerService(store=store, catalog=CATALOG,
                         subjects=Subjects(prefix="tst", stream_prefix="TST"),
                         clock=lambda: NOW, ids=lambda: f"id{next(ids):05d}")


async def accepted(svc: LedgerService, op_id: str, epoch: int, ref: str) -> OperationView:
    attempt = f"a{epoch}"
    reply = await svc.claim(ClaimAttempt(operation_id=op_id, epoch=epoch, attempt_id=attempt,
                                         dispatcher_id="d"))
    assert reply.status is ClaimStatus.GRANTED, reply
    await svc.record_outcome(AttemptAccepted(
        operation_id=op_id, epoch=epoch, attempt_id=attempt, dispatcher_id="d", at=NOW,
        provider_ref=ref, response_digest="sha256:r"), consumer="ledger",
        message_id=f"m-{op_id}-{epoch}")
    op = await svc.operation(op_id)
    assert op.state == "awaiting_confirmation", op
    return op


async def not_applied(svc: LedgerService, webhook_id: str, *, ref: str | None,
                      key: str | None = None, provider: str = "sandbox") -> Recorded:
    return await svc.record_webhook(WebhookReceived(
        provider=provider, webhook_id=webhook_id, event_type="effect.not_applied",
        operation_key=key, provider_ref=ref, outcome="not_applied", final=True,
        body_digest="sha256:b", signed_at=NOW, received_at=NOW))


async def test_a_tokenless_not_applied_counts_for_its_attempt_and_never_for_the_next(
        store: Store) -> None:
    svc = service(store)
    op = (await svc.submit(SubmitIntent(tool="post", arguments={}))).operation
    await accepted(svc, op["id"], 1, "ref-1")
    key = op["operation_key"]
    first = await not_applied(svc, "w1", ref="ref-1", key=key)
    assert (first.status, first.to_state) == ("applied", "pending"), first
    await accepted(svc, op["id"], 2, "ref-2")
    # The same event resent under a new webhook id, now that epoch 2 is in flight.
    again = await not_applied(svc, "w1-resent", ref="ref-1", key=key)
    assert (again.status, again.reason) == ("kept", "unnamed_attempt"), again
    now = await svc.operation(op["id"])
    assert (now.state, now.epoch) == ("awaiting_confirmation", 2)


async def test_a_tokenless_not_applied_naming_no_attempt_decides_nothing(store: Store) -> None:
    svc = service(store)
    op = (await svc.submit(SubmitIntent(tool="post", arguments={}))).operation
    await accepted(svc, op["id"], 1, "ref-1")
    result = await not_applied(svc, "w1", ref=None, key=op["operation_key"])
    assert (result.status, result.reason) == ("kept", "unnamed_attempt")
    assert (await svc.operation(op["id"])).state == "awaiting_confirmation"


async def test_an_early_webhook_from_an_unbound_provider_never_settles_the_operation(
        store: Store) -> None:
    """Operation keys are predictable: an event planted before the operation exists counts
    only if its provider is the tool's."""
    svc = service(store)
    op = (await svc.submit(SubmitIntent(tool="post", arguments={}))).operation
    for provider in ("acme", "sandbox"):
        await svc.record_webhook(WebhookReceived(
            provider=provider, webhook_id=f"{provider}-early", event_type="effect.applied",
            operation_key=f"{op['operation_key']}", outcome="applied", final=True,
            body_digest="sha256:b", signed_at=NOW, received_at=NOW))
    # Both were stored against the pending operation; only now does it become ambiguous.
    await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1, attempt_id="a1",
                                 dispatcher_id="d"))
    await svc.record_outcome(OutcomeAmbiguous(
        operation_id=op["id"], epoch=1, attempt_id="a1", dispatcher_id="d", at=NOW,
        reason="timeout"), consumer="ledger", message_id="m1")
    done = await svc.operation(op["id"])
    assert done.state == "succeeded"
    journal = await svc.journal(op["id"])
    [settled] = [e for e in journal.entries if e.kind == "verdict_applied"]
    assert settled.actor == "webhook:sandbox"


async def test_an_early_webhook_from_an_unbound_provider_alone_leaves_it_ambiguous(
        store: Store) -> None:
    svc = service(store)
    op = (await svc.submit(SubmitIntent(tool="post", arguments={}))).operation
    await svc.record_webhook(WebhookReceived(
        provider="acme", webhook_id="acme-early", event_type="effect.applied",
        operation_key=op["operation_key"], outcome="applied", final=True,
        body_digest="sha256:b", signed_at=NOW, received_at=NOW))
    await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1, attempt_id="a1",
                                 dispatcher_id="d"))
    await svc.record_outcome(OutcomeAmbiguous(
        operation_id=op["id"], epoch=1, attempt_id="a1", dispatcher_id="d", at=NOW,
        reason="timeout"), consumer="ledger", message_id="m1")
    assert (await svc.operation(op["id"])).state == "ambiguous"
