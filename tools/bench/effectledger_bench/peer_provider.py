"""The peers' provider call (DBOS, Temporal): the same HTTP client library effectledger uses.

effectledger's dispatcher sends provider calls over aiohttp (`effectledger_providers.session`),
which costs about a quarter of httpx's client CPU per call. A peer left on httpx would pay that
difference in every workflow, and a ratio would then come from a handicapped peer. So the peers
post with a plain `aiohttp.ClientSession` (keep-alive pool sized to their concurrency), the same
request (JSON body, bearer key, fencing token, idempotency key) and raise on a non-2xx answer.
The session is created lazily inside the running event loop, as aiohttp requires.
"""

from __future__ import annotations

import aiohttp


class PeerProvider:
    def __init__(self, endpoint: str, api_key: str, concurrency: int) -> None:
        self.endpoint = endpoint
        self.headers = {"Authorization": f"Bearer {api_key}", "Fencing-Token": "1"}
        self.concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.concurrency * 2)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=10.0))
        return self._session

    async def call(self, key: str, title: str) -> str:
        async with self._client().post(
                self.endpoint, json={"title": title},
                headers={**self.headers, "Idempotency-Key": key}) as resp:
            resp.raise_for_status()
            return str((await resp.json())["id"])

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
