"""Resolving ambiguity on both databases (issue 4): reconciler verdicts and verified webhooks
are applied only to the epoch they are about, from a state waiting for them; everything else
is rejected or kept, and journaled."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Literal

import pytest

from effectledger_core.ids import operation_key
from effectledger_core.messages import (
    AttemptFailed,
    AttemptSucceeded,
    DispatchAttempt,
    Evidence,
    FailureClass,
    ReconcileOperation,
    VerdictReached,
    WebhookReceived,
    parse,
)
from effectledger_ledger.db.outbox import lease_batch_txn, mark_published_txn, sweep_unclaimed_txn
from effectledger_ledger.db.resolution import Recorded
from effectledger_ledger.db.schema import operations, outbox, webhook_events
from effectledger_ledger.db.store import Store
from tests.support.ledger import NOW, LedgerDriver, catalog_from_toml

CATALOG = catalog_from_toml("""
[tools.ticket]
endpoint = "http://provider.test/tickets"
effect_class = "idempotent"
contract_revision = "r1"
max_attempts = 3
capabilities = { accepts_idempotency_key = true, readback = true, webhooks = true }
readback = { url = "http://provider.test/tickets/{operation_key}" }
webhook_provider = "sandbox"

[tools.charge]
endpoint = "http://provider.test/charges"
effect_class = "non_idempotent"
contract_revision = "r1"
max_attempts = 5
capabilities = { webhooks = true }
webhook_provider = "sandbox"

