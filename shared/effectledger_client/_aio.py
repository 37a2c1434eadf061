"""The async client's default HTTP: one aiohttp session, opened on first use.

Why not httpx, as the sync client: an agent's call is one request that waits for its outcome,
and on that path the client's own work is latency. httpx (with httpcore and anyio under it)
spent 0.69 ms of CPU per request where aiohttp spent 0.19 ms, measured side by side against
one loopback server; an agent's submit-and-wait took about 2 ms less at p50, and `effectledger
mcp`, which calls the ledger once per tool call, 0.7 ms less CPU per call (docs/benchmark.md,
issue 30 round seven). An async client given its own `httpx.AsyncClient` (a custom transport,
a proxy, an app served in process) still uses it.

What httpx's defaults gave, this keeps: redirects are not followed; the proxy and the CA
bundle come from the environment, read once per session (`effectledger_bus.httpenv`, as the
provider session reads them); a waiting request's read timeout grows with its wait. The base
URL may carry a path (a ledger behind a prefix): each request's path is appended to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from effectledger_bus.httpenv import env_proxies, ssl_context

from ._calls import Answer, Call

# An idle connection is given up after this long (aiohttp's default, stated): shorter than the
# ledger's own keep-alive (`Settings.http_keepalive_s`), so this side closes first and never
# writes a request on a connection the ledger is closing.
KEEPALIVE_S = 15.0

if TYPE_CHECKING:
    import aiohttp


class AioHttp:
    """Sends a `Call` with aiohttp. The session is made on the first request, inside the
    running event loop (aiohttp binds a session to the loop it was made in), so a client can
    be built anywhere; a client used from another event loop later (a sync wrapper running
    each call in `asyncio.run`) gets a session of that loop."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = headers
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proxy: str | None = None

    def _open(self) -> aiohttp.ClientSession:
        # Imported when first used: the CLI and the services that never send pay nothing.
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._forget()
            self._loop = loop
            parts = urlsplit(self.base_url)
            self._proxy = env_proxies()(parts.scheme, parts.hostname or "")
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(ssl=ssl_context(), keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s,
                                              sock_read=self.timeout_s))
        return self._session

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """What aiohttp raises when the ledger cannot be reached or does not answer in time."""
        import aiohttp

        return (aiohttp.ClientError, TimeoutError)

    async def send(self, call: Call[Any], wait_s: float) -> Answer:
        import aiohttp

        session = self._open()
        # A waiting request may take the whole wait: its read timeout grows with it.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s,
                                        sock_read=self.timeout_s + wait_s)
        params = {k: str(v) for k, v in call.params.items()} or None
        async with session.request(call.method, self.base_url + call.path, params=params,
                                   json=call.json, timeout=timeout, proxy=self._proxy,
                                   allow_redirects=False) as resp:
            body = await resp.read()
            return Answer(resp.status, body, resp.headers.get("Retry-After"))

    def _forget(self) -> None:
        """Let go of a session whose event loop has finished. Its connections went with that
        loop and it cannot be closed from this one; marked closed, it is not reported as an
        unclosed session (an asyncio ERROR line for each loop) when collected. A session of
        a loop still running (another thread's) is only dropped: closing it from here is not
        safe."""
        old, self._session = self._session, None
        if old is None or old.closed or self._loop is None or not self._loop.is_closed():
            return
        connector = old.connector
        old.detach()
        if connector is not None:
            _run_to_end(connector.close())

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._forget()  # a session of a finished loop: marked closed


def _run_to_end(closing: Awaitable[Any]) -> None:
    """Run a connector's close without an event loop: with its loop closed, aiohttp only
    marks the connector closed (its kept-alive connections counted as gone) and awaits
    nothing. Should it wait for something after all, that part is abandoned."""
    steps = closing.__await__()
    try:
        next(steps)
    except StopIteration:
        return
    steps.close()
