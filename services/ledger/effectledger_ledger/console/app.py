"""The operator console: server-rendered pages mounted by the ledger at `/console`.

A sub-application, so its errors render as pages (the API's stay JSON) and its sessions never
authenticate API calls. Every action goes through the ledger service's own use cases, which
re-check state, epoch and digest inside their transaction; the checks here only turn a stale
page into a clear message before that.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException

from effectledger_core.errors import EffectLedgerError, InvalidRequest
from effectledger_core.ids import utcnow
from effectledger_core.limits import MAX_IDENTIFIER_BYTES

from ..auth import Authenticator, Forbidden, Principal, Unauthenticated
from ..db import console_reads as cr
from ..service import LedgerService
from . import views
from .pages import register_pages
from .sessions import (
    LOGIN_COOKIE,
    PREFIX,
    SESSION_COOKIE,
    Session,
    SessionStore,
    new_secret,
    same_secret,
)

HERE = Path(__file__).parent
STATIC = HERE / "static"
OVERVIEW_TTL_S = 2.0
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
# Form bodies are small: a reason, an evidence reference, a few hidden fields.
MAX_FORM_BYTES = 16 * 1024


class SignInRequired(Exception):
    """No valid session: pages redirect to sign-in, background fetches get 401."""


class CsrfRefused(EffectLedgerError):
    code = "csrf_refused"
    http_status = 403


class Console:
    """Sessions, templates and the checks every page shares."""

    def __init__(self, service: LedgerService, authenticator: Authenticator) -> None:
        self.service = service
        self.auth = authenticator
        self.sessions = SessionStore()
        self._overviews: dict[str | None, tuple[float, datetime, cr.Overview]] = {}
        self.templates = Jinja2Templates(directory=HERE / "templates")
        env = self.templates.env
        env.filters.update(age=views.age, pretty=views.pretty, when=views.when,
                           summary=views.summary)
        env.globals.update(prefix=PREFIX, duration_ms=views.duration_ms)

    async def overview(self, tenant: str | None) -> tuple[datetime, cr.Overview]:
        """The overview's figures and when they were counted, computed at most once per
        OVERVIEW_TTL_S per tenant however many consoles are open: they count whole tables
        (150 ms at 200,000 operations on PostgreSQL), and every open overview asks every few
        seconds."""
        now = time.monotonic()
        cached = self._overviews.get(tenant)
        if cached is not None and now - cached[0] < OVERVIEW_TTL_S:
            return cached[1], cached[2]
        at = utcnow()
        async with self.service.store.transaction() as conn:
            ov = await cr.overview(conn, tenant=tenant, now=at)
        if len(self._overviews) > 1000:  # one entry per tenant that looked; keep it bounded
            self._overviews.clear()
        self._overviews[tenant] = (now, at, ov)
        return at, ov

    @property
    def open_mode(self) -> bool:
        return not self.auth.enabled

    def session(self, request: Request) -> Session:
        session = self.sessions.get(request.cookies.get(SESSION_COOKIE))
        if session is None:
            raise SignInRequired()
        return session

    async def form(self, request: Request, session: Session | None) -> FormData:
        """The posted form, refused unless it carries this session's CSRF token."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_FORM_BYTES:
            raise InvalidRequest(f"form exceeds {MAX_FORM_BYTES} bytes")
        form = await request.form(max_files=0, max_fields=32, max_part_size=MAX_FORM_BYTES)
        token = form.get("csrf")
        expected = session.csrf if session is not None else request.cookies.get(LOGIN_COOKIE)
        if expected is None or not same_secret(expected, token if isinstance(token, str)
                                                else None):
            raise CsrfRefused("the form was refused: its security token is missing or out of "
                              "date. Reload the page and submit it again.")
        return form

    def render(self, request: Request, template: str, session: Session | None,
               status_code: int = 200, **context: Any) -> HTMLResponse:
        principal = session.principal if session is not None else None
        base = {"open_mode": self.open_mode, "principal": principal,
                "is_operator": principal is not None and principal.is_operator,
                "csrf": session.csrf if session is not None else None,
                "flash": session.take_flash() if session is not None else [],
                "now": utcnow()}
        return self.templates.TemplateResponse(request, template, {**base, **context},
                                               status_code=status_code)

    @staticmethod
    def require_operator(session: Session) -> Principal:
        if not session.principal.is_operator:
            raise Forbidden("this page needs an operator: agent tokens see their own tenant's "
                            "operations, read-only")
        return session.principal

    @staticmethod
    def actor(p: Principal) -> str:
        from ..auth import operator_name

        return operator_name(p, p.name)

    @staticmethod
    def tenant_of(p: Principal) -> str | None:
        return p.tenant if p.role == "agent" else None


