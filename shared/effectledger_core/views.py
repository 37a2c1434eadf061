"""What the ledger's HTTP API answers: the response models of every route.

The same models document the API (OpenAPI) and type the Python client (`effectledger_client`).
They accept fields they do not declare (`extra="allow"`): a newer ledger may add a field
without breaking an older client. Requests are the strict models in `messages` and the
ledger's API module.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from .results import ProviderResult
from .waiting import is_settled


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


class AttemptView(_View):
    id: str
    operation_id: str
    epoch: int
    dispatcher_id: str
    status: str  # claimed | the outcome's type
    claimed_at: datetime
    finished_at: datetime | None = None
    http_status: int | None = None
    provider_ref: str | None = None
    response_digest: str | None = None
    outcome: dict[str, Any] | None = None


class OperationView(_View):
    """`GET /v1/operations/{id}` and the answer to `POST /v1/intents`."""

    id: str
    tenant: str
    task_id: str | None = None
    caller_key: str | None = None
    operation_key: str
    tool: str
    arguments: dict[str, Any]
    arguments_digest: str
    tool_digest: str
    contract_revision: str
    effect_class: str
    commit_policy: str
    state: str
    epoch: int
    created_at: datetime
    updated_at: datetime
    provider_ref: str | None = None
    response_digest: str | None = None
    last_outcome: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None
    # The provider's answer (bounded, scrubbed, narrowed by the tool's result_path): from the
    # successful response, or from the readback that found the effect.
    result: ProviderResult | None = None
    attempts: list[AttemptView] = []

    @property
    def settled(self) -> bool:
        """At rest or waiting for a human: a wait on it is over."""
        return is_settled(self.state)


class OperationSummary(_View):
    id: str
    tool: str
    state: str
    epoch: int
    operation_key: str
    created_at: datetime
    updated_at: datetime


class OperationPage(_View):
    items: list[OperationSummary]
    next_cursor: str | None = None


class JournalEntry(_View):
    id: int
    operation_id: str | None
    at: datetime
    kind: str
    epoch: int | None = None
    from_state: str | None = None
    to_state: str | None = None
    actor: str
    detail: dict[str, Any]


class Journal(_View):
    operation_id: str
    entries: list[JournalEntry]


class ReceiptDigests(_View):
    catalog_entry: str
    request: str
    response: str | None = None
    policy: str


class RecoveryView(_View):
    fact: str
    decision: str
    reason: str


class Receipt(_View):
    """Evidence, not success: `open_uncertainties` lists what is still not known."""

    operation_id: str
    operation_key: str
    run_id: str | None = None
    tenant: str
    attempt_ids: list[str]
    tool: str
    state: str
    epoch: int
    effect_class: str
    commit_policy: str
    contract_revision: str
    digests: ReceiptDigests
    provider_request_ref: str | None = None
    dispatch_outcome: str | None = None
    reconciliation_status: str
    evidence: dict[str, Any] | None = None
    recovery_decision: RecoveryView
    guidance: str | None = None
    open_uncertainties: list[str]
    result: ProviderResult | None = None


class Admission(_View):
    """A retry plan that passed admission; a refused one is a 409 `retry_refused`."""

    plan_id: str
    admitted: bool
    operation: dict[str, Any]


class ReviewQueue(_View):
    items: list[dict[str, Any]]


class ToolList(_View):
    catalog_digest: str
    tools: list[dict[str, Any]]


class Stats(_View):
    operations: dict[str, int]
    outbox: dict[str, Any] | None = None


class Health(_View):
    ok: bool


class Readiness(_View):
    ok: bool
    checks: dict[str, Any]
    auth: str
    # Guarantees that are off in this process (an open API), in words an operator reads.
    warnings: list[str] = []
    # The readiness split: what is down, and what the ledger can still do.
    missing: list[str] = []
    accepting_intents: bool = True
    relaying: bool = True


class ErrorBody(_View):
    code: str  # stable: clients branch on it, never on the message
    message: str
    details: Any = None


class ErrorResponse(_View):
    """Every error: `{"error": {"code", "message", "details"}}`."""

    error: ErrorBody
