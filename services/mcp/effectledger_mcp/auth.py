"""Over HTTP, each caller's own ledger agent token decides whose agent the server is.

The MCP endpoint takes `Authorization: Bearer <token>` where the token is one of the ledger's
agent tokens (EFFECTLEDGER_AGENT_TOKENS). The SDK's bearer middleware asks `LedgerTokens`
whether the ledger accepts it (one cheap read, remembered for a short while), answers 401 with
`WWW-Authenticate` and the protected-resource metadata otherwise, and binds each MCP session to
the token that opened it. Every call then goes to the ledger with that same token: the ledger's
own tenancy keeps tenants apart, the MCP server adds no authority of its own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any

import httpx
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext

from effectledger_client import AsyncClient

log = logging.getLogger(__name__)


def fingerprint(token: str) -> str:
    """Names a token in sessions and logs without revealing it."""
    return "agent-" + hashlib.sha256(token.encode()).hexdigest()[:16]


class LedgerTokens:
    """The SDK's TokenVerifier, asking the ledger. An accepted token is remembered for
    `ttl_s`; a refused one is not (the next request asks again).

    Only agent tokens: an operator token would let its holder read every tenant's operations
    through `operation_status`, so a token the ledger lets read the review queue (operators
    only) is refused. An open ledger (no tokens at all) has no agents to tell apart; the server
    then listens on loopback only (cli.py)."""

    def __init__(self, ledger_url: str, *, open_ledger: bool = False, ttl_s: float = 30.0,
                 timeout_s: float = 5.0) -> None:
        self.ledger_url = ledger_url
        self.open_ledger = open_ledger
        self.ttl_s = ttl_s
        self._http = httpx.AsyncClient(base_url=ledger_url, timeout=timeout_s)
        self._accepted: dict[str, float] = {}

    async def verify_token(self, token: str) -> AccessToken | None:
        now = time.monotonic()
        if self._accepted.get(token, 0.0) > now:
            return _access(token)
        try:
            resp = await self._http.get("/v1/tools", headers={
                "Authorization": f"Bearer {token}"})
        except httpx.TransportError as exc:
            log.warning("cannot check a token: the ledger at %s is unreachable: %s",
                        self.ledger_url, exc)
            return None
        if resp.status_code != 200:
            return None
        if not self.open_ledger:
            try:
                operator = await self._http.get("/v1/reviews", params={"limit": 1}, headers={
                    "Authorization": f"Bearer {token}"})
            except httpx.TransportError:
                return None
            if operator.status_code != 403:
                log.warning("refused a token that is not an agent token (%s)",
                            fingerprint(token))
                return None
        if len(self._accepted) > 10_000:
            self._accepted.clear()
        self._accepted[token] = now + self.ttl_s
        return _access(token)

    async def aclose(self) -> None:
        await self._http.aclose()


def _access(token: str) -> AccessToken:
    return AccessToken(token=token, client_id=fingerprint(token), scopes=[])


class ClientPool:
    """One ledger client per agent token (at most `size`, least recently used closed)."""

    def __init__(self, ledger_url: str, *, size: int = 256, timeout_s: float = 10.0) -> None:
        self.ledger_url, self.size, self.timeout_s = ledger_url, size, timeout_s
        self._clients: OrderedDict[str, AsyncClient] = OrderedDict()

    def for_token(self, token: str) -> AsyncClient:
        client = self._clients.get(token)
        if client is None:
            client = AsyncClient(self.ledger_url, token=token, timeout_s=self.timeout_s)
            self._clients[token] = client
            while len(self._clients) > self.size:
                # Not closed here: a call may still be using it; it goes with the garbage.
                self._clients.popitem(last=False)
        self._clients.move_to_end(token)
        return client

    def __call__(self, ctx: ServerRequestContext[Any]) -> AsyncClient:
        """The caller's client: the token the SDK's bearer middleware accepted."""
        request = ctx.request
        user = request.scope.get("user") if request is not None else None
        if not isinstance(user, AuthenticatedUser):
            # The endpoint is behind the bearer middleware: no request gets here without one.
            raise PermissionError("no authenticated caller")
        return self.for_token(user.access_token.token)
