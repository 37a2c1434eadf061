"""effectledger_client against the real ledger app (both databases): typed answers that are
exactly the documented views, and typed errors carrying the stable codes. Every test runs
twice: over the async client's default transport (aiohttp) to the app served by uvicorn on a
loopback port, as the ledger serves it, and over an `httpx.AsyncClient` of the caller's own
(the app in process)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import uvicorn

from effectledger_bus.httpedge import server_config
from effectledger_cli.embedded import free_port
from effectledger_client import (
    AsyncClient,
    Forbidden,
    IdempotencyConflict,
    InvalidRequest,
    NotFound,
    OperationView,
    RateLimited,
    Unauthenticated,
    Unavailable,
)
from effectledger_client.errors import error_from
from effectledger_core.quotas import QuotaLimits, TenantRates
from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator
from effectledger_ledger.service import LedgerService
from tests.integration.test_api_auth import (  # noqa: F401 - svc is a fixture
    AGENT_A,
    AGENTS,
    OPERATOR,
    OPERATORS,
    svc,
)
from tests.support import rawhttp


async def _ready() -> dict[str, bool]:
    return {"database": True}


Connect = Callable[[str | None], AsyncClient]


@contextlib.asynccontextmanager
async def served(app: object) -> AsyncIterator[str]:
    """`app` behind uvicorn on a loopback port, with the ledger's own HTTP edge."""
    port = free_port()
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port,
                                          log_level="warning", lifespan="off",
                                          header_timeout_s=10, body_timeout_s=10))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture(params=["aiohttp", "httpx"])
async def connect(request: pytest.FixtureRequest,
                  svc: LedgerService) -> AsyncIterator[Connect]:  # noqa: F811
    """Makes a client holding a token (None: no token)."""
    app = create_app(svc, ready=_ready, auth=Authenticator(AGENTS, OPERATORS))
    if request.param == "httpx":
        transport = httpx.ASGITransport(app=app)

        def in_process(token: str | None) -> AsyncClient:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return AsyncClient("http://ledger.test", http=httpx.AsyncClient(
                transport=transport, base_url="http://ledger.test", headers=headers))
        yield in_process
        return
    async with served(app) as url:
        yield lambda token: AsyncClient(url, token=token or "")


@pytest.fixture
async def agent(connect: Connect) -> AsyncIterator[AsyncClient]:
    async with connect(AGENT_A) as c:
        yield c


@pytest.fixture
async def operator(connect: Connect) -> AsyncIterator[AsyncClient]:
    async with connect(OPERATOR) as c:
        yield c


async def test_submit_wait_and_read_back_as_typed_views(agent: AsyncClient) -> None:
    """A gated submission answers at awaiting_approval; the same key again is the same
    operation (created False); receipt, journal and list parse as their views."""
    first = await agent.submit("payout", {"amount": 5}, idempotency_key="k1", wait_s=30)
    assert first.created and isinstance(first.operation, OperationView)
    assert first.operation.state == "awaiting_approval" and first.operation.settled
    again = await agent.submit("payout", {"amount": 5}, idempotency_key="k1")
    assert not again.created and again.operation.id == first.operation.id
    receipt = await agent.receipt(first.operation.id)
    assert receipt.state == "awaiting_approval" and receipt.open_uncertainties
    journal = await agent.journal(first.operation.id)
    assert journal.entries and journal.entries[0].operation_id == first.operation.id
    page = await agent.list(state="awaiting_approval")
    assert [o.id for o in page.items] == [first.operation.id]
    assert (await agent.wait(first.operation.id, 30)).state == "awaiting_approval"


async def test_operator_actions_return_the_operation(agent: AsyncClient,
                                                     operator: AsyncClient) -> None:
    op = (await agent.submit("payout", {"amount": 9})).operation
    approved = await operator.approve(op.id)  # binds to the digest shown now
    assert approved.state == "pending"
    cancelled = await operator.cancel(op.id, reason="changed my mind")
    assert cancelled.state == "cancelled"
    assert (await operator.review_queue()).items == []
    assert (await agent.tools()).tools and (await agent.stats()).operations


