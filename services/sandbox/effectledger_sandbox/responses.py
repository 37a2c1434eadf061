"""Responses that misbehave at the transport level: a dropped connection and a slow body.

Dropping is the delicate one. Under uvicorn, an ASGI app that raises or returns without
starting a response makes uvicorn answer `500`, which a client would read as "the provider
said no" — the opposite of what a dropped response means ("you will never know"). So the
drop closes the server's TCP transport itself, reached through the server's own `send`
callable (uvicorn's per-request cycle keeps `transport` and `disconnected`), and returns only
once uvicorn has noticed the disconnect, so it neither logs nor sends anything. The app
stores that original `send` in the scope before Starlette's middleware wraps it.

Where no transport can be found (an in-process `httpx.ASGITransport`, another server) the
drop raises `ConnectionDropped` instead, which in-process clients see as an exception.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

RAW_SEND = "effectledger.raw_send"


class ConnectionDropped(ConnectionError):
    """The sandbox dropped this response on purpose (raised only where it cannot hang up)."""


class DropConnection(Response):
    def __init__(self) -> None:
        super().__init__(status_code=204)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = getattr(scope.get(RAW_SEND), "__self__", None)
        transport = getattr(cycle, "transport", None)
        if transport is None or not hasattr(transport, "close"):
            raise ConnectionDropped("response dropped by an injected fault")
        # close(), not abort(): a FIN reads as "server disconnected without a response", the
        # clean signature of a lost answer; an RST would add an unrelated reset error.
        transport.close()
        # connection_lost runs on a later loop iteration; wait for it so uvicorn sees a
        # disconnected client rather than an app that "returned without a response".
        for _ in range(100):
            if getattr(cycle, "disconnected", True):
                return
            await asyncio.sleep(0)


class SlowBodyResponse(JSONResponse):
    """Sends the status and headers at once, then the body in pieces spread over `seconds`."""

    def __init__(self, content: Any, *, status_code: int, headers: dict[str, str],
                 seconds: float, pieces: int = 5) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self.seconds = seconds
        self.pieces = max(1, min(pieces, len(self.body)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        body = bytes(self.body)
        size = max(1, -(-len(body) // self.pieces))
        chunks = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
        pause = self.seconds / len(chunks)
        for i, chunk in enumerate(chunks):
            await asyncio.sleep(pause)
            await send({"type": "http.response.body", "body": chunk,
                        "more_body": i < len(chunks) - 1})
