"""The provider call: one HTTP attempt, classified without guessing (no NATS, no database).

Pure status/body classification runs over `FakeProviderClient` (in memory: adapters' httpx
requests in, httpx responses out); behaviour that is about sockets (hangs, connections
closed or reset mid-exchange, refused connections, pools, redirects, big bodies) runs against a
tiny raw-HTTP server on a free local port, through the production aiohttp client from
`make_client()`.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import logging
import socket
import struct
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import aiohttp
import httpx
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from pydantic import ValidationError
from yarl import URL

import effectledger_core
from effectledger_cli.embedded import free_port
from effectledger_core.catalog import Catalog, Tool
from effectledger_core.crash import CrashPointHit
from effectledger_core.errors import CatalogError
from effectledger_core.limits import MAX_HTTP_BODY_BYTES
from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    DispatchAttempt,
    FailureClass,
    Outcome,
    OutcomeAmbiguous,
)
from effectledger_core.results import ProviderResult
from effectledger_obs import tracing
from effectledger_providers.adapters import (
    DeclarativeAdapter,
    clear_adapter_cache,
    load_adapter,
)
from effectledger_providers.calls import (
    ReadbackResult,
    SendRefused,
    call_provider,
    make_client,
    parse_retry_after,
    readback,
)
from effectledger_providers.session import PoolTimeout
from effectledger_providers.testing import FakeProviderClient

SECRET = "sk_live_5f3a9c0d7e1b2a4c"
OTHER_SECRET = "xk-8d1e77a0c3b94f26"
SANDBOX_KEY = "sbx_0c7d51e2a9"
ENV = {"API_KEY": SECRET, "OTHER_KEY": OTHER_SECRET, "EFFECTLEDGER_SANDBOX_API_KEY": SANDBOX_KEY}
NOW = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)
DEMO = Catalog.load(Path(effectledger_core.__file__).parent / "demo_catalog.toml")


def clock() -> datetime:
    return NOW


def make_tool(**overrides: Any) -> Tool:
    data: dict[str, Any] = {
        "name": "create_thing", "endpoint": "http://provider.test/v1/things",
        "contract_revision": "r1", "headers": {"Authorization": "Bearer ${API_KEY}"},
        "timeout_s": 5,
    }
    return Tool.model_validate({**data, **overrides})


def make_cmd(**overrides: Any) -> DispatchAttempt:
    data: dict[str, Any] = {
        "operation_id": "op-1", "operation_key": "ck_abc123", "epoch": 7, "tool": "create_thing",
        "arguments": {"title": "hello", "amount": 1250, "currency": "EUR"},
        "arguments_digest": "sha256:a", "catalog_digest": "sha256:c", "contract_revision": "r1",
    }
    return DispatchAttempt.model_validate({**data, **overrides})


Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


class Provider(FakeProviderClient):
    """An in-memory provider that records every request it receives."""

    def client(self) -> Provider:
        return self


async def call(tool: Tool, answer: Handler, **kwargs: Any) -> tuple[Outcome, Provider]:
    provider = Provider(answer)
    async with provider.client() as client:
        outcome = await call_provider(client, tool, kwargs.pop("cmd", make_cmd()),
                                      attempt_id="att-1", dispatcher_id="disp-1", env=ENV,
                                      clock=clock, **kwargs)
    return outcome, provider


def status(code: int, body: Any = None, headers: dict[str, str] | None = None) -> Handler:
    def answer(request: httpx.Request) -> httpx.Response:
        if body is None:
            return httpx.Response(code, headers=headers)
        if isinstance(body, bytes | str):
            return httpx.Response(code, content=body, headers=headers)
        return httpx.Response(code, json=body, headers=headers)
    return answer


def raising(make: Callable[[str], Exception], text: str = "boom") -> Handler:
    def answer(request: httpx.Request) -> httpx.Response:
        raise make(text)
    return answer


def connector_error(text: str) -> Exception:
    key = aiohttp.ClientRequest("POST", URL("http://provider.test/")).connection_key
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, text))


def dns_error(text: str) -> Exception:
    key = aiohttp.ClientRequest("POST", URL("http://provider.test/")).connection_key
    return aiohttp.ClientConnectorDNSError(key, OSError(-2, text))


class BrokenStream(httpx.AsyncByteStream):
    """A response body that breaks off after its first bytes."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        raise aiohttp.ClientPayloadError("peer closed connection mid-body")


@pytest.fixture(autouse=True)
def _fresh_adapter_cache() -> None:
    clear_adapter_cache()


# --- what is sent ---------------------------------------------------------------------------

async def test_sends_operation_key_epoch_and_env_resolved_authorization_in_one_request() -> None:
    outcome, provider = await call(make_tool(), status(201, {"id": "t-1"}))
    assert isinstance(outcome, AttemptSucceeded)
    [request] = provider.requests
    assert request.method == "POST"
    assert request.url == "http://provider.test/v1/things"
    assert request.headers["Idempotency-Key"] == "ck_abc123"
    assert request.headers["Fencing-Token"] == "7"
    assert request.headers["Authorization"] == f"Bearer {SECRET}"
    assert json.loads(request.content) == make_cmd().arguments


