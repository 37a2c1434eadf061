"""Idle kept-alive connections: the HTTP ports keep them longer than our clients do, so the
client side always closes first and an agent's calls seconds apart reuse one connection."""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from effectledger_bus.httpedge import server_config
from effectledger_client._aio import KEEPALIVE_S as CLIENT_KEEPALIVE_S
from effectledger_core.config import Settings


async def ok(request: Request) -> Response:
    return JSONResponse({"ok": True})


def test_the_ports_keep_idle_connections_longer_than_the_client() -> None:
    # uvicorn's own default (5 s) is shorter than the async client's 15 s: the client could
    # write its next request on a connection the ledger was closing, and lose it.
    settings = Settings()
    assert settings.http_keepalive_s > CLIENT_KEEPALIVE_S
    assert settings.http_keepalive_s >= 60  # common proxies' idle timeout in front
    config = server_config(Starlette(), host="127.0.0.1", port=0, header_timeout_s=10,
                           body_timeout_s=10, keepalive_s=settings.http_keepalive_s)
    assert config.timeout_keep_alive == settings.http_keepalive_s


async def test_the_server_closes_a_connection_idle_past_its_keepalive() -> None:
    app = Starlette(routes=[Route("/ok", ok)])
    server = uvicorn.Server(server_config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
        header_timeout_s=10, body_timeout_s=10, keepalive_s=1))
    serving = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(reader.readexactly(len(b'{"ok":true}')), 10)
        # Nothing more is sent; the server ends the idle connection on its own.
        assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()
        server.should_exit = True
        await serving
