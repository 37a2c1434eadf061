"""stdin and stdout as asyncio pipes for the SDK's stdio transport.

The SDK reads stdin and writes stdout through `anyio.wrap_file`: every line read, every
write and every flush is a hand-off to a worker thread and back, three per tool call, which
on a busy machine cost more than the rest of the server's work on a call. Here the same text
lines go through asyncio's own pipe transports on the event loop, with no thread.

As the SDK does, fd 0 and fd 1 are moved away first (to private descriptors) and pointed at
the null device and at stderr, so that a stray `print` or a child process cannot write into
the protocol stream. Where the descriptors are not pipes (a regular file, some terminals)
`open_pipes` returns None and the SDK's own transport is used.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


class LineReader:
    """`async for line in reader` over an asyncio StreamReader, as text."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def __aiter__(self) -> LineReader:
        return self

    async def __anext__(self) -> str:
        line = await self.reader.readline()
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


class LineWriter:
    """`await write(text)` and `await flush()` over an asyncio write-pipe transport."""

    def __init__(self, transport: asyncio.WriteTransport, protocol: Any) -> None:
        self.transport, self.protocol = transport, protocol

    async def write(self, text: str) -> None:
        self.transport.write(text.encode("utf-8"))

    async def flush(self) -> None:
        # Backpressure: wait only when the pipe's buffer is over its high-water mark.
        await self.protocol._drain_helper()


@asynccontextmanager
async def open_pipes() -> AsyncIterator[tuple[LineReader, LineWriter] | None]:
    import stat

    if sys.platform == "win32" or not all(
            stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode)
            for fd in (0, 1)):
        yield None
        return
    loop = asyncio.get_running_loop()
    sys.stdout.flush()
    private_in, private_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # a handler or child reading stdin gets EOF, not the protocol
    os.dup2(2, 1)  # stray output goes to stderr, never into the protocol stream
    os.close(null)
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
    read_transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(private_in, "rb", buffering=0))
    write_transport, write_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(private_out, "wb", buffering=0))
    try:
        yield LineReader(reader), LineWriter(write_transport, write_protocol)
    finally:
        read_transport.close()
        write_transport.close()
