"""Operator actions on both databases (issue 3): approvals bound to epoch and arguments,
cancellation, and explicit single-use retry plans that still pass admission."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from effectledger_core.catalog import Catalog
from effectledger_core.errors import NotFound
from effectledger_core.messages import (
    AttemptFailed,
    AttemptSucceeded,
    ClaimAttempt,
    ClaimStatus,
    DispatchAttempt,
    FailureClass,
    parse,
)
from effectledger_core.recovery import Conclusion, RecoveryRefused, Review
from effectledger_ledger.db.recovery import ActionRejected, record_plan_txn
from effectledger_ledger.db.schema import journal, operations, outbox, retry_plans
from effectledger_ledger.db.store import Store
from tests.support.ledger import LedgerDriver, catalog_from_toml


def catalog(revision: str = "r1") -> Catalog:
    return catalog_from_toml(f"""
[tools.lookup]
endpoint = "http://provider.test/lookup"
effect_class = "read_only"
contract_revision = "{revision}"

[tools.ticket]
endpoint = "http://provider.test/tickets"
effect_class = "idempotent"
contract_revision = "{revision}"
capabilities = {{ accepts_idempotency_key = true }}

[tools.email]
endpoint = "http://provider.test/emails"
effect_class = "non_idempotent"
contract_revision = "{revision}"

