"""The operator console: server-rendered pages mounted by the ledger at `/console`.

A sub-application, so its errors render as pages (the API's stay JSON) and its sessions never
authenticate API calls. Every action goes through the ledger service's own use cases, which
re-check state, epoch and digest inside their transaction; the checks here only turn a stale
page into a clear message before that.

`create_console` only assembles: the shared state and dependencies are in `state.py`, the
routes in one router per page group (`pages.py` lists them).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from effectledger_core.errors import EffectLedgerError
from effectledger_obs.http import without_fastapi_telemetry

from ..auth import Authenticator
from ..service import LedgerService
from .pages import ROUTERS
from .sessions import PREFIX, SESSION_COOKIE
from .state import HERE, Console, SignInRequired, console_of

STATIC = HERE / "static"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")

_TITLES = {400: "Bad request", 401: "Sign-in failed", 403: "Not allowed", 404: "Not found",
           405: "Not allowed here", 409: "Refused: the operation changed", 413: "Too large",
           422: "Invalid input"}


async def security_headers(request: Request, call_next: Any) -> Response:
    response: Response = await call_next(request)
    # The browser itself refuses anything not served by this ledger (no CDN, no inline
    # script), any framing, and forms posting elsewhere.
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    if not request.url.path.startswith(f"{PREFIX}/static/"):
        response.headers.setdefault("Cache-Control", "no-store")  # arguments, receipts
    return response


async def sign_in_required(request: Request, _: SignInRequired) -> Response:
    if request.headers.get("x-console-fetch"):
        return JSONResponse({"error": "sign in again"}, status_code=401)
    # A form posted after the session ended cannot be replayed; sign-in leads back to
    # where it came from only for a page (GET).
    target = PREFIX + "/"
    if request.method == "GET":
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"{PREFIX}/login?{urlencode({'next': target})}", 303)


def _error_page(request: Request, status: int, title: str, message: str) -> HTMLResponse:
    console = console_of(request)
    session = console.sessions.get(request.cookies.get(SESSION_COOKIE))
    return console.render(request, "error.html", session, status_code=status,
                          title=title, message=message)


async def http_error(request: Request, exc: StarletteHTTPException) -> HTMLResponse:
    return _error_page(request, exc.status_code, _TITLES.get(exc.status_code, "Error"),
                       str(exc.detail))


async def own_error(request: Request, exc: EffectLedgerError) -> HTMLResponse:
    return _error_page(request, exc.http_status, _TITLES.get(exc.http_status, "Refused"),
                       exc.message)


def create_console(service: LedgerService, authenticator: Authenticator) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None,
                  **without_fastapi_telemetry())
    app.state.console = Console(service, authenticator)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.middleware("http")(security_headers)
    app.exception_handler(SignInRequired)(sign_in_required)
    app.exception_handler(StarletteHTTPException)(http_error)
    app.exception_handler(EffectLedgerError)(own_error)
    for router in ROUTERS:
        app.include_router(router)
    return app