async def test_errors_are_typed_with_their_stable_codes(
        agent: AsyncClient, connect: Connect) -> None:
    with pytest.raises(NotFound) as nf:
        await agent.get("no-such-op")
    assert nf.value.code == "not_found" and nf.value.status == 404
    await agent.submit("lookup", {"q": 1}, idempotency_key="same")
    with pytest.raises(IdempotencyConflict) as conflict:
        await agent.submit("lookup", {"q": 2}, idempotency_key="same")
    assert conflict.value.code == "idempotency_key_conflict"
    with pytest.raises(InvalidRequest) as unknown:
        await agent.submit("no_such_tool", {})
    assert unknown.value.code == "unknown_tool"
    op = (await agent.submit("payout", {"amount": 1})).operation
    with pytest.raises(Forbidden):
        await agent.approve(op.id, epoch=op.epoch, arguments_digest=op.arguments_digest)
    async with connect("wrong-token") as stranger:
        with pytest.raises(Unauthenticated):
            await stranger.get(op.id)
    async with connect(None) as anonymous:
        with pytest.raises(Unauthenticated):
            await anonymous.get(op.id)


@pytest.mark.parametrize("odd_id", ["a%2Fb", "x?y=1#z", "é ü", "%00"])
async def test_an_operation_id_is_one_path_segment_whatever_it_holds(
        agent: AsyncClient, odd_id: str) -> None:
    """The id reaches the operations route quoted, as one segment: the ledger's own not_found,
    not the router's 404 for a path it does not serve (that would read as `http_404`)."""
    with pytest.raises(NotFound) as nf:
        await agent.get(odd_id)
    assert nf.value.code == "not_found"


def test_a_non_ledger_error_page_still_maps_by_status() -> None:
    err = error_from(502, None, "<html>bad gateway</html>")
    assert isinstance(err, Unavailable) and err.retryable and err.code == "http_502"


async def test_an_unreachable_ledger_is_unavailable_and_retryable() -> None:
    async with AsyncClient("http://127.0.0.1:9", timeout_s=2) as c:
        with pytest.raises(Unavailable) as exc:
            await c.get("x")
    assert exc.value.retryable and exc.value.code == "unreachable"


async def test_a_ledger_that_does_not_answer_in_time_is_unavailable() -> None:
    """A server that accepts and never answers: the read timeout (timeout_s, plus the wait
    for a waiting request) ends the call as Unavailable, not a hang."""
    held: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}", token="", timeout_s=0.3) as c:
            with pytest.raises(Unavailable) as exc:
                await asyncio.wait_for(c.get("x"), 10)
        assert exc.value.code == "unreachable"
    finally:
        for w in held:
            w.close()
        server.close()


async def test_a_proxy_page_that_is_not_json_is_still_a_typed_error() -> None:
    """A 502 HTML page from something in front of the ledger: Unavailable, by its status."""
    server = await rawhttp.answering([], rawhttp.response(
        b"502 Bad Gateway", b"<html>bad gateway</html>", b"text/html"))
    try:
        async with AsyncClient(rawhttp.url_of(server), token="") as c:
            with pytest.raises(Unavailable) as exc:
                await c.get("x")
        assert exc.value.code == "http_502" and "bad gateway" in exc.value.message
    finally:
        server.close()


async def test_a_quota_refusal_is_rate_limited_with_its_retry_after(
        svc: LedgerService, agent: AsyncClient) -> None:  # noqa: F811
    """429 is a typed RateLimited carrying the ledger's retry-after, retryable; nothing was
    recorded."""
    svc.quotas = QuotaLimits(rate_per_s=0.001, burst=1)
    svc.rates = TenantRates(svc.quotas.rate_per_s, svc.quotas.burst)
    await agent.submit("lookup", {"q": 1})
    before = (await agent.stats()).operations
    with pytest.raises(RateLimited) as limited:
        await agent.submit("lookup", {"q": 2})
    assert limited.value.retryable and limited.value.status == 429
    assert limited.value.retry_after_s is not None and limited.value.retry_after_s > 0
    assert (await agent.stats()).operations == before


