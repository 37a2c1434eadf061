"""Request-reply on plain nats-py (effectledger_bus.rpc), both sides, against a real NATS server."""

from __future__ import annotations

import asyncio
import json
import uuid

import nats
import pytest
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from effectledger_bus.rpc import NoReply, RequestServer, request
from effectledger_core.errors import PoisonMessage
from effectledger_core.messages import (
    ErrorDetail,
    ErrorReply,
    OperationQuery,
    OperationReply,
    OperationSummary,
    encode,
    parse,
)
from effectledger_obs import tracing


async def test_every_request_gets_its_reply_with_bounded_concurrency(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subject = f"t.rpc.{uuid.uuid4().hex}"
    running, peak = 0, 0
    release = asyncio.Event()

    async def handler(data: bytes) -> bytes:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 4:
            release.set()  # all slots taken: let everyone through
        await release.wait()
        running -= 1
        return b"re:" + data

    server = RequestServer(nc)
    try:
        await server.serve(subject, handler, queue="q", concurrency=4)
        replies = await asyncio.gather(*(nc.request(subject, str(i).encode(), timeout=10)
                                         for i in range(20)))
    finally:
        await server.close()
        await nc.close()
    assert [r.data for r in replies] == [f"re:{i}".encode() for i in range(20)]
    assert peak == 4  # never more than `concurrency` handlers at once


async def test_a_failing_handler_still_answers(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subject = f"t.rpc.{uuid.uuid4().hex}"

    async def handler(data: bytes) -> bytes:
        raise RuntimeError("boom")

    server = RequestServer(nc)
    try:
        await server.serve(subject, handler, queue="q")
        reply = await nc.request(subject, b"x", timeout=10)
    finally:
        await server.close()
        await nc.close()
    body = json.loads(reply.data)
    assert body["ok"] is False and body["error"]["code"] == "internal_error"


async def test_request_parses_the_typed_answer_or_the_error_reply(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subject = f"t.rpc.{uuid.uuid4().hex}"

    async def handler(data: bytes) -> bytes:
        query = parse(OperationQuery, data)
        if query.operation_id == "missing":
            return encode(ErrorReply(error=ErrorDetail(code="not_found", message="no such op")))
        return encode(OperationReply(operation=OperationSummary(
            id=query.operation_id, state="ambiguous", epoch=2, operation_key="k", tool="t")))

    server = RequestServer(nc)
    try:
        await server.serve(subject, handler, queue="q")
        found = await request(nc, subject, encode(OperationQuery(operation_id="op1")),
                              OperationReply, timeout_s=10)
        missing = await request(nc, subject, encode(OperationQuery(operation_id="missing")),
                                OperationReply, timeout_s=10)
    finally:
        await server.close()
        await nc.close()
    assert isinstance(found, OperationReply) and found.operation.epoch == 2
    assert isinstance(missing, ErrorReply) and missing.error.code == "not_found"


async def test_request_without_responders_is_no_reply(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(NoReply):
            await request(nc, f"t.rpc.{uuid.uuid4().hex}", b"{}", OperationReply,
                          timeout_s=2)
    finally:
        await nc.close()


async def test_a_malformed_answer_is_a_poison_message_not_a_key_error(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subject = f"t.rpc.{uuid.uuid4().hex}"

    async def handler(data: bytes) -> bytes:
        return b'{"ok": true, "operation": {"id": "x"}}'

    server = RequestServer(nc)
    try:
        await server.serve(subject, handler, queue="q")
        with pytest.raises(PoisonMessage):
            await request(nc, subject, b"{}", OperationReply, timeout_s=10)
    finally:
        await server.close()
        await nc.close()


async def test_a_traced_request_is_served_in_a_span_that_continues_the_askers_trace(
        nats_url: str) -> None:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("test", exporter=exporter)
    nc = await nats.connect(nats_url)
    subject = f"t.rpc.{uuid.uuid4().hex}"
    seen: list[str | None] = []

    async def handler(data: bytes) -> bytes:
        seen.append(tracing.current_traceparent())  # what the ledger journals a claim with
        return _REPLY

    server = RequestServer(nc)
    try:
        await server.serve(subject, handler, queue="q")
        with tracing.span("claim") as asking:
            assert asking is not None
            await request(nc, subject, b"{}", OperationReply, timeout_s=10)
        await request(nc, subject, b"{}", OperationReply, timeout_s=10)  # outside any span
    finally:
        await server.close()
        await nc.close()
        tracing.shutdown_tracing()
    [served] = [s for s in exporter.get_finished_spans() if s.name == f"serve {subject}"]
    assert served.parent is not None
    assert served.parent.span_id == asking.get_span_context().span_id
    assert served.context.trace_id == asking.get_span_context().trace_id
    traced, untraced = seen
    assert traced is not None
    assert traced.split("-")[1:3] == [format(served.context.trace_id, "032x"),
                                      format(served.context.span_id, "016x")]
    assert untraced is None  # no context asked with: served without a span


async def test_without_tracing_requests_carry_no_headers(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subject = f"t.rpc.{uuid.uuid4().hex}"
    got: list[object] = []

    async def answer(msg: Msg) -> None:
        got.append(msg.headers)
        await nc.publish(msg.reply, _REPLY)

    sub = await nc.subscribe(subject, cb=answer)
    try:
        with tracing.span("not recorded") as s:
            assert s is None
            await request(nc, subject, b"{}", OperationReply, timeout_s=10)
    finally:
        await sub.unsubscribe()
        await nc.close()
    assert got == [None]


# Any well-formed reply does: these tests are about the request's context, not its answer.
_REPLY = encode(ErrorReply(error=ErrorDetail(code="not_found", message="none",
                                            retryable=False)))
