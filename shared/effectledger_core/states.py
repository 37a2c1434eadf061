"""Operation states, the one pure transition function, and the names the ledger writes.

The table is data: every (state, event) pair that is allowed maps to the next state and whether
the transition starts a new dispatch decision (epoch + 1). Everything else is illegal. The
ledger's transition applier (`effectledger_ledger.db.transitions`) builds its guarded UPDATE from
`sources(event)`, so the database enforces the same rule.

Journal kinds, outbox statuses and attempt statuses are enums here, next to the states, so that
no module spells a stored name as a string literal of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cache


class State(StrEnum):
    PENDING = "pending"
    AWAITING_APPROVAL = "awaiting_approval"
    IN_FLIGHT = "in_flight"
    AWAITING_CONFIRMATION = "awaiting_confirmation"
    AMBIGUOUS = "ambiguous"
    NEEDS_REVIEW = "needs_review"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: frozenset[State] = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED})


# What an agent is told happens next while an operation's outcome is not known yet: one text
# for every agent-facing surface (the MCP server, the framework integrations).
UNKNOWN_NEXT_STEP: dict[str, str] = {  # keyed by State, looked up by state names
    State.AMBIGUOUS: "effectledger is finding out from the provider (readback or webhook).",
    State.AWAITING_CONFIRMATION: "The provider accepted the request and will confirm it "
                                 "later.",
    State.NEEDS_REVIEW: "No machine can tell; an operator will review it. Tell the user the "
                        "outcome is unknown and pending review.",
}
# "At rest": nothing will happen without a new input (an operator, or nothing at all).
AT_REST: frozenset[State] = TERMINAL | {State.NEEDS_REVIEW}
# Not terminal: what relays, sweepers and dashboards look at (a partial index covers them).
ACTIVE: frozenset[State] = frozenset(State) - TERMINAL
# Waiting for evidence about an attempt: the reconciler's states.
UNRESOLVED: frozenset[State] = frozenset({State.AMBIGUOUS, State.AWAITING_CONFIRMATION})
# No outcome of the current decision yet, and nobody is reconciling one.
UNDECIDED: frozenset[State] = frozenset(
    {State.PENDING, State.AWAITING_APPROVAL, State.IN_FLIGHT})


class JournalKind(StrEnum):
    """What a journal entry records. Each kind says what happened, never more."""

    INTENT_ACCEPTED = "intent_accepted"
    ATTEMPT_CLAIMED = "attempt_claimed"
    CLAIM_REJECTED = "claim_rejected"
    OUTCOME_RECORDED = "outcome_recorded"
    OUTCOME_REJECTED = "outcome_rejected"
    OUTCOME_PRESUMED_LOST = "outcome_presumed_lost"
    VERDICT_APPLIED = "verdict_applied"
    VERDICT_NOT_APPLIED = "verdict_not_applied"
    VERDICT_UNDECIDABLE = "verdict_undecidable"
    VERDICT_REJECTED = "verdict_rejected"
    RETRY_SCHEDULED = "retry_scheduled"
    RETRY_DECLINED = "retry_declined"
    WEBHOOK_UNMATCHED = "webhook_unmatched"
    WEBHOOK_KEPT = "webhook_kept"
    # A verified webhook naming an operation of a tool not bound to its provider.
    WEBHOOK_REFUSED = "webhook_refused"
    EVIDENCE_CONFLICT = "evidence_conflict"
    # The provider shows more than one effect for one operation key.
    DUPLICATE_DETECTED = "duplicate_detected"
    APPROVAL_REQUIRED = "approval_required"
    APPROVED = "approved"
    APPROVAL_REJECTED = "approval_rejected"
    CANCELLED = "cancelled"
    RETRY_PLANNED = "retry_planned"
    RETRY_REFUSED = "retry_refused"
    RETRY_ADMITTED = "retry_admitted"
    REVIEW_RECORDED = "review_recorded"
    DEAD_LETTERED = "dead_lettered"
    DISPATCH_REPUBLISHED = "dispatch_republished"
    RECONCILE_REPUBLISHED = "reconcile_republished"


# The journal entries a reviewer sees as evidence for an operation in needs_review.
EVIDENCE_KINDS: frozenset[JournalKind] = frozenset({
    JournalKind.OUTCOME_RECORDED, JournalKind.VERDICT_APPLIED, JournalKind.VERDICT_NOT_APPLIED,
    JournalKind.VERDICT_UNDECIDABLE, JournalKind.VERDICT_REJECTED, JournalKind.WEBHOOK_KEPT,
    JournalKind.REVIEW_RECORDED, JournalKind.EVIDENCE_CONFLICT, JournalKind.DUPLICATE_DETECTED})


class OutboxKind(StrEnum):
    DISPATCH = "dispatch"
    RECONCILE = "reconcile"
    AUDIT = "audit"  # the duplicate audit: answered by nothing, done once published


class OutboxStatus(StrEnum):
    PENDING = "pending"  # waiting for a relay (from `available_at` on)
    PUBLISHING = "publishing"  # leased to a relay until `lease_until`
    PUBLISHED = "published"  # publish-acked; waiting for its claim or verdict
    CONSUMED = "consumed"  # answered: claimed, or the verdict was recorded
    OBSOLETE = "obsolete"  # no longer wanted: cancelled, or superseded by a new epoch


# Rows that may still reach a consumer: what a cancellation makes obsolete.
OUTBOX_LIVE: frozenset[OutboxStatus] = frozenset(
    {OutboxStatus.PENDING, OutboxStatus.PUBLISHING, OutboxStatus.PUBLISHED})
# Rows nothing will publish again: what outbox retention may delete (ledger db/retention.py).
OUTBOX_SETTLED: frozenset[OutboxStatus] = frozenset(OutboxStatus) - OUTBOX_LIVE


class AttemptStatus(StrEnum):
    """`attempts.status` while no outcome is recorded; afterwards it is the outcome's type."""

    CLAIMED = "claimed"
    OUTCOME_LOST = "outcome_lost"  # the ledger gave up waiting for the outcome


