"""Typed errors of the ledger client. Each carries the ledger's stable error code; branch on
the type or on `code`, never on the message."""

from __future__ import annotations

from typing import Any


class LedgerError(Exception):
    """An error answer from the ledger (`{"error": {code, message, details}}`)."""

    retryable = False

    def __init__(self, code: str, message: str, *, status: int | None = None,
                 details: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.status, self.details = code, message, status, details


class Unauthenticated(LedgerError):
    """401: no token or an unknown token."""


class Forbidden(LedgerError):
    """403: the token may not do this (an agent acting as an operator, another tenant)."""


class NotFound(LedgerError):
    """404: no such operation (or one of another tenant)."""


class Conflict(LedgerError):
    """409: the request contradicts the ledger's record."""


class IdempotencyConflict(Conflict):
    """The same idempotency key was used with different arguments."""


class RetryRefused(Conflict):
    """A retry plan was refused (already succeeded, needs review, superseded, ...)."""


class InvalidRequest(LedgerError):
    """422: the request or its arguments are invalid (unknown tool, bad arguments, bad wait)."""


class PayloadTooLarge(LedgerError):
    """413."""


class RateLimited(LedgerError):
    """429: the tenant's rate or open-operation quota refused it; nothing was recorded.
    Sending it again after `retry_after_s` (the ledger's Retry-After) is safe."""

    retryable = True

    def __init__(self, code: str, message: str, *, status: int | None = None,
                 details: Any = None, retry_after_s: float | None = None) -> None:
        super().__init__(code, message, status=status, details=details)
        wait = details.get("retry_after_s") if isinstance(details, dict) else None
        self.retry_after_s: float | None = (
            float(wait) if isinstance(wait, int | float) and not isinstance(wait, bool)
            else retry_after_s)


class Unavailable(LedgerError):
    """503 or no answer: the ledger could not be reached or its store is unavailable.
    Safe to send again with the same idempotency key."""

    retryable = True


_BY_CODE: dict[str, type[LedgerError]] = {
    "idempotency_key_conflict": IdempotencyConflict,
    "retry_refused": RetryRefused,
}
_BY_STATUS: dict[int, type[LedgerError]] = {
    401: Unauthenticated, 403: Forbidden, 404: NotFound, 409: Conflict, 413: PayloadTooLarge,
    422: InvalidRequest, 429: RateLimited, 503: Unavailable,
}


def error_from(status: int, body: Any, text: str = "",
               retry_after: str | None = None) -> LedgerError:
    """The typed error for an error answer; a body that is not the ledger's error shape
    (a proxy's page) still yields an error with the HTTP status as its code."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        code, message, details = err["code"], str(err.get("message", "")), err.get("details")
    else:
        code, message, details = f"http_{status}", text[:500], None
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status) or (
        Unavailable if status >= 500 else LedgerError)
    if cls is RateLimited:
        return RateLimited(code, message, status=status, details=details,
                           retry_after_s=_seconds(retry_after))
    return cls(code, message, status=status, details=details)


def _seconds(header: str | None) -> float | None:
    """A Retry-After given in seconds (the ledger's form); an HTTP date is not read."""
    try:
        return float(header) if header else None
    except ValueError:
        return None
