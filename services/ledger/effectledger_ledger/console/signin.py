"""Signing in and out of the console: a token (or, in open mode, a name) exchanged once for
a session cookie; the sign-in form carries its own CSRF token in a short-lived cookie. Failed
sign-ins back off exponentially per address and per token (`throttle.py`)."""

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from effectledger_core.limits import MAX_IDENTIFIER_BYTES
from effectledger_core.quotas import retry_after_header

from ..auth import Principal, Unauthenticated
from . import views
from .forms import text
from .sessions import LOGIN_COOKIE, PREFIX, SESSION_COOKIE, new_secret
from .state import Console, ConsoleDep, CsrfForm, SessionDep
from .throttle import Blocked

router = APIRouter()


def safe_next(value: str | None) -> str:
    """Only a path inside the console: never an open redirect to another site."""
    if value and value.startswith(PREFIX + "/") and not value.startswith("//") \
            and "\\" not in value and "://" not in value:
        return value
    return PREFIX + "/"


def set_cookie(response: Response, request: Request, name: str, value: str, *,
               max_age: int | None) -> None:
    # Secure whenever the console is reached over TLS (directly or through a proxy uvicorn
    # trusts); HttpOnly: no script reads it; Strict: no other site's page sends it.
    response.set_cookie(name, value, max_age=max_age, path=PREFIX, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")


def sign_in_page(request: Request, console: Console, *, next: str | None,
                 error: str | None, status_code: int | None = None) -> HTMLResponse:
    token = new_secret()
    response = console.render(request, "login.html", None,
                              status_code=status_code or (401 if error else 200),
                              login_csrf=token, next=safe_next(next), error=error)
    set_cookie(response, request, LOGIN_COOKIE, token, max_age=3600)
    return response


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request, console: ConsoleDep, next: str | None = None,
                     error: str | None = None) -> HTMLResponse:
    return sign_in_page(request, console, next=next, error=error)


def principal_from(console: Console, name: str | None, token: str | None) -> Principal:
    """Who signs in: the token's principal, or in open mode the name given."""
    if not console.open_mode:
        return console.auth.principal_for(token or "")
    given = views.text_field(name)
    if given is None:
        raise Unauthenticated("name yourself: open mode journals actions by the name you give")
    if len(given.encode()) > MAX_IDENTIFIER_BYTES:
        raise Unauthenticated(f"a name is at most {MAX_IDENTIFIER_BYTES} bytes")
    return Principal("open", given)


def throttle_keys(request: Request, console: Console, secret: str) -> dict[str, str]:
    """What a sign-in is counted against: the client's address (as uvicorn reports it, so
    behind a proxy only with its forwarded-address settings) and the token or name given."""
    address = request.client.host if request.client is not None else "unknown"
    kind = "name" if console.open_mode else "token"
    return {"address": f"address:{address}", kind: console.throttle.fingerprint(kind, secret)}


_BLOCKED = {"address": "from this address", "token": "with this token",
            "name": "with this name"}


def throttled_page(request: Request, console: Console, nxt: str,
                   blocked: Blocked) -> HTMLResponse:
    wait = retry_after_header(blocked.retry_after_s)
    response = sign_in_page(
        request, console, next=nxt, status_code=429,
        error=f"Too many failed sign-ins {_BLOCKED.get(blocked.key, '')}. Wait {wait} s, "
              f"then try again; until then no token is checked.")
    response.headers["Retry-After"] = wait
    return response


@router.post("/login")
async def login(request: Request, console: ConsoleDep) -> Response:
    form = await console.form(request, None)  # the sign-in form's own CSRF token
    nxt = safe_next(text(form, "next"))
    name, token = text(form, "name"), text(form, "token")
    keys = throttle_keys(request, console, (name if console.open_mode else token) or "")
    # Refused before the token is compared: guessing through a block learns nothing.
    blocked = console.throttle.blocked(keys)
    if blocked is not None:
        return throttled_page(request, console, nxt, blocked)
    try:
        principal = principal_from(console, name, token)
    except Unauthenticated as exc:
        console.throttle.failed(keys)
        return sign_in_page(request, console, next=nxt, error=exc.message)
    # The token's own count ends; the address's does not (an agent token signing in between
    # guesses must not reset them).
    console.throttle.succeeded(keys["name" if console.open_mode else "token"])
    console.sessions.drop(request.cookies.get(SESSION_COOKIE))  # never two at once
    session = console.sessions.create(principal)
    response = RedirectResponse(nxt, 303)
    set_cookie(response, request, SESSION_COOKIE, session.id, max_age=None)
    response.delete_cookie(LOGIN_COOKIE, path=PREFIX)
    return response


@router.post("/logout")
async def logout(console: ConsoleDep, session: SessionDep, form: CsrfForm) -> Response:
    console.sessions.drop(session.id)
    response = RedirectResponse(f"{PREFIX}/login", 303)
    response.delete_cookie(SESSION_COOKIE, path=PREFIX)
    return response