class Event(StrEnum):
    CLAIM = "claim"
    REQUIRE_APPROVAL = "require_approval"
    APPROVE = "approve"
    REJECT = "reject"
    CANCEL = "cancel"
    OUTCOME_SUCCEEDED = "outcome_succeeded"
    OUTCOME_FAILED = "outcome_failed"
    OUTCOME_RETRY = "outcome_retry"
    OUTCOME_AMBIGUOUS = "outcome_ambiguous"
    OUTCOME_ACCEPTED = "outcome_accepted"
    VERDICT_APPLIED = "verdict_applied"
    VERDICT_NOT_APPLIED_RETRY = "verdict_not_applied_retry"
    VERDICT_NOT_APPLIED_FINAL = "verdict_not_applied_final"
    VERDICT_UNDECIDABLE = "verdict_undecidable"
    REVIEW_COMPLETED = "review_completed"
    REVIEW_NOT_EXECUTED_RETRY = "review_not_executed_retry"
    REVIEW_NOT_EXECUTED_FINAL = "review_not_executed_final"
    REVIEW_UNCERTAIN = "review_uncertain"
    # An operator's explicit, single-use retry plan passed admission.
    PLAN_ADMITTED = "plan_admitted"


@dataclass(frozen=True, slots=True)
class Step:
    to: State
    new_epoch: bool = False


S, E = State, Event
_UNRESOLVED = sorted(UNRESOLVED)

TABLE: dict[tuple[State, Event], Step] = {
    (S.PENDING, E.CLAIM): Step(S.IN_FLIGHT),
    (S.PENDING, E.REQUIRE_APPROVAL): Step(S.AWAITING_APPROVAL),
    (S.PENDING, E.CANCEL): Step(S.CANCELLED),
    (S.AWAITING_APPROVAL, E.APPROVE): Step(S.PENDING),
    (S.AWAITING_APPROVAL, E.REJECT): Step(S.CANCELLED),
    (S.AWAITING_APPROVAL, E.CANCEL): Step(S.CANCELLED),
    (S.IN_FLIGHT, E.OUTCOME_SUCCEEDED): Step(S.SUCCEEDED),
    (S.IN_FLIGHT, E.OUTCOME_FAILED): Step(S.FAILED),
    (S.IN_FLIGHT, E.OUTCOME_RETRY): Step(S.PENDING, new_epoch=True),
    (S.IN_FLIGHT, E.OUTCOME_AMBIGUOUS): Step(S.AMBIGUOUS),
    (S.IN_FLIGHT, E.OUTCOME_ACCEPTED): Step(S.AWAITING_CONFIRMATION),
    # A definitive response of the same epoch that arrives after the attempt was declared
    # ambiguous (a slow dispatcher that was presumed lost) is evidence of application.
    (S.AMBIGUOUS, E.OUTCOME_SUCCEEDED): Step(S.SUCCEEDED),
    **{(s, E.VERDICT_APPLIED): Step(S.SUCCEEDED) for s in _UNRESOLVED},
    **{(s, E.VERDICT_NOT_APPLIED_RETRY): Step(S.PENDING, new_epoch=True) for s in _UNRESOLVED},
    **{(s, E.VERDICT_NOT_APPLIED_FINAL): Step(S.FAILED) for s in _UNRESOLVED},
    **{(s, E.VERDICT_UNDECIDABLE): Step(S.NEEDS_REVIEW) for s in _UNRESOLVED},
    (S.NEEDS_REVIEW, E.REVIEW_COMPLETED): Step(S.SUCCEEDED),
    (S.NEEDS_REVIEW, E.REVIEW_NOT_EXECUTED_RETRY): Step(S.PENDING, new_epoch=True),
    (S.NEEDS_REVIEW, E.REVIEW_NOT_EXECUTED_FINAL): Step(S.FAILED),
    (S.NEEDS_REVIEW, E.REVIEW_UNCERTAIN): Step(S.NEEDS_REVIEW),
    # `failed` is terminal for automation; only an explicit plan for a definitive refusal
    # (nothing was applied) may open a new epoch, after passing admission again.
    **{(s, E.PLAN_ADMITTED): Step(S.PENDING, new_epoch=True)
       for s in (S.AMBIGUOUS, S.NEEDS_REVIEW, S.FAILED)},
}


class IllegalTransition(ValueError):
    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"event {event.value!r} is not allowed in state {state.value!r}")
        self.state = state
        self.event = event


def transition(state: State, event: Event) -> Step:
    """The next step for `event` in `state`, or IllegalTransition."""
    step = TABLE.get((state, event))
    if step is None:
        raise IllegalTransition(state, event)
    return step


@cache  # on the hot path of every outcome: the table is constant
def sources(event: Event) -> frozenset[State]:
    """States from which `event` is allowed: the `state IN (...)` of the guarded UPDATE."""
    return frozenset(s for (s, e) in TABLE if e == event)
