"""Messages on the bus: frozen pydantic models with a schema version (see docs/asyncapi.json).

Commands are imperative (`DispatchAttempt`, `ClaimAttempt`), events past tense
(`AttemptSucceeded`, `AttemptFailed`, `OutcomeAmbiguous`). Every model rejects unknown fields so a
wrong schema version or a typo is a clear error rather than a silently ignored value.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from .errors import PayloadTooLarge, PoisonMessage
from .limits import (
    MAX_DUPLICATE_REFS,
    MAX_IDENTIFIER_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_PROVIDER_REF_BYTES,
)
from .results import ProviderResult


def _within_bytes(value: str) -> str:
    # The bound is 1 KiB of UTF-8, not 1024 characters (which could be 4 KiB).
    if len(value.encode()) > MAX_IDENTIFIER_BYTES:
        raise ValueError(f"must be at most {MAX_IDENTIFIER_BYTES} bytes of UTF-8")
    return value


def _no_nul(value: str) -> str:
    # PostgreSQL text columns cannot hold NUL; refusing it here keeps both backends alike and
    # turns it into a clear validation error instead of a database error.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _storable(value: Any) -> Any:
    return storable(value) if isinstance(value, str) else value


def storable(value: str) -> str:
    """Free text from outside (a provider's error, a webhook's event type, a reference) as a
    database can hold it: NUL becomes U+FFFD and unpaired surrogates (`"\\ud800"` in JSON)
    become `?`. PostgreSQL refuses both, and refusing the message instead would dead-letter the
    outcome that carries the correct verdict. Identifiers are refused instead (`Ident`)."""
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    try:
        value.encode()
    except UnicodeEncodeError:
        value = value.encode("utf-8", "replace").decode()
    return value


def _encodable(value: str) -> str:
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no unpaired surrogates)") from None
    return value


Ident = Annotated[str, StringConstraints(min_length=1, max_length=MAX_IDENTIFIER_BYTES),
                  AfterValidator(_encodable), AfterValidator(_within_bytes),
                  AfterValidator(_no_nul)]
ShortText = Annotated[str, BeforeValidator(_storable), StringConstraints(max_length=1024)]
ProviderRef = Annotated[str, BeforeValidator(_storable),
                        StringConstraints(max_length=MAX_PROVIDER_REF_BYTES)]
Epoch = Annotated[int, Field(ge=1)]
M = TypeVar("M", bound="BaseModel")
T = TypeVar("T")


class Message(BaseModel):
    # No NaN or infinity anywhere: JSON cannot carry them portably (PostgreSQL's jsonb refuses
    # them), so one would make the ledger's commit fail on every redelivery.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    schema_version: Literal[1] = 1


class SubmitIntent(Message):
    """Request body of `POST /v1/intents` and of the NATS intent subject."""

    tool: Ident
    arguments: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: Ident | None = None
    task_id: Ident | None = None
    tenant: Ident = "default"
    # Also known by its call identity (tenant, task, tool, arguments, `repeat`): without a key
    # it joins the latest identical operation unless that one is known not applied or
    # succeeded longer ago than the tool's dedupe window (effectledger_core/identical.py).
    join_identical: bool = False
    # A label that makes a deliberate repeat a different call (only with join_identical).
    repeat: Ident | None = None


class DispatchAttempt(Message):
    """Command from the ledger's outbox: make one attempt of this operation at this epoch."""

    type: Literal["dispatch_attempt"] = "dispatch_attempt"
    operation_id: Ident
    operation_key: Ident
    epoch: Epoch
    tool: Ident
    arguments: dict[str, Any]
    arguments_digest: str
    catalog_digest: str
    contract_revision: str


class ClaimStatus(StrEnum):
    GRANTED = "granted"
    ALREADY_CLAIMED = "already_claimed"
    STALE_EPOCH = "stale_epoch"
    NOT_CLAIMABLE = "not_claimable"  # right epoch, but cancelled / awaiting approval / resolved
    NOT_FOUND = "not_found"
    COMMAND_MISMATCH = "command_mismatch"  # the claim's tool or arguments are not the operation's


class ClaimAttempt(Message):
    """Request from a dispatcher: record the start of this attempt before any provider call."""

    type: Literal["claim_attempt"] = "claim_attempt"
    operation_id: Ident
    epoch: Epoch
    attempt_id: Ident
    dispatcher_id: Ident
    # The command the dispatcher is about to carry out; the ledger refuses the claim when it is
    # not the operation's own (effectledger_core.commands). Required on the sender-bound claim
    # subject dispatchers use; None only from trusted in-process callers.
    tool: Ident | None = None
    arguments_digest: Ident | None = None


