"""An in-memory `ProviderClient` for tests: the adapter's httpx request in, an httpx response out.

It stands where the aiohttp session stands (after the request is built, before any socket), so
classification can be tested without a server; socket behaviour is tested against real local
servers through `ProviderSession`. What the handler raises stands for what the HTTP client
would raise at that point (an aiohttp error, a `PoolTimeout`, a timeout).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx

from .session import Answer

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


class FakeProviderClient:
    """Runs `before_write` as a real client would, records the request, answers it."""

    def __init__(self, answer: Handler) -> None:
        self.answer = answer
        self.requests: list[httpx.Request] = []

    @asynccontextmanager
    async def send(self, request: httpx.Request, timeout_s: float,
                   before_write: Callable[[], None] | None = None) -> AsyncIterator[Answer]:
        if before_write is not None:
            before_write()
        self.requests.append(request)
        result = self.answer(request)
        response = await result if isinstance(result, Awaitable) else result
        yield Answer(response.status_code, response.headers, response.aiter_bytes())

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> FakeProviderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None
