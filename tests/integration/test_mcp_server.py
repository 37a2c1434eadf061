"""The MCP server in-process (the official SDK's in-memory client) on the real ledger app
(httpx.ASGITransport, both databases): refusals are tool results, a call is one request to the
ledger, and the status tool sees only the caller's tenant."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import mcp_types as types
import pytest
from mcp import Client
from pydantic import Field

from effectledger_client import AsyncClient
from effectledger_core.quotas import QuotaLimits, TenantRates
from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator
from effectledger_ledger.service import LedgerService
from effectledger_mcp.server import build_server
from tests.integration.test_api_auth import (  # noqa: F401 - svc is a fixture
    AGENT_A,
    AGENT_B,
    AGENTS,
    OPERATORS,
    svc,
)


async def _ready() -> dict[str, bool]:
    return {"database": True}


class Ledger:
    """A ledger client per token on the in-process app, counting the requests it sends."""

    def __init__(self, svc: LedgerService) -> None:  # noqa: F811
        self.transport = httpx.ASGITransport(app=create_app(
            svc, ready=_ready, auth=Authenticator(AGENTS, OPERATORS)))
        self.requests: list[str] = []

    def client(self, token: str) -> AsyncClient:
        async def count(request: httpx.Request) -> None:
            self.requests.append(f"{request.method} {request.url.path}")

        return AsyncClient("http://ledger.test", http=httpx.AsyncClient(
            transport=self.transport, base_url="http://ledger.test",
            headers={"Authorization": f"Bearer {token}"}, event_hooks={"request": [count]}))


@pytest.fixture
async def ledger(svc: LedgerService) -> Ledger:  # noqa: F811
    return Ledger(svc)


@asynccontextmanager
async def as_agent(ledger: Ledger, token: str = AGENT_A) -> AsyncIterator[Client]:
    """An MCP session in-process, in the test's own task (the SDK's task groups must be
    left in the task that entered them)."""
    client = ledger.client(token)
    try:
        async with Client(build_server(lambda _ctx: client, wait_s=0.2)) as mcp:
            yield mcp
    finally:
        await client.aclose()


async def _call(mcp: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await mcp.call_tool(name, arguments)
    assert result.structured_content is not None
    return {**result.structured_content, "is_error": result.is_error}


async def test_a_call_is_one_request_to_the_ledger(ledger: Ledger) -> None:
    async with as_agent(ledger) as agent_a:
        await agent_a.list_tools()
        ledger.requests.clear()
        done = await _call(agent_a, "email", {"to": "a@example.com"})
    assert done["outcome"] == "in_progress" and done["replayed"] is False  # no dispatcher here
    assert ledger.requests == ["POST /v1/intents"]


async def test_a_quota_refusal_is_a_tool_result_with_its_retry_after(
        ledger: Ledger, svc: LedgerService) -> None:  # noqa: F811
    svc.quotas = QuotaLimits(rate_per_s=0.001, burst=1)
    svc.rates = TenantRates(svc.quotas.rate_per_s, svc.quotas.burst)
    async with as_agent(ledger) as agent_a:
        await _call(agent_a, "email", {"n": 1})
        limited = await _call(agent_a, "email", {"n": 2})
    assert limited["is_error"] and limited["error"] == "rate_limited"
    assert limited["retry_after_s"] > 0 and "nothing was submitted" in limited["message"]


async def test_a_key_reused_with_other_arguments_is_a_tool_result(ledger: Ledger) -> None:
    key: Any = {"effectledger/idempotencyKey": "k-1"}
    async with as_agent(ledger) as agent_a:
        await agent_a.call_tool("email", {"n": 1}, meta=key)
        conflict = await agent_a.call_tool("email", {"n": 2}, meta=key)
    assert conflict.is_error and conflict.structured_content is not None
    assert conflict.structured_content["error"] == "idempotency_key_conflict"


async def test_the_status_tool_sees_only_the_callers_tenant(ledger: Ledger) -> None:
    async with as_agent(ledger) as agent_a, as_agent(ledger, AGENT_B) as agent_b:
        mine = await _call(agent_a, "email", {"n": 3})
        status = await _call(agent_a, "operation_status",
                             {"operation_id": mine["operation_id"]})
        assert status["operation_id"] == mine["operation_id"] and not status["is_error"]
        peek = await _call(agent_b, "operation_status", {"operation_id": mine["operation_id"]})
        assert peek["is_error"] and peek["error"] == "not_found"
        # Tenant b's identical call is its own operation.
        theirs = await _call(agent_b, "email", {"n": 3})
        assert theirs["operation_id"] != mine["operation_id"]
        again = await _call(agent_a, "email", {"n": 3})
        assert again["operation_id"] == mine["operation_id"] and again["replayed"] is True


class _LostSubmissions(httpx.AsyncBaseTransport):
    """The ledger answers everything but a submission, whose connection breaks."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/intents":
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


async def test_an_unreachable_ledger_is_a_result_saying_the_same_call_is_safe(
        ledger: Ledger) -> None:
    client = AsyncClient("http://ledger.test", http=httpx.AsyncClient(
        transport=_LostSubmissions(ledger.transport), base_url="http://ledger.test",
        headers={"Authorization": f"Bearer {AGENT_A}"}))
    async with Client(build_server(lambda _ctx: client, wait_s=0.2)) as mcp:
        lost = await _call(mcp, "email", {"n": 4})
    await client.aclose()
    assert lost["is_error"] and lost["error"] == "unavailable" and lost["safe_to_resend"]
    assert "never runs twice" in lost["message"]


class _KeyedParams(types.CallToolRequestParams):
    """SEP-3182's `idempotencyKey` on tools/call, which the SDK's call_tool cannot send."""

    idempotency_key: str = Field(alias="idempotencyKey")


class _KeyedCall(types.CallToolRequest):
    params: _KeyedParams  # type: ignore[assignment]


async def test_sep3182_idempotency_key_is_the_key_and_a_keyless_retry_joins(
        ledger: Ledger) -> None:
    async with as_agent(ledger) as mcp:
        await mcp.list_tools()
        keyed = await mcp.session.send_request(_KeyedCall(params=_KeyedParams(
            name="email", arguments={"n": 5}, idempotencyKey="sep-key-1")),
            types.CallToolResult)
        assert keyed.structured_content is not None
        assert keyed.structured_content["idempotency_key"] == "sep-key-1"
        retry = await _call(mcp, "email", {"n": 5})  # the host lost the key
    assert retry["operation_id"] == keyed.structured_content["operation_id"]
    assert retry["replayed"] is True and retry["idempotency_key"] == "sep-key-1"
