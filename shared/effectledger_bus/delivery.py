"""One JetStream delivery as the services see it: settle it, keep it, or dead-letter it.

Every consumer (the dispatcher's commands, the ledger's inbox, the reconciler's commands) handles
a `Delivery`: the message, how often it was delivered, and the four ways to settle it. Handlers
take the protocol, so unit tests drive them with `effectledger_bus.testing.FakeDelivery`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from nats.aio.msg import Msg

from effectledger_core.messages import DeadLetter, excerpt
from effectledger_obs import metrics

# Dead-letter fields are bounded by the `DeadLetter` model (1 KiB each).
_FIELD_LIMIT = 1024


class Delivery(Protocol):
    """What a handler needs of a JetStream delivery (a nats-py message, or a fake)."""

    subject: str
    data: bytes
    headers: Mapping[str, str]
    deliveries: int  # 1 on the first delivery

    async def ack(self) -> None: ...
    async def nak(self, delay: float) -> None: ...
    async def term(self) -> None: ...
    async def in_progress(self) -> None: ...


class JsDelivery:
    """`Delivery` over a nats-py JetStream message."""

    __slots__ = ("consumer", "data", "deliveries", "headers", "msg", "subject")

    def __init__(self, msg: Msg, *, consumer: str | None = None) -> None:
        self.msg = msg
        # Names the consumer in `effectledger_messages_handled_total` (a code constant).
        self.consumer = consumer
        self.subject: str = msg.subject
        self.data: bytes = msg.data
        self.headers: Mapping[str, str] = msg.headers or {}
        # A message without a reply subject is not from a JetStream consumer (a test publishing
        # on core NATS): it has no metadata and counts as a first delivery.
        self.deliveries: int = msg.metadata.num_delivered if msg.reply else 1

    async def ack(self) -> None:
        await self.msg.ack()
        self._count("ack")

    async def nak(self, delay: float) -> None:
        await self.msg.nak(delay=delay)
        self._count("nak")

    async def term(self) -> None:
        await self.msg.term()
        self._count("term")

    def _count(self, result: str) -> None:
        if self.consumer is not None:
            metrics.inc(metrics.MESSAGES_HANDLED, self.consumer, result)

    async def in_progress(self) -> None:
        await self.msg.in_progress()


def message_id(d: Delivery) -> str | None:
    """The delivery's `Nats-Msg-Id`, if the publisher set one."""
    return d.headers.get("Nats-Msg-Id") or None


async def keep(d: Delivery) -> None:
    """Tell JetStream the message is still being worked on (`in_progress`), ignoring failure:
    the worst case is a redelivery to another replica, which every handler tolerates."""
    with contextlib.suppress(Exception):
        await d.in_progress()


def dead_letter(d: Delivery, *, consumer: str, error: str) -> DeadLetter:
    """The record of a message that will never be handled: where it came from and why."""
    msg_id = message_id(d)
    return DeadLetter(consumer=consumer, subject=d.subject[:_FIELD_LIMIT],
                      message_id=msg_id[:_FIELD_LIMIT] if msg_id else None,
                      error=error[:_FIELD_LIMIT], payload_excerpt=excerpt(d.data),
                      deliveries=d.deliveries)


@contextlib.asynccontextmanager
async def heartbeat(d: Delivery, interval_s: float) -> AsyncIterator[None]:
    """Send `in_progress` every `interval_s` while the body runs.

    Long work (a provider call, a readback, a slow publish) must not let `ack_wait` expire:
    JetStream would redeliver the message to another replica while this one still works on it.
    A failed heartbeat is ignored (see `keep`).

    A timer, not a task: nearly every body ends long before its first beat, and a task per
    body (created, stepped, cancelled, awaited) cost the dispatcher ~40 us per provider call
    where a timer costs ~3. The next beat is armed when the previous one has finished, so
    beats never overlap.
    """
    loop = asyncio.get_running_loop()
    beating: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    live = True

    def arm(_done: object = None) -> None:
        # A beat that finished just as the body ended calls this after the exit: no new timer.
        nonlocal timer
        if live:
            timer = loop.call_later(interval_s, beat)

    def beat() -> None:
        nonlocal beating
        beating = loop.create_task(keep(d))
        beating.add_done_callback(arm)

    arm()
    try:
        yield
    finally:
        live = False
        assert timer is not None
        timer.cancel()
        if beating is not None and not beating.done():
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await beating
