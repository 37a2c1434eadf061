"""The MCP front door with the official `mcp` client (and FastMCP's) against a real stack: the
ledger, a dispatcher, the reconciler and the sandbox provider as processes, the MCP server over
stdio and over streamable HTTP. The sandbox's own count of applied effects is the ground
truth for "never twice"."""

from __future__ import annotations

import asyncio
import json
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
from mcp_types import CallToolResult, RequestParamsMeta

from effectledger_cli.embedded import free_port
from tests.support.cluster import Cluster, wait_until

pytestmark = pytest.mark.slow
# The documented fallback for SEP-3182's idempotencyKey: the key in `_meta` (the official
# SDK's call_tool cannot send the SEP's own field).
HOST_KEY = cast(RequestParamsMeta, {"effectledger/idempotencyKey": "host-key-1"})
CATALOG_TOOLS = {"create_ticket", "send_email", "charge_card", "crash_ticket", "fast_ticket",
                 "fast_lookup", "fast_email", "fast_post", "fast_page", "fast_wire"}
LISTED = CATALOG_TOOLS | {"operation_status"}
OPERATOR = "op-token-e2e"
TENANTS = {"tok-tenant-a": "tenant-a", "tok-tenant-b": "tenant-b"}


def _env(c: Cluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env["EFFECTLEDGER_LEDGER_URL"] = c.ledger_url
    return env


@asynccontextmanager
async def stdio_session(c: Cluster, *extra: str, env: dict[str, str] | None = None,
                        on_message: Any = None) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "effectledger_cli", "mcp", "--wait", "20", *extra],
        env=env if env is not None else _env(c), cwd=str(c.workdir))
    errlog = _open_log(c.logs / "mcp-stdio.log")
    try:
        async with stdio_client(params, errlog=errlog) as (read, write), \
                ClientSession(read, write, message_handler=on_message) as session:
            init = await session.initialize()
            advertised = {**(init.capabilities.experimental or {}),
                          **(init.capabilities.extensions or {})}
            ext = advertised["effectledger/idempotency"]
            assert ext["meta"] == "effectledger/idempotencyKey"
            assert ext["repeatArgument"] == "repeat"
            yield session
    finally:
        errlog.close()


def _open_log(path: Path) -> TextIO:
    return open(path, "w")  # closed by the caller once the server is gone


async def _up(make_cluster: Callable[..., Cluster], env: dict[str, str] | None = None
              ) -> Cluster:
    c = make_cluster(env)
    if env and "EFFECTLEDGER_OPERATOR_TOKENS" in env:
        c.ledger.headers["Authorization"] = f"Bearer {OPERATOR}"
    await c.start()
    await c.start_reconciler()
    return c


async def _fault(c: Cluster, route: str, action: dict[str, Any]) -> None:
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": action, "times": 1})
    assert resp.status_code == 200, resp.text


async def _operations(c: Cluster) -> int:
    return sum((await c.stats())["operations"].values())


async def _applied(c: Cluster) -> int:
    """The provider's ground truth: effects it applied, over all keys."""
    resp = await c.sandbox.get("/_truth")
    resp.raise_for_status()
    return int(resp.json()["total_applied"])


def _text(result: CallToolResult) -> str:
    return result.content[0].text  # type: ignore[union-attr]


def _same_in_text(result: CallToolResult) -> None:
    """The text is the structured content rendered: a model reading either sees the same."""
    data = result.structured_content
    assert data is not None
    text = _text(result)
    rendered = json.loads(text.rsplit("Structured: ", 1)[1])
    assert rendered == json.loads(json.dumps(data, default=str))
    if data.get("warning"):
        assert data["warning"] in text
    assert data["operation_id"] in text.split("\n")[0]


