"""The console's shared state (sessions, templates, the overview's cached figures) and the
FastAPI dependencies every page takes: the console itself, the signed-in session, and a posted
form that carries that session's CSRF token.

`create_console` puts one `Console` on the sub-application's `app.state`; a test replaces any
dependency with `app.dependency_overrides`.
"""

# FastAPI reads these annotations at run time (see api/deps.py): the aliases are module-level.
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from starlette.datastructures import FormData

from effectledger_core.errors import EffectLedgerError, InvalidRequest
from effectledger_core.ids import utcnow
from effectledger_core.limits import declared_length

from ..auth import Authenticator, Forbidden, Principal, operator_name
from ..db import console_reads as cr
from ..service import LedgerService
from . import views
from .sessions import LOGIN_COOKIE, PREFIX, SESSION_COOKIE, Session, SessionStore, same_secret
from .throttle import SignInThrottle

HERE = Path(__file__).parent
OVERVIEW_TTL_S = 2.0
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
        self.throttle = SignInThrottle()
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
        length = declared_length(declared)
        if length is not None and length > MAX_FORM_BYTES:
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
        return operator_name(p, p.name)

    @staticmethod
    def tenant_of(p: Principal) -> str | None:
        return p.tenant if p.role == "agent" else None


# ---- dependencies ---------------------------------------------------------------------------
# `async def`, as the API's (api/deps.py): a plain `def` would run in FastAPI's thread pool.

def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


async def console_state(request: Request) -> Console:
    return console_of(request)


ConsoleDep = Annotated[Console, Depends(console_state)]


async def current_session(request: Request, console: ConsoleDep) -> Session:
    """The signed-in session, or SignInRequired (a redirect to sign-in; 401 for fetches)."""
    return console.session(request)


SessionDep = Annotated[Session, Depends(current_session)]


async def session_form(request: Request, console: ConsoleDep, session: SessionDep) -> FormData:
    """The posted form, after the session is checked, refused without its CSRF token."""
    return await console.form(request, session)


CsrfForm = Annotated[FormData, Depends(session_form)]
