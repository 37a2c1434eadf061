"""The reconciler's consumer: one `ReconcileOperation` delivery → ack, nak(delay) or a verdict.

Order, for each delivery:
1. parse (poison → dead letter, ack);
2. ask the ledger for the operation (no answer → nak with backoff);
3. `strategy.decide`; at most one readback, then `strategy.after_readback`;
4. a verdict is published with `Nats-Msg-Id = verdict:<operation>:<epoch>:<verdict>` and the
   command is acked only after JetStream's publish-ack.
Several replicas share the durable consumer. Two of them deciding the same epoch (a paused
replica whose ack_wait expired) is harmless: equal verdicts collapse on the message id, and the
ledger applies only the first verdict for an epoch, rejecting and journaling the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from effectledger_core.catalog import Catalog, Tool
from effectledger_core.errors import BrokerUnavailable, PayloadTooLarge, PoisonMessage, UnknownTool
from effectledger_core.ids import Clock, utcnow
from effectledger_core.messages import (
    DeadLetter,
    ReconcileOperation,
    VerdictReached,
    encode,
    excerpt,
    parse,
)
from effectledger_core.subjects import Subjects
from effectledger_dispatcher.provider import readback as provider_readback

from . import strategy
from .ledger_client import LedgerClient, LedgerUnavailable
from .publisher import Publisher
from .strategy import ReadbackAnswer, Timing

log = logging.getLogger(__name__)
CONSUMER = "reconciler"
ACK_WAIT_S = 30.0

ReadbackFn = Callable[[Tool, ReconcileOperation], Awaitable[ReadbackAnswer]]


class Delivery(Protocol):
    """What the worker needs of a JetStream delivery (the dispatcher's `JsDelivery`, a fake)."""

    subject: str
    data: bytes
    headers: Mapping[str, str]
    deliveries: int

    async def ack(self) -> None: ...
    async def nak(self, delay: float) -> None: ...
    async def in_progress(self) -> None: ...


def http_readback(client: httpx.AsyncClient, env: Mapping[str, str]) -> ReadbackFn:
    """Readback through the dispatcher's provider code (same adapters, `${ENV}` headers)."""

    async def run(tool: Tool, cmd: ReconcileOperation) -> ReadbackAnswer:
        result = await provider_readback(client, tool, cmd.operation_key, cmd.operation_id,
                                         dict(cmd.arguments), env)
        return ReadbackAnswer(found=result.found, provider_ref=result.provider_ref,
                              digest=result.evidence_digest, http_status=result.http_status,
                              error=result.error, matches=result.matches)

    return run


def verdict_msg_id(verdict: VerdictReached) -> str:
    return f"verdict:{verdict.operation_id}:{verdict.epoch}:{verdict.verdict}"


@dataclass
class Reconciler:
    ledger: LedgerClient
    publisher: Publisher
    catalog: Catalog
    subjects: Subjects
    reconciler_id: str
    readback: ReadbackFn
    timing: Timing = field(default_factory=Timing)
    clock: Clock = utcnow
    ack_wait_s: float = ACK_WAIT_S
    publish_retry_s: float = 0.2  # first pause between publish attempts (then doubled)
    stats: dict[str, int] = field(default_factory=lambda: {
        "applied": 0, "not_applied": 0, "undecidable": 0, "waits": 0, "done": 0,
        "readbacks": 0, "dead_lettered": 0, "ledger_unavailable": 0, "publish_failed": 0})

    async def handle(self, d: Delivery) -> None:
        try:
            await self._handle(d)
        except Exception:
            # A bug or an unexpected library error: never lose the command, look again later.
            log.exception("reconciler: unexpected error on %s", d.subject)
            await d.nak(delay=strategy.backoff(d.deliveries, self.timing))

    async def _handle(self, d: Delivery) -> None:
        try:
            cmd = parse(ReconcileOperation, d.data)
        except (PoisonMessage, PayloadTooLarge) as exc:
            await self._reject(d, exc.message)
            return
        try:
            op = await self.ledger.operation(cmd.operation_id)
        except LedgerUnavailable as exc:
            self.stats["ledger_unavailable"] += 1
            log.warning("reconcile %s: %s", cmd.operation_id, exc.message)
            await self._wait(d, strategy.ledger_unavailable(d.deliveries, self.timing))
            return
        try:
            tool: Tool | None = self.catalog.get(cmd.tool)
        except UnknownTool:
            tool = None
        decision = strategy.decide(cmd, op, tool, now=self.clock(), deliveries=d.deliveries,
                                   timing=self.timing)
        if isinstance(decision, strategy.NeedReadback):
            assert tool is not None
            decision = await self._readback(d, cmd, tool)
        if isinstance(decision, strategy.Done):
            self.stats["done"] += 1
            log.debug("reconcile %s: %s", cmd.operation_id, decision.reason)
            await d.ack()
        elif isinstance(decision, strategy.Wait):
            await self._wait(d, decision)
        elif isinstance(decision, strategy.Reject):
            await self._reject(d, decision.reason)
        else:
            await self._verdict(d, cmd, decision)

    async def _readback(self, d: Delivery, cmd: ReconcileOperation,
                        tool: Tool) -> strategy.AfterReadback:
        self.stats["readbacks"] += 1
        sent_at = self.clock()  # taken before sending: "not found" counts from here
        async with self._heartbeat(d):
            answer = await self.readback(tool, cmd)
        return strategy.after_readback(cmd, tool, answer, sent_at=sent_at,
                                       answered_at=self.clock(), deliveries=d.deliveries,
                                       timing=self.timing)

    async def _wait(self, d: Delivery, wait: strategy.Wait) -> None:
        self.stats["waits"] += 1
        log.debug("reconcile: waiting %.2fs: %s", wait.delay_s, wait.reason)
        await d.nak(delay=wait.delay_s)

    async def _verdict(self, d: Delivery, cmd: ReconcileOperation,
                       decision: strategy.Decide) -> None:
        verdict = VerdictReached(operation_id=cmd.operation_id, epoch=cmd.epoch,
                                 verdict=decision.verdict, evidence=decision.evidence,
                                 reconciler_id=self.reconciler_id, reason=decision.reason,
                                 at=self.clock())
        try:
            async with self._heartbeat(d):
                await self._publish_with_retries(self.subjects.verdict, encode(verdict),
                                                 verdict_msg_id(verdict))
        except BrokerUnavailable as exc:
            self.stats["publish_failed"] += 1
            log.error("reconcile %s: verdict not stored: %s", cmd.operation_id, exc.message)
            await d.nak(delay=strategy.backoff(d.deliveries, self.timing))
            return
        self.stats[decision.verdict] += 1
        log.info("reconcile %s epoch %d: %s (%s)", cmd.operation_id, cmd.epoch,
                 decision.verdict, decision.reason)
        await d.ack()

    async def _reject(self, d: Delivery, error: str) -> None:
        letter = DeadLetter(consumer=CONSUMER, subject=d.subject[:1024],
                            message_id=(d.headers.get("Nats-Msg-Id") or "")[:1024] or None,
                            error=error[:1024], payload_excerpt=excerpt(d.data),
                            deliveries=d.deliveries)
        msg_id = f"deadletter:{CONSUMER}:{letter.message_id or d.subject}:{d.deliveries}"
        try:
            await self._publish_with_retries(self.subjects.deadletter, encode(letter), msg_id)
        except BrokerUnavailable as exc:
            log.error("could not dead-letter a message on %s: %s", d.subject, exc.message)
            await d.nak(delay=strategy.backoff(d.deliveries, self.timing))
            return
        self.stats["dead_lettered"] += 1
        log.warning("dead-lettered a message on %s: %s", d.subject, error)
        await d.ack()

    async def _publish_with_retries(self, subject: str, payload: bytes, msg_id: str,
                                    attempts: int = 3) -> None:
        # Republishing with the same message id is safe: JetStream keeps one copy.
        for attempt in range(1, attempts + 1):
            try:
                await self.publisher.publish(subject, payload, msg_id=msg_id)
                return
            except BrokerUnavailable:
                if attempt == attempts:
                    raise
                await asyncio.sleep(self.publish_retry_s * 2 ** (attempt - 1))

    @contextlib.asynccontextmanager
    async def _heartbeat(self, d: Delivery) -> AsyncIterator[None]:
        """Keep ack_wait from expiring while a slow readback or publish is under way."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.ack_wait_s / 3)
                with contextlib.suppress(Exception):
                    await d.in_progress()

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
