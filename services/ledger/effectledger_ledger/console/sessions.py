"""Console sessions: an operator's or agent's token, exchanged once at sign-in for an opaque
session id in an `HttpOnly`, `SameSite=Strict` cookie, with a CSRF token for its forms.

Sessions live in the ledger process's memory, never in the cookie: the token itself never
travels again after sign-in, a signed-out session is gone at once, and a restarted ledger asks
everyone to sign in again (nothing to revoke, nothing to leak from a database).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..auth import Principal

PREFIX = "/console"  # where the ledger mounts the console; its cookies are scoped to it
SESSION_COOKIE = "effectledger_console"
LOGIN_COOKIE = "effectledger_console_login"  # CSRF token of the sign-in form itself
SESSION_TTL_S = 8 * 3600.0
# Only token holders can create sessions; the bound keeps a sign-in loop from growing memory.
MAX_SESSIONS = 10_000


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def same_secret(expected: str, given: str | None) -> bool:
    """Constant-time comparison; an absent value never matches."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


@dataclass
class Session:
    id: str
    principal: Principal
    csrf: str
    expires_at: float
    flash: list[str] = field(default_factory=list)

    def take_flash(self) -> list[str]:
        messages, self.flash = self.flash, []
        return messages


class SessionStore:
    def __init__(self, *, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._ttl_s = ttl_s
        self._max = max_sessions
        self._clock = clock

    def create(self, principal: Principal) -> Session:
        while len(self._sessions) >= self._max:
            self._sessions.popitem(last=False)  # the oldest sign-in goes first
        session = Session(id=new_secret(), principal=principal, csrf=new_secret(),
                          expires_at=self._clock() + self._ttl_s)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            return None
        if session.expires_at <= self._clock():
            del self._sessions[session_id]
            return None
        return session

    def drop(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._sessions)
