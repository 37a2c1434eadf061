"""The failure taxonomy: the policy table, classification, guidance."""

from __future__ import annotations

import itertools
import re

import pytest

from effectledger_core.failures import (
    POLICY,
    AuthenticationError,
    Failure,
    Idempotency,
    InvalidArgumentError,
    NotFoundError,
    PermanentError,
    PermissionDeniedError,
    Policy,
    RateLimitedError,
    TransientError,
    classify,
    classify_http_status,
    guidance,
    policy_digest,
)
from effectledger_core.messages import FailureClass

FC = FailureClass

# The table written out independently of the module: (retryable, backoff, surface_retry_after,
# needs_operator, safe_to_resubmit, remediation). An edit to either side shows up here.
EXPECTED: dict[FailureClass, tuple[bool, bool, bool, bool, bool, str]] = {
    FC.TRANSIENT: (True, True, False, False, False,
                   "The provider or the network was briefly unavailable."),
    FC.PERMANENT: (False, False, False, False, False,
                   "The provider cannot perform this request as given; choose a different "
                   "approach."),
    FC.AUTHENTICATION: (False, False, False, True, True,
                        "The credentials for this tool were rejected."),
    FC.NOT_FOUND: (False, False, False, False, True,
                   "The target does not exist; check the identifiers in the arguments."),
    FC.PERMISSION_DENIED: (False, False, False, True, True,
                           "This tool is not permitted to perform the request."),
    FC.INVALID_ARGUMENT: (False, False, False, False, True,
                          "The arguments were rejected; correct the invalid values."),
    FC.RATE_LIMITED: (True, True, True, False, True,
                      "The provider is limiting the request rate."),
    FC.SELF_REPORTED: (True, True, False, False, False,
                       "The tool reported this failure itself without naming its cause."),
    FC.UNKNOWN: (False, False, False, False, False, "The failure could not be classified."),
}

# Words and phrases that would make a remediation line carry a retry verdict (no "retry", no
# "wait N seconds", no "needs a human"); the verdict is guidance()'s job alone.
VERDICT = re.compile(
    r"\b(retr(y|ies|ied|ying)|again|wait(s|ing)?|later|pause|back\s*off|resubmit|repeat|"
    r"re-?send|try|tries|human|operator|person|someone|admin\w*|support)\b"
    r"|\d+\s*(s|sec|secs|seconds?|ms|minutes?)\b",
    re.IGNORECASE)


def _failure(cls: FailureClass, idem: Idempotency = Idempotency.UNSET,
             retry_after_s: float | None = None) -> Failure:
    return Failure(cls, f"{cls.value}_code", "human message", retry_after_s=retry_after_s,
                   idempotency=idem)


# ---- the table ----------------------------------------------------------------------------


def test_policy_table_has_exactly_one_row_per_class() -> None:
    """Every failure class has a row and there is no row for anything else."""
    assert set(POLICY) == set(FailureClass)


@pytest.mark.parametrize("cls", list(FailureClass), ids=lambda c: c.value)
def test_policy_row_is_pinned(cls: FailureClass) -> None:
    """Each class's row (five verdicts and the remediation line) is exactly as designed."""
    p = POLICY[cls]
    assert (p.retryable, p.backoff, p.surface_retry_after, p.needs_operator,
            p.safe_to_resubmit, p.remediation) == EXPECTED[cls]


def test_unclassifiable_is_not_retryable_and_not_safe() -> None:
    """The conservative default: unknown failures are neither retried nor resent."""
    p = POLICY[FC.UNKNOWN]
    assert not p.retryable and not p.safe_to_resubmit and not p.backoff


def test_only_rate_limited_surfaces_retry_after() -> None:
    """Only a rate limit carries the provider's suggested delay to the model."""
    assert {c for c, p in POLICY.items() if p.surface_retry_after} == {FC.RATE_LIMITED}


def test_retryable_classes_back_off() -> None:
    """A retryable class always backs off: an immediate repeat only meets the same condition."""
    assert all(p.backoff for p in POLICY.values() if p.retryable)
    assert not any(p.backoff for p in POLICY.values() if not p.retryable)


