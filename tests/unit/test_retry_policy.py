"""The automatic retry policy (issue 3): every row, the budget, and properties over sequences."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from effectledger_core.catalog import EffectClass
from effectledger_core.failures import POLICY, Failure, Idempotency
from effectledger_core.messages import FailureClass
from effectledger_core.retry_policy import (
    RetryBudget,
    RetryContext,
    RetryDecision,
    backoff_s,
    decide_retry,
)

FC = FailureClass
DEFINITIVE = [FC.INVALID_ARGUMENT, FC.AUTHENTICATION, FC.PERMISSION_DENIED, FC.NOT_FOUND,
              FC.PERMANENT, FC.UNKNOWN]


def ctx(cls: FailureClass = FC.RATE_LIMITED, *, effect: EffectClass = EffectClass.IDEMPOTENT,
        idem: Idempotency = Idempotency.UNSET, retry_after_s: float | None = None,
        attempts_made: int = 1, max_attempts: int = 3, elapsed_s: float = 0.0,
        deadline_s: float = 3600.0, contract_changed: bool = False,
        budget_available: bool = True) -> RetryContext:
    return RetryContext(
        effect_class=effect,
        failure=Failure(cls, "code", "message", retry_after_s=retry_after_s, idempotency=idem),
        attempts_made=attempts_made, max_attempts=max_attempts, elapsed_s=elapsed_s,
        deadline_s=deadline_s, contract_changed=contract_changed,
        budget_available=budget_available)


def decide(c: RetryContext, seed: int = 7) -> RetryDecision:
    return decide_retry(c, random.Random(seed))


@pytest.mark.parametrize(("cls", "effect", "idem"),
                         list(itertools.product(DEFINITIVE, EffectClass, Idempotency)),
                         ids=lambda v: v.value)
def test_definitive_failures_never_retry(cls: FailureClass, effect: EffectClass,
                                         idem: Idempotency) -> None:
    """invalid_argument / authentication / permission_denied / not_found / permanent (and
    unclassifiable) → no retry, whatever the tool or the attempt's idempotency says."""
    d = decide(ctx(cls, effect=effect, idem=idem, retry_after_s=1.0))
    assert d == RetryDecision(False, f"class_not_retryable:{cls.value}")


def test_rate_limited_retries_no_sooner_than_retry_after() -> None:
    """429 with Retry-After 2 → a retry whose delay is at least 2 s, reason names the code."""
    d = decide(ctx(FC.RATE_LIMITED, retry_after_s=2.0))
    assert d.retry and d.reason == "rate_limited:code" and d.delay_s >= 2.0


@pytest.mark.parametrize("effect", list(EffectClass), ids=lambda e: e.value)
def test_rate_limited_is_safe_for_every_effect_class(effect: EffectClass) -> None:
    """A rate limit is known not to have applied (class default safe), even non-idempotent."""
    assert decide(ctx(FC.RATE_LIMITED, effect=effect, retry_after_s=1.0)).retry


def test_transient_known_not_applied_retries_honouring_retry_after() -> None:
    """503 before the body (the dispatcher states idempotency=yes) with Retry-After 10 →
    retried no sooner than 10 s, even though transient does not surface the delay."""
    d = decide(ctx(FC.TRANSIENT, effect=EffectClass.NON_IDEMPOTENT, idem=Idempotency.YES,
                   retry_after_s=10.0))
    assert d.retry and d.reason == "transient:code" and d.delay_s >= 10.0


def test_transient_without_retry_after_uses_backoff() -> None:
    d = decide(ctx(FC.TRANSIENT, idem=Idempotency.YES))
    assert d.retry and 0.5 <= d.delay_s <= 30.0 * 1.25


@pytest.mark.parametrize("effect", [EffectClass.NON_IDEMPOTENT, EffectClass.UNKNOWN,
                                    EffectClass.REVERSIBLE, EffectClass.COMPENSATABLE],
                         ids=lambda e: e.value)
def test_not_safe_to_resubmit_for_non_idempotent_with_idempotency_unset(
        effect: EffectClass) -> None:
    """A transient failure of a tool that does not deduplicate, with no statement from the
    attempt, is not resent: it may have been applied."""
    assert decide(ctx(FC.TRANSIENT, effect=effect)) == RetryDecision(
        False, "not_safe_to_resubmit")
    assert decide(ctx(FC.SELF_REPORTED, effect=effect)).reason == "not_safe_to_resubmit"


@pytest.mark.parametrize("effect", [EffectClass.NON_IDEMPOTENT, EffectClass.READ_ONLY,
                                    EffectClass.IDEMPOTENT], ids=lambda e: e.value)
def test_attempt_saying_no_is_only_overridden_by_a_deduplicating_contract(
        effect: EffectClass) -> None:
    """idempotency=no makes the failure unsafe; only a read_only/idempotent contract (the
    provider deduplicates by key) still lets it retry."""
    d = decide(ctx(FC.RATE_LIMITED, effect=effect, idem=Idempotency.NO))
    assert d.retry is (effect is not EffectClass.NON_IDEMPOTENT)


@pytest.mark.parametrize("effect", [EffectClass.READ_ONLY, EffectClass.IDEMPOTENT],
                         ids=lambda e: e.value)
def test_transient_on_deduplicating_tool_retries_with_idempotency_unset(
        effect: EffectClass) -> None:
    assert decide(ctx(FC.TRANSIENT, effect=effect)).retry


