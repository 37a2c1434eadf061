"""Explicit recovery (the table in effectledger_core.recovery): every row, typed refusals,
and properties over random operations."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from effectledger_core.catalog import EffectClass
from effectledger_core.limits import MAX_IDENTIFIER_BYTES
from effectledger_core.recovery import (
    SAFE_UNDER_UNCERTAINTY,
    Assessment,
    Conclusion,
    Decision,
    Fact,
    OperationFacts,
    RecoveryRefused,
    RetryPlan,
    Review,
    inspect_recovery,
    prepare_retry,
)
from effectledger_core.states import State

EC = EffectClass
UNSAFE = [EC.UNKNOWN, EC.NON_IDEMPOTENT, EC.REVERSIBLE, EC.COMPENSATABLE]
SAFE = [EC.READ_ONLY, EC.IDEMPOTENT]
ACTIVE = ["pending", "in_flight", "awaiting_approval", "awaiting_confirmation"]
# Every way an attempt can end uncertain: the operation is ambiguous or in review, or it
# failed after an uncertain outcome (a verdict or an operator decided "failed").
UNCERTAIN = [("ambiguous", "outcome_ambiguous"), ("needs_review", "outcome_ambiguous"),
             ("needs_review", "attempt_accepted"), ("failed", "outcome_ambiguous"),
             ("ambiguous", None)]
LAST_OUTCOMES = [None, "attempt_failed", "outcome_ambiguous", "attempt_succeeded",
                 "attempt_accepted"]


def facts(state: str = "ambiguous", effect: EffectClass = EC.IDEMPOTENT, *,
          last: str | None = "outcome_ambiguous", epoch: int = 3,
          key: str | None = "ck_key") -> OperationFacts:
    return OperationFacts(operation_id="op1", operation_key=key, state=state, epoch=epoch,
                          effect_class=effect, arguments_digest="sha256:args",
                          contract_revision="rev1", last_outcome=last)


def review(conclusion: Conclusion = Conclusion.NOT_EXECUTED, epoch: int = 3, *,
           operator: str = "alice", evidence_ref: str = "TICKET-1") -> Review:
    return Review(operator=operator, evidence_ref=evidence_ref, conclusion=conclusion,
                  epoch=epoch)


def refused(reason: str, op: OperationFacts, rv: Review | None = None,
            for_epoch: int | None = None) -> RecoveryRefused:
    with pytest.raises(RecoveryRefused) as info:
        prepare_retry(op, rv, for_epoch=for_epoch)
    assert info.value.reason == reason, info.value.message
    assert info.value.code == "retry_refused" and info.value.http_status == 409
    assert info.value.details["reason"] == reason
    return info.value


# ---- row: success, or verified completed → refuse any retry -------------------------------


@pytest.mark.parametrize("effect", list(EC), ids=lambda e: e.value)
@pytest.mark.parametrize("last", LAST_OUTCOMES, ids=str)
def test_succeeded_is_refused_whatever_else_is_true(effect: EffectClass,
                                                    last: str | None) -> None:
    """A succeeded operation gets no plan, even with a not_executed review of its epoch."""
    op = facts("succeeded", effect, last=last)
    assert inspect_recovery(op) == Assessment(Fact.COMPLETED, Decision.REFUSE_COMPLETED,
                                              "operation succeeded")
    refused("already_succeeded", op)
    refused("already_succeeded", op, review(Conclusion.NOT_EXECUTED))


@pytest.mark.parametrize(("state", "last"), UNCERTAIN)
@pytest.mark.parametrize("effect", list(EC), ids=lambda e: e.value)
def test_verified_completed_is_refused(state: str, last: str | None,
                                       effect: EffectClass) -> None:
    """An operator's review concluding 'completed' refuses any retry, for any tool."""
    refused("verified_completed", facts(state, effect, last=last), review(Conclusion.COMPLETED))


