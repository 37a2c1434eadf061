"""The failure taxonomy: classes, the policy table, classification and model guidance.

Two questions are kept apart on purpose: "is another attempt worth it" (retryable, backoff) and
"is it safe to send the same request again" (safe_to_resubmit). A timeout is where they
disagree: worth another try, but the first may have been applied. Unclassifiable failures are
not retryable: retrying a call that cannot succeed multiplies side effects, while not retrying a
call that could have succeeded only costs time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from .digest import digest
from .messages import FailureClass


@dataclass(frozen=True, slots=True)
class Policy:
    retryable: bool
    backoff: bool
    surface_retry_after: bool
    needs_operator: bool
    safe_to_resubmit: bool
    # For the model: what the situation is and what to change. Never a retry verdict, which
    # is `guidance()`'s job; a test pins that no remediation says "retry", "wait" or "human".
    remediation: str


FC = FailureClass
POLICY: dict[FailureClass, Policy] = {
    FC.TRANSIENT: Policy(True, True, False, False, False,
                         "The provider or the network was briefly unavailable."),
    FC.PERMANENT: Policy(False, False, False, False, False,
                         "The provider cannot perform this request as given; choose a different "
                         "approach."),
    FC.AUTHENTICATION: Policy(False, False, False, True, True,
                              "The credentials for this tool were rejected."),
    FC.NOT_FOUND: Policy(False, False, False, False, True,
                         "The target does not exist; check the identifiers in the arguments."),
    FC.PERMISSION_DENIED: Policy(False, False, False, True, True,
                                 "This tool is not permitted to perform the request."),
    FC.INVALID_ARGUMENT: Policy(False, False, False, False, True,
                                "The arguments were rejected; correct the invalid values."),
    FC.RATE_LIMITED: Policy(True, True, True, False, True,
                            "The provider is limiting the request rate."),
    FC.SELF_REPORTED: Policy(True, True, False, False, False,
                             "The tool reported this failure itself without naming its cause."),
    FC.UNKNOWN: Policy(False, False, False, False, False,
                       "The failure could not be classified."),
}


def policy_digest() -> str:
    """Digest of the policy table, recorded in receipts and retry journal entries."""
    return digest({c.value: p.__repr__() for c, p in sorted(POLICY.items())})


class Idempotency(StrEnum):
    """A per-attempt statement that overrides the class default for "safe to resubmit"."""

    UNSET = "unset"
    YES = "yes"  # idempotent, or known not accepted: sending it again is safe
    NO = "no"  # may have taken effect: sending it again is not safe


@dataclass(eq=False)
class Failure(Exception):
    """A classified failure: class, stable code, human message, optional hints and cause."""

    failure_class: FailureClass
    code: str
    message: str
    retry_after_s: float | None = None
    idempotency: Idempotency = Idempotency.UNSET
    remediation_override: str | None = None
    cause: BaseException | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"{self.failure_class.value}/{self.code}: {self.message}"

    @property
    def policy(self) -> Policy:
        return POLICY[self.failure_class]

    @property
    def retryable(self) -> bool:
        return self.policy.retryable

    @property
    def safe_to_resubmit(self) -> bool:
        if self.idempotency is Idempotency.YES:
            return True
        if self.idempotency is Idempotency.NO:
            return False
        return self.policy.safe_to_resubmit

    @property
    def remediation(self) -> str:
        return self.remediation_override or self.policy.remediation

    def guidance(self) -> str:
        return guidance(self)


@runtime_checkable
class RetryableReporter(Protocol):
    """An error that reports, itself, whether the same call is worth another attempt."""

    def is_retryable(self) -> bool: ...


class TransientError(Exception):
    """Sentinel: a tool may raise these (or subclasses) to be classified without guessing."""


class PermanentError(Exception): ...


class AuthenticationError(Exception): ...


class NotFoundError(Exception): ...


class PermissionDeniedError(Exception): ...


class InvalidArgumentError(Exception): ...


class RateLimitedError(Exception): ...


_SENTINELS: tuple[tuple[type[BaseException], FailureClass], ...] = (
    (TransientError, FC.TRANSIENT), (PermanentError, FC.PERMANENT),
    (AuthenticationError, FC.AUTHENTICATION), (NotFoundError, FC.NOT_FOUND),
    (PermissionDeniedError, FC.PERMISSION_DENIED), (InvalidArgumentError, FC.INVALID_ARGUMENT),
    (RateLimitedError, FC.RATE_LIMITED),
    # Known conditions of the standard library: a refused connection never reached anyone.
    (ConnectionRefusedError, FC.TRANSIENT),
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__
    if isinstance(exc, Failure) and exc.cause is not None and id(exc.cause) not in seen:
        yield from _chain(exc.cause)


def classify(exc: BaseException) -> Failure:
    """Classify with a fixed precedence; the order matters and is pinned by tests.

    1. an explicit Failure anywhere on the chain: the layer that made it already decided;
    2. the error's own report (`is_retryable()`): yes → self_reported, no → unknown. It comes
       before sentinels because it describes this occurrence, a sentinel only a general kind;
       and "no" is final, or the two entry points would disagree about the same error;
    3. sentinel types (ours, and a few of the standard library's);
    4. otherwise unknown, not retryable.
    """
    for link in _chain(exc):
        if isinstance(link, Failure):
            return link
    for link in _chain(exc):
        if isinstance(link, RetryableReporter):
            try:
                says = bool(link.is_retryable())
            except Exception:  # a broken reporter reports nothing
                continue
            cls = FC.SELF_REPORTED if says else FC.UNKNOWN
            return Failure(cls, "self_reported" if says else "unclassified", _msg(exc), cause=exc)
    for link in _chain(exc):
        for sentinel, cls in _SENTINELS:
            if isinstance(link, sentinel):
                return Failure(cls, cls.value, _msg(exc), cause=exc)
    return Failure(FC.UNKNOWN, "unclassified", _msg(exc), cause=exc)


# The one table of what an HTTP status proves about a refused request. Every status here (and
# every other 4xx) means the provider refused before applying anything. A 409 under our own
# idempotency key is the exception the adapter makes: an earlier attempt may still apply.
HTTP_STATUS_CLASSES: Mapping[int, FailureClass] = MappingProxyType({
    400: FC.INVALID_ARGUMENT, 422: FC.INVALID_ARGUMENT,
    401: FC.AUTHENTICATION, 403: FC.PERMISSION_DENIED,
    404: FC.NOT_FOUND, 410: FC.NOT_FOUND,
    429: FC.RATE_LIMITED,
    501: FC.PERMANENT,
})


def classify_http_status(status: int, *, retry_after: bool = False) -> FailureClass | None:
    """The class of an HTTP refusal that proves "not applied"; None when the status proves nothing.

    `retry_after`: the answer carried a `Retry-After` header. A 503 that names a retry time is
    the provider refusing before starting (overload, maintenance), so it was not applied; any
    other 5xx may have been, and 1xx, 2xx and 3xx are not refusals.
    """
    cls = HTTP_STATUS_CLASSES.get(status)
    if cls is not None:
        return cls
    if 400 <= status < 500:
        return FC.PERMANENT
    if status == 503 and retry_after:
        return FC.TRANSIENT
    return None


def _msg(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}")[:1000]


def guidance(failure: Failure) -> str:
    """The one line a model sees: remediation plus the mechanical verdicts, always in one form."""
    p = failure.policy
    parts = [failure.remediation.rstrip(".") + "."]
    if not p.retryable:
        parts.append("Do not repeat the same request.")
    elif failure.safe_to_resubmit:
        if p.surface_retry_after and failure.retry_after_s is not None:
            parts.append(f"The same request may be sent again after {failure.retry_after_s:g}s.")
        elif p.backoff:
            parts.append("The same request may be sent again after a pause.")
        else:
            parts.append("The same request may be sent again.")
    else:
        parts.append("Another attempt may help, but first confirm the previous one did not "
                     "take effect.")
    if p.needs_operator:
        parts.append("An operator must fix this before it can succeed.")
    return " ".join(parts)
