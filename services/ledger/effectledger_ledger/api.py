"""The ledger's HTTP API (FastAPI). Errors are JSON: `{"error": {"code", "message"}}`.

Agents (agent tokens) submit intents and read their own tenant's operations; operators
(operator tokens) also approve, reject, cancel, retry and review. Operator actions are journaled
with the operator's name from the token.
"""

# No `from __future__ import annotations` here: FastAPI resolves string annotations in the
# module's globals, so the `Who` dependency (local to create_app) would silently become a
# required query parameter `p` on every route.
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from effectledger_core.errors import (
    EffectLedgerError,
    InvalidRequest,
    PayloadTooLarge,
    PoisonMessage,
)
from effectledger_core.limits import MAX_HTTP_BODY_BYTES, MAX_IDENTIFIER_BYTES
from effectledger_core.messages import SubmitIntent, parse
from effectledger_core.quotas import retry_after_header
from effectledger_core.recovery import Conclusion, Review
from effectledger_core.views import (
    Admission,
    Health,
    Journal,
    OperationPage,
    OperationView,
    Readiness,
    Receipt,
    RecoveryView,
    ReviewQueue,
    Stats,
    ToolList,
)
from effectledger_core.waiting import DEFAULT_MAX_WAIT_S, parse_wait, wait_over
from effectledger_obs.http import HttpObservability, metrics_response

from . import console
from .auth import (
    OPEN_API_WARNING,
    Authenticator,
    Forbidden,
    Principal,
    check_tenant,
    operator_name,
)
from .openapi import WAIT_DOC, errors, submit_intent_body
from .service import LedgerService

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


def _error(status: int, code: str, message: str, details: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status)