async def test_mcp_over_stdio_retry_rules_errors_and_metadata(
        make_cluster: Callable[..., Cluster]) -> None:
    """tools/list: schemas (with `repeat`), titles, outputSchema, annotations from the table,
    the status tool. Calls: a keyed call whose answer is lost and a key-less retry are one
    effect; a deliberate repeat is a second; a provider refusal (400) fails, and the same call
    once the cause is gone runs anew and succeeds; an unknown outcome is "do not retry" in
    text and structure with the safe re-call, and the status tool and the resource give the
    outcome; invalid arguments are an isError result naming the field, nothing enqueued."""
    c = await _up(make_cluster)
    async with stdio_session(c) as mcp:
        listed = {t.name: t for t in (await mcp.list_tools()).tools}
        assert set(listed) == LISTED
        card = listed["charge_card"]
        assert card.input_schema["required"] == ["amount", "currency", "repeat"]
        assert card.title == "Charge card" and card.output_schema is not None
        assert card.annotations is not None and card.annotations.destructive_hint
        assert card.annotations.idempotent_hint and not card.annotations.read_only_hint
        lookup = listed["fast_lookup"].annotations
        assert lookup is not None and lookup.read_only_hint and not lookup.destructive_hint
        assert "repeat" not in listed["fast_lookup"].input_schema.get("properties", {})
        status_hints = listed["operation_status"].annotations
        assert status_hints is not None and status_hints.read_only_hint

        # A call, with progress notifications while the operation moves.
        seen: list[str] = []

        async def progress(progress: float, total: float | None, message: str | None) -> None:
            seen.append(message or "")

        done = await mcp.call_tool("create_ticket", {"title": "from mcp"},
                                   progress_callback=progress)
        data = done.structured_content
        assert not done.is_error and data["outcome"] == "succeeded", data
        assert data["result"]["body"] == {"title": "from mcp"}  # the provider's own answer
        assert data["replayed"] is False and data["idempotency_key"].startswith("auto-")
        assert data["decided_by"] == "provider"
        assert seen and seen[-1] == "state: succeeded", seen
        _same_in_text(done)

        # Keyed call, its answer lost (the client gives up), the retry WITHOUT the key (a host
        # that restarted): the same operation, one effect at the provider.
        await _fault(c, "idempotent", {"kind": "delay", "seconds": 2})
        before, applied = await _operations(c), await _applied(c)
        lost = asyncio.create_task(mcp.call_tool(
            "charge_card", {"amount": 7, "currency": "EUR"}, meta=HOST_KEY))
        await wait_until(lambda: _grew(c, before), 20, what="the first call's operation")
        lost.cancel()
        again = await mcp.call_tool("charge_card", {"amount": 7, "currency": "EUR"})
        info = again.structured_content
        assert info["outcome"] == "succeeded" and info["replayed"] is True, info
        assert info["idempotency_key"] == "host-key-1"  # the key it ran under
        assert await _operations(c) == before + 1
        assert await _applied(c) == applied + 1

        # A deliberate repeat (the `repeat` argument the description teaches): a second effect.
        twice = await mcp.call_tool("charge_card", {"amount": 7, "currency": "EUR",
                                                    "repeat": "2"})
        assert twice.structured_content["replayed"] is False
        assert twice.structured_content["operation_id"] != info["operation_id"]
        assert await _applied(c) == applied + 2

        # The provider refuses (400): failed, nothing applied. The cause is gone (the fault was
        # for one request): the same call again runs anew and succeeds.
        await _fault(c, "idempotent", {"kind": "status_before_apply", "status": 400})
        applied = await _applied(c)
        refused = await mcp.call_tool("create_ticket", {"title": "refused once"})
        assert refused.is_error and refused.structured_content["outcome"] == "failed"
        assert "runs it anew" in _text(refused)
        fixed = await mcp.call_tool("create_ticket", {"title": "refused once"})
        assert not fixed.is_error and fixed.structured_content["outcome"] == "succeeded"
        assert fixed.structured_content["operation_id"] != refused.structured_content[
            "operation_id"]
        assert await _applied(c) == applied + 1

        # The provider applies the effect and the answer is lost: unknown, do not retry, with
        # the safe re-call and the way to learn the outcome, in text and in structure.
        await _fault(c, "plainpager", {"kind": "drop_after_apply"})
        unknown = await mcp.call_tool("fast_page", {"text": "page ops"})
        info = unknown.structured_content
        assert not unknown.is_error and info["do_not_retry"] is True, info
        assert info["state"] in ("ambiguous", "needs_review") and info["outcome"] == "unknown"
        assert info["safe_recall"] == {"tool": "fast_page",
                                       "arguments": {"text": "page ops"},
                                       "idempotency_key": info["idempotency_key"]}
        assert info["check_status"]["tool"] == "operation_status"
        text = _text(unknown)
        assert "UNKNOWN" in text and "Do NOT retry" in text and "Safe re-call" in text
        assert info["idempotency_key"] in text
        _same_in_text(unknown)
        status = await mcp.call_tool("operation_status", {"operation_id": info["operation_id"]})
        assert status.structured_content["operation_id"] == info["operation_id"]
        assert status.structured_content["open_uncertainties"]
        retried = await mcp.call_tool("fast_page", {"text": "page ops"})
        assert retried.structured_content["operation_id"] == info["operation_id"]
        op = await c.operation(info["operation_id"])
        assert (await c.key_truth(op["operation_key"]))["applied"] == 1
        read = await mcp.read_resource(info["check_status"]["resource"])
        assert json.loads(read.contents[0].text)["operation_id"] == info["operation_id"]  # type: ignore[union-attr]

        # Invalid arguments: a tool result naming the field and what is expected; nothing
        # enqueued.
        before = await _operations(c)
        bad = await mcp.call_tool("charge_card", {"amount": "five"})
        assert bad.is_error, bad
        errors = {e["pointer"]: e for e in bad.structured_content["errors"]}
        assert set(errors) == {"/amount", "/currency"}
        assert "integer" in (errors["/amount"]["expected"] or "")
        assert "/currency" in _text(bad)
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


