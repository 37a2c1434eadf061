"""Explicit, host-driven recovery: inspect an operation, prepare a single-use retry plan.

The recovery table:
- succeeded, or an operator verified it completed → refuse any retry;
- rejected before the body started → a new attempt may be prepared (it passes admission again);
- outcome uncertain (timeout, lost response, lost dispatcher, 5xx) → a retryable flag does not
  prove non-execution:
  * read_only / idempotent → one explicit attempt with the same operation key;
  * unknown / non_idempotent / reversible / compensatable → needs review until a trusted
    review says `not_executed`.
A plan is bound to the operation, its epoch, the exact arguments and the contract revision. It
is not a permission: admission still runs the current catalog, approval and budget checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .catalog import EffectClass
from .errors import EffectLedgerError
from .limits import MAX_IDENTIFIER_BYTES
from .states import UNDECIDED, State

SAFE_UNDER_UNCERTAINTY = frozenset({EffectClass.READ_ONLY, EffectClass.IDEMPOTENT})


class Fact(StrEnum):
    COMPLETED = "completed"  # succeeded, or verified completed by an operator
    REJECTED_BEFORE_BODY = "rejected_before_body"  # definitive refusal: nothing applied
    UNCERTAIN = "uncertain"  # the provider may or may not have applied it
    ACTIVE = "active"  # pending / in flight / awaiting approval: nothing to recover yet
    CANCELLED = "cancelled"


class Decision(StrEnum):
    REFUSE_COMPLETED = "refuse_completed"
    MAY_PREPARE = "may_prepare"  # a new attempt may be prepared (same key)
    NEEDS_REVIEW = "needs_review"
    NOT_APPLICABLE = "not_applicable"


class Conclusion(StrEnum):
    NOT_EXECUTED = "not_executed"
    COMPLETED = "completed"
    UNCERTAIN = "uncertain"


@dataclass(frozen=True, slots=True)
class Review:
    """An operator's conclusion; never a model's output (the API takes it from operators)."""

    operator: str
    evidence_ref: str
    conclusion: Conclusion
    epoch: int

    def __post_init__(self) -> None:
        for name in ("operator", "evidence_ref"):
            value = getattr(self, name)
            if not value or len(value.encode()) > MAX_IDENTIFIER_BYTES:
                raise RecoveryRefused("limits_exceeded",
                                      f"review {name} must be 1..{MAX_IDENTIFIER_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class OperationFacts:
    """What recovery needs to know of an operation, read from the ledger."""

    operation_id: str
    operation_key: str | None  # None: a legacy operation recorded without a key
    state: str
    epoch: int
    effect_class: EffectClass
    arguments_digest: str
    contract_revision: str
    last_outcome: str | None  # attempt_failed / outcome_ambiguous / attempt_succeeded / ...


@dataclass(frozen=True, slots=True)
class Assessment:
    fact: Fact
    decision: Decision
    reason: str


@dataclass(frozen=True, slots=True)
class RetryPlan:
    operation_id: str
    operation_key: str
    epoch: int  # the epoch the plan supersedes; admission requires it to be current
    arguments_digest: str
    contract_revision: str
    review: Review | None


class RecoveryRefused(EffectLedgerError):
    """A typed refusal: `reason` is one of the stable codes below."""

    code = "retry_refused"
    http_status = 409
    REASONS = frozenset({"already_succeeded", "verified_completed", "needs_review",
                         "superseded_attempt", "legacy_operation", "limits_exceeded",
                         "operation_active", "cancelled", "plan_already_used",
                         "contract_changed", "arguments_changed"})

    def __init__(self, reason: str, message: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(message, reason=reason)
        self.reason = reason


def inspect_recovery(op: OperationFacts) -> Assessment:
    s = op.state
    if s == State.SUCCEEDED:
        return Assessment(Fact.COMPLETED, Decision.REFUSE_COMPLETED, "operation succeeded")
    if s == State.CANCELLED:
        return Assessment(Fact.CANCELLED, Decision.NOT_APPLICABLE, "operation was cancelled")
    # Nothing to recover while an attempt may still be under way or is awaited.
    if s in UNDECIDED or s == State.AWAITING_CONFIRMATION:
        return Assessment(Fact.ACTIVE, Decision.NOT_APPLICABLE, f"operation is {s}")
    if s == State.FAILED and op.last_outcome == "attempt_failed":
        return Assessment(Fact.REJECTED_BEFORE_BODY, Decision.MAY_PREPARE,
                          "the provider refused before applying anything")
    # ambiguous, needs_review, or failed after an uncertain outcome (an operator decision)
    if op.effect_class in SAFE_UNDER_UNCERTAINTY:
        return Assessment(Fact.UNCERTAIN, Decision.MAY_PREPARE,
                          f"outcome uncertain; a {op.effect_class.value} tool deduplicates by "
                          f"the operation key")
    return Assessment(Fact.UNCERTAIN, Decision.NEEDS_REVIEW,
                      f"outcome uncertain and the tool is {op.effect_class.value}")


def prepare_retry(op: OperationFacts, review: Review | None = None, *,
                  for_epoch: int | None = None) -> RetryPlan:
    """A single-use plan, or RecoveryRefused with a typed reason."""
    if op.operation_key is None:
        raise RecoveryRefused("legacy_operation",
                              "operation was recorded without an operation key; it cannot be "
                              "retried safely")
    if for_epoch is not None and for_epoch != op.epoch:
        raise RecoveryRefused("superseded_attempt",
                              f"epoch {for_epoch} was superseded by epoch {op.epoch}")
    if review is not None and review.epoch != op.epoch:
        raise RecoveryRefused("superseded_attempt",
                              f"the review is for epoch {review.epoch}, the operation is at "
                              f"{op.epoch}")
    a = inspect_recovery(op)
    if a.decision is Decision.REFUSE_COMPLETED:
        raise RecoveryRefused("already_succeeded", "operation already succeeded")
    if review is not None and review.conclusion is Conclusion.COMPLETED:
        raise RecoveryRefused("verified_completed", "an operator verified the effect completed")
    if a.fact is Fact.CANCELLED:
        raise RecoveryRefused("cancelled", "operation was cancelled")
    if a.fact is Fact.ACTIVE:
        raise RecoveryRefused("operation_active", a.reason)
    if a.decision is Decision.NEEDS_REVIEW and not (
            review is not None and review.conclusion is Conclusion.NOT_EXECUTED):
        raise RecoveryRefused("needs_review",
                              f"{a.reason}: a trusted review concluding not_executed is needed")
    return RetryPlan(operation_id=op.operation_id, operation_key=op.operation_key,
                     epoch=op.epoch, arguments_digest=op.arguments_digest,
                     contract_revision=op.contract_revision, review=review)