@pytest.mark.parametrize(("made", "maximum", "retry"), [(1, 3, True), (2, 3, True),
                                                        (3, 3, False), (4, 3, False),
                                                        (1, 1, False)])
def test_max_attempts(made: int, maximum: int, retry: bool) -> None:
    """No retry once the attempts made reach the tool's max_attempts."""
    d = decide(ctx(attempts_made=made, max_attempts=maximum, retry_after_s=1.0))
    assert d.retry is retry
    if not retry:
        assert d.reason == "max_attempts_reached"


def test_deadline_counts_the_delay() -> None:
    """A retry whose due time would fall after the deadline is declined (with the delay)."""
    ok = decide(ctx(retry_after_s=5.0, elapsed_s=10.0, deadline_s=20.0))
    assert ok.retry
    late = decide(ctx(retry_after_s=5.0, elapsed_s=16.0, deadline_s=20.0))
    assert not late.retry and late.reason == "deadline_exceeded" and late.delay_s >= 5.0


def test_contract_change_blocks_automatic_retry() -> None:
    assert decide(ctx(contract_changed=True)) == RetryDecision(
        False, "contract_revision_changed")


def test_exhausted_budget_blocks_retry() -> None:
    assert decide(ctx(retry_after_s=1.0, budget_available=False)) == RetryDecision(
        False, "retry_budget_exhausted")


def test_same_seed_same_decision() -> None:
    """Jitter comes from the injected rng: a seeded run decides identically twice."""
    c = ctx(FC.TRANSIENT, idem=Idempotency.YES, attempts_made=2)
    assert decide(c, 42) == decide(c, 42)


class NoJitter(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return a


def test_backoff_doubles_from_half_a_second_and_is_capped() -> None:
    """Exponential backoff without jitter: 0.5, 1, 2, 4, ... capped at 30 s; jitter adds at
    most a quarter on top and never subtracts."""
    bases = [backoff_s(n, NoJitter()) for n in range(1, 10)]
    assert bases == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    rng = random.Random(1)
    for attempt in range(1, 40):
        base = backoff_s(attempt, NoJitter())
        assert base <= backoff_s(attempt, rng) <= base * 1.25


# ---- the budget ----------------------------------------------------------------------------


def test_budget_spends_capacity_then_refuses() -> None:
    """A full bucket allows `capacity` retries at one instant, then none."""
    b = RetryBudget(capacity=3, refill_per_s=1.0, now=100.0)
    assert [b.try_take(100.0) for _ in range(4)] == [True, True, True, False]


def test_budget_refills_with_injected_time() -> None:
    b = RetryBudget(capacity=2, refill_per_s=0.5, now=0.0)
    assert b.try_take(0.0) and b.try_take(0.0) and not b.try_take(0.0)
    assert not b.try_take(1.0)  # half a token
    assert b.try_take(2.0)  # one whole token after 2 s at 0.5/s
    assert not b.try_take(2.0)


def test_budget_never_exceeds_capacity() -> None:
    b = RetryBudget(capacity=2, refill_per_s=10.0, now=0.0)
    taken = [b.try_take(1_000.0) for _ in range(3)]
    assert taken == [True, True, False]


def test_empty_budget_refuses_forever_without_refill() -> None:
    b = RetryBudget(capacity=0, refill_per_s=0.0, now=0.0)
    assert not any(b.try_take(t) for t in (0.0, 10.0, 1e6))


# ---- properties ----------------------------------------------------------------------------

failures = st.builds(
    lambda cls, idem, ra: Failure(cls, "c", "m", retry_after_s=ra, idempotency=idem),
    st.sampled_from(list(FailureClass)), st.sampled_from(list(Idempotency)),
    st.one_of(st.none(), st.floats(min_value=0.0, max_value=600.0)))


@settings(max_examples=300, deadline=None)
@given(effect=st.sampled_from(list(EffectClass)), sequence=st.lists(failures, min_size=1,
                                                                     max_size=12),
       max_attempts=st.integers(1, 10), deadline=st.floats(1.0, 7200.0),
       contract_changed=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_failure_sequences_never_retry_what_policy_forbids(
        effect: EffectClass, sequence: list[Failure], max_attempts: int, deadline: float,
        contract_changed: bool, seed: int) -> None:
    """Over random sequences of failures of one operation: a non-retryable class never
    retries; a retry is never sooner than Retry-After, never past max attempts or the
    deadline, never after a contract change, never for an unsafe resend."""
    rng = random.Random(seed)
    elapsed, attempts = 0.0, 1
    for failure in sequence:
        d = decide_retry(RetryContext(
            effect_class=effect, failure=failure, attempts_made=attempts,
            max_attempts=max_attempts, elapsed_s=elapsed, deadline_s=deadline,
            contract_changed=contract_changed), rng)
        if not d.retry:
            break
        assert POLICY[failure.failure_class].retryable
        assert failure.safe_to_resubmit or effect in (EffectClass.READ_ONLY,
                                                      EffectClass.IDEMPOTENT)
        assert not contract_changed and attempts < max_attempts
        assert elapsed + d.delay_s <= deadline
        if failure.retry_after_s is not None:
            assert d.delay_s >= failure.retry_after_s
        assert d.delay_s > 0
        elapsed += d.delay_s
        attempts += 1
