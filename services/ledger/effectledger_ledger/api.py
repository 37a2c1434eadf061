"""The ledger's HTTP API (FastAPI). Errors are JSON: `{"error": {"code", "message"}}`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from effectledger_core.errors import (
    EffectLedgerError,
    InvalidRequest,
    PayloadTooLarge,
    PoisonMessage,
)
from effectledger_core.limits import MAX_HTTP_BODY_BYTES
from effectledger_core.messages import SubmitIntent, parse
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .service import LedgerService


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
