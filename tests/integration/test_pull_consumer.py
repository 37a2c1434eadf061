"""JetStream pull consumers on plain nats-py (effectledger_bus.pull) against a real NATS server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from effectledger_bus.delivery import Delivery
from effectledger_bus.pull import MessageHandler, PullConsumer
from tests.support.cluster import wait_until


@dataclass
class Stream:
    nc: NatsClient
    name: str
    subject: str  # the consumer's filter, "<prefix>.>"

    def consumer(self, handler: MessageHandler, *, concurrency: int, ack_wait: float = 30.0,
                 **kw: Any) -> PullConsumer:
        return PullConsumer(self.nc, subject=self.subject, stream=self.name, durable="workers",
                            handler=handler, concurrency=concurrency,
                            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                                  ack_wait=ack_wait), **kw)

    async def publish(self, n: int) -> None:
        js = self.nc.jetstream()
        for i in range(n):
            await js.publish(f"{self.subject[:-2]}.m", str(i).encode())


@asynccontextmanager
async def consuming(consumer: PullConsumer) -> AsyncIterator[PullConsumer]:
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


@pytest.fixture
async def stream(nats_url: str) -> AsyncIterator[Stream]:
    nc = await nats.connect(nats_url)
    tag = uuid.uuid4().hex[:12]
    name, prefix = f"TPULL_{tag.upper()}", f"tpull.{tag}"
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[f"{prefix}.>"]))
    try:
        yield Stream(nc, name, f"{prefix}.>")
    finally:
        await js.delete_stream(name)
        await nc.close()


async def test_every_message_is_handled_with_bounded_concurrency(stream: Stream) -> None:
    await stream.publish(40)
    seen: list[bytes] = []
    running, peak = 0, 0
    all_in = asyncio.Event()

    async def handler(msg: Delivery) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)  # yield, so that concurrent handlers overlap if allowed
        seen.append(msg.data)
        running -= 1
        await msg.ack()
        if len(seen) == 40:
            all_in.set()

    async with consuming(stream.consumer(handler, concurrency=3, batch=10)):
        await asyncio.wait_for(all_in.wait(), 30)
    assert sorted(seen, key=int) == [str(i).encode() for i in range(40)]
    assert 1 <= peak <= 3


async def test_a_failing_handler_leaves_its_message_for_redelivery(stream: Stream) -> None:
    await stream.publish(1)
    deliveries: list[int] = []
    redelivered = asyncio.Event()

    async def handler(msg: Delivery) -> None:
        deliveries.append(msg.deliveries)
        if len(deliveries) == 1:
            raise RuntimeError("boom")  # not acked: JetStream must deliver it again
        await msg.ack()
        redelivered.set()

    async with consuming(stream.consumer(handler, concurrency=2, ack_wait=1.0)):
        await asyncio.wait_for(redelivered.wait(), 30)
    assert deliveries == [1, 2]


async def test_stop_lets_running_handlers_finish(stream: Stream) -> None:
    await stream.publish(2)
    started, finish = asyncio.Event(), asyncio.Event()
    done: list[bytes] = []
    count = 0

    async def handler(msg: Delivery) -> None:
        nonlocal count
        count += 1
        if count == 2:
            started.set()
        await finish.wait()
        await msg.ack()
        done.append(msg.data)

    consumer = stream.consumer(handler, concurrency=4)
    await consumer.start()
    await asyncio.wait_for(started.wait(), 30)
    stopping = asyncio.create_task(consumer.stop())
    await asyncio.sleep(0)
    assert not stopping.done()  # waiting for the two running handlers
    finish.set()
    await asyncio.wait_for(stopping, 30)
    assert sorted(done) == [b"0", b"1"]

    # An ack is a plain publish that JetStream applies on its own time: the consumer's state
    # shows it soon after, not necessarily by the next request (seen once on a loaded host).
    async def settled() -> bool:
        info = await stream.nc.jetstream().consumer_info(stream.name, "workers")
        return info.num_ack_pending == 0 and info.num_pending == 0

    await wait_until(settled, 10.0, what="both acks applied by JetStream")


async def test_stop_cancels_handlers_that_outlive_the_grace(stream: Stream) -> None:
    await stream.publish(1)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def handler(msg: Delivery) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # never finishes by itself
        except asyncio.CancelledError:
            cancelled.set()
            raise

    consumer = stream.consumer(handler, concurrency=1, grace_s=0.2)
    await consumer.start()
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.wait_for(consumer.stop(), 30)
    assert cancelled.is_set() and consumer.in_flight == 0


def test_nonsense_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PullConsumer(None, subject="a.>", stream="A", durable="d",  # type: ignore[arg-type]
                     config=ConsumerConfig(), handler=None, concurrency=0)  # type: ignore[arg-type]


async def test_a_message_into_an_open_pull_request_is_handled_at_once(stream: Stream) -> None:
    # The request asks for 32 and stays open for 30 s; nats-py's fetch(32) would hold the one
    # message until the batch filled or the 30 s passed. Here it must arrive well before.
    handled = asyncio.Event()

    async def handler(msg: Delivery) -> None:
        await msg.ack()
        handled.set()

    pulled = await _pull_seen(stream)
    async with consuming(stream.consumer(handler, concurrency=32, batch=32,
                                       expires_s=30.0)) as consumer:
        await asyncio.wait_for(pulled.wait(), 10)
        await stream.publish(1)
        await asyncio.wait_for(handled.wait(), 10)
    assert consumer.pull_requests == 1  # the same open request delivered it


async def test_a_deleted_consumer_is_created_again(stream: Stream) -> None:
    handled = asyncio.Event()

    async def handler(msg: Delivery) -> None:
        await msg.ack()
        handled.set()

    pulled = await _pull_seen(stream)
    async with consuming(stream.consumer(handler, concurrency=4, expires_s=30.0)):
        await asyncio.wait_for(pulled.wait(), 10)
        await stream.nc.jetstream().delete_consumer(stream.name, "workers")
        await stream.publish(1)
        await asyncio.wait_for(handled.wait(), 30)


async def _pull_seen(stream: Stream) -> asyncio.Event:
    """Set when a pull request for the consumer crosses the server (a copy, via core NATS)."""
    seen = asyncio.Event()

    async def saw(_: Delivery) -> None:
        seen.set()

    await stream.nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{stream.name}.workers", cb=saw)
    return seen