async def test_form_body_renders_template_with_operation_key_as_client_reference() -> None:
    tool = DEMO.get("charge_card")
    outcome, provider = await call(tool, status(200, {"id": "ch_1"}), cmd=make_cmd(tool=tool.name))
    assert isinstance(outcome, AttemptSucceeded)
    [request] = provider.requests
    assert request.headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert parse_qs(request.content.decode()) == {
        "amount": ["1250"], "currency": ["EUR"], "client_reference": ["ck_abc123"]}
    assert request.headers["Idempotency-Key"] == "ck_abc123"
    assert request.headers["Authorization"] == f"Bearer {SANDBOX_KEY}"


async def test_idempotency_key_is_sent_whenever_a_header_name_is_configured() -> None:
    tool = DEMO.get("send_email")  # non-idempotent: the provider ignores it, a stable key is free
    assert not tool.capabilities.accepts_idempotency_key
    _, provider = await call(tool, status(200, {}), cmd=make_cmd(tool=tool.name))
    assert provider.requests[0].headers["Idempotency-Key"] == "ck_abc123"


async def test_no_key_or_fencing_header_when_the_catalog_disables_them() -> None:
    tool = make_tool(idempotency_header=None, fencing_header=None)
    _, provider = await call(tool, status(200, {}))
    assert "Idempotency-Key" not in provider.requests[0].headers
    assert "Fencing-Token" not in provider.requests[0].headers


async def test_get_tool_sends_arguments_as_query_without_body() -> None:
    _, provider = await call(make_tool(method="GET"), status(200, {}))
    [request] = provider.requests
    assert request.content == b""
    assert request.url.params["title"] == "hello"


async def test_on_sent_runs_once_right_before_the_request_leaves() -> None:
    events: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        events.append("provider")
        return httpx.Response(200)

    await call(make_tool(), answer, on_sent=lambda: events.append("on_sent"))
    assert events == ["on_sent", "provider"]


async def test_crash_in_on_sent_propagates_and_nothing_is_sent() -> None:
    def crash() -> None:
        raise CrashPointHit("dispatcher.before_call")

    provider = Provider(status(200))
    async with provider.client() as client:
        with pytest.raises(CrashPointHit):
            await call_provider(client, make_tool(), make_cmd(), attempt_id="a", dispatcher_id="d",
                                env=ENV, on_sent=crash)
    assert provider.requests == []


@pytest.mark.parametrize("tool_kw, cmd_kw, why", [
    ({"headers": {"Authorization": "Bearer ${MISSING_KEY}"}}, {}, "MISSING_KEY"),
    ({"body": {"x": "{args.nope}"}}, {}, "nope"),
])
async def test_unbuildable_request_is_invalid_argument_and_nothing_is_sent(
        tool_kw: dict[str, Any], cmd_kw: dict[str, Any], why: str) -> None:
    outcome, provider = await call(make_tool(**tool_kw), status(200), cmd=make_cmd(**cmd_kw))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.INVALID_ARGUMENT
    assert outcome.code == "request_build_failed"
    assert why in outcome.message
    assert outcome.http_status is None
    assert provider.requests == []


# --- answers: success -----------------------------------------------------------------------

async def test_2xx_succeeds_with_envelope_body_digest_and_json_id_as_provider_ref() -> None:
    body = b'{"id": "t-42", "status": "created"}'
    outcome, provider = await call(make_tool(), status(201, body))
    assert isinstance(outcome, AttemptSucceeded)
    assert len(provider.requests) == 1
    assert outcome.response_digest == "sha256:" + hashlib.sha256(body).hexdigest()
    assert outcome.provider_ref == "t-42"
    assert (outcome.operation_id, outcome.epoch, outcome.attempt_id, outcome.dispatcher_id) == (
        "op-1", 7, "att-1", "disp-1")
    assert outcome.at == NOW and outcome.http_status == 201
    assert outcome.duration_ms is not None and outcome.duration_ms >= 0


async def test_provider_ref_falls_back_to_x_request_id_truncated_to_256_chars() -> None:
    outcome, _ = await call(make_tool(), status(200, b"ok", {"X-Request-Id": "r" * 300}))
    assert isinstance(outcome, AttemptSucceeded)
    assert outcome.provider_ref == "r" * 256


@pytest.mark.parametrize("async_acceptance, expected", [
    (True, AttemptAccepted), (False, AttemptSucceeded)])
async def test_202_is_accepted_only_for_tools_with_async_acceptance(
        async_acceptance: bool, expected: type) -> None:
    tool = make_tool(capabilities={"async_acceptance": async_acceptance})
    outcome, _ = await call(tool, status(202, {"id": "job-1"}))
    assert type(outcome) is expected
    assert outcome.provider_ref == "job-1"


