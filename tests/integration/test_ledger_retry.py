"""The ledger's automatic retry policy on both databases (issue 3): the dispatcher's claims and
outcomes are simulated by calling the service directly; time, ids and jitter are injected."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from effectledger_core.catalog import Catalog
from effectledger_core.errors import PoisonMessage
from effectledger_core.failures import Failure, Idempotency, policy_digest
from effectledger_core.messages import (
    ClaimAttempt,
    ClaimStatus,
    DispatchAttempt,
    FailureClass,
    parse,
    parse_outcome,
)
from effectledger_core.retry_policy import RetryBudget
from effectledger_ledger.db.resolution import Recorded
from effectledger_ledger.db.store import Store
from tests.support.ledger import NOW, LedgerDriver, catalog_from_toml

FC = FailureClass


def catalog(revision: str = "r1", *, max_attempts: int = 3,
            retry_deadline_s: float = 3600.0) -> Catalog:
    return catalog_from_toml(f"""
[tools.ticket]
endpoint = "http://provider.test/tickets"
effect_class = "idempotent"
contract_revision = "{revision}"
max_attempts = {max_attempts}
retry_deadline_s = {retry_deadline_s}
capabilities = {{ accepts_idempotency_key = true }}

[tools.email]
endpoint = "http://provider.test/emails"
effect_class = "non_idempotent"
contract_revision = "{revision}"
max_attempts = {max_attempts}
""")


class Ledger(LedgerDriver):
    default_catalog, tool, seed = catalog(), "ticket", 7


async def test_rate_limited_retries_at_a_new_epoch_no_sooner_than_retry_after(
        store: Store) -> None:
    """429 with Retry-After 2 → pending at epoch 2 with the same operation key; the epoch-2
    dispatch row is not available before now + 2 s; journal retry_scheduled with the reason
    and the policy digest."""
    led = Ledger(store)
    op_id = await led.submit()
    key = (await led.op(op_id))["operation_key"]
    result = await led.fail(op_id, 1, FC.RATE_LIMITED, code="rate_limited", http_status=429,
                            retry_after_s=2.0)
    assert result == Recorded("applied", to_state="pending")

    op = await led.op(op_id)
    assert (op["state"], op["epoch"], op["operation_key"]) == ("pending", 2, key)
    first, second = await led.outbox_rows(op_id)
    assert (first["epoch"], first["status"]) == (1, "consumed")
    assert (second["epoch"], second["status"]) == (2, "pending")
    assert second["available_at"] >= NOW + timedelta(seconds=2)
    cmd = parse(DispatchAttempt, second["payload"].encode())
    assert (cmd.epoch, cmd.operation_key, cmd.operation_id) == (2, key, op_id)

    [entry] = await led.entries(op_id, "retry_scheduled")
    assert entry["epoch"] == 2 and entry["actor"] == "ledger.retry_policy"
    detail = entry["detail"]
    assert detail["reason"] == "rate_limited:rate_limited"
    assert detail["policy_digest"] == policy_digest() and detail["delay_s"] >= 2.0
    assert detail["operation_key"] == key
    assert datetime.fromisoformat(detail["due_at"]) == second["available_at"]
    assert await led.entries(op_id, "retry_declined") == []

    # the new epoch is claimable; the superseded one is not
    await led.claim(op_id, 2)
    stale = await led.svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id="late",
                                             dispatcher_id="d9"))
    assert stale.status is not ClaimStatus.GRANTED


async def test_invalid_argument_fails_without_retry_and_the_receipt_guides(
        store: Store) -> None:
    """400 → failed at epoch 1, no new outbox row, journal retry_declined, and the receipt
    carries the one-line guidance."""
    led = Ledger(store)
    op_id = await led.submit()
    result = await led.fail(op_id, 1, FC.INVALID_ARGUMENT, code="bad_request", http_status=400)
    assert result == Recorded("applied", to_state="failed")
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("failed", 1)
    assert [r["epoch"] for r in await led.outbox_rows(op_id)] == [1]
    [entry] = await led.entries(op_id, "retry_declined")
    assert entry["detail"]["reason"] == "class_not_retryable:invalid_argument"
    assert entry["detail"]["policy_digest"] == policy_digest()
    receipt = (await led.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    expected = Failure(FC.INVALID_ARGUMENT, "bad_request", "x",
                       idempotency=Idempotency.YES).guidance()
    assert receipt["guidance"] == expected and "\n" not in expected
    assert "Do not repeat the same request." in receipt["guidance"]
    assert receipt["digests"]["policy"] == policy_digest()
    assert receipt["recovery_decision"]["fact"] == "rejected_before_body"


async def test_receipt_renders_guidance_when_the_outcome_carried_none(store: Store) -> None:
    """A failure outcome without a guidance line still gets one in the receipt, rendered
    from the same table."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.fail(op_id, 1, FC.PERMISSION_DENIED, code="forbidden", http_status=403,
                   guidance="")
    receipt = (await led.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    assert receipt["guidance"] == Failure(FC.PERMISSION_DENIED, "forbidden", "x",
                                          idempotency=Idempotency.YES).guidance()
    assert "An operator must fix this" in receipt["guidance"]


async def test_transient_503_before_body_retries_until_max_attempts_then_fails(
        store: Store) -> None:
    """503 before the body (transient, known not applied) → epochs 2 and 3 with the same key,
    each no sooner than its Retry-After, then failed at tool.max_attempts (3)."""
    led = Ledger(store)
    op_id = await led.submit()
    key = (await led.op(op_id))["operation_key"]
    for epoch in (1, 2):
        r = await led.fail(op_id, epoch, FC.TRANSIENT, code="service_unavailable",
                           http_status=503, retry_after_s=1.0)
        assert r.to_state == "pending"
        row = (await led.outbox_rows(op_id))[-1]
        assert row["epoch"] == epoch + 1 and row["available_at"] >= led.now + timedelta(
            seconds=1)
        led.now = row["available_at"]  # the relay publishes it when due
    r = await led.fail(op_id, 3, FC.TRANSIENT, code="service_unavailable", http_status=503)
    assert r == Recorded("applied", to_state="failed")
    op = await led.op(op_id)
    assert (op["state"], op["epoch"], op["operation_key"]) == ("failed", 3, key)
    assert [r["epoch"] for r in await led.outbox_rows(op_id)] == [1, 2, 3]
    assert [e["epoch"] for e in await led.entries(op_id, "retry_scheduled")] == [2, 3]
    [declined] = await led.entries(op_id, "retry_declined")
    assert declined["detail"]["reason"] == "max_attempts_reached"
    assert [a["epoch"] for a in op["attempts"]] == [1, 2, 3]


async def test_contract_revision_change_between_attempts_blocks_automatic_retry(
        store: Store) -> None:
    """The tool's contract revision changed in the catalog after the intent: a 429 that would
    otherwise retry fails instead, journaled as contract_revision_changed."""
    led = Ledger(store, catalog("r1"))
    op_id = await led.submit()
    led.use_catalog(catalog("r2"))
    r = await led.fail(op_id, 1, FC.RATE_LIMITED, code="rate_limited", http_status=429,
                       retry_after_s=1.0)
    assert r.to_state == "failed"
    assert [row["epoch"] for row in await led.outbox_rows(op_id)] == [1]
    [declined] = await led.entries(op_id, "retry_declined")
    assert declined["detail"]["reason"] == "contract_revision_changed"


async def test_non_idempotent_transient_with_idempotency_unset_is_not_resent(
        store: Store) -> None:
    """A transient failure of a non-idempotent tool that did not say it was not applied may
    have taken effect: failed, not retried."""
    led = Ledger(store)
    op_id = await led.submit("email", to="a@example.com")
    r = await led.fail(op_id, 1, FC.TRANSIENT, code="flaky", http_status=503,
                       idempotency="unset")
    assert r.to_state == "failed"
    [declined] = await led.entries(op_id, "retry_declined")
    assert declined["detail"]["reason"] == "not_safe_to_resubmit"


async def test_retry_past_the_deadline_is_declined(store: Store) -> None:
    """A retry due after the tool's retry deadline (counted from acceptance) is declined."""
    led = Ledger(store, catalog(retry_deadline_s=60.0))
    op_id = await led.submit()
    led.now = NOW + timedelta(seconds=59)
    r = await led.fail(op_id, 1, FC.RATE_LIMITED, code="rate_limited", http_status=429,
                       retry_after_s=2.0)
    assert r.to_state == "failed"
    [declined] = await led.entries(op_id, "retry_declined")
    assert declined["detail"]["reason"] == "deadline_exceeded"


async def test_exhausted_retry_budget_declines(store: Store) -> None:
    """With the ledger-wide retry budget spent, a retryable failure fails instead."""
    led = Ledger(store, budget=RetryBudget(capacity=0, refill_per_s=0.0))
    op_id = await led.submit()
    r = await led.fail(op_id, 1, FC.RATE_LIMITED, code="rate_limited", http_status=429)
    assert r.to_state == "failed"
    [declined] = await led.entries(op_id, "retry_declined")
    assert declined["detail"]["reason"] == "retry_budget_exhausted"



@pytest.mark.parametrize("value", ["1e999", "NaN", "Infinity"])
async def test_unusable_retry_after_is_a_poison_message_not_a_stuck_outcome(
        store: Store, value: str) -> None:
    """A 429 outcome whose Retry-After is not a finite number (1e999 parses as infinity) is
    refused at the message boundary with a clear error (to be dead-lettered), instead of an
    outcome whose commit fails on PostgreSQL (jsonb has no Infinity) on every redelivery; the
    operation is untouched."""
    led = Ledger(store)
    op_id = await led.submit()
    attempt = await led.claim(op_id, 1)
    raw = (f'{{"type":"attempt_failed","operation_id":"{op_id}","epoch":1,'
           f'"attempt_id":"{attempt}","dispatcher_id":"d1","at":"2026-11-30T09:00:00Z",'
           f'"failure_class":"rate_limited","code":"rate_limited","message":"m",'
           f'"retry_after_s":{value}}}').encode()
    with pytest.raises(PoisonMessage) as info:
        parse_outcome(raw)
    assert "retry_after_s" in info.value.message
    assert (await led.op(op_id))["state"] == "in_flight"