def test_worth_retrying_and_safe_to_resubmit_disagree_for_transient() -> None:
    """A transient failure (a timeout's class) is worth retrying but not safe to resend."""
    p = POLICY[FC.TRANSIENT]
    assert p.retryable and not p.safe_to_resubmit


@pytest.mark.parametrize("cls", list(FailureClass), ids=lambda c: c.value)
def test_remediation_carries_no_retry_verdict(cls: FailureClass) -> None:
    """Contract: no remediation says retry / again / wait N seconds / needs a human or
    operator; only guidance() gives verdicts, so the two never contradict each other."""
    text = POLICY[cls].remediation
    assert text and text.strip() == text and "\n" not in text
    found = VERDICT.search(text)
    assert found is None, f"{cls.value}: remediation carries a verdict: {found.group(0)!r}"


def test_verdict_pattern_catches_the_forbidden_phrasings() -> None:
    """The contract test's pattern is not vacuous: each forbidden phrasing is caught."""
    for bad in ("Retry the request.", "Correct them before asking again.",
                "Wait 5 seconds first.", "A human needs to look at it.",
                "An operator must fix it.", "It may succeed later.", "Try once more.",
                "Pause for 30s."):
        assert VERDICT.search(bad), bad


def test_policy_digest_is_stable_and_tracks_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest recorded in receipts is deterministic and changes with any row."""
    first = policy_digest()
    assert first == policy_digest() and first.startswith("sha256:")
    changed = dict(POLICY)
    changed[FC.UNKNOWN] = Policy(True, True, False, False, False, "x")
    monkeypatch.setattr("effectledger_core.failures.POLICY", changed)
    assert policy_digest() != first


# ---- classification precedence ------------------------------------------------------------


class Reporter(Exception):
    """An error that reports its own retryability."""

    def __init__(self, says: bool) -> None:
        super().__init__(f"reporter says {says}")
        self.says = says

    def is_retryable(self) -> bool:
        return self.says


class TransientReporter(TransientError):
    def __init__(self, says: bool) -> None:
        super().__init__(f"transient reporter says {says}")
        self.says = says

    def is_retryable(self) -> bool:
        return self.says


class BrokenReporter(TransientError):
    def is_retryable(self) -> bool:
        raise RuntimeError("reporter is broken")


def _chained(*chain: BaseException) -> BaseException:
    """chain[0] raised from chain[1] raised from ... (explicit __cause__ links)."""
    for outer, inner in itertools.pairwise(chain):
        outer.__cause__ = inner
    return chain[0]


def test_explicit_failure_on_the_chain_wins_over_everything() -> None:
    """Level 1: a Failure anywhere on the chain is returned as is, even beneath a self-report
    and a sentinel."""
    explicit = Failure(FC.PERMANENT, "explicit", "decided below")
    exc = _chained(TransientReporter(True), RateLimitedError("limit"), explicit)
    assert classify(exc) is explicit


def test_failure_itself_is_returned_unchanged() -> None:
    f = Failure(FC.NOT_FOUND, "gone", "no such ticket", retry_after_s=3.0)
    assert classify(f) is f


def test_explicit_failure_found_through_implicit_context() -> None:
    """Level 1 also follows __context__ (an error raised while handling another)."""
    explicit = Failure(FC.AUTHENTICATION, "expired", "token expired")
    try:
        try:
            raise explicit
        except Failure:
            raise ValueError("wrapper") from None
    except ValueError as exc:
        # `from None` suppresses display but keeps __context__; the chain walks it.
        assert classify(exc) is explicit


def test_self_report_yes_beats_a_sentinel() -> None:
    """Level 2 before level 3: a sentinel type that reports 'retryable' is self_reported."""
    f = classify(TransientReporter(True))
    assert f.failure_class is FC.SELF_REPORTED and f.code == "self_reported" and f.retryable


def test_self_report_anywhere_on_the_chain_beats_a_sentinel_above_it() -> None:
    exc = _chained(InvalidArgumentError("bad"), Reporter(True))
    assert classify(exc).failure_class is FC.SELF_REPORTED


def test_self_report_no_is_unknown_and_not_overridden_by_a_sentinel() -> None:
    """A report of 'not retryable' is final: unknown, even on a TransientError subclass, so
    the error's own answer and the classifier never disagree."""
    f = classify(TransientReporter(False))
    assert f.failure_class is FC.UNKNOWN and f.code == "unclassified" and not f.retryable
    exc = _chained(RateLimitedError("limit"), Reporter(False))
    assert classify(exc).failure_class is FC.UNKNOWN