# --- answers: refusals ----------------------------------------------------------------------

@pytest.mark.parametrize("code, failure_class", [
    (400, FailureClass.INVALID_ARGUMENT), (422, FailureClass.INVALID_ARGUMENT),
    (401, FailureClass.AUTHENTICATION), (403, FailureClass.PERMISSION_DENIED),
    (404, FailureClass.NOT_FOUND), (410, FailureClass.NOT_FOUND),
    (418, FailureClass.PERMANENT), (451, FailureClass.PERMANENT), (501, FailureClass.PERMANENT),
])
async def test_definitive_refusals_map_status_to_failure_class(
        code: int, failure_class: FailureClass) -> None:
    outcome, provider = await call(make_tool(), status(code, b"nope"))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is failure_class
    assert outcome.code == f"http_{code}"
    assert outcome.http_status == code
    assert outcome.message.startswith(f"HTTP {code}")
    assert outcome.response_digest is not None
    assert len(provider.requests) == 1


async def test_provider_json_error_code_and_message_are_reported() -> None:
    body = {"error": {"code": "amount_too_small", "message": "amount must be at least 50"}}
    outcome, _ = await call(make_tool(), status(422, body))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.code == "amount_too_small"
    assert outcome.message == "HTTP 422: amount must be at least 50"


async def test_409_stale_fencing_token_is_a_permanent_refusal() -> None:
    """A provider that fenced us out refused the request: definitively not applied."""
    outcome, _ = await call(make_tool(), status(409, {"error": {"code": "stale_fencing_token"}}))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.PERMANENT
    assert outcome.code == "conflict:stale_fencing_token"
    assert outcome.idempotency == "yes" and outcome.guidance


@pytest.mark.parametrize("body", [{"error": {"code": "request_in_progress"}}, b""])
async def test_409_under_our_idempotency_key_is_ambiguous(body: Any) -> None:
    """Another attempt with the same key may still be running at the provider and apply."""
    outcome, _ = await call(make_tool(), status(409, body))
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "request_in_progress"


async def test_409_without_an_idempotency_header_is_a_permanent_conflict() -> None:
    tool = make_tool(idempotency_header=None)
    outcome, _ = await call(tool, status(409, {"error": {"code": "key_reused"}}))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.PERMANENT
    assert outcome.code == "conflict:key_reused"


async def test_long_provider_message_is_bounded_to_1000_chars() -> None:
    outcome, _ = await call(make_tool(), status(400, {"error": {"message": "x" * 5000}}))
    assert isinstance(outcome, AttemptFailed)
    assert len(outcome.message) == 1000


@pytest.mark.parametrize("retry_after, seconds", [
    ("30", 30.0),
    (format_datetime(NOW + timedelta(seconds=120), usegmt=True), 120.0),
    (format_datetime(NOW - timedelta(seconds=120), usegmt=True), 0.0),
    ("-5", 0.0),
    ("soon", None),
])
async def test_429_is_rate_limited_with_retry_after_in_both_forms_against_injected_clock(
        retry_after: str, seconds: float | None) -> None:
    outcome, _ = await call(make_tool(), status(429, b"", {"Retry-After": retry_after}))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.RATE_LIMITED
    assert outcome.retry_after_s == seconds


def test_parse_retry_after_accepts_delta_seconds_and_http_dates_and_rejects_garbage() -> None:
    assert parse_retry_after(" 12 ", NOW) == 12.0
    assert parse_retry_after("Sun, 01 Nov 2026 12:01:00 GMT", NOW) == 60.0
    assert parse_retry_after("Sun, 01 Nov 2026 11:00:00 GMT", NOW) == 0.0
    assert parse_retry_after("Sunday, 01-Nov-26 12:00:30 GMT", NOW) == 30.0  # RFC 850 form
    assert parse_retry_after("-1", NOW) == 0.0
    for bad in ("", "nan", "inf", "tomorrow", "12 parsecs"):
        assert parse_retry_after(bad, NOW) is None


async def test_503_with_retry_after_is_transient_refusal_by_the_503_before_body_rule() -> None:
    outcome, _ = await call(make_tool(), status(503, b"", {"Retry-After": "7"}))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.TRANSIENT
    assert outcome.retry_after_s == 7.0


@pytest.mark.parametrize("code", [500, 502, 503, 504])
async def test_server_errors_without_a_retry_promise_are_ambiguous(code: int) -> None:
    outcome, provider = await call(make_tool(), status(code, b"oops"))
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "server_error"
    assert outcome.http_status == code
    assert len(provider.requests) == 1


async def test_redirect_is_not_followed_and_is_ambiguous() -> None:
    outcome, provider = await call(make_tool(), status(303, b"", {"Location": "/v1/things/1"}))
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "invalid_response"
    assert len(provider.requests) == 1


