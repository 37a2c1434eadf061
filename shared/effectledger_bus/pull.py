"""JetStream pull consumers on plain nats-py: each message is handled the moment it arrives.

The dispatcher's command consumer and the ledger's inbox carry every operation, so two things
matter here: latency and the per-message cost.

Latency. nats-py's `PullSubscription.fetch(n)` returns only when `n` messages have arrived or
its timeout has passed, unless messages were already buffered when it started. FastStream's
pull subscriber fetches that way, so at moderate load a message that arrived into an empty
fetch waited for the batch to fill (32 commands at 180 ops/s is 180 ms) or for the 1 s timeout:
the benchmark's half-rate p50 was 81 ms on a pipeline whose work takes a few. Here a pull
request asks for up to `batch` messages and every message that it brings is handed to its own
task at once; the request ends when it is filled, when the server expires it (status 408), or,
if a reconnect lost it, after `expires_s` plus a grace; then the next one is sent.

Cost. FastStream's concurrent subscriber passed each message through an anyio memory stream, a
worker, its middleware and dependency-injection stack and a message wrapper: about half the
dispatcher's CPU in the benchmark profile. Here a message is one task calling one handler.

So every JetStream consumer of the services is a `PullConsumer`, built by `durable_consumer`:
the dispatcher's commands, the ledger's inbox and the reconciler's commands (which carry only
the ambiguous few, but one way of consuming is easier to reason about than two). Handlers take an
`effectledger_bus.delivery.Delivery`.

Semantics kept from the FastStream setup this replaces:
- a durable consumer with explicit acks, created with the given config when missing (an
  existing durable is joined as it is, as nats-py's `pull_subscribe` does);
- the handler settles each message itself (ack, nak, in_progress); a handler that raises is
  logged and its message left unacked, so JetStream redelivers it after `ack_wait`;
- at most `concurrency` handlers run at once: a pull request asks only for free slots, so
  nothing waits in this process that another replica could be handling;
- stopping stops pulling, naks what still arrives (another replica takes it at once), then
  lets running handlers finish for up to `grace_s`: a dispatcher cancelled mid-call would
  leave an attempt ambiguous for no reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from effectledger_core.config import Settings
from effectledger_obs import metrics, tracing

from .delivery import Delivery, JsDelivery
from .streams import at_startup
from .topology import topology

log = logging.getLogger(__name__)

# Handlers get a `Delivery`, never a nats-py message: what they may do with it is the protocol.
MessageHandler = Callable[[Delivery], Awaitable[None]]
# How long past its `expires` a pull request that got no answer at all (lost in a reconnect)
# is still waited for before the next one is sent.
LOST_REQUEST_GRACE_S = 1.0
# After a refused pull (409: too many waiting requests, consumer deleted, ...; any 4xx) or a
# failed publish, wait this long before pulling again, doubling up to the cap.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0


class _Request:
    """The one outstanding pull request."""

    __slots__ = ("done", "remaining", "status", "token")

    def __init__(self, token: str, size: int) -> None:
        self.token = token
        self.remaining = size
        self.done = asyncio.Event()
        self.status = ""  # the server's status line if it ended the request

    def end(self, status: str = "") -> None:
        self.status = status
        self.done.set()


class PullConsumer:
    """One durable pull consumer feeding `handler` (see the module docstring)."""

    def __init__(self, nc: NatsClient, *, subject: str, stream: str, durable: str,
                 config: ConsumerConfig, handler: MessageHandler, concurrency: int,
                 batch: int = 64, expires_s: float = 2.0, grace_s: float = 10.0,
                 name: str | None = None) -> None:
        if concurrency < 1 or batch < 1:
            raise ValueError("concurrency and batch must be at least 1")
        if expires_s <= 0:
            raise ValueError("expires_s must be positive")
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.subject, self.stream, self.durable, self.config = subject, stream, durable, config
        self.handler = handler
        self.concurrency, self.batch = concurrency, min(batch, concurrency)
        # Under saturation, wait until a quarter of the slots are free rather than sending a
        # pull request per finished message.
        self.min_request = max(1, self.batch // 4)
        self.expires_s, self.grace_s = expires_s, grace_s
        self.name = name or durable
        prefix = getattr(self.js, "_prefix", "$JS.API")  # nats-py keeps the API prefix there
        self._next_subject = f"{prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = ""
        self._sub: Subscription | None = None
        self._request: _Request | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._room.set()
        self._stopping = False
        self.pull_requests = 0  # for tests and logs

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def start(self) -> None:
        await at_startup(self._ensure_consumer)  # a broker restarting now is waited for
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_message,
                                            pending_msgs_limit=65536,
                                            pending_bytes_limit=256 * 1024 * 1024)
        self._loop_task = asyncio.create_task(self._pull_loop(), name=f"pull:{self.name}")

    async def _ensure_consumer(self) -> None:
        try:
            await self.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            config = replace(self.config, durable_name=self.durable,
                             filter_subject=self.config.filter_subject or self.subject)
            await self.js.add_consumer(self.stream, config=config)

    async def _pull_loop(self) -> None:
        retry_s = RETRY_FIRST_S
        while not self._stopping:
            await self._room.wait()
            size = min(self.batch, self.concurrency - len(self._running))
            self.pull_requests += 1
            request = self._request = _Request(str(self.pull_requests), size)
            body = json.dumps({"batch": size, "expires": int(self.expires_s * 1e9)}).encode()
            try:
                await self.nc.publish(self._next_subject, body,
                                      reply=f"{self._inbox}.{request.token}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(request.done.wait(),
                                           self.expires_s + LOST_REQUEST_GRACE_S)
            except Exception as exc:  # the connection is closing or closed
                if self._stopping:
                    return
                log.warning("%s: pull request not sent (%s); retrying in %.1fs", self.name,
                            exc, retry_s)
                request.status = "unsent"
            # Any end but "filled", "expired" (408) or "lost" is a refusal: back off, so that a
            # server answering every pull with an error is not asked again in a tight loop.
            if request.status and not request.status.startswith("408"):
                if "Consumer Deleted" in request.status:
                    log.error("%s: the consumer was deleted; creating it again", self.name)
                    with contextlib.suppress(Exception):
                        await self._ensure_consumer()
                await asyncio.sleep(retry_s)  # back-off, not synchronisation
                retry_s = min(RETRY_MAX_S, retry_s * 2)
            else:
                retry_s = RETRY_FIRST_S

    async def _on_message(self, msg: Msg) -> None:
        # nats-py runs this callback for one message after another: it must not block.
        status = msg.headers.get("Status") if msg.headers else None
        if status is not None:
            if status == "100":
                return  # an idle heartbeat
            request = self._request
            if request is not None and msg.subject.endswith("." + request.token):
                description = msg.headers.get("Description", "") if msg.headers else ""
                if status != "408":  # 408: the request expired, the normal end of a quiet one
                    log.warning("%s: pull request ended with %s %s", self.name, status,
                                description)
                request.end(f"{status} {description}")
            return
        if self._stopping:
            with contextlib.suppress(Exception):
                await msg.nak()  # let another replica have it now, not after ack_wait
            return
        request = self._request
        if request is not None:
            request.remaining -= 1
            if request.remaining <= 0:
                request.end()
        task = asyncio.create_task(self._handle(msg))
        self._running.add(task)
        task.add_done_callback(self._done)
        if self.concurrency - len(self._running) < self.min_request:
            self._room.clear()

    async def _handle(self, msg: Msg) -> None:
        try:
            if not tracing.ENABLED:
                await self.handler(JsDelivery(msg, consumer=self.name))
                return
            # A span per delivery, in the trace of whoever published the message.
            with tracing.span(f"consume {self.name}", kind=tracing.SpanKind.CONSUMER,
                              context=tracing.extract(msg.headers),
                              attributes={"messaging.system": "nats",
                                          "messaging.destination.name": msg.subject}):
                await self.handler(JsDelivery(msg, consumer=self.name))
        except Exception:
            metrics.inc(metrics.MESSAGES_HANDLED, self.name, "error")
            # Left unacked on purpose: JetStream redelivers it after ack_wait.
            log.exception("%s: handler failed on %s; it will be redelivered", self.name,
                          msg.subject)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if self.concurrency - len(self._running) >= self.min_request:
            self._room.set()

    async def stop(self) -> None:
        """Stop pulling; let running handlers finish for up to `grace_s`, then cancel them."""
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        if self._running:
            _, late = await asyncio.wait(set(self._running), timeout=self.grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        if self._sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has nothing to undo
                await self._sub.unsubscribe()


def durable_consumer(nc: NatsClient, settings: Settings, durable: str, handler: MessageHandler,
                     *, concurrency: int, batch: int, name: str | None = None) -> PullConsumer:
    """The one way a service builds its JetStream consumer: the stream, the filter and the
    delivery settings (ack wait, deliveries, pending acks) of `durable` are those of the
    topology (`effectledger_bus.topology`, from the message catalogue), the same definition
    `effectledger streams apply` creates; only the process's own concurrency is the caller's."""
    for spec in topology(settings).consumers:
        if spec.config.durable_name == durable:
            return PullConsumer(nc, subject=spec.config.filter_subject or "", stream=spec.stream,
                                durable=durable, config=spec.config, handler=handler,
                                concurrency=concurrency, batch=batch, name=name)
    raise KeyError(f"no durable consumer {durable!r} in the topology")
