"""Automatic retry policy: the ledger's decision after a definitive failure. Pure.

Only failures the provider refused before applying anything come here. Ambiguous outcomes never
do: they go to reconciliation. Backoff uses tenacity's wait strategies with injected jitter so a
seeded run decides the same way twice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

from tenacity import wait_exponential

from .catalog import EffectClass
from .failures import Failure
from .messages import FailureClass

_SAFE_BY_CONTRACT = frozenset({EffectClass.READ_ONLY, EffectClass.IDEMPOTENT})


@dataclass(frozen=True, slots=True)
class RetryContext:
    effect_class: EffectClass
    failure: Failure
    attempts_made: int  # epochs attempted so far, including the one that just failed
    max_attempts: int
    elapsed_s: float  # since the intent was accepted
    deadline_s: float  # the operation's retry deadline, from acceptance
    contract_changed: bool  # the tool's contract revision differs from the operation's
    budget_available: bool = True


@dataclass(frozen=True, slots=True)
class RetryDecision:
    retry: bool
    reason: str
    delay_s: float = 0.0


_BACKOFF = wait_exponential(multiplier=0.5, min=0.5, max=30.0)


def backoff_s(attempt: int, rng: random.Random) -> float:
    base = float(_BACKOFF(SimpleNamespace(attempt_number=attempt)))  # type: ignore[arg-type]
    return base + rng.uniform(0.0, base * 0.25)


def decide_retry(ctx: RetryContext, rng: random.Random) -> RetryDecision:
    f = ctx.failure
    if not f.retryable:
        return RetryDecision(False, f"class_not_retryable:{f.failure_class.value}")
    if not (f.safe_to_resubmit or ctx.effect_class in _SAFE_BY_CONTRACT):
        return RetryDecision(False, "not_safe_to_resubmit")
    if ctx.contract_changed:
        return RetryDecision(False, "contract_revision_changed")
    if ctx.attempts_made >= ctx.max_attempts:
        return RetryDecision(False, "max_attempts_reached")
    delay = backoff_s(ctx.attempts_made, rng)
    if f.retry_after_s is not None:
        # Never sooner than the provider asked, whatever the class (a 503 with Retry-After is
        # transient, not rate_limited); jitter only ever adds. `surface_retry_after` governs
        # only whether the guidance line shows the delay to the model.
        delay = max(delay, f.retry_after_s + rng.uniform(0.0, 0.1 + f.retry_after_s * 0.1))
    if ctx.elapsed_s + delay > ctx.deadline_s:
        return RetryDecision(False, "deadline_exceeded", delay)
    if not ctx.budget_available:
        return RetryDecision(False, "retry_budget_exhausted")
    reason = "rate_limited" if f.failure_class is FailureClass.RATE_LIMITED else "transient"
    return RetryDecision(True, f"{reason}:{f.code}", delay)


class RetryBudget:
    """A token bucket bounding automatic retries ledger-wide, so an outage of one provider
    cannot turn into a retry storm. Time is injected (monotonic seconds)."""

    def __init__(self, *, capacity: float = 200.0, refill_per_s: float = 20.0,
                 now: float = 0.0) -> None:
        self.capacity, self.refill_per_s = capacity, refill_per_s
        self.tokens, self.updated = capacity, now

    def try_take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.refill_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
