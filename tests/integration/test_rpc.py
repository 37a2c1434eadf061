"""Request-reply on plain nats-py (effectledger_bus.rpc) against a real NATS server."""

from __future__ import annotations

import asyncio
import json
import uuid

import nats

from effectledger_bus.rpc import RequestServer


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
