"""A response leaves in one write (`httpedge.OneWrite`): uvicorn's own protocols, with the
header deadline mixed in (both parsers), driven over a transport that records what is written
to it. uvicorn writes a response's status line and headers, then its body, in two writes;
each wakes the client."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.server import ServerState

from effectledger_bus.httpedge import timed_protocol

BODY = {"answer": "x" * 500}


class Recorder(asyncio.Transport):
    """A socket's transport that keeps each write and a close as events, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, bytes]] = []
        self.changed = asyncio.Condition()
        self.closed = False

    def write(self, data: Any) -> None:
        if not data:
            return  # as asyncio's and uvloop's transports do (h11 ends a message with b"")
        self.events.append(("write", bytes(data)))
        asyncio.get_running_loop().create_task(self._notify())

    def close(self) -> None:
        self.closed = True
        self.events.append(("close", b""))
        asyncio.get_running_loop().create_task(self._notify())

    def abort(self) -> None:
        self.closed = True

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def until(self, check: Any) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: check(self.sent())), 10)

    def sent(self) -> bytes:
        return b"".join(data for kind, data in self.events if kind == "write")

    def writes(self) -> list[bytes]:
        return [data for kind, data in self.events if kind == "write"]

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def answer(request: Request) -> Response:
    return JSONResponse(BODY, status_code=201)


class Gate:
    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def stream(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            await self.open.wait()
            yield b"late"

        return StreamingResponse(chunks(), media_type="text/plain")


@pytest.fixture(params=["httptools", "h11"])
def connect(request: pytest.FixtureRequest) -> Any:
    gate = Gate()
    app = Starlette(routes=[Route("/answer", answer), Route("/stream", gate.stream)])
    config = uvicorn.Config(app, lifespan="off", log_level="warning")
    config.load()
    protocol_class = timed_protocol(10.0, request.param)

    def made() -> tuple[Any, Recorder, Gate]:
        transport = Recorder()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(transport)
        return protocol, transport, gate

    return made


async def test_a_response_is_one_write(connect: Any) -> None:
    protocol, transport, _ = connect()
    for answered in (1, 2):  # and again on the kept-alive connection
        before = len(transport.writes())
        protocol.data_received(b"GET /answer HTTP/1.1\r\nHost: t\r\n\r\n")
        await transport.until(lambda sent, n=answered: sent.count(b"x" * 500) == n)
        writes = transport.writes()[before:]
        assert len(writes) == 1, writes
        assert writes[0].startswith(b"HTTP/1.1 201 Created\r\n")
        assert writes[0].endswith(b"\r\n\r\n" + JSONResponse(BODY).body)
    assert not transport.closed


async def test_a_stream_gets_its_headers_before_its_body_exists(connect: Any) -> None:
    protocol, transport, gate = connect()
    protocol.data_received(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
    await transport.until(lambda sent: sent.endswith(b"\r\n\r\n"))
    assert b"late" not in transport.sent()  # headers not held back for a body not yet there
    gate.open.set()
    await transport.until(lambda sent: sent.endswith(b"0\r\n\r\n"))
    assert b"late" in transport.sent()


async def test_a_closing_connection_sends_its_response_before_it_closes(connect: Any) -> None:
    protocol, transport, _ = connect()
    protocol.data_received(b"GET /answer HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    await transport.until(lambda sent: sent.endswith(JSONResponse(BODY).body))
    await asyncio.wait_for(_closed(transport), 10)
    assert [kind for kind, _ in transport.events] == ["write", "close"]


async def _closed(transport: Recorder) -> None:
    async with transport.changed:
        while not transport.closed:
            await transport.changed.wait()


class _Cycle:
    response_started = True


class _Protocol:
    def __init__(self) -> None:
        self.cycle = _Cycle()
        self.loop = asyncio.get_running_loop()


async def test_held_headers_are_sent_before_a_close_and_dropped_by_an_abort() -> None:
    from effectledger_bus.httpedge import OneWrite

    transport = Recorder()
    one = OneWrite(transport, _Protocol())
    one.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.events == []  # held: its body may follow in this turn
    one.close()
    assert transport.events == [("write", b"HTTP/1.1 200 OK\r\n\r\n"), ("close", b"")]

    aborted = Recorder()
    one = OneWrite(aborted, _Protocol())
    one.write(b"HTTP/1.1 200 OK\r\n\r\n")
    one.abort()
    assert aborted.events == []


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not installed on Windows")
@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_real_server_on_uvloop_answers_in_one_piece(parser: str) -> None:
    """The services run on uvloop, whose transports are not asyncio.Transport subclasses: a
    real server there answers twice on one kept-alive connection."""
    import uvloop

    from effectledger_bus.httpedge import server_config

    async def main() -> list[bytes]:
        app = Starlette(routes=[Route("/answer", answer)])
        server = uvicorn.Server(server_config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
            header_timeout_s=10.0, body_timeout_s=10.0, http_parser=parser))
        serving = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = JSONResponse(BODY).body
        answers = []
        for _ in range(2):
            writer.write(b"GET /answer HTTP/1.1\r\nHost: t\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            answers.append(head + await asyncio.wait_for(reader.readexactly(len(body)), 10))
        writer.close()
        server.should_exit = True
        await serving
        return answers

    for got in uvloop.run(main()):
        assert got.startswith(b"HTTP/1.1 201 Created\r\n")
        assert got.endswith(JSONResponse(BODY).body)
