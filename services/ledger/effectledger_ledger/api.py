"""The ledger's HTTP API (FastAPI). Errors are JSON: `{"error": {"code", "message"}}`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from effectledger_core.errors import (
    EffectLedgerError,
    InvalidRequest,
    PayloadTooLarge,
    PoisonMessage,
)
from effectledger_core.limits import MAX_HTTP_BODY_BYTES, MAX_IDENTIFIER_BYTES
from effectledger_core.messages import SubmitIntent, parse
from effectledger_core.recovery import Conclusion, Review

from .service import LedgerService

Bounded = Annotated[str, StringConstraints(min_length=1, max_length=MAX_IDENTIFIER_BYTES)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApproveBody(_Body):
    epoch: int
    arguments_digest: Bounded
    operator: Bounded


class RejectBody(_Body):
    epoch: int
    operator: Bounded
    reason: Annotated[str, StringConstraints(max_length=MAX_IDENTIFIER_BYTES)] = ""


class CancelBody(_Body):
    operator: Bounded
    reason: Annotated[str, StringConstraints(max_length=MAX_IDENTIFIER_BYTES)] = ""


class ReviewBody(_Body):
    conclusion: Conclusion
    evidence_ref: Bounded
    operator: Bounded


class RetryBody(_Body):
    operator: Bounded
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
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(service: LedgerService, *, ready: Callable[[], Awaitable[dict[str, bool]]]
               ) -> FastAPI:
    app = FastAPI(title="effectledger ledger", version="1")

    @app.exception_handler(EffectLedgerError)
    async def _own(_: Request, exc: EffectLedgerError) -> JSONResponse:
        return _error(exc.http_status, exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", "request validation failed",
                      [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]])

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", str(exc.detail))

    @app.post("/v1/intents")
    async def submit_intent(request: Request) -> JSONResponse:
        raw = await read_bounded(request)
        try:
            intent = parse(SubmitIntent, raw)
        except PoisonMessage as exc:
            raise InvalidRequest(exc.message) from exc
        submitted = await service.submit(intent, actor="agent:http")
        view = await service.operation(submitted.operation["id"])
        return JSONResponse(view, status_code=201 if submitted.created else 200)

    @app.get("/v1/operations/{operation_id}")
    async def get_operation(operation_id: str) -> dict[str, Any]:
        return await service.operation(operation_id)

    @app.get("/v1/operations/{operation_id}/journal")
    async def get_journal(operation_id: str) -> dict[str, Any]:
        return {"operation_id": operation_id, "entries": await service.journal(operation_id)}

    @app.get("/v1/operations/{operation_id}/receipt")
    async def get_receipt(operation_id: str) -> dict[str, Any]:
        return await service.receipt(operation_id)

    @app.get("/v1/operations")
    async def list_operations(state: str | None = None,
                              limit: int = Query(100, ge=1, le=1000),
                              cursor: str | None = None) -> dict[str, Any]:
        return await service.list_operations(state=state, limit=limit, cursor=cursor)

    @app.post("/v1/operations/{operation_id}/approve")
    async def approve(operation_id: str, body: ApproveBody) -> dict[str, Any]:
        await service.approve(operation_id, epoch=body.epoch,
                              arguments_digest=body.arguments_digest, operator=body.operator)
        return await service.operation(operation_id)

    @app.post("/v1/operations/{operation_id}/reject")
    async def reject(operation_id: str, body: RejectBody) -> dict[str, Any]:
        await service.reject(operation_id, epoch=body.epoch, operator=body.operator,
                             reason=body.reason)
        return await service.operation(operation_id)

    @app.post("/v1/operations/{operation_id}/cancel")
    async def cancel(operation_id: str, body: CancelBody) -> dict[str, Any]:
        await service.cancel(operation_id, operator=body.operator, reason=body.reason)
        return await service.operation(operation_id)

    @app.get("/v1/operations/{operation_id}/recovery")
    async def recovery(operation_id: str) -> dict[str, Any]:
        a = await service.inspect(operation_id)
        return {"fact": a.fact.value, "decision": a.decision.value, "reason": a.reason}

    @app.post("/v1/operations/{operation_id}/retry")
    async def retry(operation_id: str, body: RetryBody) -> JSONResponse:
        review = None
        if body.review is not None:
            op = await service.operation(operation_id)
            review = Review(operator=body.review.operator, evidence_ref=body.review.evidence_ref,
                            conclusion=body.review.conclusion,
                            epoch=body.epoch if body.epoch is not None else op["epoch"])
        plan_id, admission = await service.retry(operation_id, operator=body.operator,
                                                 review=review, for_epoch=body.epoch)
        return _admission(plan_id, admission)

    @app.post("/v1/retry-plans/{plan_id}/use")
    async def use_plan(plan_id: str) -> JSONResponse:
        return _admission(plan_id, await service.use_plan(plan_id))

    @app.get("/v1/tools")
    async def list_tools() -> dict[str, Any]:
        tools = service.catalog.tools
        return {"catalog_digest": service.catalog.digest(),
                "tools": [tools[n].public_view() for n in sorted(tools)]}

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return await service.stats()

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        checks = await ready()
        ok = all(checks.values())
        return JSONResponse({"ok": ok, "checks": checks}, status_code=200 if ok else 503)

    return app


def _admission(plan_id: str, admission: Any) -> JSONResponse:
    if not admission.admitted:
        return _error(409, "retry_refused", f"the retry plan was refused at admission: "
                      f"{admission.reason}", {"reason": admission.reason, "plan_id": plan_id})
    return JSONResponse({"plan_id": plan_id, "admitted": True,
                         "operation": {k: _json(v) for k, v in admission.operation.items()}})


def _json(v: Any) -> Any:
    return v.isoformat() if hasattr(v, "isoformat") else v
