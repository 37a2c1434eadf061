"""What the ledger's HTTP API answers: the response models of every route.

One type per concept, end to end: the ledger's service returns these models, its HTTP API and
console answer them, they document the API (OpenAPI) and type the Python client
(`effectledger_client`). They accept fields they do not declare (`extra="allow"`): a newer
ledger may add a field without breaking an older client. Requests are the strict models in
`messages` and the ledger's API module.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainSerializer, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

from .results import ProviderResult
from .waiting import is_settled


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


def _iso(value: datetime) -> str:
    return value.isoformat()


# A time in JSON as the API has always written it, Python's isoformat ("+00:00"): pydantic's
# own form ("Z") would change the bytes of every answer. Read from either form.
Timestamp = Annotated[datetime, PlainSerializer(_iso, return_type=str, when_used="json"),
                      WithJsonSchema({"type": "string", "format": "date-time"})]


class AttemptView(_View):
    id: str
    operation_id: str
    epoch: int
    dispatcher_id: str
    status: str  # claimed | the outcome's type
    claimed_at: Timestamp
    finished_at: Timestamp | None = None
    http_status: int | None = None
    provider_ref: str | None = None
    response_digest: str | None = None
    outcome: dict[str, Any] | None = None


class OperationRecord(_View):
    """An operation's own columns: what a retry's admission and the review queue show."""

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
    created_at: Timestamp
    updated_at: Timestamp
    provider_ref: str | None = None
    response_digest: str | None = None
    last_outcome: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None
    # The provider's answer (bounded, scrubbed, narrowed by the tool's result_path): from the
    # successful response, or from the readback that found the effect.
    result: ProviderResult | None = None
    # The call identity the operation holds (identical.py), if any: always in the JSON, in
    # this place, but left out of the API's documented schema (an internal column).
    call_key: SkipJsonSchema[str | None] = None

    @property
    def settled(self) -> bool:
        """At rest or waiting for a human: a wait on it is over."""
        return is_settled(self.state)


class OperationView(OperationRecord):
    """`GET /v1/operations/{id}` and the answer to `POST /v1/intents`: the operation with its
    attempts."""

    attempts: list[AttemptView] = []


class OperationSummary(_View):
    id: str
    tool: str
    state: str
    epoch: int
    operation_key: str
    created_at: Timestamp
    updated_at: Timestamp


class OperationPage(_View):
    items: list[OperationSummary]
    next_cursor: str | None = None


class JournalEntry(_View):
    id: int
    operation_id: str | None
    at: Timestamp
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
    operation: OperationRecord


class WebhookEventView(_View):
    """A provider's webhook as the ledger received it (evidence for a reviewer)."""

    id: int
    provider: str
    webhook_id: str
    event_type: str
    operation_key: str | None = None
    provider_ref: str | None = None
    outcome: str
    final: bool
    fencing_token: int | None = None
    body_digest: str
    signed_at: Timestamp
    received_at: Timestamp
    operation_id: str | None = None
    applied: str | None = None  # null until used: applied | rejected:<why> | ignored


class ReviewItem(_View):
    """An operation waiting for a human, with the evidence gathered so far."""

    operation: OperationRecord
    evidence: list[JournalEntry]
    webhooks: list[WebhookEventView]


class ReviewQueue(_View):
    items: list[ReviewItem]


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
