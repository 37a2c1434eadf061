"""Attacks on the console's sign-in (issue 28, "Console"), in process through the real app.

Before: 300 wrong tokens took 0.8 s and the right one then worked at once; sessions were capped
only globally, so an agent signing in again and again ended operators' sessions. Now failed
sign-ins back off exponentially per client address and per token (429 with Retry-After and a
clear message on the sign-in page, and no token is compared while blocked), and sessions are
capped per principal, an agent never ending an operator's.

The throttle's clock is replaced by a fake one: a block ends when the test says so, not after
a sleep. Sign-in touches no database; one SQLite file serves the pages that do.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator, Principal
from effectledger_ledger.console.state import Console
from effectledger_ledger.db.store import Store
from effectledger_ledger.migrate import upgrade
from tests.integration.test_api_auth import (
    AGENT_A,
    AGENT_B,
    AGENTS,
    OPERATOR,
    OPERATORS,
    _ready,
    service,
)

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
SESSION = "effectledger_console"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[FastAPI]:
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}")
    await upgrade(store)
    yield create_app(service(store), ready=_ready, auth=Authenticator(AGENTS, OPERATORS))
    await store.close()


def console_of(app: FastAPI) -> Console:
    mounted = next(r for r in app.routes if getattr(r, "path", None) == "/console")
    console: Console = mounted.app.state.console  # type: ignore[attr-defined]
    return console


def client(app: FastAPI, address: str) -> httpx.AsyncClient:
    """A browser at `address` (what uvicorn reports as the client's host)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(address, 50000)),
                             base_url="http://ledger.test")


class Browser:
    """Signs in like a browser: each answer carries the next form's CSRF token."""

    def __init__(self, c: httpx.AsyncClient) -> None:
        self.c = c
        self.csrf: str | None = None

    async def sign_in(self, token: str) -> httpx.Response:
        if self.csrf is None:
            self._take((await self.c.get("/console/login")).text)
        resp = await self.c.post("/console/login", data={"csrf": self.csrf or "",
                                                          "token": token})
        self._take(resp.text)
        return resp

    def _take(self, page: str) -> None:
        found = CSRF.search(page)
        self.csrf = found.group(1) if found else None


def signed_in(resp: httpx.Response) -> bool:
    return resp.status_code == 303 and any(
        h.startswith(f"{SESSION}=") for h in resp.headers.get_list("set-cookie"))


async def test_300_wrong_tokens_then_the_right_one_is_refused_until_the_backoff_ends(
        app: FastAPI) -> None:
    clock = Clock()
    console_of(app).throttle.clock = clock
    async with client(app, "203.0.113.7") as c:
        attacker = Browser(c)
        started = time.perf_counter()
        statuses = [(await attacker.sign_in(f"guess-{i}")).status_code for i in range(300)]
        elapsed = time.perf_counter() - started
        # A few typos are free; then every attempt is refused before any token is compared.
        assert statuses[:5] == [401] * 5 and set(statuses[6:]) == {429}, statuses[:10]
        right = await attacker.sign_in(OPERATOR)
        assert right.status_code == 429 and not signed_in(right)
        wait = int(right.headers["retry-after"])
        assert wait >= 1
        assert f"Wait {wait} s" in right.text and "Too many failed sign-ins" in right.text
        # Once the block is over the right token works (nothing was counted while blocked).
        clock.now += wait
        assert signed_in(await attacker.sign_in(OPERATOR))
    print(f"300 sign-in attempts in {elapsed:.2f} s")


async def test_each_further_failure_doubles_the_wait(app: FastAPI) -> None:
    clock = Clock()
    console_of(app).throttle.clock = clock
    waits = []
    async with client(app, "203.0.113.8") as c:
        attacker = Browser(c)
        for i in range(5):
            assert (await attacker.sign_in(f"typo-{i}")).status_code == 401
        for i in range(5):
            assert (await attacker.sign_in(f"guess-{i}")).status_code == 401  # counted
            blocked = await attacker.sign_in("another")
            assert blocked.status_code == 429
            waits.append(int(blocked.headers["retry-after"]))
            clock.now += waits[-1]
    assert waits == [1, 2, 4, 8, 16]


async def test_one_token_tried_from_many_addresses_is_blocked_and_nobody_else_is(
        app: FastAPI) -> None:
    clock = Clock()
    console_of(app).throttle.clock = clock
    answers = []
    for n in range(10):  # a botnet: one attempt per address, all with the same token
        async with client(app, f"198.51.100.{n}") as c:
            answers.append((await Browser(c).sign_in("stolen-looking-token")).status_code)
    assert answers[:5] == [401] * 5 and answers[6:] == [429] * 4, answers
    async with client(app, "192.0.2.1") as c:  # the same token from a fresh address
        assert (await Browser(c).sign_in("stolen-looking-token")).status_code == 429
    async with client(app, "192.0.2.2") as c:  # an operator elsewhere is not affected
        assert signed_in(await Browser(c).sign_in(OPERATOR))


async def test_an_agent_token_signing_in_between_guesses_does_not_reset_its_address(
        app: FastAPI) -> None:
    clock = Clock()
    console_of(app).throttle.clock = clock
    async with client(app, "203.0.113.9") as c:
        attacker = Browser(c)
        statuses = []
        for i in range(12):
            statuses.append((await attacker.sign_in(f"guess-{i}")).status_code)
            await attacker.sign_in(AGENT_A)  # refused too once the address is blocked
            clock.now += 0.5
        assert 429 in statuses[5:], statuses


async def test_repeated_agent_sign_ins_never_end_an_operators_session(app: FastAPI) -> None:
    console = console_of(app)
    # A store this small fills after a few dozen sign-ins, as 10,000 would after a loop.
    console.sessions = type(console.sessions)(max_sessions=30)
    async with client(app, "192.0.2.10") as op_c:
        assert signed_in(await Browser(op_c).sign_in(OPERATOR))
        async with client(app, "192.0.2.66") as agent_c:
            agent = Browser(agent_c)
            for i in range(60):
                agent.c.cookies.clear()  # a new browser each time: no session to replace
                agent.csrf = None
                resp = await agent.sign_in(AGENT_A if i % 2 else AGENT_B)
                assert signed_in(resp), resp.text[:300]
        page = await op_c.get("/console/")
        assert page.status_code == 200 and "Operator <strong>alice</strong>" in page.text
    for tenant in ("tenant-a", "tenant-b"):  # each agent keeps only its own newest sessions
        assert console.sessions.of(Principal("agent", f"agent:{tenant}", tenant)) <= 20
    assert console.sessions.of(Principal("operator", "alice")) == 1
    assert len(console.sessions) <= 30