[tools.once]
endpoint = "http://provider.test/once"
effect_class = "idempotent"
contract_revision = "r1"
max_attempts = 1
capabilities = { accepts_idempotency_key = true, readback = true }
readback = { url = "http://provider.test/once/{operation_key}" }
""")


class Ledger(LedgerDriver):
    default_catalog, tool, seed = CATALOG, "ticket", 5


# ---- verdicts ------------------------------------------------------------------------------


async def test_ambiguous_outcome_writes_a_reconcile_command(store: Store) -> None:
    """The ambiguity firewall: a ReconcileOperation outbox row, never a dispatch row."""
    led = Ledger(store)
    op_id = await led.submit()
    assert (await led.ambiguous(op_id)).to_state == "ambiguous"
    [row] = await led.outbox_rows(op_id, "reconcile")
    cmd = parse(ReconcileOperation, row["payload"].encode())
    assert (cmd.operation_id, cmd.epoch, cmd.cause, cmd.operation_key) == (
        op_id, 1, "ambiguous", await led.key(op_id))
    assert cmd.claimed_at == NOW and cmd.reason == "timeout"
    assert [r["epoch"] for r in await led.outbox_rows(op_id, "dispatch")] == [1]


async def test_applied_verdict_succeeds_with_evidence_in_the_receipt(store: Store) -> None:
    """applied → succeeded; the receipt carries the readback evidence and the provider ref,
    and no response digest is invented."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    assert await led.verdict(op_id, "applied") == Recorded("applied", to_state="succeeded")
    op = await led.op(op_id)
    assert op["state"] == "succeeded" and op["response_digest"] is None
    receipt = (await led.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    assert receipt["digests"]["response"] is None
    assert receipt["provider_request_ref"] == "tk_7"
    ev = receipt["evidence"]
    assert ev["source"] == "readback" and ev["digest"] == "sha256:readback"
    assert ev["provider_ref"] == "tk_7" and ev["reconciler_id"] == "r1"
    assert ev["verdict"] == "applied" and ev["epoch"] == 1
    assert receipt["reconciliation_status"] == "resolved"
    assert receipt["open_uncertainties"] == []
    [entry] = await led.entries(op_id, "verdict_applied")
    assert (entry["from_state"], entry["to_state"], entry["actor"]) == (
        "ambiguous", "succeeded", "reconciler:r1")


@pytest.mark.parametrize(("verdict", "to_state"), [
    ("applied", "succeeded"), ("not_applied", "pending"), ("undecidable", "needs_review")])
async def test_each_verdict_is_journaled_as_what_it_says(
        store: Store, verdict: Literal["applied", "not_applied", "undecidable"],
        to_state: str) -> None:
    """The journal entry of a recorded verdict names that verdict: a not_applied or
    undecidable verdict is never journaled as verdict_applied."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    assert (await led.verdict(op_id, verdict)).to_state == to_state
    kinds = {"applied": "verdict_applied", "not_applied": "verdict_not_applied",
             "undecidable": "verdict_undecidable"}
    [entry] = await led.entries(op_id, kinds[verdict])
    assert (entry["detail"]["verdict"], entry["to_state"]) == (verdict, to_state)
    for other in set(kinds.values()) - {kinds[verdict]}:
        assert await led.entries(op_id, other) == [], other


@pytest.mark.parametrize("published", [False, True])
@pytest.mark.parametrize("verdict", ["applied", "not_applied", "undecidable"])
async def test_a_verdict_answers_its_reconcile_command_even_before_the_publish_ack(
        store: Store, verdict: Literal["applied", "not_applied", "undecidable"],
        published: bool) -> None:
    """A verdict consumes its epoch's reconcile command whether or not the relay has marked
    it published yet (a webhook can settle an operation within the publish's round trip): a
    row left behind stayed `published` with nothing to answer it until the sweeper's
    reconcile horizon (15 minutes by default), counted as backlog all that time. The relay's
    later mark leaves the consumed row alone, and no sweep brings it back."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    leased = await store.run(lease_batch_txn, now=NOW, limit=100, lease_s=30)
    [row] = await led.outbox_rows(op_id, "reconcile")
    assert row["id"] in {i.id for i in leased} and row["status"] == "publishing"
    if published:
        assert await store.run(mark_published_txn, [row["id"]], now=NOW) == 1
    await led.verdict(op_id, verdict)
    assert [r["status"] for r in await led.outbox_rows(op_id, "reconcile")] == ["consumed"]
    assert await store.run(mark_published_txn, [row["id"]], now=NOW) == 0
    far = NOW + timedelta(days=1)
    assert await store.run(sweep_unclaimed_txn, now=far, older_than_s=60,
                           kind="reconcile") == 0
    assert [r["status"] for r in await led.outbox_rows(op_id, "reconcile")] == ["consumed"]


async def test_a_verdict_leaves_a_queued_reconcile_command_of_another_epoch_alone(
        store: Store) -> None:
    """Only the verdict's own epoch's command is answered: one for a later epoch (ambiguous
    again after a retry) is still wanted."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    assert (await led.verdict(op_id, "not_applied")).to_state == "pending"
    await led.ambiguous(op_id, 2)
    assert await led.verdict(op_id, "applied", epoch=1) == Recorded(
        "rejected", reason="stale_epoch")
    rows = await led.outbox_rows(op_id, "reconcile")
    assert [(r["epoch"], r["status"]) for r in rows] == [(1, "consumed"), (2, "pending")]


async def test_not_applied_verdict_retries_under_policy_with_the_same_key(
        store: Store) -> None:
    """not_applied (known not applied) → pending at epoch 2 with the same key and a dispatch
    row for epoch 2; the retry policy journals why."""
    led = Ledger(store)
    op_id = await led.submit()
    key = await led.key(op_id)
    await led.ambiguous(op_id)
    assert (await led.verdict(op_id, "not_applied")).to_state == "pending"
    op = await led.op(op_id)
    assert (op["state"], op["epoch"], op["operation_key"]) == ("pending", 2, key)
    rows = await led.outbox_rows(op_id, "dispatch")
    assert [r["epoch"] for r in rows] == [1, 2]
    assert parse(DispatchAttempt, rows[1]["payload"].encode()).operation_key == key
    [scheduled] = await led.entries(op_id, "retry_scheduled")
    assert scheduled["epoch"] == 2 and scheduled["detail"]["reason"].startswith("transient:")


async def test_not_applied_verdict_fails_when_attempts_are_exhausted(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit("once")
    await led.ambiguous(op_id)
    assert (await led.verdict(op_id, "not_applied")).to_state == "failed"
    assert (await led.op(op_id))["epoch"] == 1
    assert [r["epoch"] for r in await led.outbox_rows(op_id, "dispatch")] == [1]
    [declined] = await led.entries(op_id, "retry_declined")
    assert declined["detail"]["reason"] == "max_attempts_reached"


async def test_undecidable_verdict_goes_to_review(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    assert (await led.verdict(op_id, "undecidable")).to_state == "needs_review"
    receipt = (await led.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    assert receipt["reconciliation_status"] == "needs_review"
    assert receipt["open_uncertainties"]


async def test_verdict_for_a_superseded_epoch_is_rejected_and_journaled(store: Store) -> None:
    """After not_applied moved the operation to epoch 2, a paused replica's epoch-1 verdict is
    rejected (stale_epoch), journaled as verdict_rejected, and changes nothing."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    await led.verdict(op_id, "not_applied")
    await led.ambiguous(op_id, epoch=2)
    before = await led.op(op_id)
    result = await led.verdict(op_id, "applied", epoch=1, reconciler="r2")
    assert result == Recorded("rejected", reason="stale_epoch")
    assert await led.op(op_id) == before
    [entry] = await led.entries(op_id, "verdict_rejected")
    assert entry["epoch"] == 1 and entry["actor"] == "reconciler:r2"
    assert entry["detail"]["reason"] == "stale_epoch" and entry["detail"]["verdict"] == "applied"


async def test_verdict_after_another_verdict_decided_is_rejected(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    await led.verdict(op_id, "applied")
    before = await led.op(op_id)
    result = await led.verdict(op_id, "undecidable", reconciler="r2")
    assert result.status == "rejected" and result.reason == "state_succeeded"
    assert await led.op(op_id) == before
    [entry] = await led.entries(op_id, "verdict_rejected")
    assert entry["detail"]["reason"] == "state_succeeded"


async def test_verdict_for_an_unknown_operation_is_rejected(store: Store) -> None:
    led = Ledger(store)
    result = await led.verdict("ghost", "applied")
    assert result == Recorded("rejected", reason="unknown_operation")
    [entry] = await led.entries("ghost", "verdict_rejected")
    assert entry["detail"]["reason"] == "unknown_operation"


async def test_redelivered_verdict_is_a_duplicate(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    v = VerdictReached(operation_id=op_id, epoch=1, verdict="undecidable", reconciler_id="r1",
                       at=NOW)
    first = await led.svc.record_verdict(v, consumer="ledger", message_id="v1")
    again = await led.svc.record_verdict(v, consumer="ledger", message_id="v1")
    assert (first.status, again.status) == ("applied", "duplicate")
    assert len(await led.entries(op_id, "verdict_undecidable")) == 1


async def test_racing_reconcilers_with_opposite_verdicts_decide_once_each(
        store: Store) -> None:
    """Two reconcilers race with opposite verdicts on 500 ambiguous operations: exactly one
    verdict is accepted per operation, the other is rejected and journaled."""
    led = Ledger(store)
    # The 500 ambiguous operations are made concurrently (group commit batches them: one at a
    # time they were 1,500 transactions, most of this test's time); the race is the verdicts.
    op_ids = await asyncio.gather(*(led.submit(n=i) for i in range(500)))
    await asyncio.gather(*(led.ambiguous(op_id) for op_id in op_ids))
    results = await asyncio.gather(*(
        led.verdict(op_id, verdict, reconciler=name)
        for op_id in op_ids
        for verdict, name in (("applied", "rA"), ("not_applied", "rB"))))
    for i, op_id in enumerate(op_ids):
        pair = results[2 * i: 2 * i + 2]
        assert sorted(r.status for r in pair) == ["applied", "rejected"], (op_id, pair)
        op = await led.op(op_id)
        winner = pair[0] if pair[0].status == "applied" else pair[1]
        won, lost = (("verdict_applied", "verdict_not_applied") if winner is pair[0]
                     else ("verdict_not_applied", "verdict_applied"))
        if winner is pair[0]:
            assert (op["state"], op["epoch"]) == ("succeeded", 1)
        else:
            assert (op["state"], op["epoch"]) == ("pending", 2)
        assert len(await led.entries(op_id, won)) == 1
        assert await led.entries(op_id, lost) == []
        assert len(await led.entries(op_id, "verdict_rejected")) == 1


@pytest.mark.parametrize("verdict", ["applied", "not_applied"])
async def test_verdict_without_evidence_goes_to_review_not_to_a_guess(
        store: Store, verdict: Literal["applied", "not_applied"]) -> None:
    """Evidence before verdict: an applied / not_applied verdict that carries no evidence is
    not applied as such (no success, no retry); the operation goes to needs_review."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    result = await led.svc.record_verdict(VerdictReached(
        operation_id=op_id, epoch=1, verdict=verdict, reconciler_id="r1", at=NOW),
        consumer="ledger", message_id="v-bare")
    assert result.to_state == "needs_review"
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("needs_review", 1)
    assert [r["epoch"] for r in await led.outbox_rows(op_id, "dispatch")] == [1]
    assert await led.entries(op_id, "verdict_applied") == []
    [entry] = await led.entries(op_id, "verdict_undecidable")
    assert entry["detail"]["verdict"] == "undecidable"
    assert entry["detail"]["evidence"]["claimed_verdict"] == verdict


# ---- webhooks ------------------------------------------------------------------------------


async def test_applied_webhook_resolves_an_ambiguous_operation(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    result = await led.webhook("wh1", key=await led.key(op_id))
    assert result == Recorded("applied", to_state="succeeded")
    op = await led.op(op_id)
    assert op["state"] == "succeeded" and op["provider_ref"] == "tk_hook"
    assert op["evidence"]["source"] == "webhook" and op["evidence"]["webhook_id"] == "wh1"
    assert op["response_digest"] is None
    [hook] = await led.rows(webhook_events)
    assert hook["applied"] == "applied" and hook["operation_id"] == op_id


async def test_concurrent_duplicate_webhooks_have_one_effect(store: Store) -> None:
    """The same webhook id delivered five times at once: one row, one state change, one
    journal entry; the others are duplicates."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    key = await led.key(op_id)
    results = await asyncio.gather(*(led.webhook("wh-dup", key=key) for _ in range(5)))
    assert sorted(r.status for r in results) == ["applied"] + ["duplicate"] * 4
    assert len(await led.rows(webhook_events)) == 1
    assert len(await led.entries(op_id, "verdict_applied")) == 1
    assert (await led.op(op_id))["state"] == "succeeded"


async def test_webhook_before_the_outcome_is_kept_then_applied(store: Store) -> None:
    """A webhook for an in-flight operation is kept; when the ambiguous outcome arrives it
    decides at once, so no reconciliation command is written."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.claim(op_id)
    kept = await led.webhook("wh-early", key=await led.key(op_id))
    assert kept.status == "kept"
    assert (await led.op(op_id))["state"] == "in_flight"
    [entry] = await led.entries(op_id, "webhook_kept")
    assert entry["detail"]["state"] == "in_flight"

    led.now += timedelta(seconds=5)
    result = await led.ambiguous(op_id, claimed=True)
    assert result == Recorded("applied", to_state="succeeded")
    op = await led.op(op_id)
    assert op["state"] == "succeeded" and op["evidence"]["webhook_id"] == "wh-early"
    assert await led.outbox_rows(op_id, "reconcile") == []
    [hook] = await led.rows(webhook_events)
    assert hook["applied"] == "applied"


async def test_webhook_before_the_operation_exists_is_applied_when_it_can_be(
        store: Store) -> None:
    """A webhook naming an operation key the ledger does not know yet is kept (unmatched) and
    decides that operation once it is created and its outcome turns ambiguous."""
    led = Ledger(store)
    key = operation_key(tenant="default", task_id=None, caller_key="ck-1",
                        operation_id="unused")
    kept = await led.webhook("wh-orphan", key=key)
    assert kept == Recorded("kept", reason="unknown_operation")
    op_id = await led.submit(caller_key="ck-1")
    assert await led.key(op_id) == key
    result = await led.ambiguous(op_id)
    assert result.to_state == "succeeded"
    assert await led.outbox_rows(op_id, "reconcile") == []


async def test_webhook_for_an_unknown_operation_is_kept_and_journaled(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    before = await led.op(op_id)
    result = await led.webhook("wh-x", key="ck_nobody")
    assert result == Recorded("kept", reason="unknown_operation")
    [entry] = await led.entries(None, "webhook_unmatched")
    assert entry["detail"] == {"webhook_id": "wh-x", "operation_key": "ck_nobody"}
    [hook] = await led.rows(webhook_events)
    assert hook["operation_id"] is None and hook["applied"] is None
    assert await led.op(op_id) == before


async def test_final_not_applied_webhook_for_a_succeeded_operation_is_a_conflict(
        store: Store) -> None:
    """The provider contradicts a recorded success: journaled as evidence_conflict for a
    human; the state and its evidence stay."""
    led = Ledger(store)
    op_id = await led.submit()
    attempt = await led.claim(op_id)
    await led.svc.record_outcome(AttemptSucceeded(
        operation_id=op_id, epoch=1, attempt_id=attempt, dispatcher_id="d1", at=NOW,
        provider_ref="tk_1", response_digest="sha256:resp"), consumer="ledger",
        message_id="m-ok")
    before = await led.op(op_id)
    result = await led.webhook("wh-no", key=await led.key(op_id), outcome="not_applied")
    assert result.status == "kept"
    assert await led.op(op_id) == before
    [entry] = await led.entries(op_id, "evidence_conflict")
    assert entry["detail"] == {"webhook_id": "wh-no", "says": "not_applied"}


async def test_non_final_webhook_is_evidence_only(store: Store) -> None:
    """A 'not applied yet' (non-final) or 'pending' webhook decides nothing."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    key = await led.key(op_id)
    for wid, outcome in (("w1", "not_applied"), ("w2", "pending")):
        r = await led.webhook(wid, key=key, outcome=outcome, final=False)  # type: ignore[arg-type]
        assert r.status == "kept"
    assert (await led.op(op_id))["state"] == "ambiguous"


async def test_final_not_applied_webhook_of_another_epoch_is_ignored(store: Store) -> None:
    """'Not applied' speaks only for the attempt whose fencing token it names."""
    led = Ledger(store)
    op_id = await led.submit()
    await led.ambiguous(op_id)
    r = await led.webhook("w-old", key=await led.key(op_id), outcome="not_applied",
                          fencing_token=7)
    assert r == Recorded("kept", reason="other_epoch")
    assert (await led.op(op_id))["state"] == "ambiguous"
    r = await led.webhook("w-now", key=await led.key(op_id), outcome="not_applied",
                          fencing_token=1)
    assert r.to_state == "pending"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_operation_rows_untouched_by_unmatched_webhooks(store: Store) -> None:
    """Nothing but the webhook row and the journal entry is written for an unknown key."""
    led = Ledger(store)
    await led.webhook("wh-lonely", key="ck_none")
    assert await led.rows(operations) == []
    assert await led.rows(outbox) == []


async def test_stored_not_applied_webhook_of_an_earlier_attempt_does_not_decide_a_later_one(
        store: Store) -> None:
    """A final 'not applied' webhook without a fencing token, kept while epoch 1 was in
    flight, says nothing about epoch 2 (claimed after it arrived): when epoch 2 turns
    ambiguous it goes to the reconciler instead of being retried on stale evidence, which
    for a non-idempotent tool could apply the effect twice."""
    led = Ledger(store)
    op_id = await led.submit("charge")
    key = await led.key(op_id)
    attempt = await led.claim(op_id, 1)
    kept = await led.webhook("wh-epoch1", key=key, outcome="not_applied")
    assert kept.status == "kept"
    led.now += timedelta(seconds=1)
    r = await led.svc.record_outcome(AttemptFailed(
        operation_id=op_id, epoch=1, attempt_id=attempt, dispatcher_id="d1", at=led.now,
        http_status=429, failure_class=FailureClass.RATE_LIMITED, code="rate_limited",
        message="slow down", retry_after_s=1.0, idempotency="yes"),
        consumer="ledger", message_id=led.mid())
    assert r.to_state == "pending"
    led.now += timedelta(seconds=2)
    result = await led.ambiguous(op_id, epoch=2)
    assert result == Recorded("applied", to_state="ambiguous")
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("ambiguous", 2)
    [row] = await led.outbox_rows(op_id, "reconcile")
    assert row["epoch"] == 2
    [hook] = await led.rows(webhook_events)
    assert hook["applied"] == "ignored"


async def test_stored_applied_webhook_speaks_for_the_key_at_any_epoch(store: Store) -> None:
    """'Applied' is about the operation key, not one attempt: kept from epoch 1, it settles
    the operation when a later epoch turns ambiguous."""
    led = Ledger(store)
    op_id = await led.submit("charge")
    attempt = await led.claim(op_id, 1)
    await led.svc.record_outcome(AttemptFailed(
        operation_id=op_id, epoch=1, attempt_id=attempt, dispatcher_id="d1", at=led.now,
        http_status=429, failure_class=FailureClass.RATE_LIMITED, code="rate_limited",
        message="slow down", idempotency="yes"), consumer="ledger", message_id=led.mid())
    kept = await led.webhook("wh-applied", key=await led.key(op_id), outcome="applied")
    assert kept.status == "kept"
    led.now += timedelta(seconds=2)
    assert (await led.ambiguous(op_id, epoch=2)).to_state == "succeeded"


# --- issue 12: current-epoch evidence, duplicates found by readback ---------------------------

async def test_operation_view_shows_only_the_current_epochs_evidence(store: Store) -> None:
    """Epoch 1 verified not applied, epoch 2 succeeded by response: the view carries no
    epoch-1 "not applied" next to the success; the journal still has it."""
    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    await ledger.ambiguous(op_id)
    assert (await ledger.verdict(op_id, "not_applied")).to_state == "pending"
    assert (await ledger.op(op_id))["evidence"] is None  # epoch 2 has no evidence yet
    attempt = await ledger.claim(op_id, 2)
    await ledger.svc.record_outcome(AttemptSucceeded(
        operation_id=op_id, epoch=2, attempt_id=attempt, dispatcher_id="d1", at=ledger.now,
        http_status=201, provider_ref="ch_2", response_digest="sha256:r"),
        consumer="ledger", message_id=ledger.mid())
    op = await ledger.op(op_id)
    assert (op["state"], op["epoch"], op["evidence"]) == ("succeeded", 2, None)
    receipt = (await ledger.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    assert receipt["evidence"] is None and receipt["open_uncertainties"] == []
    [entry] = await ledger.entries(op_id, "verdict_not_applied")
    assert entry["detail"]["verdict"] == "not_applied" and entry["epoch"] == 1


async def test_readback_with_two_matches_records_duplicate_detected(store: Store) -> None:
    """A verdict whose readback counted two effects: needs_review, a duplicate_detected
    journal entry, an open uncertainty on the receipt, and an item in the review queue."""
    from effectledger_ledger.db import duplicates

    seen: list[tuple[str, int]] = []

    def observe(tool: str, n: int) -> None:
        seen.append((tool, n))

    duplicates.observers.append(observe)
    try:
        ledger = Ledger(store)
        op_id = await ledger.submit("charge")
        await ledger.ambiguous(op_id)
        result = await ledger.svc.record_verdict(VerdictReached(
            operation_id=op_id, epoch=1, verdict="undecidable", reconciler_id="r1",
            reason="duplicate_detected: 2 effects", at=ledger.now, evidence=Evidence(
                source="readback", at=ledger.now, provider_ref="cus_1", digest="sha256:x",
                matches=2, detail="readback found 2 effects for one key")),
            consumer="ledger", message_id=ledger.mid())
    finally:
        # Only our own observer: the ledger's metrics observer stays registered.
        duplicates.observers.remove(observe)
    assert result.to_state == "needs_review"
    [entry] = await ledger.entries(op_id, "duplicate_detected")
    assert entry["detail"]["matches"] == 2 and entry["detail"]["provider_ref"] == "cus_1"
    receipt = (await ledger.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    assert any(u.startswith("duplicate_detected") for u in receipt["open_uncertainties"])
    [item] = await ledger.svc.review_queue()
    assert "duplicate_detected" in [e.kind for e in item.evidence]
    assert seen == [("charge", 2)]


async def test_a_single_match_records_no_duplicate(store: Store) -> None:
    ledger = Ledger(store)
    op_id = await ledger.submit("ticket")
    await ledger.ambiguous(op_id)
    await ledger.svc.record_verdict(VerdictReached(
        operation_id=op_id, epoch=1, verdict="applied", reconciler_id="r1", at=ledger.now,
        evidence=Evidence(source="readback", at=ledger.now, matches=1)),
        consumer="ledger", message_id=ledger.mid())
    assert (await ledger.op(op_id))["state"] == "succeeded"
    assert await ledger.entries(op_id, "duplicate_detected") == []


async def test_retry_on_not_applied_schedules_an_audit_and_its_duplicate_is_recorded(
        store: Store) -> None:
    """A not-applied verdict that retries also queues a duplicate audit for that epoch; the
    audit's finding on the succeeded operation keeps it succeeded, marks its evidence, lists it
    on the receipt and in the review queue, and journals duplicate_detected."""
    from effectledger_ledger.db.outbox import mark_published_txn

    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    await ledger.ambiguous(op_id)
    await ledger.verdict(op_id, "not_applied")
    [row] = await ledger.rows(outbox, outbox.c.operation_id == op_id, outbox.c.kind == "audit")
    cmd = parse(ReconcileOperation, row["payload"].encode())
    assert (cmd.cause, cmd.epoch, cmd.operation_key) == ("audit", 1, await ledger.key(op_id))
    async with store.transaction() as conn:
        await conn.execute(outbox.update().where(outbox.c.id == row["id"])
                           .values(status="publishing"))
        await mark_published_txn(conn, [row["id"]], now=ledger.now)
    # An audit command needs no answer: once published its row is done, never swept.
    [row] = await ledger.rows(outbox, outbox.c.id == row["id"])
    assert row["status"] == "consumed"

    attempt = await ledger.claim(op_id, 2)
    await ledger.svc.record_outcome(AttemptSucceeded(
        operation_id=op_id, epoch=2, attempt_id=attempt, dispatcher_id="d1", at=ledger.now,
        http_status=201, provider_ref="ch_2", response_digest="sha256:r"),
        consumer="ledger", message_id=ledger.mid())
    result = await ledger.svc.record_verdict(VerdictReached(
        operation_id=op_id, epoch=1, verdict="undecidable", reconciler_id="r1",
        reason="duplicate_detected: audit", at=ledger.now, evidence=Evidence(
            source="readback", at=ledger.now, provider_ref="ch_1", matches=2)),
        consumer="ledger", message_id=ledger.mid())
    assert (result.status, result.reason) == ("applied", "duplicate_detected")
    op = await ledger.op(op_id)
    assert op["state"] == "succeeded" and op["evidence"]["duplicate"]["matches"] == 2
    [entry] = await ledger.entries(op_id, "duplicate_detected")
    assert entry["epoch"] == 1
    receipt = (await ledger.svc.receipt(op_id)).model_dump(mode="json")  # as the API answers it
    assert receipt["open_uncertainties"] == [
        "duplicate_detected: the provider lists 2 effects for this operation key"]
    assert [i.operation.id for i in await ledger.svc.review_queue()] == [op_id]

    # An operator closes it with a "completed" review naming how the extra effect was handled;
    # any other conclusion is refused. The operation stays succeeded, the mark stays as evidence.
    from effectledger_core.recovery import Conclusion, Review
    from effectledger_ledger.db.recovery import ActionRejected

    with pytest.raises(ActionRejected):
        await ledger.svc.review(op_id, Review(operator="alice", evidence_ref="T-1",
                                              conclusion=Conclusion.UNCERTAIN, epoch=2))
    await ledger.svc.review(op_id, Review(operator="alice", evidence_ref="refund re_1",
                                          conclusion=Conclusion.COMPLETED, epoch=2))
    op = await ledger.op(op_id)
    assert op["state"] == "succeeded"
    assert op["evidence"]["duplicate"]["reviewed"]["evidence_ref"] == "refund re_1"
    assert (await ledger.svc.receipt(op_id)).open_uncertainties == []
    assert await ledger.svc.review_queue() == []


async def test_an_audit_finding_one_effect_changes_nothing(store: Store) -> None:
    """No verdict is sent for a clean audit; a stray one with one match is rejected as usual."""
    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    await ledger.ambiguous(op_id)
    await ledger.verdict(op_id, "applied")
    result = await ledger.svc.record_verdict(VerdictReached(
        operation_id=op_id, epoch=1, verdict="undecidable", reconciler_id="r1",
        at=ledger.now, evidence=Evidence(source="readback", at=ledger.now, matches=1)),
        consumer="ledger", message_id=ledger.mid())
    assert result.status == "rejected"
    assert await ledger.entries(op_id, "duplicate_detected") == []
    assert await ledger.svc.review_queue() == []


# --- issue 28: duplicate detection gaps --------------------------------------------------------

async def test_a_retry_decided_applied_gets_its_own_duplicate_audit(store: Store) -> None:
    """Epoch 1 verified not applied, epoch 2 ambiguous and then decided applied: epoch 2's own
    request may still land late, after epoch 1's audit has looked, so epoch 2 is audited too,
    from its own claim; that audit's finding is recorded like any other."""
    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    await ledger.ambiguous(op_id)
    await ledger.verdict(op_id, "not_applied")
    ledger.now = NOW + timedelta(seconds=40)  # the retry is claimed later than epoch 1
    await ledger.ambiguous(op_id, 2)
    assert (await ledger.verdict(op_id, "applied", 2)).to_state == "succeeded"
    audits = [parse(ReconcileOperation, r["payload"].encode())
              for r in await ledger.outbox_rows(op_id, "audit")]
    assert [(c.cause, c.epoch, c.claimed_at) for c in audits] == [
        ("audit", 1, NOW), ("audit", 2, NOW + timedelta(seconds=40))]
    assert audits[1].reason == "a retry decided applied"

    # What that audit finds after epoch 2's horizon: two effects, both named.
    result = await ledger.svc.record_verdict(VerdictReached(
        operation_id=op_id, epoch=2, verdict="undecidable", reconciler_id="r1",
        reason="duplicate_detected: audit", at=ledger.now, evidence=Evidence(
            source="readback", at=ledger.now, provider_ref="ch_1", matches=2,
            provider_refs=["ch_1", "ch_2"])),
        consumer="ledger", message_id=ledger.mid())
    assert (result.status, result.reason) == ("applied", "duplicate_detected")
    [entry] = await ledger.entries(op_id, "duplicate_detected")
    assert entry["epoch"] == 2 and entry["detail"]["provider_refs"] == ["ch_1", "ch_2"]


async def test_two_epochs_audits_seeing_the_same_effects_are_one_finding(store: Store) -> None:
    """Epoch 1's and epoch 2's audits both count the same two effects: one duplicate_detected
    (the second verdict is rejected and journaled as such); a third effect seen later is a new
    finding."""
    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    await ledger.ambiguous(op_id)
    await ledger.verdict(op_id, "not_applied")
    await ledger.ambiguous(op_id, 2)
    await ledger.verdict(op_id, "applied", 2)

    async def audit(epoch: int, *refs: str) -> Recorded:
        return await ledger.svc.record_verdict(VerdictReached(
            operation_id=op_id, epoch=epoch, verdict="undecidable", reconciler_id="r1",
            reason="duplicate_detected: audit", at=ledger.now, evidence=Evidence(
                source="readback", at=ledger.now, provider_ref=refs[0], matches=len(refs),
                provider_refs=list(refs))),
            consumer="ledger", message_id=ledger.mid())

    assert (await audit(1, "ch_1", "ch_2")).reason == "duplicate_detected"
    again = await audit(2, "ch_1", "ch_2")
    assert (again.status, again.reason) == ("rejected", "duplicate_already_recorded")
    assert len(await ledger.entries(op_id, "duplicate_detected")) == 1
    [rejected] = await ledger.entries(op_id, "verdict_rejected")
    assert rejected["detail"]["reason"] == "duplicate_already_recorded"
    assert (await audit(2, "ch_1", "ch_2", "ch_3")).reason == "duplicate_detected"
    entries = await ledger.entries(op_id, "duplicate_detected")
    assert [e["detail"]["provider_refs"] for e in entries] == [
        ["ch_1", "ch_2"], ["ch_1", "ch_2", "ch_3"]]


async def test_a_first_attempt_decided_applied_queues_no_audit(store: Store) -> None:
    """Only a retry can duplicate its own epoch's effect: epoch 1 applied queues nothing."""
    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    await ledger.ambiguous(op_id)
    await ledger.verdict(op_id, "applied")
    assert await ledger.outbox_rows(op_id, "audit") == []


async def test_every_duplicate_detected_names_all_the_references_found(store: Store) -> None:
    """A readback listing three effects for one key: the journal entry names all three, the
    operation's own reference apart, so an operator can tell what to refund or delete."""
    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    await ledger.ambiguous(op_id)
    await ledger.svc.record_verdict(VerdictReached(
        operation_id=op_id, epoch=1, verdict="undecidable", reconciler_id="r1",
        reason="duplicate_detected: 3 effects", at=ledger.now, evidence=Evidence(
            source="readback", at=ledger.now, provider_ref="cus_1", matches=3,
            provider_refs=["cus_1", "cus_2", "cus_3"])),
        consumer="ledger", message_id=ledger.mid())
    [entry] = await ledger.entries(op_id, "duplicate_detected")
    assert entry["detail"]["provider_refs"] == ["cus_1", "cus_2", "cus_3"]
    assert entry["detail"]["matches"] == 3


async def _signed(ledger: Ledger, webhook_id: str, key: str, ref: str) -> Recorded:
    return await ledger.svc.record_webhook(WebhookReceived(
        provider="sandbox", webhook_id=webhook_id, event_type="effect.applied",
        operation_key=key, provider_ref=ref, outcome="applied", final=True,
        body_digest=f"sha256:{webhook_id}", signed_at=ledger.now, received_at=ledger.now))


async def test_a_second_signed_webhook_naming_another_object_is_a_duplicate(
        store: Store) -> None:
    """The first verified event settles the operation; a second one for the same key naming
    another provider object is duplicate_detected at once (not merely kept), naming both
    objects; a resend of an object already named is no new finding."""
    from effectledger_ledger.db import duplicates

    seen: list[tuple[str, int]] = []

    def observe(tool: str, n: int) -> None:
        seen.append((tool, n))

    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    key = await ledger.key(op_id)
    await ledger.ambiguous(op_id)
    assert (await _signed(ledger, "wh1", key, "ch_1")).to_state == "succeeded"
    duplicates.observers.append(observe)
    try:
        result = await _signed(ledger, "wh2", key, "ch_2")
    finally:
        duplicates.observers.remove(observe)
    assert result.reason == "duplicate_detected" and seen == [("charge", 2)]
    [entry] = await ledger.entries(op_id, "duplicate_detected")
    assert entry["detail"]["provider_refs"] == ["ch_1", "ch_2"]
    assert (entry["detail"]["source"], entry["actor"]) == ("webhook", "webhook:sandbox")
    assert await ledger.entries(op_id, "webhook_kept") == []
    op = await ledger.op(op_id)
    assert op["state"] == "succeeded" and op["evidence"]["duplicate"]["matches"] == 2
    assert op["evidence"]["duplicate"]["provider_refs"] == ["ch_1", "ch_2"]
    assert [i.operation.id for i in await ledger.svc.review_queue()] == [op_id]
    [hook] = await ledger.rows(webhook_events, webhook_events.c.webhook_id == "wh2")
    assert hook["applied"] == "duplicate_detected"

    # The same object again under a new webhook id: kept, no second finding.
    assert (await _signed(ledger, "wh3", key, "ch_2")).reason == "state_succeeded"
    assert len(await ledger.entries(op_id, "duplicate_detected")) == 1


async def test_two_objects_while_in_flight_are_a_duplicate_at_once_and_marked_when_settled(
        store: Store) -> None:
    """Both verified events arrive while the attempt is in flight: the second one's other
    object is duplicate_detected on arrival; when the ambiguity then settles from the first,
    the succeeded operation's evidence carries the finding (the receipt lists it), and the
    journal has it once."""
    ledger = Ledger(store)
    op_id = await ledger.submit("charge")
    key = await ledger.key(op_id)
    await ledger.claim(op_id)
    assert (await _signed(ledger, "wh1", key, "ch_1")).reason == "state_in_flight"
    assert (await _signed(ledger, "wh2", key, "ch_2")).reason == "duplicate_detected"
    result = await ledger.ambiguous(op_id, claimed=True)
    assert result.to_state == "succeeded"
    [entry] = await ledger.entries(op_id, "duplicate_detected")
    assert entry["detail"]["provider_refs"] == ["ch_1", "ch_2"]
    op = await ledger.op(op_id)
    assert (op["provider_ref"], op["evidence"]["duplicate"]["provider_refs"]) == (
        "ch_1", ["ch_1", "ch_2"])
    assert any(u.startswith("duplicate_detected")
               for u in (await ledger.svc.receipt(op_id)).open_uncertainties)
    assert [i.operation.id for i in await ledger.svc.review_queue()] == [op_id]
