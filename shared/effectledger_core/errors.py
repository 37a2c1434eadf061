"""effectledger's own error types. Retryability is a property of the type.

Adapters translate library errors (SQLAlchemy, nats-py, aiohttp, httpx) into these at their
boundary; the HTTP layer renders them as `{"error": {"code", "message", "details"}}`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class EffectLedgerError(Exception):
    code: ClassVar[str] = "internal_error"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


class InvalidRequest(EffectLedgerError):
    code = "invalid_request"
    http_status = 422


class UnknownTool(EffectLedgerError):
    code = "unknown_tool"
    http_status = 422


class InvalidArguments(EffectLedgerError):
    code = "invalid_arguments"
    http_status = 422


class PayloadTooLarge(EffectLedgerError):
    code = "payload_too_large"
    http_status = 413


class QuotaExceeded(EffectLedgerError):
    """A tenant's rate or open-operation quota (effectledger_core.quotas); nothing recorded."""

    code = "quota_exceeded"
    http_status = 429
    retryable = True


class IdempotencyConflict(EffectLedgerError):
    code = "idempotency_key_conflict"
    http_status = 409


class NotFound(EffectLedgerError):
    code = "not_found"
    http_status = 404


class CatalogError(EffectLedgerError):
    code = "catalog_invalid"
    http_status = 500


class ConfigError(EffectLedgerError):
    code = "config_invalid"
    http_status = 500


class StoreUnavailable(EffectLedgerError):
    """The database could not be reached or the transaction hit a retryable conflict."""

    code = "store_unavailable"
    http_status = 503
    retryable = True


class BrokerUnavailable(EffectLedgerError):
    code = "broker_unavailable"
    http_status = 503
    retryable = True


class PoisonMessage(EffectLedgerError):
    """A message that can never be processed: it is dead-lettered, not redelivered forever."""

    code = "poison_message"
    http_status = 422
