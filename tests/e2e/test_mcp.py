"""The MCP front door (issue 13) with the official `mcp` client against a real stack: the
ledger, a dispatcher, the reconciler and the sandbox provider as processes, the MCP server
over stdio and over streamable HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO, cast

import httpx
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import RequestParamsMeta

from effectledger_cli.embedded import free_port
from tests.support.cluster import Cluster, wait_until

pytestmark = pytest.mark.slow
MCP_TOKEN = "mcp-test-token"
# The documented fallback for SEP-3182's idempotencyKey: the key in `_meta`.
RETRY_KEY = cast(RequestParamsMeta, {"effectledger/idempotencyKey": "mcp-retry-1"})
CATALOG_TOOLS = {"create_ticket", "send_email", "charge_card", "fast_ticket", "fast_lookup",
                 "fast_email", "fast_post", "fast_page", "fast_wire"}


def _env(c: Cluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env["EFFECTLEDGER_LEDGER_URL"] = c.ledger_url
    return env


@asynccontextmanager
async def stdio_session(c: Cluster) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "effectledger_cli", "mcp", "--wait", "20"],
        env=_env(c), cwd=str(c.workdir))
    errlog = _open_log(c.logs / "mcp-stdio.log")
    try:
        async with stdio_client(params, errlog=errlog) as (read, write), \
                ClientSession(read, write) as session:
            init = await session.initialize()
            # Where idempotency keys come from, advertised until SEP-3182 is in the SDK.
            advertised = {**(init.capabilities.experimental or {}),
                          **(init.capabilities.extensions or {})}
            assert advertised["effectledger/idempotency"]["meta"] == "effectledger/idempotencyKey"
            yield session
    finally:
        errlog.close()


def _open_log(path: Path) -> TextIO:
    return open(path, "w")  # closed by the caller once the server is gone


def _spawn_http(c: Cluster, port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "effectledger_cli", "mcp", "--http", f"127.0.0.1:{port}",
             "--wait", "20"], env={**_env(c), "EFFECTLEDGER_MCP_TOKEN": MCP_TOKEN},
            cwd=c.workdir, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def _up(make_cluster: Callable[..., Cluster]) -> Cluster:
    c = make_cluster()
    await c.start()
    await c.start_reconciler()
    return c


async def _fault(c: Cluster, route: str, action: dict[str, Any]) -> None:
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": action, "times": 1})
    assert resp.status_code == 200, resp.text


async def _operations(c: Cluster) -> int:
    return sum((await c.stats())["operations"].values())


async def test_mcp_over_stdio_lists_calls_and_never_applies_twice(
        make_cluster: Callable[..., Cluster]) -> None:
    """tools/list carries schemas and annotations; a call succeeds with progress; a call the
    client gave up on and sent again is the same operation with one effect; a lost provider
    response is "outcome unknown, do not retry" (not an error) with no second effect; invalid
    arguments are an MCP error naming the field with nothing enqueued; an approval-gated tool
    reports awaiting_approval."""
    c = await _up(make_cluster)
    async with stdio_session(c) as mcp:
        listed = {t.name: t for t in (await mcp.list_tools()).tools}
        assert set(listed) == CATALOG_TOOLS
        assert listed["charge_card"].input_schema["required"] == ["amount", "currency"]
        hints = {n: t.annotations for n, t in listed.items()}
        assert hints["fast_lookup"] is not None and hints["fast_lookup"].read_only_hint
        ticket = hints["create_ticket"]
        assert ticket is not None and ticket.idempotent_hint and not ticket.read_only_hint
        email = hints["send_email"]
        assert email is not None and email.destructive_hint and not email.idempotent_hint

        # A call, with progress notifications while the operation moves.
        seen: list[str] = []

        async def progress(progress: float, total: float | None, message: str | None) -> None:
            seen.append(message or "")

        done = await mcp.call_tool("create_ticket", {"title": "from mcp"},
                                   progress_callback=progress)
        data = done.structured_content
        assert not done.is_error and data["state"] == "succeeded", data
        assert data["result"]["body"] == {"title": "from mcp"}  # the provider's own answer
        assert data["receipt"]["digests"]["request"].startswith("sha256:")
        assert seen and seen[-1] == "state: succeeded", seen

        # The client loses the answer (cancels) and calls again: same operation, one effect.
        await _fault(c, "idempotent", {"kind": "delay", "seconds": 2})
        before = await _operations(c)
        lost = asyncio.create_task(mcp.call_tool(
            "charge_card", {"amount": 7, "currency": "EUR"},
            meta=RETRY_KEY))
        await wait_until(lambda: _grew(c, before), 20, what="the first call's operation")
        lost.cancel()
        again = await mcp.call_tool("charge_card", {"amount": 7, "currency": "EUR"},
                                    meta=RETRY_KEY)
        assert again.structured_content["state"] == "succeeded"
        assert await _operations(c) == before + 1
        op = await c.operation(again.structured_content["operation_id"])
        assert (await c.key_truth(op["operation_key"]))["applied"] == 1

        # The provider applies the effect and the answer is lost: unknown, do not retry.
        await _fault(c, "plainpager", {"kind": "drop_after_apply"})
        unknown = await mcp.call_tool("fast_page", {"text": "page ops"})
        info = unknown.structured_content
        assert not unknown.is_error and info["do_not_retry"] is True, info
        assert info["state"] in ("ambiguous", "needs_review") and info["outcome"] == "unknown"
        text = unknown.content[0].text  # type: ignore[union-attr]
        assert "UNKNOWN" in text and "Do NOT retry" in text
        retried = await mcp.call_tool("fast_page", {"text": "page ops"})
        assert retried.structured_content["operation_id"] == info["operation_id"]
        op = await c.operation(info["operation_id"])
        assert (await c.key_truth(op["operation_key"]))["applied"] == 1

        # Invalid arguments: an MCP error naming the field, nothing enqueued.
        before = await _operations(c)
        with pytest.raises(MCPError, match="currency"):
            await mcp.call_tool("charge_card", {"amount": 5})
        assert await _operations(c) == before

        # An approval-gated tool says so, and the same call waits on the same operation.
        gated = await mcp.call_tool("fast_wire", {"amount": 100})
        assert gated.structured_content["state"] == "awaiting_approval"
        assert not gated.is_error
        same = await mcp.call_tool("fast_wire", {"amount": 100})
        assert same.structured_content["operation_id"] == gated.structured_content[
            "operation_id"]


async def _grew(c: Cluster, before: int) -> bool:
    return await _operations(c) > before


@asynccontextmanager
async def http_server(c: Cluster) -> AsyncIterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    log = c.logs / "mcp-http.log"
    proc = _spawn_http(c, port, log)
    try:
        async def up() -> bool:
            assert proc.poll() is None, "the MCP server exited; see " + str(log)
            try:
                async with httpx.AsyncClient() as http:
                    await http.get(url, timeout=1.0)
                return True
            except httpx.TransportError:
                return False

        await wait_until(up, 30, interval=0.1, what="the MCP HTTP server")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def test_mcp_over_streamable_http_calls_once(
        make_cluster: Callable[..., Cluster]) -> None:
    """Over streamable HTTP (behind its bearer token): the catalog is listed, a call succeeds,
    and the same call again returns the same operation with one effect in the provider's
    ground truth. Without the token the endpoint answers 401."""
    c = await _up(make_cluster)
    async with http_server(c) as url:
        async with httpx.AsyncClient() as plain:
            assert (await plain.post(url, json={})).status_code == 401
        # The SDK's own HTTP client library, as its transport expects.
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {MCP_TOKEN}"},
                                  timeout=httpx2.Timeout(30.0, read=300.0))
        async with http, streamable_http_client(url, http_client=http) as (read, write), \
                ClientSession(read, write) as mcp:
            await _call_twice(c, mcp)


async def _call_twice(c: Cluster, mcp: ClientSession) -> None:
    await mcp.initialize()
    assert {t.name for t in (await mcp.list_tools()).tools} == CATALOG_TOOLS
    first = await mcp.call_tool("create_ticket", {"title": "over http"})
    assert first.structured_content["state"] == "succeeded", first
    second = await mcp.call_tool("create_ticket", {"title": "over http"})
    assert second.structured_content["operation_id"] == first.structured_content[
        "operation_id"]
    op = await c.operation(first.structured_content["operation_id"])
    assert (await c.key_truth(op["operation_key"]))["applied"] == 1