# ---- row: rejected before the body → a new attempt may be prepared --------------------------


@pytest.mark.parametrize("effect", list(EC), ids=lambda e: e.value)
def test_rejected_before_the_body_may_be_prepared(effect: EffectClass) -> None:
    """A definitive refusal (failed after attempt_failed) applied nothing: a plan for any
    tool, bound to the operation, key, epoch, exact arguments and contract revision."""
    op = facts("failed", effect, last="attempt_failed")
    a = inspect_recovery(op)
    assert (a.fact, a.decision) == (Fact.REJECTED_BEFORE_BODY, Decision.MAY_PREPARE)
    assert prepare_retry(op) == RetryPlan(
        operation_id="op1", operation_key="ck_key", epoch=3, arguments_digest="sha256:args",
        contract_revision="rev1", review=None)


# ---- row: uncertain + read_only / idempotent → one explicit attempt, same key ---------------


@pytest.mark.parametrize(("state", "last"), UNCERTAIN)
@pytest.mark.parametrize("effect", SAFE, ids=lambda e: e.value)
def test_uncertain_on_a_deduplicating_tool_may_be_prepared(state: str, last: str | None,
                                                           effect: EffectClass) -> None:
    op = facts(state, effect, last=last)
    a = inspect_recovery(op)
    assert (a.fact, a.decision) == (Fact.UNCERTAIN, Decision.MAY_PREPARE)
    plan = prepare_retry(op)
    assert plan.operation_key == "ck_key" and plan.epoch == 3 and plan.review is None


# ---- row: uncertain + unknown / non_idempotent / irreversible → needs review ----------------


@pytest.mark.parametrize(("state", "last"), UNCERTAIN)
@pytest.mark.parametrize("effect", UNSAFE, ids=lambda e: e.value)
def test_uncertain_on_other_tools_needs_a_not_executed_review(state: str, last: str | None,
                                                              effect: EffectClass) -> None:
    """No plan without a review; an 'uncertain' review is not enough; a not_executed review
    of the same epoch lets one plan through, carrying the review."""
    op = facts(state, effect, last=last)
    a = inspect_recovery(op)
    assert (a.fact, a.decision) == (Fact.UNCERTAIN, Decision.NEEDS_REVIEW)
    refused("needs_review", op)
    refused("needs_review", op, review(Conclusion.UNCERTAIN))
    rv = review(Conclusion.NOT_EXECUTED)
    assert prepare_retry(op, rv).review == rv


@pytest.mark.parametrize("effect", UNSAFE, ids=lambda e: e.value)
def test_a_review_of_another_epoch_does_not_count(effect: EffectClass) -> None:
    """A not_executed review speaks only for the epoch it reviewed."""
    refused("superseded_attempt", facts("needs_review", effect), review(epoch=2))
    refused("superseded_attempt", facts("needs_review", effect), review(epoch=4))


# ---- typed refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("state", ACTIVE)
def test_active_operation_is_refused(state: str) -> None:
    op = facts(state, EC.READ_ONLY, last=None)
    assert inspect_recovery(op).decision is Decision.NOT_APPLICABLE
    refused("operation_active", op)


def test_cancelled_operation_is_refused() -> None:
    op = facts("cancelled", EC.READ_ONLY, last=None)
    assert inspect_recovery(op).fact is Fact.CANCELLED
    refused("cancelled", op)


def test_plan_for_a_superseded_attempt_is_refused() -> None:
    """The caller saw epoch 2; the operation is at 3."""
    refused("superseded_attempt", facts(), for_epoch=2)
    assert prepare_retry(facts(), for_epoch=3).epoch == 3


@pytest.mark.parametrize("state", ["succeeded", "ambiguous", "failed", "needs_review"])
def test_legacy_operation_without_a_key_cannot_be_planned(state: str) -> None:
    """An operation recorded without an operation key: a clear error, whatever its state."""
    err = refused("legacy_operation", facts(state, key=None, last="attempt_failed"))
    assert "operation key" in err.message


