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

from effectledger_core.errors import EffectLedgerError

from ..auth import Principal

PREFIX = "/console"  # where the ledger mounts the console; its cookies are scoped to it
SESSION_COOKIE = "effectledger_console"
LOGIN_COOKIE = "effectledger_console_login"  # CSRF token of the sign-in form itself
SESSION_TTL_S = 8 * 3600.0
# Only token holders can create sessions; the bounds keep a sign-in loop from growing memory.
# Each principal keeps its own newest sessions (a loop signing in as one agent replaces only
# that agent's own); when the whole store is full, an agent's sign-in may end only another
# agent's session, never an operator's.
MAX_SESSIONS = 10_000
MAX_SESSIONS_PER_PRINCIPAL = 20


class SessionsFull(EffectLedgerError):
    code = "too_many_sessions"
    http_status = 503


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


def _rank(p: Principal) -> int:
    """Who may end whose session when the store is full: agents only agents'."""
    return 1 if p.is_operator else 0


class SessionStore:
    def __init__(self, *, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS,
                 max_per_principal: int = MAX_SESSIONS_PER_PRINCIPAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # oldest sign-in first
        self._by_principal: dict[Principal, OrderedDict[str, None]] = {}
        self._ttl_s = ttl_s
        self._max = max_sessions
        self._per_principal = max_per_principal
        self._clock = clock

    def create(self, principal: Principal) -> Session:
        mine = self._by_principal.get(principal)
        while mine and len(mine) >= self._per_principal:
            self._remove(next(iter(mine)))  # this principal's own oldest sign-in
        if len(self._sessions) >= self._max:
            self._purge_expired()
        while len(self._sessions) >= self._max:
            victim = self._victim(principal)
            if victim is None:
                raise SessionsFull("the console has as many sessions as it keeps, all of "
                                   "operators: an agent cannot sign in until some end")
            self._remove(victim)
        session = Session(id=new_secret(), principal=principal, csrf=new_secret(),
                          expires_at=self._clock() + self._ttl_s)
        self._sessions[session.id] = session
        self._by_principal.setdefault(principal, OrderedDict())[session.id] = None
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            return None
        if session.expires_at <= self._clock():
            self._remove(session_id)
            return None
        return session

    def drop(self, session_id: str | None) -> None:
        if session_id:
            self._remove(session_id)

    def of(self, principal: Principal) -> int:
        """How many sessions this principal holds."""
        return len(self._by_principal.get(principal, ()))

    def __len__(self) -> int:
        return len(self._sessions)

    def _victim(self, newcomer: Principal) -> str | None:
        """The oldest session of the lowest rank the newcomer may end, if any."""
        for rank in range(_rank(newcomer) + 1):
            for sid, session in self._sessions.items():
                if _rank(session.principal) == rank:
                    return sid
        return None

    def _purge_expired(self) -> None:
        now = self._clock()
        for sid in [sid for sid, s in self._sessions.items() if s.expires_at <= now]:
            self._remove(sid)

    def _remove(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        mine = self._by_principal.get(session.principal)
        if mine is not None:
            mine.pop(session_id, None)
            if not mine:
                del self._by_principal[session.principal]