def _spawn_http(c: Cluster, port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            # --unsafe-open-http: most of these clusters run the ledger open (no tokens); the
            # switch only matters then, and only on loopback.
            [sys.executable, "-m", "effectledger_cli", "mcp", "--http", f"127.0.0.1:{port}",
             "--wait", "20", "--unsafe-open-http"], env=_env(c), cwd=c.workdir, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _run_bare(c: Cluster, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "effectledger_cli", "mcp", *extra], env=_env(c),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


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


@asynccontextmanager
async def http_session(url: str, token: str) -> AsyncIterator[ClientSession]:
    # The SDK's own HTTP client library, as its transport expects.
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx2.Timeout(30.0, read=300.0))
    async with http, streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write) as mcp:
        await mcp.initialize()
        yield mcp


def _token_env() -> dict[str, str]:
    return {"EFFECTLEDGER_AGENT_TOKENS": json.dumps(TENANTS),
            "EFFECTLEDGER_OPERATOR_TOKENS": json.dumps({OPERATOR: "ops"})}


async def test_mcp_over_http_each_caller_is_its_own_tenant(
        make_cluster: Callable[..., Cluster]) -> None:
    """One HTTP server, two tenants' ledger tokens: each sees only its own operations, and
    the same call by the other tenant is its own operation. Without a token (or with one the
    ledger does not know): 401 with WWW-Authenticate pointing at the protected-resource
    metadata."""
    c = await _up(make_cluster, _token_env())
    async with http_server(c) as url:
        async with httpx.AsyncClient() as plain:
            # No token, a token the ledger does not know, an operator's token (it could read
            # every tenant's operations): all refused.
            for headers in ({}, {"Authorization": "Bearer not-a-ledger-token"},
                            {"Authorization": f"Bearer {OPERATOR}"}):
                refused = await plain.post(url, json={}, headers=headers)
                assert refused.status_code == 401
                assert "resource_metadata=" in refused.headers["www-authenticate"]
            meta = await plain.get(url.replace("/mcp", "/.well-known/oauth-protected-resource/mcp"))
            assert meta.status_code == 200 and meta.json()["resource"].endswith("/mcp")
        applied = await _applied(c)
        async with http_session(url, "tok-tenant-a") as a, \
                http_session(url, "tok-tenant-b") as b:
            assert {t.name for t in (await a.list_tools()).tools} == LISTED
            first = await a.call_tool("create_ticket", {"title": "over http"})
            op_a = first.structured_content["operation_id"]
            assert first.structured_content["outcome"] == "succeeded", first
            again = await a.call_tool("create_ticket", {"title": "over http"})
            assert again.structured_content["operation_id"] == op_a
            assert again.structured_content["replayed"] is True
            # Tenant b: a's operation does not exist for it; its own identical call is its own.
            peek = await b.call_tool("operation_status", {"operation_id": op_a})
            assert peek.is_error and peek.structured_content["error"] == "not_found"
            with pytest.raises(Exception, match="no operation"):
                await b.read_resource(f"effectledger://operations/{op_a}")
            theirs = await b.call_tool("create_ticket", {"title": "over http"})
            assert theirs.structured_content["operation_id"] != op_a
            assert theirs.structured_content["replayed"] is False
            mine = await a.call_tool("operation_status", {"operation_id": op_a})
            assert mine.structured_content["outcome"] == "succeeded"
        assert await _applied(c) == applied + 2
        assert (await c.operation(op_a))["tenant"] == "tenant-a"


