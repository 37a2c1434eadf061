"""The one place that builds the HTTP client for provider calls (dispatcher, reconciler): aiohttp.

Why aiohttp and not httpx: on the same calls httpx + httpcore + anyio spend about four times
the client CPU (docs/benchmark.md, "HTTP clients"). Adapters still describe requests and read
answers as `httpx.Request` / `httpx.Response` values (a stable, public adapter API); only the
sending moved. The agents' SDK (`effectledger_client`) and the sandbox stay on httpx.

What a provider session guarantees, each pinned by tests/unit/test_provider_call.py:
- exactly one request per call: no redirects followed, and aiohttp's silent second attempt of an
  idempotent request on a reused connection that broke (`_retry_connection`) is switched off;
- split timeouts: waiting for a free connection (`PoolTimeout`), connecting (DNS, TCP, TLS:
  aiohttp's `ConnectionTimeoutError`), each read, and the caller's overall deadline;
- `before_write` runs after the connection is ready and before the request's first byte is
  written (`_CheckedConnector`), and for a request with a body once more in the task that
  writes it (`_CheckedBody`); what it raises propagates and nothing is written;
- no request logging: aiohttp's client logs no request lines (its `aiohttp.access` logger is
  the server's); no cookies kept between calls of different operations (`DummyCookieJar`).

The environment is read once, when the session is built, as httpx did: `HTTP_PROXY`,
`HTTPS_PROXY`, `NO_PROXY` (aiohttp's own `trust_env` would re-read them and `~/.netrc` on every
request), and `SSL_CERT_FILE` / `SSL_CERT_DIR`. Unlike httpx, `~/.netrc` credentials are not
added to provider requests: a provider's credentials come from the catalog's headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import httpx
from aiohttp.abc import AbstractStreamWriter
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.payload import BytesPayload
from aiohttp.tracing import Trace
from yarl import URL

from effectledger_bus.httpenv import env_proxies, ssl_context

__all__ = ["CONNECT_SHARE", "Answer", "PoolTimeout", "ProviderSession"]

# Connect and pool waits get a share of the deadline, so a hanging connect ends as a connect
# timeout (known: nothing sent) rather than as the overall deadline (must be ambiguous).
CONNECT_SHARE = 0.8
# Idle connections expire before the provider's own keep-alive closes them (5 s for uvicorn
# and Node): a request written on a connection the server is closing at that instant is lost
# without an answer, which is ambiguous, so that race must not be run at all.
KEEPALIVE_S = 2.0
# Headers aiohttp derives from the URL and the body itself; the adapter's copies would clash.
_DERIVED = frozenset({"host", "content-length", "transfer-encoding"})

# The running call's `before_write`: the connector runs in the caller's task, so a context
# variable reaches it without threading it through aiohttp's request machinery.
_before_write: ContextVar[Callable[[], None] | None] = ContextVar(
    "effectledger_before_write", default=None)


class PoolTimeout(Exception):
    """No pooled connection became free within the pool share of the deadline: nothing sent."""


@dataclass
class Answer:
    """A status line and headers that arrived; the body is read from `chunks`."""

    status: int
    headers: httpx.Headers
    chunks: AsyncIterator[bytes]


class ProviderClient(Protocol):
    """What `calls` needs to send one request: `ProviderSession`, or a test's in-memory fake."""

    def send(self, request: httpx.Request, timeout_s: float,
             before_write: Callable[[], None] | None = None,
             ) -> AbstractAsyncContextManager[Answer]:
        ...

    async def aclose(self) -> None:
        ...


class _CheckedConnector(aiohttp.TCPConnector):
    """Runs the call's `before_write` on the connection it hands out, pooled or new.

    aiohttp writes the request right after `connect` returns (`ClientRequest.send` does not
    yield to the event loop before its first write), so this is the last moment before the
    first byte, after DNS, TCP and TLS: the same point as httpcore's
    `send_request_headers.started` trace event used before.
    """

    async def connect(self, req: ClientRequest, traces: list[Trace],
                      timeout: aiohttp.ClientTimeout) -> Connection:  # noqa: ASYNC109
        conn = await super().connect(req, traces, timeout)
        check = _before_write.get()
        if check is not None:
            try:
                check()
            except BaseException:
                conn.close()  # nothing was written on it; not worth keeping either
                raise
        return conn


