"""What the OpenAPI document says beyond the routes' signatures: the real error body and its
stable codes per status, and the request body of `POST /v1/intents` (read raw, size-bounded,
so FastAPI cannot infer it)."""

from __future__ import annotations

from typing import Any

from effectledger_core.messages import SubmitIntent
from effectledger_core.views import ErrorResponse

# The stable error codes each status carries; clients branch on the code.
ERROR_CODES: dict[int, tuple[str, ...]] = {
    401: ("unauthenticated",),
    403: ("forbidden",),
    404: ("not_found",),
    409: ("idempotency_key_conflict", "action_rejected", "retry_refused"),
    413: ("payload_too_large",),
    422: ("invalid_request", "unknown_tool", "invalid_arguments"),
    503: ("store_unavailable", "broker_unavailable"),
}

WAIT_DOC = ("how long to wait for the operation to settle (succeeded, failed, cancelled, "
            "needs_review, awaiting_approval), e.g. `10s`, `500ms`, `2.5`; capped by the "
            "ledger (EFFECTLEDGER_WAIT_MAX_S). The answer comes as soon as it settles, else at "
            "the end of the wait with the state then.")


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these statuses, each `{"error": {code, message, details}}`.
    Every authenticated route may answer 401 (credentials) and 422 (a malformed parameter)."""
    return {status: {"model": ErrorResponse,
                     "description": "error codes: " + ", ".join(
                         f"`{c}`" for c in ERROR_CODES[status])}
            for status in sorted({401, 422, *statuses})}


def submit_intent_body() -> dict[str, Any]:
    schema = SubmitIntent.model_json_schema()
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}