def _safe_next(value: str | None) -> str:
    """Only a path inside the console: never an open redirect to another site."""
    if value and value.startswith(PREFIX + "/") and not value.startswith("//") \
            and "\\" not in value and "://" not in value:
        return value
    return PREFIX + "/"


def create_console(service: LedgerService, authenticator: Authenticator) -> FastAPI:
    console = Console(service, authenticator)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.middleware("http")
    async def _headers(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        # The browser itself refuses anything not served by this ledger (no CDN, no inline
        # script), any framing, and forms posting elsewhere.
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        if not request.url.path.startswith(f"{PREFIX}/static/"):
            response.headers.setdefault("Cache-Control", "no-store")  # arguments, receipts
        return response

    @app.exception_handler(SignInRequired)
    async def _sign_in(request: Request, _: SignInRequired) -> Response:
        if request.headers.get("x-console-fetch"):
            return JSONResponse({"error": "sign in again"}, status_code=401)
        # A form posted after the session ended cannot be replayed; sign-in leads back to
        # where it came from only for a page (GET).
        target = PREFIX + "/"
        if request.method == "GET":
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"{PREFIX}/login?{urlencode({'next': target})}", 303)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> HTMLResponse:
        session = console.sessions.get(request.cookies.get(SESSION_COOKIE))
        return console.render(request, "error.html", session, status_code=exc.status_code,
                              title=_TITLES.get(exc.status_code, "Error"),
                              message=str(exc.detail))

    @app.exception_handler(EffectLedgerError)
    async def _error(request: Request, exc: EffectLedgerError) -> HTMLResponse:
        session = console.sessions.get(request.cookies.get(SESSION_COOKIE))
        return console.render(request, "error.html", session, status_code=exc.http_status,
                              title=_TITLES.get(exc.http_status, "Refused"),
                              message=exc.message)

    @app.get("/login", response_class=HTMLResponse)
    async def login_page(request: Request, next: str | None = None,
                         error: str | None = None) -> HTMLResponse:
        token = new_secret()
        response = console.render(request, "login.html", None,
                                  status_code=401 if error else 200,
                                  login_csrf=token, next=_safe_next(next), error=error)
        _set_cookie(response, request, LOGIN_COOKIE, token, max_age=3600)
        return response

    @app.post("/login")
    async def login(request: Request) -> Response:
        form = await console.form(request, None)
        nxt = _safe_next(_str(form, "next"))
        try:
            if console.open_mode:
                name = views.text_field(_str(form, "name"))
                if name is None:
                    raise Unauthenticated("name yourself: open mode journals actions by the "
                                          "name you give")
                if len(name.encode()) > MAX_IDENTIFIER_BYTES:
                    raise Unauthenticated(f"a name is at most {MAX_IDENTIFIER_BYTES} bytes")
                principal = Principal("open", name)
            else:
                principal = authenticator.principal_for(_str(form, "token") or "")
        except Unauthenticated as exc:
            return await login_page(request, next=nxt, error=exc.message)
        console.sessions.drop(request.cookies.get(SESSION_COOKIE))  # never two at once
        session = console.sessions.create(principal)
        response = RedirectResponse(nxt, 303)
        _set_cookie(response, request, SESSION_COOKIE, session.id, max_age=None)
        response.delete_cookie(LOGIN_COOKIE, path=PREFIX)
        return response

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        session = console.session(request)
        await console.form(request, session)
        console.sessions.drop(session.id)
        response = RedirectResponse(f"{PREFIX}/login", 303)
        response.delete_cookie(SESSION_COOKIE, path=PREFIX)
        return response

    register_pages(app, console)
    return app


_TITLES = {400: "Bad request", 401: "Sign-in failed", 403: "Not allowed", 404: "Not found",
           405: "Not allowed here", 409: "Refused: the operation changed", 413: "Too large",
           422: "Invalid input"}


def _str(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def _set_cookie(response: Response, request: Request, name: str, value: str, *,
                max_age: int | None) -> None:
    # Secure whenever the console is reached over TLS (directly or through a proxy uvicorn
    # trusts); HttpOnly: no script reads it; Strict: no other site's page sends it.
    response.set_cookie(name, value, max_age=max_age, path=PREFIX, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