[tools.payout]
endpoint = "http://provider.test/payouts"
effect_class = "non_idempotent"
contract_revision = "{revision}"
commit_policy = "approval"
""")


class Ledger(LedgerDriver):
    default_catalog, seed = catalog(), 3

    async def snapshot(self, op_id: str) -> tuple[Any, ...]:
        """Everything an action could change about one operation."""
        return (await self.op(op_id), await self.outbox_rows(op_id), await self.kinds(op_id),
                await self.rows(retry_plans, retry_plans.c.operation_id == op_id))


# ---- approvals -----------------------------------------------------------------------------


async def test_approval_gated_tool_waits_without_a_dispatch_row(store: Store) -> None:
    """An approval-gated tool enters awaiting_approval; nothing can reach the provider."""
    led = Ledger(store)
    op_id = await led.submit("payout", amount=10)
    op = await led.op(op_id)
    assert (op["state"], op["epoch"], op["commit_policy"]) == ("awaiting_approval", 1,
                                                               "approval")
    assert await led.rows(outbox, outbox.c.operation_id == op_id) == []
    reply = await led.svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id="a",
                                             dispatcher_id="d"))
    assert reply.status is ClaimStatus.NOT_CLAIMABLE


@pytest.mark.parametrize(("epoch", "digest", "reason"), [
    (2, None, "stale_epoch"), (0, None, "stale_epoch"),
    (1, "sha256:" + "0" * 64, "arguments_changed"),
], ids=["future_epoch", "stale_epoch", "altered_arguments"])
async def test_approval_of_another_epoch_or_other_arguments_is_rejected(
        store: Store, epoch: int, digest: str | None, reason: str) -> None:
    """Approving a different epoch or a different arguments digest is ActionRejected and
    nothing changes: no state, no outbox row, no journal entry."""
    led = Ledger(store)
    op_id = await led.submit("payout", amount=10)
    before = await led.snapshot(op_id)
    right = (await led.op(op_id))["arguments_digest"]
    with pytest.raises(ActionRejected) as info:
        await led.svc.approve(op_id, epoch=epoch, arguments_digest=digest or right,
                              operator="alice")
    assert info.value.details.get("reason") == reason and info.value.http_status == 409
    assert await led.snapshot(op_id) == before


async def test_approval_of_the_exact_arguments_dispatches(store: Store) -> None:
    """The right epoch and digest → pending with its dispatch row, journaled with who."""
    led = Ledger(store)
    op_id = await led.submit("payout", amount=10)
    op = await led.op(op_id)
    await led.svc.approve(op_id, epoch=1, arguments_digest=op["arguments_digest"],
                          operator="alice")
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("pending", 1)
    [row] = await led.outbox_rows(op_id)
    assert (row["epoch"], row["status"]) == (1, "pending")
    assert parse(DispatchAttempt, row["payload"].encode()).arguments == {"amount": 10}
    [entry] = await led.rows(journal, journal.c.kind == "approved")
    assert entry["actor"] == "operator:alice" and entry["to_state"] == "pending"
    assert entry["detail"]["arguments_digest"] == op["arguments_digest"]
    # approving twice is rejected: the operation is no longer awaiting approval
    with pytest.raises(ActionRejected):
        await led.svc.approve(op_id, epoch=1, arguments_digest=op["arguments_digest"],
                              operator="alice")


async def test_rejection_cancels(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit("payout", amount=10)
    with pytest.raises(ActionRejected):
        await led.svc.reject(op_id, epoch=2, operator="bob", reason="stale")
    await led.svc.reject(op_id, epoch=1, operator="bob", reason="too much")
    op = await led.op(op_id)
    assert op["state"] == "cancelled"
    assert await led.rows(outbox, outbox.c.operation_id == op_id) == []
    [entry] = await led.rows(journal, journal.c.kind == "approval_rejected")
    assert entry["detail"] == {"operator": "bob", "reason": "too much"}


async def test_cancel_of_pending_obsoletes_its_outbox_rows(store: Store) -> None:
    """Cancelling a pending operation marks its dispatch rows obsolete; a dispatcher that
    still got the message cannot claim it."""
    led = Ledger(store)
    op_id = await led.submit("ticket")
    await led.svc.cancel(op_id, operator="carol", reason="not needed")
    assert (await led.op(op_id))["state"] == "cancelled"
    assert [r["status"] for r in await led.outbox_rows(op_id)] == ["obsolete"]
    reply = await led.svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id="a",
                                             dispatcher_id="d"))
    assert reply.status is ClaimStatus.NOT_CLAIMABLE


async def test_cancel_of_in_flight_is_rejected(store: Store) -> None:
    """Once an attempt is claimed the provider may be applying it: too late to cancel."""
    led = Ledger(store)
    op_id = await led.submit("ticket")
    await led.claim(op_id, 1)
    with pytest.raises(ActionRejected):
        await led.svc.cancel(op_id, operator="carol", reason="late")
    assert (await led.op(op_id))["state"] == "in_flight"


# ---- retry plans ---------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["lookup", "ticket"])
async def test_ambiguous_deduplicating_tool_admits_one_explicit_retry(store: Store,
                                                                      tool: str) -> None:
    """Ambiguous read_only / idempotent → a plan is admitted: epoch 2, same key, a dispatch
    row for epoch 2; plan and admission journaled."""
    led = Ledger(store)
    op_id = await led.submit(tool)
    key = (await led.op(op_id))["operation_key"]
    await led.ambiguous(op_id)
    plan_id, admission = await led.svc.retry(op_id, operator="alice")
    assert admission.admitted and admission.reason == "admitted"
    op = await led.op(op_id)
    assert (op["state"], op["epoch"], op["operation_key"]) == ("pending", 2, key)
    rows = await led.outbox_rows(op_id)
    assert [(r["epoch"], r["status"]) for r in rows] == [(1, "consumed"), (2, "pending")]
    cmd = parse(DispatchAttempt, rows[1]["payload"].encode())
    assert (cmd.epoch, cmd.operation_key) == (2, key)
    kinds = await led.kinds(op_id)
    assert kinds[-2:] == ["retry_planned", "retry_admitted"]
    # both journaled as the operator's acts, distinguishable from the ledger's own
    actors = {r["kind"]: r["actor"] for r in await led.rows(journal, journal.c.kind.in_(
        ("retry_planned", "retry_admitted")))}
    assert actors == {"retry_planned": "operator:alice", "retry_admitted": "operator:alice"}
    [plan] = await led.rows(retry_plans, retry_plans.c.id == plan_id)
    assert plan["admission"] == "admitted" and plan["consumed_at"] == led.now
    assert (plan["epoch"], plan["requested_by"]) == (1, "alice")


async def test_ambiguous_non_idempotent_needs_review(store: Store) -> None:
    """No plan (and no plan row) for an uncertain non-idempotent attempt without a review."""
    led = Ledger(store)
    op_id = await led.submit("email")
    await led.ambiguous(op_id)
    before = await led.snapshot(op_id)
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.retry(op_id, operator="alice")
    assert info.value.reason == "needs_review"
    assert await led.snapshot(op_id) == before
    assert (await led.svc.inspect(op_id)).decision.value == "needs_review"


async def test_not_executed_review_lets_one_retry_through(store: Store) -> None:
    """In needs_review (after an undecidable verdict), an operator's not_executed review of
    that epoch makes the plan admissible; the plan records the review."""
    led = Ledger(store)
    op_id = await led.submit("email")
    await led.undecidable(op_id)
    with pytest.raises(RecoveryRefused):
        await led.svc.retry(op_id, operator="alice")
    await led.svc.review(op_id, Review(operator="alice", evidence_ref="INC-7",
                                       conclusion=Conclusion.NOT_EXECUTED, epoch=1))
    assert (await led.op(op_id))["state"] == "needs_review"
    plan_id, admission = await led.svc.retry(op_id, operator="alice")
    assert admission.admitted
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("pending", 2)
    [plan] = await led.rows(retry_plans, retry_plans.c.id == plan_id)
    assert plan["review"] == {"operator": "alice", "evidence_ref": "INC-7",
                              "conclusion": "not_executed", "epoch": 1}
    # the review spoke for epoch 1 only: after a new ambiguity at epoch 2, it no longer counts
    await led.undecidable(op_id, epoch=2)
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.retry(op_id, operator="alice")
    assert info.value.reason == "needs_review"


async def test_plan_used_twice_fails_even_after_an_admission_refusal(store: Store) -> None:
    """The contract changed between the attempt and the plan: admission refuses (and consumes)
    the plan; using it again is plan_already_used, and nothing moved."""
    led = Ledger(store, catalog("r1"))
    op_id = await led.submit("ticket")
    await led.ambiguous(op_id)
    led.use_catalog(catalog("r2"))
    plan_id, admission = await led.svc.retry(op_id, operator="alice")
    assert not admission.admitted and admission.reason == "contract_changed"
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("ambiguous", 1)
    [entry] = await led.rows(journal, journal.c.kind == "retry_refused")
    assert entry["detail"] == {"plan_id": plan_id, "reason": "contract_changed"}
    before = await led.snapshot(op_id)
    led.use_catalog(catalog("r1"))  # even once the contract is back, the plan stays spent
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.use_plan(plan_id)
    assert info.value.reason == "plan_already_used"
    assert await led.snapshot(op_id) == before


async def test_admitted_plan_cannot_be_used_again(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit("lookup")
    await led.ambiguous(op_id)
    plan_id, admission = await led.svc.retry(op_id, operator="alice")
    assert admission.admitted
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.use_plan(plan_id)
    assert info.value.reason == "plan_already_used"
    assert (await led.op(op_id))["epoch"] == 2


async def test_concurrent_uses_of_one_plan_admit_it_once(store: Store) -> None:
    """Five simultaneous uses of one recorded plan: one admission, four plan_already_used."""
    led = Ledger(store)
    op_id = await led.submit("lookup")
    await led.ambiguous(op_id)
    from effectledger_core.recovery import prepare_retry
    from effectledger_ledger.db.recovery import facts, load_op

    async with store.transaction() as conn:
        plan = prepare_retry(facts(await load_op(conn, op_id)))
    await store.run(record_plan_txn, plan, plan_id="plan1", requested_by="alice", now=led.now)
    results = await asyncio.gather(*(led.svc.use_plan("plan1") for _ in range(5)),
                                   return_exceptions=True)
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, RecoveryRefused)]
    assert len(admitted) == 1 and admitted[0].admitted and len(refused) == 4
    assert {r.reason for r in refused} == {"plan_already_used"}
    assert [r["epoch"] for r in await led.outbox_rows(op_id)] == [1, 2]


async def test_unknown_plan_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        await Ledger(store).svc.use_plan("no-such-plan")


async def test_legacy_operation_without_a_key_is_refused(store: Store) -> None:
    """An operation recorded without an operation key cannot be planned: legacy_operation."""
    led = Ledger(store)
    op_id = await led.submit("lookup")
    await led.ambiguous(op_id)
    async with store.transaction() as conn:
        await conn.execute(operations.update().where(operations.c.id == op_id)
                           .values(operation_key=""))
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.retry(op_id, operator="alice")
    assert info.value.reason == "legacy_operation"
    assert await led.rows(retry_plans) == []


async def test_plan_for_a_superseded_epoch_is_refused(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit("lookup")
    await led.ambiguous(op_id)
    await led.svc.retry(op_id, operator="alice")
    await led.ambiguous(op_id, epoch=2)
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.retry(op_id, operator="alice", for_epoch=1)
    assert info.value.reason == "superseded_attempt"


async def test_succeeded_operation_is_never_planned(store: Store) -> None:
    led = Ledger(store)
    op_id = await led.submit("lookup")
    attempt = await led.claim(op_id, 1)
    await led.svc.record_outcome(AttemptSucceeded(
        operation_id=op_id, epoch=1, attempt_id=attempt, dispatcher_id="d1", at=led.now,
        response_digest="sha256:ok"), consumer="ledger", message_id="m-ok")
    with pytest.raises(RecoveryRefused) as info:
        await led.svc.retry(op_id, operator="alice")
    assert info.value.reason == "already_succeeded"


async def test_definitive_refusal_may_be_planned_for_any_tool(store: Store) -> None:
    """Failed by a refusal before the body (nothing applied): a plan is admitted even for a
    non-idempotent tool, at a new epoch with the same key."""
    led = Ledger(store)
    op_id = await led.submit("email")
    attempt = await led.claim(op_id, 1)
    await led.svc.record_outcome(AttemptFailed(
        operation_id=op_id, epoch=1, attempt_id=attempt, dispatcher_id="d1", at=led.now,
        http_status=403, failure_class=FailureClass.PERMISSION_DENIED, code="forbidden",
        message="no"), consumer="ledger", message_id="m-f")
    assert (await led.op(op_id))["state"] == "failed"
    _, admission = await led.svc.retry(op_id, operator="alice")
    assert admission.admitted and (await led.op(op_id))["epoch"] == 2


async def test_admitted_plan_for_an_approval_gated_tool_needs_a_fresh_approval(
        store: Store) -> None:
    """A plan is not a permission: the approval-gated tool goes back to awaiting_approval at
    the new epoch, its dispatch row obsolete until an operator approves again."""
    led = Ledger(store)
    op_id = await led.submit("payout", amount=5)
    op = await led.op(op_id)
    await led.svc.approve(op_id, epoch=1, arguments_digest=op["arguments_digest"],
                          operator="alice")
    await led.undecidable(op_id)
    await led.svc.review(op_id, Review(operator="bob", evidence_ref="bank-statement",
                                       conclusion=Conclusion.NOT_EXECUTED, epoch=1))
    _, admission = await led.svc.retry(op_id, operator="bob")
    assert admission.admitted
    op = await led.op(op_id)
    assert (op["state"], op["epoch"]) == ("awaiting_approval", 2)
    assert [(r["epoch"], r["status"]) for r in await led.outbox_rows(op_id)] == [
        (1, "consumed"), (2, "obsolete")]
    with pytest.raises(ActionRejected):
        await led.svc.approve(op_id, epoch=1, arguments_digest=op["arguments_digest"],
                              operator="alice")
    await led.svc.approve(op_id, epoch=2, arguments_digest=op["arguments_digest"],
                          operator="alice")
    assert (await led.op(op_id))["state"] == "pending"
    assert [(r["epoch"], r["status"]) for r in await led.outbox_rows(op_id)][-1] == (
        2, "pending")
