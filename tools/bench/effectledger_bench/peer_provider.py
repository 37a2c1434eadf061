"""The peers' provider call (DBOS, Temporal): the same HTTP client library effectledger uses.

effectledger's dispatcher sends provider calls over aiohttp (`effectledger_providers.session`),
which costs about a quarter of httpx's client CPU per call. A peer left on httpx would pay that
difference in every workflow, and a ratio would then come from a handicapped peer. So the peers
post with a plain `aiohttp.ClientSession` (keep-alive pool sized to their concurrency), the same
request (JSON body, bearer key, fencing token, idempotency key) and raise on a non-2xx answer.
An aiohttp session belongs to the event loop it was made in, and DBOS's queue mode runs
workflows on loops of its own worker threads, so there is one session per loop, made lazily.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp


class PeerProvider:
    def __init__(self, endpoint: str, api_key: str, concurrency: int) -> None:
        self.endpoint = endpoint
        self.headers = {"Authorization": f"Bearer {api_key}", "Fencing-Token": "1"}
        self.concurrency = concurrency
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._lock = threading.Lock()

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is None or session.closed:
                connector = aiohttp.TCPConnector(limit=self.concurrency * 2)
                session = aiohttp.ClientSession(
                    connector=connector, timeout=aiohttp.ClientTimeout(total=10.0))
                self._sessions[loop] = session
        return session

    async def call(self, key: str, title: str) -> str:
        async with self._client().post(
                self.endpoint, json={"title": title},
                headers={**self.headers, "Idempotency-Key": key}) as resp:
            resp.raise_for_status()
            return str((await resp.json())["id"])

    async def aclose(self) -> None:
        """Close this loop's session (the others end with their threads' loops)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()
