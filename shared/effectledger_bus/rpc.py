"""Request-reply on plain nats-py core subscriptions: the serving side and the asking side.

The ledger's intents and claims are request-reply over core NATS (no JetStream), on every
operation's critical path. Through FastStream each request went through its middleware,
dependency-injection and message-wrapper stack, about a quarter of the ledger's CPU in the
benchmark's profile; here a request is one callback. The dispatcher's and the inbox's JetStream
consumers are plain nats-py too (effectledger_bus.pull).

nats-py runs one subscription's callbacks one after another; each request therefore gets its
own task, at most `concurrency` at once (beyond that the callback waits, which leaves further
requests in the subscription's pending buffer: back-pressure instead of unbounded tasks). Every
request gets a reply, also when the handler fails unexpectedly: a requester left without one
would wait for its timeout and retry blind.

Replies are the typed models of `effectledger_core.messages` (`IntentReply`, `ClaimReply`,
`OperationReply`, `ErrorReply`): the ledger encodes them, and `request` parses the answer into
the union the caller expects, so a malformed reply is a `PoisonMessage`, never a KeyError.

A request whose reply subject is not an inbox of someone who may ask it (`replies.py`) is
refused before any work: not handled, not answered (an answer there would be written into a
stream or the JetStream API on the requester's behalf), logged and counted.

When tracing is on, a request carries the asker's W3C context in its headers and is served in
a span that continues it, so what the ledger journals for a claim names the claim's trace.
A request without a context (tracing off on either side) is served with no span at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import ClassVar, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from effectledger_core.errors import EffectLedgerError
from effectledger_core.messages import ErrorDetail, ErrorReply, Message, encode, parse_answer
from effectledger_obs import metrics, tracing

log = logging.getLogger(__name__)

Handler = Callable[[bytes], Awaitable[bytes]]
# (request subject, reply subject) -> None to serve, or the stable reason for refusing.
ReplyCheck = Callable[[str, str], str | None]
# For wildcard subjects whose last tokens say who is asking (a tenant, a dispatcher id).
SubjectHandler = Callable[[str, bytes], Awaitable[bytes]]
R = TypeVar("R", bound=Message)
INTERNAL_ERROR = encode(ErrorReply(error=ErrorDetail(
    code="internal_error", message="the ledger failed to handle this request; retry",
    retryable=True)))


class NoReply(EffectLedgerError):
    """A request got no answer: timeout, no responders, or a closed connection."""

    code: ClassVar[str] = "no_reply"
    http_status: ClassVar[int] = 503
    retryable: ClassVar[bool] = True


async def request(nc: NatsClient, subject: str, payload: bytes, answer: type[R], *,
                  timeout_s: float) -> R | ErrorReply:
    """Ask once; the reply parsed as `answer`, or the `ErrorReply` the server sent instead.

    Raises NoReply when nobody answered in time, PoisonMessage (or PayloadTooLarge) when the
    reply is neither.
    """
    try:
        headers = tracing.inject(None)  # None when tracing is off
        msg = await nc.request(subject, payload, timeout=timeout_s,
                               headers=None if headers is None else dict(headers))
    except (TimeoutError, NatsTimeout, NoRespondersError, ConnectionClosedError) as exc:
        raise NoReply(f"{subject}: {type(exc).__name__}") from exc
    return parse_answer(answer, msg.data)


class RequestServer:
    """Serves request-reply subjects with bounded concurrency (see module docstring)."""

    def __init__(self, nc: NatsClient, *, reply_check: ReplyCheck | None = None) -> None:
        self.nc = nc
        self.reply_check = reply_check
        self.subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused = 0

    def _refused(self, msg: Msg) -> bool:
        """Whether `msg` is refused for its reply subject (counted, and logged sparingly: an
        attacker can send thousands)."""
        if self.reply_check is None or not msg.reply:
            return False
        verdict = self.reply_check(msg.subject, msg.reply)
        if verdict is None:
            return False
        self.refused += 1
        metrics.inc(metrics.RPC_REPLIES_REFUSED, verdict)
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("request on %s refused (%s, %d so far): reply subject %r is not an "
                        "inbox of a user that may ask this", msg.subject[:200], verdict,
                        self.refused, msg.reply[:200])
        return True

    async def serve(self, subject: str, handler: Handler, *, queue: str,
                    concurrency: int = 64) -> Subscription:
        return await self._serve(subject, lambda msg: handler(msg.data), queue=queue,
                                 concurrency=concurrency)

    async def serve_by_subject(self, subject: str, handler: SubjectHandler, *, queue: str,
                               concurrency: int = 64) -> Subscription:
        """Like `serve`, but the handler also gets the subject the request arrived on."""
        return await self._serve(subject, lambda msg: handler(msg.subject, msg.data),
                                 queue=queue, concurrency=concurrency)

    async def _serve(self, subject: str, handler: Callable[[Msg], Awaitable[bytes]], *,
                     queue: str, concurrency: int) -> Subscription:
        slots = asyncio.Semaphore(concurrency)

        span_name = f"serve {subject}"  # the subscribed pattern: no ids in span names

        async def answer(msg: Msg) -> None:
            try:
                parent = tracing.extract(msg.headers)
                if parent is None:
                    reply = await handler(msg)
                else:
                    with tracing.span(span_name, kind=tracing.SpanKind.SERVER, context=parent):
                        reply = await handler(msg)
            except Exception:
                log.exception("request on %s failed", subject)
                reply = INTERNAL_ERROR
            finally:
                slots.release()
            if msg.reply:
                try:
                    await self.nc.publish(msg.reply, reply)
                except Exception as exc:  # the requester times out and asks again
                    log.warning("reply on %s not sent: %s", subject, exc)

        async def on_message(msg: Msg) -> None:
            if self._refused(msg):
                return  # before any work: no handler, no reply
            await slots.acquire()
            task = asyncio.create_task(answer(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        # The pending limits bound what waits in this process while all slots are busy.
        sub = await self.nc.subscribe(subject, queue=queue, cb=on_message,
                                      pending_msgs_limit=65536,
                                      pending_bytes_limit=256 * 1024 * 1024)
        self.subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        """Stop taking requests, then let those in progress finish (and reply)."""
        for sub in self.subscriptions:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # a closed connection has no subscriptions left
                log.debug("unsubscribe: %s", exc)
        self.subscriptions = []
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
