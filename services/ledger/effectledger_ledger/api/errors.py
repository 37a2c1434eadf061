"""Every error the API answers is `{"error": {"code", "message", "details"?}}`: the ledger's
own errors with their status, FastAPI's validation errors as `invalid_request`, Starlette's
(404 route, 405 method) as `http_error`."""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from effectledger_core.errors import EffectLedgerError
from effectledger_core.quotas import retry_after_header


def error_response(status: int, code: str, message: str, details: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status)


async def own_error(_: Request, exc: EffectLedgerError) -> JSONResponse:
    response = error_response(exc.http_status, exc.code, exc.message, exc.details)
    if exc.http_status == 401:
        # RFC 9110: a 401 names the scheme the client must use.
        response.headers["WWW-Authenticate"] = 'Bearer realm="effectledger"'
    wait = exc.details.get("retry_after_s")
    if exc.http_status == 429 and isinstance(wait, int | float):
        response.headers["Retry-After"] = retry_after_header(wait)
    return response


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(422, "invalid_request", "request validation failed",
                          [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]])


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, "http_error", str(exc.detail))


def install(app: FastAPI) -> None:
    app.exception_handler(EffectLedgerError)(own_error)
    app.exception_handler(RequestValidationError)(validation_error)
    app.exception_handler(StarletteHTTPException)(http_error)
