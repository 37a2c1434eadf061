"""What requests carry: the operator actions' JSON bodies, and the size-bounded raw read of a
body FastAPI does not parse itself (`POST /v1/intents`)."""

import logging
from typing import Annotated

from fastapi import Request
from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints
from starlette.requests import ClientDisconnect

from effectledger_core.errors import InvalidRequest, PayloadTooLarge
from effectledger_core.limits import MAX_HTTP_BODY_BYTES, MAX_IDENTIFIER_BYTES, declared_length
from effectledger_core.recovery import Conclusion

log = logging.getLogger(__name__)


def _storable(value: str) -> str:
    # Journaled as jsonb on PostgreSQL, which holds neither NUL nor an unpaired surrogate: a
    # clear 422 here instead of a failed transaction (a 500).
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no unpaired surrogates)") from None
    return value


Bounded = Annotated[str, StringConstraints(min_length=1, max_length=MAX_IDENTIFIER_BYTES),
                    AfterValidator(_storable)]
Text = Annotated[str, StringConstraints(max_length=MAX_IDENTIFIER_BYTES),
                 AfterValidator(_storable)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApproveBody(_Body):
    epoch: int
    arguments_digest: Bounded
    operator: Bounded | None = None


class RejectBody(_Body):
    epoch: int
    operator: Bounded | None = None
    reason: Text = ""


class CancelBody(_Body):
    operator: Bounded | None = None
    reason: Text = ""


class ReviewBody(_Body):
    conclusion: Conclusion
    evidence_ref: Bounded
    operator: Bounded | None = None
    epoch: int | None = None  # the epoch reviewed; default the current one


class RetryBody(_Body):
    operator: Bounded | None = None
    epoch: int | None = None  # the epoch the caller saw; a superseded one is refused
    review: ReviewBody | None = None


async def read_bounded(request: Request, limit: int = MAX_HTTP_BODY_BYTES) -> bytes:
    """Read a request body, refusing it as soon as it exceeds `limit` (before reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        length = declared_length(declared)
        if length is None:
            raise InvalidRequest("invalid Content-Length")
        if length > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # Anyone can do this, unauthenticated: one line, not a traceback per request.
        log.info("%s %s: the client went away mid-body", request.method,
                 request.url.path[:200])
        raise InvalidRequest("the client disconnected before sending the whole body") from None
    return b"".join(chunks)
