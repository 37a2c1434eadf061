"""A loopback HTTP server that answers every request with fixed bytes and keeps what it was
sent: for tests of what a client puts on the wire and of how it reads answers no ledger gives
(an HTML 502, an empty 404)."""

from __future__ import annotations

import asyncio

NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def response(status: bytes, body: bytes, content_type: bytes) -> bytes:
    """A whole HTTP/1.1 answer that closes its connection."""
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type
            + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n" + body)


async def answering(heads: list[bytes], answer: bytes = NOT_FOUND) -> asyncio.Server:
    """Records each request's head (request line and headers) in `heads`, then writes
    `answer` and closes the connection."""
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        heads.append(await r.readuntil(b"\r\n\r\n"))
        w.write(answer)
        await w.drain()
        w.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def url_of(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def first_lines(heads: list[bytes]) -> list[bytes]:
    return [head.split(b"\r\n", 1)[0] for head in heads]


def header(head: bytes, name: str) -> str | None:
    """One header's value in a recorded head, None when it is absent."""
    for line in head.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None