async def test_stdio_takes_its_token_on_the_command_line(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    """Hosts start stdio servers with an empty environment: --token / --token-file carry the
    tenant's agent token. Without one the server says why in one line and exits."""
    c = await _up(make_cluster, _token_env())
    async with stdio_session(c, "--token", "tok-tenant-a") as mcp:
        done = await mcp.call_tool("create_ticket", {"title": "with --token"})
        assert done.structured_content["outcome"] == "succeeded", done
        assert (await c.operation(done.structured_content["operation_id"]))[
            "tenant"] == "tenant-a"
    token_file = tmp_path / "token"
    token_file.write_text("tok-tenant-b\n")
    async with stdio_session(c, "--token-file", str(token_file)) as mcp:
        done = await mcp.call_tool("create_ticket", {"title": "with --token-file"})
        assert (await c.operation(done.structured_content["operation_id"]))[
            "tenant"] == "tenant-b"
    bare = await asyncio.to_thread(_run_bare, c)
    assert bare.returncode == 2
    assert "refused the agent token (none given: pass --token" in bare.stderr
    # An operator's token is no agent's: refused at start too.
    operator = await asyncio.to_thread(_run_bare, c, "--token", OPERATOR)
    assert operator.returncode == 2 and "operator's token" in operator.stderr


async def test_fastmcp_client_over_stdio_and_http(make_cluster: Callable[..., Cluster]) -> None:
    """A second client library, FastMCP's: the same rules over both transports."""
    fastmcp = pytest.importorskip("fastmcp")
    from fastmcp.client.transports import StdioTransport, StreamableHttpTransport

    c = await _up(make_cluster)
    applied = await _applied(c)
    stdio = StdioTransport(command=sys.executable,
                           args=["-m", "effectledger_cli", "mcp", "--wait", "20"],
                           env=_env(c), cwd=str(c.workdir))
    async with fastmcp.Client(stdio) as client:
        names = {t.name for t in await client.list_tools()}
        assert names == LISTED
        first = await client.call_tool("create_ticket", {"title": "fastmcp"})
        again = await client.call_tool("create_ticket", {"title": "fastmcp"})
        assert first.structured_content is not None and again.structured_content is not None
        assert again.structured_content["operation_id"] == first.structured_content[
            "operation_id"]
        bad = await client.call_tool("charge_card", {"amount": 1}, raise_on_error=False)
        assert bad.is_error
    async with http_server(c) as url:
        async with fastmcp.Client(StreamableHttpTransport(url, auth="any-bearer")) as client:
            # The test ledger runs open (no tokens): any bearer is accepted, on loopback only.
            over_http = await client.call_tool("create_ticket", {"title": "fastmcp"})
            assert over_http.structured_content is not None
            assert over_http.structured_content["operation_id"] == first.structured_content[
                "operation_id"]
    assert await _applied(c) == applied + 1


async def test_the_outcome_later_status_tool_resource_and_notification(
        make_cluster: Callable[..., Cluster]) -> None:
    """An answer lost with no oracle: the call says unknown; the model subscribes to the
    operation's resource; an operator's review settles it; the subscriber is told
    (notifications/resources/updated) and the status tool says succeeded, decided by the
    operator's review."""
    c = await _up(make_cluster)
    updated: asyncio.Queue[str] = asyncio.Queue()

    async def on_message(message: Any) -> None:
        params = getattr(getattr(message, "params", None), "uri", None)
        if params is not None:
            updated.put_nowait(str(params))

    await _fault(c, "plainpager", {"kind": "drop_after_apply"})
    async with stdio_session(c, on_message=on_message) as mcp:
        unknown = await mcp.call_tool("fast_page", {"text": "page later"})
        info = unknown.structured_content
        assert info["outcome"] == "unknown", info
        uri = info["check_status"]["resource"]
        op_id = info["operation_id"]
        await wait_until(lambda: _in_state(c, op_id, "needs_review"), 30,
                         what="the operation to reach review")
        await mcp.subscribe_resource(uri)
        review = await c.ledger.post(f"/v1/operations/{op_id}/reviews", json={
            "conclusion": "completed", "evidence_ref": "pager log #1", "operator": "ada"})
        assert review.status_code == 200, review.text
        assert await asyncio.wait_for(updated.get(), 30) == uri
        status = await mcp.call_tool("operation_status", {"operation_id": op_id})
        data = status.structured_content
        assert data["outcome"] == "succeeded" and data["decided_by"] == "operator_review", data
        assert "Decided by: operator_review" in _text(status)


async def _in_state(c: Cluster, op_id: str, state: str) -> bool:
    return (await c.operation(op_id))["state"] == state