class ClaimReply(Message):
    type: Literal["claim_reply"] = "claim_reply"
    status: ClaimStatus
    operation_id: str
    epoch: int
    attempt_id: str | None = None  # the attempt that holds the claim
    current_epoch: int | None = None
    outcome_recorded: bool = False
    state: str | None = None
    claim_age_s: float | None = None  # for already_claimed: seconds since the claim
    # On a grant, the ledger's copy of the command: the dispatcher sends nothing else.
    tool: str | None = None
    arguments_digest: str | None = None
    reason: str | None = None  # for command_mismatch: what differed


# --- request-reply answers of the ledger (intents, claims, operation reads) ---


class _Part(BaseModel):
    """A nested part of a message: the message carries the schema version."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ErrorDetail(_Part):
    code: str
    message: str
    details: dict[str, Any] | None = None
    retryable: bool | None = None  # set when the ledger knows asking again may help


class ErrorReply(Message):
    """Any request the ledger could not serve: bad input, an unknown operation, a failure."""

    ok: Literal[False] = False
    error: ErrorDetail


class OperationSummary(_Part):
    """What request-reply answers say about an operation."""

    id: str
    state: str
    epoch: StrictInt  # a JSON `true` is not an epoch
    operation_key: str
    tool: str
    provider_ref: str | None = None
    arguments_digest: str | None = None  # for the reconciler's check of its command


class IntentReply(Message):
    """Answer to `SubmitIntent` on the intent subject; `created` False for a known key."""

    ok: Literal[True] = True
    created: bool
    operation: OperationSummary


class OutcomeRecorded(Message):
    """Answer to an outcome sent by request (`rpc.v1.outcome.<dispatcher id>`), sent only
    after the ledger's inbox transaction committed it: `status` is what became of it
    (`applied`, `duplicate` when its inbox id was already in, `rejected` and journaled) and
    `message_id` the inbox id it was committed under, the one its JetStream copy carries."""

    type: Literal["outcome_recorded"] = "outcome_recorded"
    ok: Literal[True] = True
    status: Literal["applied", "duplicate", "rejected", "kept"]
    operation_id: str
    attempt_id: str
    message_id: str
    reason: str | None = None


class OperationQuery(Message):
    """Request on the read-only operation subject (reconcilers, before deciding)."""

    operation_id: Ident


class OperationWait(Message):
    """Request on the operation wait subject: answered (`OperationReply`) once the operation
    is settled, at rest or awaiting approval, or when `wait_s` (capped by the ledger) is over."""

    operation_id: Ident
    wait_s: Annotated[float, Field(ge=0, strict=True)] = 0.0


class OperationReply(Message):
    ok: Literal[True] = True
    operation: OperationSummary


class FailureClass(StrEnum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    AUTHENTICATION = "authentication"
    NOT_FOUND = "not_found"
    PERMISSION_DENIED = "permission_denied"
    INVALID_ARGUMENT = "invalid_argument"
    RATE_LIMITED = "rate_limited"
    SELF_REPORTED = "self_reported"
    UNKNOWN = "unknown"


class _Outcome(Message):
    operation_id: Ident
    epoch: Epoch
    attempt_id: Ident
    dispatcher_id: Ident
    at: datetime
    http_status: int | None = None
    provider_ref: ProviderRef | None = None
    duration_ms: float | None = None


class AttemptSucceeded(_Outcome):
    type: Literal["attempt_succeeded"] = "attempt_succeeded"
    response_digest: str
    # The provider's answer for the agent (bounded, scrubbed; results.py).
    result: ProviderResult | None = None


class AttemptAccepted(_Outcome):
    """The provider accepted the request asynchronously; the final state comes later."""

    type: Literal["attempt_accepted"] = "attempt_accepted"
    response_digest: str


class AttemptFailed(_Outcome):
    """The provider answered with a definitive refusal: the effect was not applied."""

    type: Literal["attempt_failed"] = "attempt_failed"
    failure_class: FailureClass
    code: ShortText
    message: ShortText
    retry_after_s: float | None = None
    response_digest: str | None = None
    # The attempt's own statement of whether sending it again is safe (overrides the class
    # default), and the one-line model guidance rendered from the policy table.
    idempotency: Literal["unset", "yes", "no"] = "unset"
    guidance: ShortText = ""


class OutcomeAmbiguous(_Outcome):
    """Nobody knows whether the effect was applied: reconciliation decides, never a retry."""

    type: Literal["outcome_ambiguous"] = "outcome_ambiguous"
    reason: Literal[
        "timeout", "connection_lost", "server_error", "dispatcher_lost_mid_attempt",
        "invalid_response", "request_in_progress",
    ]
    message: ShortText = ""


Outcome = Annotated[
    AttemptSucceeded | AttemptAccepted | AttemptFailed | OutcomeAmbiguous,
    Field(discriminator="type"),
]
OUTCOME_ADAPTER: TypeAdapter[Outcome] = TypeAdapter(Outcome)



class ReconcileOperation(Message):
    """Command from the ledger outbox: find out whether this epoch's effect was applied."""

    type: Literal["reconcile_operation"] = "reconcile_operation"
    operation_id: Ident
    epoch: Epoch
    attempt_id: Ident
    operation_key: Ident
    tool: Ident
    arguments: dict[str, Any]
    # "audit": re-read a retried key after the horizon to find a late duplicate.
    cause: Literal["ambiguous", "accepted", "audit"]
    reason: ShortText = ""
    claimed_at: datetime  # when the attempt started: the provider horizon counts from here
    noticed_at: datetime
    provider_ref: ProviderRef | None = None


