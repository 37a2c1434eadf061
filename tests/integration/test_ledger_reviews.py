"""Human review on both databases (issue 4): the needs_review queue with its evidence, and
operator conclusions bound to the operation's epoch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from effectledger_core.messages import VerdictReached, WebhookReceived
from effectledger_core.recovery import Conclusion, RecoveryRefused, Review
from effectledger_core.states import State
from effectledger_ledger.db.recovery import ActionRejected
from effectledger_ledger.db.schema import journal, outbox, reviews
from effectledger_ledger.db.store import Store
from tests.support.ledger import NOW, LedgerDriver, catalog_from_toml

CATALOG = catalog_from_toml("""
[tools.email]
endpoint = "http://provider.test/emails"
effect_class = "non_idempotent"
contract_revision = "r1"
webhook_provider = "sandbox"
""")


class Ledger(LedgerDriver):
    default_catalog, tool = CATALOG, "email"

    async def in_review(self, n: int = 1) -> str:
        """An operation no machine could decide: its answer lost when the connection reset
        after the send, then an undecidable verdict."""
        op_id = await self.submit(n=n)
        await self.undecidable(op_id, reason="connection_lost", message="reset after send")
        return op_id

    async def snapshot(self, op_id: str) -> tuple[Any, ...]:
        return (await self.op(op_id),
                await self.rows(outbox, outbox.c.operation_id == op_id),
                len(await self.rows(journal, journal.c.operation_id == op_id)),
                await self.rows(reviews, reviews.c.operation_id == op_id))


def review(conclusion: Conclusion, epoch: int = 1, operator: str = "alice") -> Review:
    return Review(operator=operator, evidence_ref="INC-42: provider console", epoch=epoch,
                  conclusion=conclusion)


async def test_queue_lists_operations_in_review_with_their_evidence(store: Store) -> None:
    """GET /v1/reviews' data: only needs_review operations, each with the journal evidence
    (the ambiguous outcome and the undecidable verdict) and webhooks for its key."""
    led = Ledger(store)
    waiting = await led.in_review(1)
    other = await led.submit(n=2)
    await led.ambiguous(other)  # still with the reconciler: not in the queue
    key = (await led.op(waiting))["operation_key"]
    await led.svc.record_webhook(WebhookReceived(
        provider="sandbox", webhook_id="wh-p", event_type="effect.pending", operation_key=key,
        outcome="pending", body_digest="sha256:b", signed_at=NOW, received_at=NOW))

    [item] = await led.svc.review_queue()
    assert item.operation.id == waiting and item.operation.state == "needs_review"
    kinds = [e.kind for e in item.evidence]
    assert kinds[:2] == ["outcome_recorded", "verdict_undecidable"] and "webhook_kept" in kinds
    outcome = item.evidence[0].detail
    assert outcome["reason"] == "connection_lost" and outcome["message"] == "reset after send"
    assert item.evidence[1].detail["evidence"]["reason"] == "no readback and no webhook"
    assert [h.webhook_id for h in item.webhooks] == ["wh-p"]


async def test_completed_review_succeeds_on_operator_evidence(store: Store) -> None:
    """completed → succeeded with the operator's evidence; no provider response is invented
    and no request (dispatch or reconcile) is queued."""
    led = Ledger(store)
    op_id = await led.in_review()
    outbox_before = await led.rows(outbox, outbox.c.operation_id == op_id)
    led.now += timedelta(minutes=5)
    row = await led.svc.review(op_id, review(Conclusion.COMPLETED))
    assert row.state is State.SUCCEEDED
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("succeeded", 1)
    assert op["response_digest"] is None and op["provider_ref"] is None
    assert op["evidence"]["source"] == "operator" and op["evidence"]["operator"] == "alice"
    assert op["evidence"]["evidence_ref"] == "INC-42: provider console"
    assert await led.rows(outbox, outbox.c.operation_id == op_id) == outbox_before
    receipt = (await led.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    assert receipt["digests"]["response"] is None and receipt["evidence"]["source"] == "operator"
    assert receipt["open_uncertainties"] == []
    [entry] = await led.rows(journal, journal.c.kind == "review_recorded")
    assert entry["actor"] == "operator:alice" and entry["detail"]["conclusion"] == "completed"
    assert (entry["from_state"], entry["to_state"]) == ("needs_review", "succeeded")
    [row] = await led.rows(reviews)
    assert (row["operator"], row["epoch"], row["conclusion"], row["at"]) == (
        "alice", 1, "completed", led.now)
    assert await led.svc.review_queue() == []
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.retry(op_id, operator="alice")
    assert info.value.reason == "already_succeeded"


async def test_uncertain_review_stays_in_review(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.in_review()
    await led.svc.review(op_id, review(Conclusion.UNCERTAIN))
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("needs_review", 1)
    [row] = await led.rows(reviews)
    assert row["conclusion"] == "uncertain"
    assert [i.operation.id for i in await led.svc.review_queue()] == [op_id]
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.retry(op_id, operator="alice")
    assert info.value.reason == "needs_review"


async def test_not_executed_review_is_recorded_and_stays_until_a_plan(store: Store) -> None:
    """not_executed records the review; the operation waits for an explicit retry plan."""
    led = Ledger(store)
    op_id = await led.in_review()
    await led.svc.review(op_id, review(Conclusion.NOT_EXECUTED))
    assert (await led.op(op_id))["state"] == "needs_review"
    assert (await led.svc.inspect(op_id)).decision.value == "needs_review"
    _, admission = await led.svc.retry(op_id, operator="bob")
    assert admission.admitted and (await led.op(op_id))["epoch"] == 2


@pytest.mark.parametrize("epoch", [0, 2])
async def test_review_of_another_epoch_is_rejected(store: Store, epoch: int) -> None:
    led = Ledger(store)
    op_id = await led.in_review()
    before = await led.snapshot(op_id)
    with pytest.raises(ActionRejected) as info:
        await led.svc.review(op_id, review(Conclusion.COMPLETED, epoch=epoch))
    assert info.value.details["reason"] == "stale_epoch"
    assert await led.snapshot(op_id) == before


async def test_stale_review_after_a_retry_is_rejected(store: Store) -> None:
    """A review of epoch 1 arriving after the operation moved on to epoch 2 (and back into
    review) changes nothing."""
    led = Ledger(store)
    op_id = await led.in_review()
    await led.svc.review(op_id, review(Conclusion.NOT_EXECUTED))
    await led.svc.retry(op_id, operator="alice")
    await led.ambiguous(op_id, epoch=2)
    await led.svc.record_verdict(VerdictReached(
        operation_id=op_id, epoch=2, verdict="undecidable", reconciler_id="r1", at=NOW),
        consumer="ledger", message_id="v-2")
    before = await led.snapshot(op_id)
    with pytest.raises(ActionRejected):
        await led.svc.review(op_id, review(Conclusion.COMPLETED, epoch=1, operator="mallory"))
    assert await led.snapshot(op_id) == before


@pytest.mark.parametrize("setup", ["pending", "ambiguous"])
async def test_review_of_an_operation_not_in_review_is_rejected(store: Store,
                                                               setup: str) -> None:
    led = Ledger(store)
    op_id = await led.submit()
    if setup == "ambiguous":
        await led.ambiguous(op_id)
    before = await led.snapshot(op_id)
    with pytest.raises(ActionRejected) as info:
        await led.svc.review(op_id, review(Conclusion.COMPLETED))
    assert info.value.details["reason"] == "not_in_review"
    assert await led.snapshot(op_id) == before
