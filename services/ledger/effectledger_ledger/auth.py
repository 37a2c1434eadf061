"""Bearer-token authentication: agents submit and read their own operations; operators act.

Tokens come from configuration (`EFFECTLEDGER_AGENT_TOKENS='{"<token>": "<tenant>"}'` and
`EFFECTLEDGER_OPERATOR_TOKENS='{"<token>": "<operator name>"}'`). With neither set the API runs
open and says so loudly, in its logs and on /readyz (`warnings`). `effectledger up` always
sets both unless told `--unsafe-open-api`.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Literal

from fastapi import Request

from effectledger_core.errors import EffectLedgerError

log = logging.getLogger(__name__)
OPEN_API_WARNING = ("UNSAFE: the API is open (no EFFECTLEDGER_AGENT_TOKENS or "
                    "EFFECTLEDGER_OPERATOR_TOKENS): anyone who reaches this port may submit "
                    "for any tenant and approve, cancel or retry as anyone")


class Unauthenticated(EffectLedgerError):
    code = "unauthenticated"
    http_status = 401


class Forbidden(EffectLedgerError):
    code = "forbidden"
    http_status = 403


@dataclass(frozen=True)
class Principal:
    role: Literal["agent", "operator", "open"]
    name: str
    tenant: str | None = None  # agents are confined to their tenant

    @property
    def is_operator(self) -> bool:
        return self.role in ("operator", "open")


class Authenticator:
    def __init__(self, agent_tokens: dict[str, str], operator_tokens: dict[str, str]) -> None:
        self._agents = [(t.encode(), tenant) for t, tenant in agent_tokens.items() if t]
        self._operators = [(t.encode(), name) for t, name in operator_tokens.items() if t]
        self.enabled = bool(self._agents or self._operators)
        if not self.enabled:
            log.critical(OPEN_API_WARNING)

    def authenticate(self, request: Request) -> Principal:
        if not self.enabled:
            return Principal("open", "anonymous")
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("a bearer token is required")
        return self.principal_for(token)

    def principal_for(self, token: str) -> Principal:
        """The principal a token stands for (also the console's sign-in), or Unauthenticated."""
        given = token.strip().encode()
        if not given:
            raise Unauthenticated("a token is required")
        found: Principal | None = None
        # Compare against every token in constant time; never stop at the first match.
        for candidate, name in self._operators:
            if hmac.compare_digest(candidate, given):
                found = Principal("operator", name)
        for candidate, tenant in self._agents:
            if hmac.compare_digest(candidate, given):
                found = found or Principal("agent", f"agent:{tenant}", tenant)
        if found is None:
            raise Unauthenticated("unknown token")
        return found


def require_operator(p: Principal) -> None:
    if not p.is_operator:
        raise Forbidden("this action needs operator credentials")


def operator_name(p: Principal, claimed: str | None) -> str:
    """Who acts: the token's operator; a body naming someone else is refused."""
    require_operator(p)
    if p.role == "operator":
        if claimed is not None and claimed != p.name:
            raise Forbidden(f"token belongs to operator {p.name!r}, not {claimed!r}")
        return p.name
    if not claimed:
        raise Forbidden("name the operator (field 'operator') when authentication is off")
    return claimed


def check_tenant(p: Principal, tenant: str, operation_id: str | None = None) -> None:
    if p.role == "agent" and p.tenant != tenant:
        # Not found rather than forbidden, worded as for a missing operation (db/reads.py):
        # agents learn nothing about other tenants.
        from effectledger_core.errors import NotFound

        raise NotFound(f"operation {operation_id!r} not found" if operation_id is not None
                       else "operation not found")