def test_broken_reporter_is_ignored() -> None:
    """A reporter that raises reports nothing: the sentinel beneath it decides."""
    assert classify(BrokenReporter("x")).failure_class is FC.TRANSIENT
    exc = _chained(ValueError("outer"), BrokenReporter("inner"))
    assert classify(exc).failure_class is FC.TRANSIENT


def test_broken_reporter_falls_through_to_a_later_reporter() -> None:
    exc = _chained(BrokenReporter("first"), Reporter(True))
    assert classify(exc).failure_class is FC.SELF_REPORTED


@pytest.mark.parametrize(("exc", "cls"), [
    (TransientError("t"), FC.TRANSIENT),
    (PermanentError("p"), FC.PERMANENT),
    (AuthenticationError("a"), FC.AUTHENTICATION),
    (NotFoundError("n"), FC.NOT_FOUND),
    (PermissionDeniedError("d"), FC.PERMISSION_DENIED),
    (InvalidArgumentError("i"), FC.INVALID_ARGUMENT),
    (RateLimitedError("r"), FC.RATE_LIMITED),
    (ConnectionRefusedError("refused"), FC.TRANSIENT),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.value)
def test_sentinels_classify_by_type(exc: BaseException, cls: FailureClass) -> None:
    """Level 3: each sentinel (ours and the standard library's) maps to its class, also when
    it is the cause of an unrelated wrapper."""
    f = classify(exc)
    assert f.failure_class is cls and f.code == cls.value and f.cause is exc
    wrapped = _chained(RuntimeError("wrapper"), exc)
    assert classify(wrapped).failure_class is cls


@pytest.mark.parametrize("exc", [ValueError("v"), TimeoutError("t"), KeyError("k"),
                                 ConnectionResetError("reset"), RuntimeError("r")],
                         ids=lambda e: type(e).__name__)
def test_anything_else_is_unknown_and_not_retryable(exc: BaseException) -> None:
    """Level 4: no explicit failure, report or sentinel → unknown, not retryable. (A reset
    connection or a timeout may have been applied; they are not sentinels for that reason.)"""
    f = classify(exc)
    assert f.failure_class is FC.UNKNOWN and not f.retryable and not f.safe_to_resubmit
    assert f.cause is exc and f.message.startswith(type(exc).__name__)


def test_cyclic_chain_terminates() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert classify(a).failure_class is FC.UNKNOWN


def test_classified_message_is_bounded() -> None:
    f = classify(ValueError("x" * 10_000))
    assert len(f.message) <= 1000


# ---- the failure value ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(FailureClass), ids=lambda c: c.value)
def test_per_attempt_idempotency_overrides_safe_to_resubmit(cls: FailureClass) -> None:
    """unset → the class default; yes → safe; no → not safe; 'retryable' never changes."""
    assert _failure(cls).safe_to_resubmit is POLICY[cls].safe_to_resubmit
    assert _failure(cls, Idempotency.YES).safe_to_resubmit is True
    assert _failure(cls, Idempotency.NO).safe_to_resubmit is False
    for idem in Idempotency:
        assert _failure(cls, idem).retryable is POLICY[cls].retryable


def test_failure_carries_class_code_message_retry_after_and_cause() -> None:
    cause = OSError("socket")
    f = Failure(FC.RATE_LIMITED, "too_many", "slow down", retry_after_s=2.0, cause=cause)
    assert (f.failure_class, f.code, f.message, f.retry_after_s, f.cause) == (
        FC.RATE_LIMITED, "too_many", "slow down", 2.0, cause)
    assert str(f) == "rate_limited/too_many: slow down"


def test_remediation_override_replaces_the_class_default() -> None:
    f = Failure(FC.INVALID_ARGUMENT, "bad_title", "title too long",
                remediation_override="The title must be at most 80 characters.")
    assert f.remediation == "The title must be at most 80 characters."
    assert f.guidance().startswith("The title must be at most 80 characters.")


# ---- guidance ------------------------------------------------------------------------------

NOT_RETRYABLE = "Do not repeat the same request."
CONFIRM_FIRST = ("Another attempt may help, but first confirm the previous one did not take "
                 "effect.")
NEEDS_OPERATOR = "An operator must fix this before it can succeed."


@pytest.mark.parametrize(("cls", "idem", "retry_after"),
                         list(itertools.product(FailureClass, Idempotency, [None, 2.0])),
                         ids=lambda v: str(v.value if hasattr(v, "value") else v))
def test_guidance_is_one_line_combining_every_verdict(cls: FailureClass, idem: Idempotency,
                                                      retry_after: float | None) -> None:
    """For every class x idempotency (x retry-after): one line = remediation, then exactly one
    resend verdict consistent with retryable/safe, then the operator clause iff needed."""
    f = _failure(cls, idem, retry_after)
    line = guidance(f)
    assert line == f.guidance()
    assert "\n" not in line and "\r" not in line and line == line.strip()
    p = POLICY[cls]
    assert line.startswith(p.remediation)
    rest = line[len(p.remediation):].strip()
    verdicts = [NOT_RETRYABLE in rest, CONFIRM_FIRST in rest,
                "The same request may be sent again" in rest]
    assert sum(verdicts) == 1, line
    if not p.retryable:
        assert verdicts[0]
    elif f.safe_to_resubmit:
        assert verdicts[2]
    else:
        assert verdicts[1]
    assert (NEEDS_OPERATOR in rest) is p.needs_operator
    shows_delay = "after 2s" in rest
    assert shows_delay is (p.retryable and f.safe_to_resubmit and p.surface_retry_after
                           and retry_after is not None)


def test_guidance_exact_lines_for_representative_cases() -> None:
    """Pinned wording for the lines a model sees most."""
    assert guidance(_failure(FC.RATE_LIMITED, retry_after_s=2.0)) == (
        "The provider is limiting the request rate. The same request may be sent again "
        "after 2s.")
    assert guidance(_failure(FC.RATE_LIMITED)) == (
        "The provider is limiting the request rate. The same request may be sent again after "
        "a pause.")
    assert guidance(_failure(FC.TRANSIENT)) == (
        "The provider or the network was briefly unavailable. " + CONFIRM_FIRST)
    assert guidance(_failure(FC.TRANSIENT, Idempotency.YES)) == (
        "The provider or the network was briefly unavailable. The same request may be sent "
        "again after a pause.")
    assert guidance(_failure(FC.INVALID_ARGUMENT)) == (
        "The arguments were rejected; correct the invalid values. " + NOT_RETRYABLE)
    assert guidance(_failure(FC.AUTHENTICATION)) == (
        "The credentials for this tool were rejected. " + NOT_RETRYABLE + " " + NEEDS_OPERATOR)


# ---- HTTP sentinel conditions --------------------------------------------------------------


@pytest.mark.parametrize(("status", "cls"), [
    (400, FC.INVALID_ARGUMENT), (422, FC.INVALID_ARGUMENT), (401, FC.AUTHENTICATION),
    (403, FC.PERMISSION_DENIED), (404, FC.NOT_FOUND), (410, FC.NOT_FOUND),
    (429, FC.RATE_LIMITED), (409, FC.PERMANENT), (413, FC.PERMANENT), (501, FC.PERMANENT),
    (200, None), (500, None), (502, None), (503, None), (504, None),
])
def test_http_status_sentinels(status: int, cls: FailureClass | None) -> None:
    """Only answers that mean 'not applied' classify; 5xx (may have applied) do not."""
    assert classify_http_status(status) is cls


@pytest.mark.parametrize(("status", "retry_after", "cls"), [
    (503, True, FC.TRANSIENT), (503, False, None), (500, True, None), (429, True, FC.RATE_LIMITED),
])
def test_only_a_503_naming_a_retry_time_is_a_transient_refusal(
        status: int, retry_after: bool, cls: FailureClass | None) -> None:
    assert classify_http_status(status, retry_after=retry_after) is cls