async def read_bounded(request: Request, limit: int = MAX_HTTP_BODY_BYTES) -> bytes:
    """Read a request body, refusing it as soon as it exceeds `limit` (before reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("invalid Content-Length")
        if int(declared) > limit:
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


def _json(v: Any) -> Any:
    return v.isoformat() if hasattr(v, "isoformat") else v


# Readiness split (liveness is /healthz: the process answers HTTP at all).
INTENTS_NEED = ("database",)
RELAY_NEEDS = ("database", "nats", "relay")


def create_app(service: LedgerService, *, ready: Callable[[], Awaitable[dict[str, Any]]],
               auth: Authenticator | None = None,
               max_wait_s: float = DEFAULT_MAX_WAIT_S,
               before_scrape: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    app = FastAPI(title="effectledger ledger", version="1",
                  description="Side-effecting tool calls, attempted at most once per decision.")
    # Request counts by route template and, when tracing is on, a span per request.
    app.add_middleware(HttpObservability)
    authenticator = auth or Authenticator({}, {})
    # Declares the bearer scheme in the OpenAPI document; the Authenticator does the checking
    # (auto_error off: with authentication disabled a request without a token is fine).
    bearer = HTTPBearer(auto_error=False, description="an agent or operator token")

    Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]

    async def principal(request: Request, _: Credentials = None) -> Principal:
        return authenticator.authenticate(request)

    Who = Annotated[Principal, Depends(principal)]
    Wait = Annotated[str | None, Query(description=WAIT_DOC, examples=["10s"])]
    ChangedFrom = Annotated[str | None, Query(
        description="with `wait`: also answer as soon as the state is no longer this one "
                    "(progress displays)")]

    async def waited(op: dict[str, Any], wait: str | None,
                     changed_from: str | None) -> dict[str, Any]:
        wait_s = parse_wait(wait, cap_s=max_wait_s)
        if wait_s <= 0 or wait_over(op["state"], changed_from):
            return op  # nothing to wait for: no second read
        return await service.wait_operation(op["id"], wait_s, changed_from=changed_from)

    async def visible(p: Principal, operation_id: str) -> dict[str, Any]:
        op = await service.operation(operation_id)
        # Another tenant's operation reads exactly like a missing one, message included.
        check_tenant(p, op["tenant"], operation_id)
        return op

    @app.exception_handler(EffectLedgerError)
    async def _own(_: Request, exc: EffectLedgerError) -> JSONResponse:
        response = _error(exc.http_status, exc.code, exc.message, exc.details)
        if exc.http_status == 401:
            # RFC 9110: a 401 names the scheme the client must use.
            response.headers["WWW-Authenticate"] = 'Bearer realm="effectledger"'
        wait = exc.details.get("retry_after_s")
        if exc.http_status == 429 and isinstance(wait, int | float):
            response.headers["Retry-After"] = retry_after_header(wait)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", "request validation failed",
                      [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]])

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", str(exc.detail))

    @app.post("/v1/intents", status_code=201, openapi_extra=submit_intent_body(),
              summary="Submit an intent (optionally wait for its outcome)",
              responses={201: {"model": OperationView, "description": "a new operation"},
                         200: {"model": OperationView,
                               "description": "the existing operation for this key and "
                                              "arguments"},
                         **errors(401, 403, 409, 413, 422, 503)})
    async def submit_intent(request: Request, p: Who, wait: Wait = None) -> JSONResponse:
        wait_s = parse_wait(wait, cap_s=max_wait_s)  # a bad wait is refused before submitting
        raw = await read_bounded(request)
        try:
            intent = parse(SubmitIntent, raw)
        except PoisonMessage as exc:
            raise InvalidRequest(exc.message) from exc
        if p.role == "agent":
            if "tenant" in intent.model_fields_set and intent.tenant != p.tenant:
                raise Forbidden("agents submit intents for their own tenant only")
            intent = intent.model_copy(update={"tenant": p.tenant})
        submitted = await service.submit(intent, actor=p.name)
        op_id = submitted.operation["id"]
        view = (await service.wait_operation(op_id, wait_s) if wait_s > 0
                else await service.operation(op_id))
        return JSONResponse(view, status_code=201 if submitted.created else 200)

    @app.get("/v1/operations/{operation_id}", responses={
        200: {"model": OperationView}, **errors(401, 404, 422)},
        summary="An operation (optionally wait until it is settled)")
    async def get_operation(operation_id: str, p: Who, wait: Wait = None,
                            changed_from: ChangedFrom = None) -> dict[str, Any]:
        return await waited(await visible(p, operation_id), wait, changed_from)

    @app.get("/v1/operations/{operation_id}/journal",
             responses={200: {"model": Journal}, **errors(401, 404)})
    async def get_journal(operation_id: str, p: Who) -> dict[str, Any]:
        await visible(p, operation_id)
        return {"operation_id": operation_id, "entries": await service.journal(operation_id)}

    @app.get("/v1/operations/{operation_id}/receipt",
             responses={200: {"model": Receipt}, **errors(401, 404)})
    async def get_receipt(operation_id: str, p: Who) -> dict[str, Any]:
        await visible(p, operation_id)
        return await service.receipt(operation_id)

    @app.get("/v1/operations", responses={200: {"model": OperationPage}, **errors(401, 422)})
    async def list_operations(p: Who, state: str | None = None,
                              limit: int = Query(100, ge=1, le=1000),
                              cursor: str | None = None) -> dict[str, Any]:
        return await service.list_operations(state=state, limit=limit, cursor=cursor,
                                             tenant=p.tenant)

    @app.post("/v1/operations/{operation_id}/approve",
              responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
    async def approve(operation_id: str, body: ApproveBody, p: Who) -> dict[str, Any]:
        await service.approve(operation_id, epoch=body.epoch,
                              arguments_digest=body.arguments_digest,
                              operator=operator_name(p, body.operator))
        return await service.operation(operation_id)

    @app.post("/v1/operations/{operation_id}/reject",
              responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
    async def reject(operation_id: str, body: RejectBody, p: Who) -> dict[str, Any]:
        await service.reject(operation_id, epoch=body.epoch,
                             operator=operator_name(p, body.operator), reason=body.reason)
        return await service.operation(operation_id)

    @app.post("/v1/operations/{operation_id}/cancel",
              responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
    async def cancel(operation_id: str, body: CancelBody, p: Who) -> dict[str, Any]:
        await service.cancel(operation_id, operator=operator_name(p, body.operator),
                             reason=body.reason)
        return await service.operation(operation_id)

    @app.get("/v1/operations/{operation_id}/recovery",
             responses={200: {"model": RecoveryView}, **errors(401, 404)})
    async def recovery(operation_id: str, p: Who) -> dict[str, Any]:
        await visible(p, operation_id)
        a = await service.inspect(operation_id)
        return {"fact": a.fact.value, "decision": a.decision.value, "reason": a.reason}

    @app.post("/v1/operations/{operation_id}/retry",
              responses={200: {"model": Admission}, **errors(401, 403, 404, 409, 422)})
    async def retry(operation_id: str, body: RetryBody, p: Who) -> JSONResponse:
        who = operator_name(p, body.operator)
        review = None
        if body.review is not None:
            op = await service.operation(operation_id)
            epoch = body.review.epoch or body.epoch or op["epoch"]
            review = Review(operator=operator_name(p, body.review.operator or who),
                            evidence_ref=body.review.evidence_ref,
                            conclusion=body.review.conclusion, epoch=epoch)
        plan_id, admission = await service.retry(operation_id, operator=who, review=review,
                                                 for_epoch=body.epoch)
        return _admission(plan_id, admission)

    @app.post("/v1/retry-plans/{plan_id}/use",
              summary="Use a prepared single-use retry plan (operator)",
              responses={200: {"model": Admission}, **errors(401, 403, 404, 409)})
    async def use_plan(plan_id: str, p: Who) -> JSONResponse:
        operator_name(p, None if p.role == "operator" else "anonymous")
        return _admission(plan_id, await service.use_plan(plan_id))

    @app.get("/v1/reviews", responses={200: {"model": ReviewQueue}, **errors(401, 403, 422)})
    async def review_queue(p: Who, limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
        operator_name(p, None if p.role == "operator" else "anonymous")
        return {"items": await service.review_queue(limit)}

    @app.post("/v1/operations/{operation_id}/reviews",
              responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
    async def review(operation_id: str, body: ReviewBody, p: Who) -> dict[str, Any]:
        who = operator_name(p, body.operator)
        op = await service.operation(operation_id)
        await service.review(operation_id, Review(
            operator=who, evidence_ref=body.evidence_ref, conclusion=body.conclusion,
            epoch=body.epoch if body.epoch is not None else op["epoch"]))
        return await service.operation(operation_id)

    @app.get("/v1/tools", responses={200: {"model": ToolList}, **errors(401)})
    async def list_tools(p: Who) -> dict[str, Any]:
        tools = service.catalog.tools
        return {"catalog_digest": service.catalog.digest(),
                "tools": [tools[n].public_view() for n in sorted(tools)]}

    @app.get("/v1/stats", responses={200: {"model": Stats}, **errors(401)})
    async def stats(p: Who) -> dict[str, Any]:
        # Agents see their own tenant's counts only, like every other read.
        return await service.stats(tenant=p.tenant if p.role == "agent" else None)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        # Unauthenticated like /healthz: scrapers carry no token, and the figures hold no
        # operation ids, tenants or arguments (bounded labels only).
        if before_scrape is not None:
            await before_scrape()  # the gauges read from the database (gauges.py)
        return metrics_response()

    @app.get("/healthz", responses={200: {"model": Health}})
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    async def readiness(need: tuple[str, ...]) -> JSONResponse:
        checks = await ready()
        missing = [name for name, v in checks.items() if isinstance(v, bool) and not v]
        ok = not any(name in missing for name in need)
        return JSONResponse({"ok": ok, "checks": checks, "missing": missing,
                             "accepting_intents": not any(n in missing for n in INTENTS_NEED),
                             "relaying": not any(n in missing for n in RELAY_NEEDS),
                             "auth": "enabled" if authenticator.enabled else "disabled",
                             "warnings": [] if authenticator.enabled else [OPEN_API_WARNING]},
                            status_code=200 if ok else 503)

    @app.get("/readyz", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
    async def readyz() -> JSONResponse:
        """Ready to accept intents, approvals and reads: the database answers. A missing
        broker is named in `missing` but does not make the ledger unready: commands wait in
        the outbox and the relay publishes them once NATS is back."""
        return await readiness(INTENTS_NEED)

    @app.get("/readyz/relay", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
    async def readyz_relay() -> JSONResponse:
        """Ready to move commands and outcomes: database, NATS and the relay all running."""
        return await readiness(RELAY_NEEDS)

    # The operator console at /console, and /docs from its vendored Swagger UI (no CDN).
    console.mount(app, service, authenticator)
    return app


def _admission(plan_id: str, admission: Any) -> JSONResponse:
    if not admission.admitted:
        return _error(409, "retry_refused", f"the retry plan was refused at admission: "
                      f"{admission.reason}", {"reason": admission.reason, "plan_id": plan_id})
    return JSONResponse({"plan_id": plan_id, "admitted": True,
                         "operation": {k: _json(v) for k, v in admission.operation.items()}})
