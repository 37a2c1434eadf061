"""effectledger's Python client: submit intents, wait for outcomes, read receipts, act as an
operator. Sync (`Client`) and async (`AsyncClient`); typed answers and typed errors."""

from effectledger_core.views import (
    Journal,
    OperationPage,
    OperationView,
    Receipt,
)

from ._calls import Submitted
from .client import AsyncClient, Client
from .errors import (
    Conflict,
    Forbidden,
    IdempotencyConflict,
    InvalidRequest,
    LedgerError,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RetryRefused,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "AsyncClient", "Client", "Conflict", "Forbidden", "IdempotencyConflict", "InvalidRequest",
    "Journal", "LedgerError", "NotFound", "OperationPage", "OperationView", "PayloadTooLarge",
    "RateLimited", "Receipt", "RetryRefused", "Submitted", "Unauthenticated", "Unavailable",
]