def test_rate_limited_reads_the_header_when_the_body_has_no_figure() -> None:
    err = error_from(429, {"error": {"code": "quota_exceeded", "message": "slow down"}}, "",
                     "7")
    assert isinstance(err, RateLimited) and err.retry_after_s == 7.0


async def test_identical_calls_join_through_the_api(agent: AsyncClient) -> None:
    """join_identical over HTTP: keyed call, then the same call without the key: one operation
    (created False); a repeat label makes a second one."""
    first = await agent.submit("lookup", {"q": 5}, idempotency_key="host-1",
                               join_identical=True)
    again = await agent.submit("lookup", {"q": 5}, join_identical=True)
    assert first.created and not again.created and again.operation.id == first.operation.id
    assert again.operation.caller_key == "host-1"
    repeat = await agent.submit("lookup", {"q": 5}, join_identical=True, repeat="2")
    assert repeat.created and repeat.operation.id != first.operation.id


async def test_the_environments_proxy_is_used_and_no_proxy_is_honoured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As httpx did: HTTP_PROXY carries the request (absolute URI), NO_PROXY skips it."""
    via_proxy: list[bytes] = []
    direct: list[bytes] = []
    proxy, ledger = await rawhttp.answering(via_proxy), await rawhttp.answering(direct)
    ledger_url = rawhttp.url_of(ledger)
    monkeypatch.setenv("HTTP_PROXY", rawhttp.url_of(proxy))
    monkeypatch.delenv("http_proxy", raising=False)
    try:
        for no_proxy in ("", "127.0.0.1"):
            monkeypatch.setenv("NO_PROXY", no_proxy)
            monkeypatch.delenv("no_proxy", raising=False)
            async with AsyncClient(ledger_url, token="") as c:
                with pytest.raises(NotFound):
                    await c.get("op1")
    finally:
        proxy.close()
        ledger.close()
    via_proxy, direct = rawhttp.first_lines(via_proxy), rawhttp.first_lines(direct)
    assert via_proxy == [f"GET {ledger_url}/v1/operations/op1 HTTP/1.1".encode()]
    assert direct == [b"GET /v1/operations/op1 HTTP/1.1"]


async def test_a_base_url_with_a_path_prefixes_every_request() -> None:
    """A ledger behind a path prefix (a proxy's route): the prefix stays, as with httpx."""
    seen: list[bytes] = []
    server = await rawhttp.answering(seen)
    try:
        url = rawhttp.url_of(server) + "/ledger/"
        async with AsyncClient(url, token="") as c:
            with pytest.raises(NotFound):
                await c.get("op1")
    finally:
        server.close()
    seen = rawhttp.first_lines(seen)
    assert seen == [b"GET /ledger/v1/operations/op1 HTTP/1.1"]


def test_one_client_serves_calls_from_successive_event_loops(
        caplog: pytest.LogCaptureFixture) -> None:
    """A sync wrapper that runs each call in its own `asyncio.run` (as some agent frameworks
    do) keeps working with one AsyncClient: each loop gets its own connections, and the
    sessions of finished loops are not reported as leaked when collected."""
    import gc
    import http.server
    import threading

    class NotFoundJson(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # kept alive: each loop leaves a connection behind

        def do_GET(self) -> None:
            body = b'{"error": {"code": "not_found", "message": "no such operation"}}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFoundJson)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = AsyncClient(f"http://127.0.0.1:{server.server_address[1]}", token="")

    async def one() -> str:
        try:
            await client.get("op1")
        except NotFound as exc:
            return exc.code
        return "answered"

    try:
        assert [asyncio.run(one()) for _ in range(3)] == ["not_found"] * 3
        asyncio.run(client.aclose())
        gc.collect()
    finally:
        server.shutdown()
    assert not [r for r in caplog.records if "Unclosed" in r.getMessage()]
