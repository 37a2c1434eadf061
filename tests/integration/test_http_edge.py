"""Every HTTP port's defences, against a real uvicorn server on a local port: request headers
and bodies that never finish are cut off, `%00` is a 400 before any handler, and a client that
goes away mid-body is one log line, not a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from effectledger_bus.httpedge import server_config, timed_protocol
from effectledger_cli.embedded import free_port
from effectledger_core.errors import EffectLedgerError
from effectledger_ledger.api import read_bounded

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
# How long a test waits for the server to act; far above the timeouts, never a pacing sleep.
PATIENCE_S = 10.0


async def echo(request: Request) -> Response:
    try:
        body = await read_bounded(request)
    except EffectLedgerError as exc:
        return JSONResponse({"error": exc.code}, status_code=exc.http_status)
    return JSONResponse({"path": request.url.path, "size": len(body)})


@pytest.fixture(params=["httptools", "h11"])
async def port(request: pytest.FixtureRequest) -> AsyncIterator[int]:
    """Every defence holds with either parser: httptools (the default) and h11 (where
    httptools is not installed)."""
    app = Starlette(routes=[Route("/{rest:path}", echo, methods=["GET", "POST"])])
    p = free_port()
    server = uvicorn.Server(server_config(
        app, host="127.0.0.1", port=p, log_level="warning", lifespan="off",
        header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S,
        http_parser=request.param))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
        await asyncio.sleep(0.01)
    yield p
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def exchange(port: int, data: bytes) -> bytes:
    """Send `data`, then read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), PATIENCE_S)
    finally:
        writer.close()


async def test_a_client_that_never_finishes_its_headers_is_disconnected(port: int) -> None:
    answer = await exchange(port, b"GET /v1/operations HTTP/1.1\r\nHost: x\r\n")
    assert answer == b""  # closed by the server, within PATIENCE_S


async def test_a_body_that_never_finishes_gets_408(port: int) -> None:
    answer = await exchange(port, b"POST /v1/intents HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Length: 100\r\n\r\n0123456789")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer


@pytest.mark.parametrize("target", [b"/v1/operations/op%00x", b"/v1/operations?cursor=a%00b"])
async def test_nul_in_the_path_or_query_is_400_before_any_handler(port: int,
                                                                  target: bytes) -> None:
    answer = await exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"NUL" in answer


async def test_a_complete_request_is_served(port: int) -> None:
    answer = await exchange(port, b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                  b"Connection: close\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 200") and b'"size":2' in answer


@pytest.mark.parametrize("request_bytes", [
    b"GET /ok HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",  # a space in a header name
    b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}",
    b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n",  # TLS on a plain port
], ids=["header-name", "two-lengths", "negative-length", "tls-hello"])
async def test_a_malformed_request_is_400_and_reaches_no_handler(port: int,
                                                                 request_bytes: bytes) -> None:
    answer = await exchange(port, request_bytes)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b'"path"' not in answer  # the echo handler never ran


class _Seen(logging.Handler):
    """Sets `event` when a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text, self.event = text, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def test_a_client_leaving_mid_body_is_one_line_not_a_traceback(
        port: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    seen = _Seen("went away mid-body")
    logging.getLogger().addHandler(seen)
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/intents HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n01")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(seen.event.wait(), PATIENCE_S)
    finally:
        logging.getLogger().removeHandler(seen)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_the_default_parser_is_httptools_and_a_wrong_name_is_refused() -> None:
    assert timed_protocol(1.0).__mro__[1].__name__ == "TimedHttpToolsProtocol"
    assert timed_protocol(1.0, "h11").header_timeout_s == 1.0
    with pytest.raises(ValueError, match="unknown HTTP parser"):
        timed_protocol(1.0, "picohttp")