@pytest.mark.parametrize("field", ["operator", "evidence_ref"])
def test_review_identifiers_over_one_kib_are_refused(field: str) -> None:
    """Review identifiers are bounded at 1 KiB; exactly 1 KiB is fine."""
    review(**{field: "x" * MAX_IDENTIFIER_BYTES})
    with pytest.raises(RecoveryRefused) as info:
        review(**{field: "x" * (MAX_IDENTIFIER_BYTES + 1)})
    assert info.value.reason == "limits_exceeded" and field in info.value.message


@pytest.mark.parametrize("field", ["operator", "evidence_ref"])
def test_review_limit_counts_bytes_not_characters(field: str) -> None:
    """342 three-byte characters are 1026 bytes: over the limit although only 342 chars;
    341 of them (1023 bytes) are within it."""
    review(**{field: "€" * 341})
    with pytest.raises(RecoveryRefused) as info:
        review(**{field: "€" * 342})
    assert info.value.reason == "limits_exceeded"
    with pytest.raises(RecoveryRefused):
        review(**{field: "😀" * 257})  # 4 bytes each: 1028 bytes


@pytest.mark.parametrize("field", ["operator", "evidence_ref"])
def test_empty_review_identifiers_are_refused(field: str) -> None:
    with pytest.raises(RecoveryRefused) as info:
        review(**{field: ""})
    assert info.value.reason == "limits_exceeded"


def test_refusal_reasons_are_a_closed_set() -> None:
    with pytest.raises(AssertionError):
        RecoveryRefused("made_up", "x")


def test_plan_is_bound_to_the_operation_it_was_made_for() -> None:
    plan = prepare_retry(dataclasses.replace(facts(), arguments_digest="sha256:other",
                                             contract_revision="rev9"))
    assert (plan.operation_id, plan.arguments_digest, plan.contract_revision) == (
        "op1", "sha256:other", "rev9")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.epoch = 4  # type: ignore[misc]


# ---- properties ----------------------------------------------------------------------------

reviews = st.one_of(st.none(), st.builds(
    lambda c, e: review(c, e), st.sampled_from(list(Conclusion)), st.integers(1, 5)))


@settings(max_examples=500, deadline=None)
@given(state=st.sampled_from([s.value for s in State]), effect=st.sampled_from(list(EC)),
       last=st.sampled_from(LAST_OUTCOMES), epoch=st.integers(1, 5), rv=reviews,
       key=st.sampled_from(["ck_k", None]), for_epoch=st.one_of(st.none(), st.integers(1, 5)))
def test_no_plan_for_success_or_for_unreviewed_uncertainty(
        state: str, effect: EffectClass, last: str | None, epoch: int, rv: Review | None,
        key: str | None, for_epoch: int | None) -> None:
    """Over random operations: never a plan for a succeeded operation; never one for an
    uncertain outcome of a non-deduplicating tool without a not_executed review of the same
    epoch; every plan matches the operation; every refusal is typed."""
    op = facts(state, effect, last=last, epoch=epoch, key=key)
    try:
        plan = prepare_retry(op, rv, for_epoch=for_epoch)
    except RecoveryRefused as exc:
        assert exc.reason in RecoveryRefused.REASONS
        return
    assert state != "succeeded"
    assert state in ("ambiguous", "needs_review", "failed")
    assert key is not None and plan.operation_key == key and plan.epoch == epoch
    assert rv is None or (rv.epoch == epoch and rv.conclusion is not Conclusion.COMPLETED)
    uncertain = not (state == "failed" and last == "attempt_failed")
    if uncertain and effect not in SAFE_UNDER_UNCERTAINTY:
        assert rv is not None and rv.conclusion is Conclusion.NOT_EXECUTED
        assert rv.epoch == epoch and plan.review == rv