class _CheckedBody(BytesPayload):
    """A request body that runs `before_write` again right before it is written.

    On Python < 3.12 aiohttp buffers the headers of a request with a body and writes them
    together with the body from a task that starts on the next turn of the event loop, so the
    connector's check can be one loop turn (milliseconds to tens of milliseconds under load)
    before the first byte. This check runs in that task, immediately before the (coalesced)
    headers and body are handed to the socket. What it raises reaches aiohttp wrapped in a
    `ClientConnectionError`; `ProviderSession.send` raises the original instead.
    """

    def __init__(self, value: bytes, check: Callable[[], None], content_type: str) -> None:
        super().__init__(value, content_type=content_type)
        self._check = check
        self.refused: BaseException | None = None

    def _run_check(self) -> None:
        try:
            self._check()
        except BaseException as exc:
            self.refused = exc
            raise

    async def write(self, writer: AbstractStreamWriter) -> None:
        self._run_check()
        await super().write(writer)

    async def write_with_length(self, writer: AbstractStreamWriter,
                                content_length: int | None) -> None:
        self._run_check()
        await super().write_with_length(writer, content_length)


class ProviderSession:
    """A bounded pool of keep-alive connections to providers; built lazily inside the loop."""

    def __init__(self, max_connections: int = 200) -> None:
        self.max_connections = max_connections
        self._slots = asyncio.Semaphore(max_connections)
        self._http: aiohttp.ClientSession | None = None
        self._proxy = env_proxies()

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            connector = _CheckedConnector(
                limit=self.max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S,
                ssl=ssl_context(),
                # aiohttp rounds timeouts of 5 s and more up to whole seconds; the split of
                # the deadline between connect and the rest should stay as computed.
                timeout_ceil_threshold=math.inf)
            self._http = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
                auto_decompress=True, raise_for_status=False,
                timeout=aiohttp.ClientTimeout(total=None))
            # aiohttp sends an idempotent request a second time when a reused connection
            # breaks; a provider call is made exactly once (the reconciler decides the rest).
            self._http._retry_connection = False
        return self._http

    @contextlib.asynccontextmanager
    async def send(self, request: httpx.Request, timeout_s: float,
                   before_write: Callable[[], None] | None = None) -> AsyncIterator[Answer]:
        """Send `request` once; yield its status, headers and body stream.

        Raises `PoolTimeout` (nothing sent), aiohttp's errors, or what `before_write` raised.
        The overall deadline is the caller's (`asyncio.timeout`); this bounds the parts.
        """
        share = timeout_s * CONNECT_SHARE
        try:
            async with asyncio.timeout(share):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise PoolTimeout(f"all {self.max_connections} connections busy for {share:.3f}s"
                              ) from exc
        try:
            try:
                body = request.content
            except httpx.RequestNotRead:  # an adapter's streaming body
                body = await request.aread()
            headers = [(k, v) for k, v in request.headers.multi_items()
                       if k.lower() not in _DERIVED]
            url = URL(str(request.url), encoded=True)
            data: bytes | _CheckedBody | None = body or None
            if body and before_write is not None:
                data = _CheckedBody(body, before_write, request.headers.get(
                    "content-type", "application/octet-stream"))
            token = _before_write.set(before_write)
            try:
                response = await self._session().request(
                    request.method, url, headers=headers,
                    proxy=self._proxy(url.scheme, url.host or ""), data=data,
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None, connect=share,
                                                  sock_connect=share, sock_read=timeout_s))
            except Exception:
                if isinstance(data, _CheckedBody) and data.refused is not None:
                    raise data.refused from None  # refused in the body task: nothing written
                raise
            finally:
                _before_write.reset(token)
            try:
                yield Answer(response.status, httpx.Headers(list(response.raw_headers)),
                             response.content.iter_any())
            finally:
                # A connection whose answer was read in full goes back to the pool; any other
                # (a body cut short, a deadline) is closed: its next bytes are this answer's.
                if response.content.at_eof():
                    response.release()
                else:
                    response.close()
        finally:
            self._slots.release()

    async def __aenter__(self) -> ProviderSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
