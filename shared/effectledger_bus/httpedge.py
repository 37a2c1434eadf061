"""Every HTTP port's defences against slow and hostile clients (ledger API, webhook ingress).

uvicorn times out idle keep-alive connections but neither a client that never finishes its
request headers nor one that trickles its body: each would hold a connection (and a task) for
as long as it likes. Here:

- `HeaderDeadline`, mixed into uvicorn's httptools protocol (or h11's where httptools is not
  installed): closes a connection whose request headers are not complete within
  `header_timeout_s` of its first byte (or of the connection);
- `BodyDeadline`: ASGI middleware that answers 408 when a request body is not complete within
  `body_timeout_s`, and turns a client that goes away mid-body into one log line;
- `NulFree`: ASGI middleware that answers 400 when the path or query carries NUL (`%00`), which
  PostgreSQL cannot compare with, before any handler or query sees it;
- `OneWrite`: the protocols' transport, which sends a response's headers with its body in one
  write instead of uvicorn's two;
- `server_config`: the uvicorn.Config every service uses, with all of the above.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any, cast
from urllib.parse import unquote_to_bytes

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from effectledger_core.config import Settings

log = logging.getLogger(__name__)
# Idle kept-alive connections: the setting's own default, for servers built without settings.
KEEPALIVE_S: int = Settings.model_fields["http_keepalive_s"].default

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Any
Send = Any
App = Any


class HeaderDeadline:
    """A deadline for the request line and headers, mixed into a uvicorn HTTP protocol (h11's
    or httptools'): both keep the request in flight as `cycle` and the socket as `transport`."""

    header_timeout_s: float = 10.0
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        # Every request's cycle is built with this transport: a response goes out as one write.
        # (uvloop's transports are not asyncio.Transport subclasses, hence the cast.)
        self.transport = OneWrite(cast(asyncio.Transport, transport), self)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_headers()

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_headers(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_headers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._idle() and not self.transport.is_closing():
            log.info("closed a connection from %s: request headers not complete within %gs",
                     self.client, self.header_timeout_s)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._idle():
            self._arm_headers()  # the next request on a kept-alive connection starts now
        super().data_received(data)  # type: ignore[misc]
        if not self._idle():
            self._disarm_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_headers()
        super().connection_lost(exc)  # type: ignore[misc]


class OneWrite(asyncio.Transport):
    """A connection's transport that sends a response's status line and headers together with
    the first write of its body.

    uvicorn writes them in two writes (one at `http.response.start`, one at the body). On
    loopback each write also runs the receiver's side of TCP and wakes it, so the client
    woke twice for every answer, once for the headers alone (strace of the ledger: the
    submit-and-wait's headers and body 0.5 ms apart; docs/benchmark.md, round fourteen).
    Held is only the first write after a request's response has started (its status line
    and headers), and only until the next write or the end of the event loop's turn, whichever
    comes first: a body written in the same turn (every plain response) goes out with it, and a
    body that comes later (a stream) finds the headers already sent. Closing sends what is held
    first; aborting drops it, as the transport drops its own buffer."""

    def __init__(self, transport: asyncio.Transport, protocol: Any) -> None:
        super().__init__()
        self._transport = transport
        self._protocol = protocol
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None
        self._started: Any = None  # the request cycle whose response start was held

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            data = self._take() + data
        else:
            cycle = getattr(self._protocol, "cycle", None)
            if cycle is not None and cycle is not self._started and cycle.response_started:
                self._started = cycle
                self._held = bytes(data)
                self._flush = self._protocol.loop.call_soon(self.flush)
                return
        self._transport.write(data)

    def _take(self) -> bytes:
        held, self._held = self._held or b"", None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        return held

    def flush(self) -> None:
        if self._held is not None:
            self._transport.write(self._take())

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._take()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class TimedH11Protocol(HeaderDeadline, H11Protocol):
    """h11 with a deadline for the request line and headers."""


@functools.cache  # one class, however many servers a process builds
def _httptools() -> type[Any] | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is a dependency; a build without its wheel gets h11
        return None

    class TimedHttpToolsProtocol(HeaderDeadline, HttpToolsProtocol):
        """httptools (llhttp, in C) with a deadline for the request line and headers."""

    return TimedHttpToolsProtocol


def timed_protocol(header_timeout_s: float, parser: str = "auto") -> type[Any]:
    """The HTTP protocol with the header deadline: httptools where it is installed ("auto"),
    else h11. httptools parses a request in a fraction of h11's time (pure Python): on an
    agent's one call at a time the ledger spent ~0.6 ms less CPU per operation
    (docs/benchmark.md, issue 30 round seven)."""
    if parser not in ("auto", "h11", "httptools"):
        raise ValueError(f"unknown HTTP parser {parser!r}: auto, h11 or httptools")
    fast = _httptools() if parser != "h11" else None
    if parser == "httptools" and fast is None:
        raise ValueError("the httptools parser is not installed (pip install httptools)")
    base = fast or TimedH11Protocol
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s})


class _BodyTimeout(BaseException):
    """Not an Exception: the app's own error middleware (Starlette answers 500 to any
    Exception) must let it through to `BodyDeadline`, which answers 408."""


def _json_response(status: int, code: str, message: str) -> tuple[Message, Message]:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]},
            {"type": "http.response.body", "body": body})


class BodyDeadline:
    """The whole request body within `body_timeout_s`, else 408 and the connection closed."""

    def __init__(self, app: App, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        body_done = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                after: Message = await receive()  # e.g. waiting for a disconnect
                return after
            try:
                async with asyncio.timeout_at(deadline):
                    message: Message = await receive()
            except TimeoutError:
                raise _BodyTimeout from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except _BodyTimeout:
            log.info("%s %s: request body not complete within %gs; answered 408",
                     scope.get("method"), scope.get("path", "")[:200], self.body_timeout_s)
            if not started:
                for message in _json_response(408, "request_timeout",
                                              "the request body was not received in time"):
                    await send(message)


class NulFree:
    """400 for a path or query containing NUL: data, never a database error."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
                "\x00" in scope.get("path", "")
                or b"\x00" in unquote_to_bytes(scope.get("query_string", b"") or b"")):
            for message in _json_response(400, "invalid_request",
                                          "the path or query contains a NUL character"):
                await send(message)
            return
        await self.app(scope, receive, send)


def guarded(app: App, *, body_timeout_s: float) -> App:
    """`app` behind the body deadline and the NUL check."""
    return BodyDeadline(NulFree(app), body_timeout_s)


def server_config(app: App, *, host: str, port: int, header_timeout_s: float,
                  body_timeout_s: float, keepalive_s: int = KEEPALIVE_S,
                  http_parser: str = "auto",
                  **kwargs: Any) -> uvicorn.Config:
    """uvicorn.Config with the header deadline (httptools or h11: `timed_protocol`), the
    body deadline, the NUL check, and idle kept-alive connections closed after `keepalive_s`
    (`Settings.http_keepalive_s`: why it is longer than uvicorn's 5 s)."""
    return uvicorn.Config(guarded(app, body_timeout_s=body_timeout_s), host=host, port=port,
                          http=timed_protocol(header_timeout_s, http_parser),
                          timeout_keep_alive=keepalive_s, **kwargs)