class Evidence(Message):
    source: Literal["readback", "webhook", "operator", "response"]
    at: datetime
    provider_ref: ProviderRef | None = None
    digest: str | None = None
    detail: ShortText = ""
    # Effects the provider lists for the operation key (readback.count_path); > 1: duplicate.
    matches: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    # The references of every effect listed (a duplicate's: what to refund or delete).
    provider_refs: Annotated[list[ProviderRef], Field(max_length=MAX_DUPLICATE_REFS)] | None = None


class VerdictReached(Message):
    """The reconciler's finding for one epoch. `undecidable` sends it to human review."""

    type: Literal["verdict_reached"] = "verdict_reached"
    operation_id: Ident
    epoch: Epoch
    verdict: Literal["applied", "not_applied", "undecidable"]
    evidence: Evidence | None = None
    reconciler_id: Ident
    reason: ShortText = ""
    at: datetime
    # For `applied` by readback: the readback's answer, kept like a response's (results.py).
    result: ProviderResult | None = None


class WebhookReceived(Message):
    """A provider webhook whose signature was verified, forwarded to the ledger as evidence."""

    type: Literal["webhook_received"] = "webhook_received"
    provider: Ident
    webhook_id: Ident
    event_type: ShortText
    operation_key: Ident | None = None
    provider_ref: ProviderRef | None = None
    outcome: Literal["applied", "not_applied", "pending", "unknown"]
    final: bool = False  # the provider says this is its last word for the effect
    fencing_token: int | None = None  # the epoch the provider saw, when it reports one
    body_digest: str
    signed_at: datetime
    received_at: datetime


class DeadLetter(Message):
    """A poison message, recorded in the ledger instead of being redelivered forever."""

    type: Literal["dead_letter"] = "dead_letter"
    consumer: Ident
    subject: ShortText
    message_id: ShortText | None = None
    error: ShortText
    payload_excerpt: Annotated[str, StringConstraints(max_length=2048)]
    deliveries: int = 1


# Everything the ledger's inbox consumes on `<prefix>.ledger.v1.>`.
LedgerEvent = Annotated[
    AttemptSucceeded | AttemptAccepted | AttemptFailed | OutcomeAmbiguous | VerdictReached
    | WebhookReceived | DeadLetter,
    Field(discriminator="type"),
]
LEDGER_EVENT_ADAPTER: TypeAdapter[LedgerEvent] = TypeAdapter(LedgerEvent)

# What each request-reply subject answers: its reply model, or an ErrorReply.
IntentAnswer = IntentReply | ErrorReply
ClaimAnswer = ClaimReply | ErrorReply
OutcomeAnswer = OutcomeRecorded | ErrorReply
OperationAnswer = OperationReply | ErrorReply


def _validated(validate: Callable[[bytes], T], raw: bytes) -> T:
    """Size-bound, then validate: every kind of bad input becomes one of our two errors."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise PayloadTooLarge(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return validate(raw)
    except ValidationError as exc:
        raise PoisonMessage(_short_errors(exc)) from exc


def parse(model: type[M], raw: bytes) -> M:
    """Parse a bus payload into `model`, turning every kind of bad input into PoisonMessage."""
    return _validated(model.model_validate_json, raw)


def parse_answer(model: type[M], raw: bytes) -> M | ErrorReply:
    """A request-reply answer: `model`, or the `ErrorReply` the server sent instead.

    The expected model is tried first and the error reply only when it does not fit: a third
    of the cost of validating against the union, on every claim of the dispatcher's hot path.
    """
    if len(raw) > MAX_MESSAGE_BYTES:
        raise PayloadTooLarge(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        try:
            return ErrorReply.model_validate_json(raw)
        except ValidationError:
            raise PoisonMessage(_short_errors(exc)) from exc


def parse_outcome(raw: bytes) -> Outcome:
    return _validated(OUTCOME_ADAPTER.validate_json, raw)


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json().encode()


def _short_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)[:1000]


def excerpt(raw: bytes, limit: int = 2048) -> str:
    """A bounded, printable excerpt of a payload for dead-letter records."""
    return raw[:limit].decode("utf-8", errors="replace")


def parse_ledger_event(raw: bytes) -> LedgerEvent:
    return _validated(LEDGER_EVENT_ADAPTER.validate_json, raw)