async def test_secrets_from_headers_never_appear_in_outcome_messages() -> None:
    tool = make_tool(headers={"Authorization": "Bearer ${API_KEY}", "X-Api-Key": "${OTHER_KEY}"})

    def echo(request: httpx.Request) -> httpx.Response:
        text = f"bad auth {request.headers['Authorization']} / {request.headers['X-Api-Key']}"
        return httpx.Response(401, json={"error": {"code": f"bad_{SECRET}", "message": text}})

    def echo_text(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, text=f"token {SECRET} rejected; key={OTHER_SECRET}")

    def exploding(request: httpx.Request) -> httpx.Response:
        raise aiohttp.ClientOSError(f"lost while sending {request.headers['Authorization']}")

    for answer in (echo, echo_text, exploding):
        outcome, _ = await call(tool, answer)
        dumped = outcome.model_dump_json()
        assert SECRET not in dumped and OTHER_SECRET not in dumped
        assert "[redacted]" in dumped


async def test_a_provider_echoing_the_key_in_its_reference_never_puts_it_in_provider_ref(
        ) -> None:
    """`provider_ref` is provider text like any other: an API key echoed in `id` or
    `X-Request-Id` is redacted before it can reach the journal or the receipt."""
    def in_id(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": f"obj-{SECRET}"})

    def in_request_id(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={}, headers={"X-Request-Id": SECRET})

    for answer in (in_id, in_request_id):
        outcome, _ = await call(make_tool(), answer)
        assert isinstance(outcome, AttemptSucceeded)
        assert outcome.provider_ref is not None and SECRET not in outcome.provider_ref
        assert "[redacted]" in outcome.provider_ref


async def test_nul_and_unpaired_surrogates_from_a_provider_keep_the_verdict() -> None:
    """Bytes a database cannot hold are escaped, so the right outcome (here failed, and
    succeeded with its reference) can still be recorded."""
    def refused(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, content=b'{"error": {"code": "bad\\u0000", '
                                            b'"message": "no\\u0000\\ud800pe"}}',
                              headers={"content-type": "application/json"})

    def applied(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'{"id": "ref\\u0000x"}',
                              headers={"content-type": "application/json"})

    failed, _ = await call(make_tool(), refused)
    assert isinstance(failed, AttemptFailed)
    succeeded, _ = await call(make_tool(), applied)
    assert isinstance(succeeded, AttemptSucceeded) and succeeded.provider_ref == "ref\ufffdx"
    for outcome in (failed, succeeded):
        dumped = outcome.model_dump_json()
        assert "\\u0000" not in dumped and "\\ud800" not in dumped
        dumped.encode()


# --- transport failures ---------------------------------------------------------------------

@pytest.mark.parametrize("make, code", [
    (connector_error, "connect_failed"), (dns_error, "connect_failed"),
    (aiohttp.ConnectionTimeoutError, "connect_failed"), (PoolTimeout, "pool_timeout")])
async def test_failures_before_connecting_are_transient_because_nothing_was_sent(
        make: Callable[[str], Exception], code: str) -> None:
    outcome, provider = await call(make_tool(), raising(make))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.TRANSIENT
    assert outcome.code == code
    assert outcome.http_status is None
    assert len(provider.requests) == 1


@pytest.mark.parametrize("make, reason", [
    (aiohttp.SocketTimeoutError, "timeout"), (TimeoutError, "timeout"),
    (aiohttp.ServerDisconnectedError, "connection_lost"),
    (aiohttp.ClientOSError, "connection_lost"),
    (aiohttp.ClientConnectionResetError, "connection_lost"),
    (aiohttp.ClientPayloadError, "connection_lost"),
    (lambda text: aiohttp.ClientResponseError(aiohttp.RequestInfo(
        URL("http://provider.test/"), "POST", CIMultiDictProxy(CIMultiDict())), (),
        message=text), "connection_lost"),  # an unparsable status line
    (RuntimeError, "connection_lost")])
async def test_failures_after_connecting_are_ambiguous(
        make: Callable[[str], Exception], reason: str) -> None:
    outcome, provider = await call(make_tool(), raising(make))
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == reason
    assert len(provider.requests) == 1


async def test_2xx_whose_body_breaks_off_is_ambiguous_invalid_response() -> None:
    outcome, _ = await call(make_tool(), lambda r: httpx.Response(200, stream=BrokenStream(b"{")))
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "invalid_response"
    assert outcome.http_status == 200


async def test_4xx_whose_body_breaks_off_is_still_a_definitive_refusal() -> None:
    outcome, _ = await call(make_tool(), lambda r: httpx.Response(400, stream=BrokenStream(b"{")))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.INVALID_ARGUMENT
    assert outcome.response_digest is None


# --- real sockets ---------------------------------------------------------------------------

Behaviour = Callable[["RawServer", asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A raw HTTP/1.1 server on a free local port that reads one request, then misbehaves."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.requests: list[bytes] = []
        self.connections = 0
        self.release = asyncio.Event()
        self.got_request = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode("latin-1").split("\r\n"):
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            self.requests.append(head + await reader.readexactly(length))
            self.got_request.set()
            await self.behaviour(self, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        self.server.close()
        for writer in self._writers:
            writer.close()
        await self.server.wait_closed()

    def tool(self, timeout_s: float = 5.0) -> Tool:
        return make_tool(endpoint=f"http://127.0.0.1:{self.port}/v1/things", timeout_s=timeout_s)


async def real_call(tool: Tool) -> Outcome:
    async with make_client() as client:
        return await call_provider(client, tool, make_cmd(), attempt_id="att-1",
                                   dispatcher_id="disp-1", env=ENV, clock=clock)


async def hang(server: RawServer, writer: asyncio.StreamWriter) -> None:
    await server.release.wait()


async def close_at_once(server: RawServer, writer: asyncio.StreamWriter) -> None:
    return None


async def answer_201(server: RawServer, writer: asyncio.StreamWriter) -> None:
    body = b'{"id": "t-9"}'
    writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()


async def partial_200(server: RawServer, writer: asyncio.StreamWriter) -> None:
    writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"id": "t-')
    await writer.drain()


async def headers_then_hang(server: RawServer, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
    await writer.drain()
    await server.release.wait()


async def trickle_200(server: RawServer, writer: asyncio.StreamWriter) -> None:
    # Each chunk arrives well within httpx's per-read timeout; only the overall deadline ends it.
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    while not server.release.is_set():
        writer.write(b"1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)  # the server's pacing, not synchronisation


async def test_real_round_trip_succeeds_with_headers_on_the_wire() -> None:
    async with RawServer(answer_201) as server:
        outcome = await real_call(server.tool())
    assert isinstance(outcome, AttemptSucceeded)
    assert outcome.provider_ref == "t-9"
    [raw] = server.requests
    head = raw.decode().lower()
    assert "idempotency-key: ck_abc123" in head and "fencing-token: 7" in head
    assert f"authorization: bearer {SECRET}".lower() in head


async def test_provider_that_never_answers_is_ambiguous_timeout_after_exactly_one_request() -> None:
    async with RawServer(hang) as server:
        outcome = await real_call(server.tool(timeout_s=0.3))
        assert isinstance(outcome, OutcomeAmbiguous)
        assert outcome.reason == "timeout"
        assert server.connections == 1 and len(server.requests) == 1


async def test_connection_closed_after_request_read_is_connection_lost_without_retry() -> None:
    async with RawServer(close_at_once) as server:
        outcome = await real_call(server.tool())
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "connection_lost"
    assert server.connections == 1 and len(server.requests) == 1


async def test_refused_connection_is_transient_connect_failed_known_not_sent() -> None:
    port = free_port()  # free, and below the ephemeral range, so no client socket takes it
    outcome = await real_call(make_tool(endpoint=f"http://127.0.0.1:{port}/v1/things"))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.TRANSIENT
    assert outcome.code == "connect_failed"


@pytest.mark.parametrize("behaviour", [partial_200, headers_then_hang, trickle_200])
async def test_2xx_whose_body_does_not_arrive_in_full_within_the_deadline_is_ambiguous(
        behaviour: Behaviour) -> None:
    async with RawServer(behaviour) as server:
        outcome = await real_call(server.tool(timeout_s=0.3))
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "invalid_response"
    assert outcome.http_status == 200
    assert outcome.duration_ms is not None and outcome.duration_ms < 3000
    assert len(server.requests) == 1


# --- readback -------------------------------------------------------------------------------

async def do_readback(tool: Tool, answer: Handler, arguments: dict[str, Any] | None = None,
                      ) -> tuple[ReadbackResult, Provider]:
    provider = Provider(answer)
    async with provider.client() as client:
        result = await readback(client, tool, "ck_abc123", "op-1", arguments or {}, ENV)
    return result, provider


def readback_tool(**readback_kw: Any) -> Tool:
    spec = {"url": "http://provider.test/v1/by-key/{operation_key}?ref={args.ref}", **readback_kw}
    return make_tool(capabilities={"readback": True}, readback=spec)


async def test_readback_renders_url_with_quoted_arguments_and_sends_credentials() -> None:
    result, provider = await do_readback(readback_tool(), status(200, {"id": "t-1"}),
                                         {"ref": "a/b c"})
    # A readback that found the effect also keeps its answer for the agent.
    kept = ProviderResult(kind="json", value={"id": "t-1"}, bytes=12)
    assert result == ReadbackResult(True, "t-1", result.evidence_digest, 200, None,
                                    result=kept)
    assert result.evidence_digest is not None and result.evidence_digest.startswith("sha256:")
    [request] = provider.requests
    assert request.method == "GET"
    assert str(request.url) == "http://provider.test/v1/by-key/ck_abc123?ref=a%2Fb%20c"
    assert request.headers["Authorization"] == f"Bearer {SECRET}"


@pytest.mark.parametrize("readback_kw, answer, found", [
    ({}, status(404, {"error": {"code": "not_found"}}), False),
    ({}, status(500, b"oops"), None),
    ({"found_when": {"json_path": "$.data.items"}}, status(200, {"data": {"items": [1]}}), True),
    ({"found_when": {"json_path": "$.data.items"}}, status(200, {"data": {"items": []}}), False),
    ({"found_when": {"json_path": "$.id"}}, status(200, {"other": 1}), False),
    ({"found_when": {"json_path": "$.id"}}, status(200, b"<html>"), None),
    ({"not_found_status": 204}, status(204), False),
    ({}, raising(aiohttp.SocketTimeoutError), None),
])
async def test_readback_says_found_not_found_or_cannot_tell(
        readback_kw: dict[str, Any], answer: Handler, found: bool | None) -> None:
    result, _ = await do_readback(readback_tool(**readback_kw), answer, {"ref": "r"})
    assert result.found is found
    assert (result.error is None) == (found is not None)


async def test_a_counting_readback_names_every_effect_with_credentials_redacted() -> None:
    """Every listed effect's reference reaches the verdict (a duplicate names them all), each
    scrubbed like `provider_ref`: a key echoed in one never reaches the journal."""
    listing = {"data": [{"id": "t-1"}, {"id": f"t-{SECRET}"}, {"id": "t-1"}]}
    result, _ = await do_readback(readback_tool(count_path="$.data[*]"), status(200, listing),
                                  {"ref": "r"})
    assert result.matches == 3 and result.provider_refs[0] == "t-1"
    assert len(result.provider_refs) == 2 and SECRET not in "".join(result.provider_refs)
    assert "[redacted]" in result.provider_refs[1]


async def test_readback_without_configuration_cannot_tell() -> None:
    result, provider = await do_readback(make_tool(), status(200))
    assert result.found is None and result.error == "the tool has no readback"
    assert provider.requests == []


def test_readback_url_with_epoch_is_refused_at_load() -> None:
    """A readback spans all epochs, so `{epoch}` in its URL is a catalog error, not a 404."""
    with pytest.raises(ValidationError, match="epoch"):
        make_tool(readback={"url": "http://provider.test/{epoch}"})


# --- adapter loading ------------------------------------------------------------------------

ADAPTER_MODULE = '''
import httpx
from effectledger_core.messages import FailureClass
from effectledger_providers.adapters import Classified, DeclarativeAdapter

made = []

class SelfReporting(DeclarativeAdapter):
    """A provider that answers 200 with {"status": "failed"} when it refused."""
    def classify(self, tool, response):
        if response.status_code == 200 and response.json().get("status") == "failed":
            return Classified("failed", failure_class=FailureClass.SELF_REPORTED,
                              code="self_reported", message="provider reported failure")
        return super().classify(tool, response)

def make():
    made.append(1)
    return SelfReporting()

def explode():
    raise RuntimeError("no credentials file")

NOT_CALLABLE = 3
'''


@pytest.fixture
def adapter_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"el_test_adapters_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(ADAPTER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_tool_without_adapter_uses_the_declarative_adapter() -> None:
    assert isinstance(load_adapter(make_tool()), DeclarativeAdapter)


async def test_adapter_loads_by_import_path_once_per_tool_and_classifies(
        adapter_module: str) -> None:
    tool = make_tool(adapter=f"{adapter_module}:make")
    adapter = load_adapter(tool)
    assert load_adapter(tool) is adapter
    assert sys.modules[adapter_module].made == [1]
    outcome, _ = await call(tool, status(200, {"status": "failed"}))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.SELF_REPORTED


def test_adapter_loads_by_entry_point_name(
        adapter_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = metadata.EntryPoint(name="selfreport", value=f"{adapter_module}:make",
                             group="effectledger.adapters")
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group: [ep] if group == "effectledger.adapters" else [])
    assert type(load_adapter(make_tool(adapter="selfreport"))).__name__ == "SelfReporting"


@pytest.mark.parametrize("spec, says", [
    ("no_such_module_xyz:make", "No module named 'no_such_module_xyz'"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:NOT_CALLABLE", "is not callable"),
    ("{mod}:explode", "the factory raised RuntimeError: no credentials file"),
    ("{mod}:SelfReporting.__doc__", "is not callable"),
    ("{mod}:", "expected 'package.module:Factory'"),
    ("unknown_name", "no entry point of that name"),
])
def test_bad_adapter_spec_is_a_clear_catalog_error(
        adapter_module: str, spec: str, says: str) -> None:
    spec = spec.format(mod=adapter_module)
    with pytest.raises(CatalogError) as err:
        load_adapter(make_tool(adapter=spec))
    assert "tool 'create_thing'" in err.value.message and repr(spec) in err.value.message
    assert says in err.value.message
    assert err.value.details == {"tool": "create_thing", "field": "adapter"}


async def test_unloadable_adapter_fails_the_attempt_as_unbuildable_without_sending() -> None:
    outcome, provider = await call(make_tool(adapter="no_such_module_xyz:make"), status(200))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.code == "request_build_failed"
    assert "no_such_module_xyz" in outcome.message
    assert provider.requests == []


def test_factory_returning_a_non_adapter_is_a_clear_catalog_error(adapter_module: str) -> None:
    with pytest.raises(CatalogError, match="lacks build_request, classify"):
        load_adapter(make_tool(adapter="builtins:object"))


@pytest.mark.parametrize("method, allowed_checks", [
    ("POST", 0),  # refused in the connector, as the connection is handed over
    ("POST", 1),  # refused in the task that writes the body (headers are sent with it)
    ("GET", 0),  # no body: the connector's check is the last before aiohttp writes
])
async def test_before_write_refusal_after_connecting_sends_no_byte_and_is_transient(
        method: str, allowed_checks: int) -> None:
    received: list[bytes] = []
    checks = 0
    connection_ended = asyncio.Event()

    async def record_until_eof(reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read())  # everything the client wrote, until it closed
        writer.close()
        connection_ended.set()

    server = await asyncio.start_server(record_until_eof, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    def refuse() -> None:
        nonlocal checks
        checks += 1
        if checks > allowed_checks:
            raise SendRefused("send_deadline_passed", "nothing was sent: too late")

    try:
        async with make_client() as client:
            outcome = await call_provider(
                client, make_tool(endpoint=f"http://127.0.0.1:{port}/v1/things", method=method),
                make_cmd(),
                attempt_id="a", dispatcher_id="d", env=ENV, clock=clock, before_write=refuse)
        await asyncio.wait_for(connection_ended.wait(), 5)  # the client closed its socket
    finally:
        server.close()
    assert isinstance(outcome, AttemptFailed)
    assert (outcome.failure_class, outcome.code) == (FailureClass.TRANSIENT,
                                                     "send_deadline_passed")
    assert outcome.idempotency == "yes"  # known not applied: the retry policy may retry it
    # The check ran after connecting (the server saw a connection) and before writing (it
    # never saw a byte): nothing but the write itself lies between the check and the wire.
    assert received == [b""]


async def test_before_write_that_allows_sends_exactly_once() -> None:
    calls: list[str] = []
    async with RawServer(answer_201) as server:
        async with make_client() as client:
            outcome = await call_provider(client, server.tool(), make_cmd(), attempt_id="a",
                                          dispatcher_id="d", env=ENV, clock=clock,
                                          before_write=lambda: calls.append("check"))
    assert isinstance(outcome, AttemptSucceeded)
    # Checked as the connection is handed over and again as the body is written.
    assert calls == ["check", "check"] and len(server.requests) == 1


# --- the aiohttp client against real sockets: each error mapped as before ---------------------

def reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), as a crashed provider or a middlebox does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def reset_at_once(server: RawServer, writer: asyncio.StreamWriter) -> None:
    reset(writer)


async def reset_mid_body(server: RawServer, writer: asyncio.StreamWriter) -> None:
    writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"id": "t-')
    await writer.drain()
    reset(writer)


async def refuse_400_then_reset(server: RawServer, writer: asyncio.StreamWriter) -> None:
    writer.write(b'HTTP/1.1 400 Bad Request\r\nContent-Length: 100\r\n\r\n{"error":')
    await writer.drain()
    reset(writer)


async def redirect(server: RawServer, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 302 Found\r\nLocation: /v1/elsewhere\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()


BIG = MAX_HTTP_BODY_BYTES * 3 + 17


async def oversized_200(server: RawServer, writer: asyncio.StreamWriter) -> None:
    body = b'{"id": "t-big", "pad": "' + b"x" * (BIG - 26) + b'"}'
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    writer.write(body)
    await writer.drain()


async def gzip_201(server: RawServer, writer: asyncio.StreamWriter) -> None:
    body = gzip.compress(b'{"id": "t-gz"}')
    writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                 b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()


async def test_reset_before_any_answer_is_connection_lost_and_not_retried() -> None:
    async with RawServer(reset_at_once) as server:
        outcome = await real_call(server.tool())
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "connection_lost"
    assert server.connections == 1 and len(server.requests) == 1


async def test_reset_mid_body_of_a_2xx_is_ambiguous_and_of_a_4xx_still_a_refusal() -> None:
    async with RawServer(reset_mid_body) as server:
        outcome = await real_call(server.tool())
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "invalid_response" and outcome.http_status == 200
    async with RawServer(refuse_400_then_reset) as server:
        refused = await real_call(server.tool())
    assert isinstance(refused, AttemptFailed)
    assert refused.failure_class is FailureClass.INVALID_ARGUMENT
    assert refused.http_status == 400 and refused.response_digest is None


async def test_redirect_on_the_wire_is_not_followed() -> None:
    async with RawServer(redirect) as server:
        outcome = await real_call(server.tool())
    assert isinstance(outcome, OutcomeAmbiguous)
    assert outcome.reason == "invalid_response" and outcome.http_status == 302
    assert server.connections == 1 and len(server.requests) == 1
    assert b"/v1/elsewhere" not in server.requests[0]


async def test_oversized_body_is_digested_whole_and_kept_only_as_too_large() -> None:
    tool_kw = {"max_result_bytes": 1024}
    async with RawServer(oversized_200) as server:
        outcome = await real_call(make_tool(endpoint=f"http://127.0.0.1:{server.port}/v1/things",
                                            **tool_kw))
    assert isinstance(outcome, AttemptSucceeded)
    body = b'{"id": "t-big", "pad": "' + b"x" * (BIG - 26) + b'"}'
    assert outcome.response_digest == "sha256:" + hashlib.sha256(body).hexdigest()
    assert outcome.result == ProviderResult(kind="text", omitted="too_large", bytes=len(body))


async def test_compressed_answer_is_read_decoded() -> None:
    async with RawServer(gzip_201) as server:
        outcome = await real_call(server.tool())
    assert isinstance(outcome, AttemptSucceeded) and outcome.provider_ref == "t-gz"
    assert outcome.response_digest == "sha256:" + hashlib.sha256(b'{"id": "t-gz"}').hexdigest()


async def test_unresolvable_host_is_connect_failed_known_not_sent() -> None:
    outcome = await real_call(make_tool(endpoint="http://no-such-provider.invalid/v1/things",
                                        timeout_s=2))
    assert isinstance(outcome, AttemptFailed)
    assert outcome.failure_class is FailureClass.TRANSIENT
    assert outcome.code == "connect_failed"


async def test_no_free_connection_is_pool_timeout_and_nothing_is_sent() -> None:
    async with RawServer(hang) as server, make_client(max_connections=1) as client:
        first = asyncio.create_task(call_provider(
            client, server.tool(timeout_s=30), make_cmd(), attempt_id="a1", dispatcher_id="d",
            env=ENV))
        await server.got_request.wait()  # the first call holds the only connection
        second = await call_provider(client, server.tool(timeout_s=0.3), make_cmd(),
                                     attempt_id="a2", dispatcher_id="d", env=ENV)
        assert isinstance(second, AttemptFailed)
        assert second.code == "pool_timeout" and second.failure_class is FailureClass.TRANSIENT
        assert server.connections == 1 and len(server.requests) == 1
        server.release.set()  # the provider hangs up on the first call without an answer
        outcome = await first
    assert isinstance(outcome, OutcomeAmbiguous) and outcome.reason == "connection_lost"


class KeepAliveThenDrop:
    """Answers the first request on a connection and keeps it open; at the next request on it,
    closes without answering (a provider that crashed between two calls)."""

    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def test_idempotent_method_on_a_reused_connection_is_not_sent_twice() -> None:
    """aiohttp would send a GET again on a fresh connection when a reused one breaks; a
    provider call is exactly one request, whatever its method."""
    peer = KeepAliveThenDrop()
    server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tool = make_tool(endpoint=f"http://127.0.0.1:{port}/v1/things", method="GET")
    try:
        async with make_client() as client:
            first = await call_provider(client, tool, make_cmd(), attempt_id="a1",
                                        dispatcher_id="d", env=ENV)
            second = await call_provider(client, tool, make_cmd(), attempt_id="a2",
                                         dispatcher_id="d", env=ENV)
    finally:
        server.close()
        await server.wait_closed()
    assert isinstance(first, AttemptSucceeded)
    assert isinstance(second, OutcomeAmbiguous) and second.reason == "connection_lost"
    assert peer.connections == 1 and peer.requests == 2


async def test_traceparent_goes_to_the_provider_when_tracing_is_on() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    assert tracing.configure_tracing("test", exporter=InMemorySpanExporter())
    try:
        async with RawServer(answer_201) as server:
            with tracing.span("dispatch"):
                outcome = await real_call(server.tool())
    finally:
        tracing.shutdown_tracing()
    assert isinstance(outcome, AttemptSucceeded)
    assert b"traceparent: 00-" in server.requests[0].lower()


def test_provider_calls_log_no_request_lines(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> Outcome:
        async with RawServer(answer_201) as server:
            return await real_call(make_tool(
                endpoint=f"http://127.0.0.1:{server.port}/v1/things", method="GET"))

    with caplog.at_level(logging.DEBUG):
        outcome = asyncio.run(run())
    assert isinstance(outcome, AttemptSucceeded)
    assert not [r for r in caplog.records if "title=hello" in r.getMessage()
                or "/v1/things" in r.getMessage()]


async def test_http_proxy_from_the_environment_is_used_as_httpx_did(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with RawServer(answer_201) as proxy:
        for name in ("NO_PROXY", "no_proxy", "http_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        outcome = await real_call(make_tool())  # http://provider.test/v1/things, via the proxy
    assert isinstance(outcome, AttemptSucceeded) and outcome.provider_ref == "t-9"
    assert proxy.requests[0].startswith(b"POST http://provider.test/v1/things HTTP/1.1\r\n")
