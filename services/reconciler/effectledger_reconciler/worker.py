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

Logs: a wait is one INFO line when it starts and one when the reconciler decides (with how
many redeliveries and how long it waited), not a line per redelivery; every line about a
command carries its operation_id, epoch, attempt_id, tool and, when traced, trace_id.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from effectledger_bus import catalogue
from effectledger_bus.delivery import Delivery, dead_letter, heartbeat
from effectledger_bus.publish import Publisher, publish_with_retries
from effectledger_bus.topology import RECONCILER_ACK_WAIT_S
from effectledger_core.catalog import Catalog, Tool
from effectledger_core.errors import BrokerUnavailable, PayloadTooLarge, PoisonMessage, UnknownTool
from effectledger_core.ids import Clock, utcnow
from effectledger_core.messages import ReconcileOperation, VerdictReached, encode, parse
from effectledger_core.readbacks import ReadbackResult
from effectledger_core.subjects import Subjects
from effectledger_obs import logs, metrics, tracing
from effectledger_providers.calls import readback as provider_readback
from effectledger_providers.session import ProviderClient

from . import decisions, strategy
from .decisions import Timing
from .ledger_client import LedgerClient, LedgerUnavailable

log = logging.getLogger(__name__)
CONSUMER = catalogue.RECONCILER
# The consumer's ack wait (topology): heartbeats are paced by it.
ACK_WAIT_S = RECONCILER_ACK_WAIT_S
PUBLISH_ATTEMPTS = 3
# Waits remembered for their closing log line; beyond this (commands abandoned mid-wait, e.g.
# taken over by another replica) the oldest are forgotten, and only their end line is lost.
MAX_WAITING = 10_000

ReadbackFn = Callable[[Tool, ReconcileOperation], Awaitable[ReadbackResult]]


@dataclass
class _Waiting:
    since: datetime
    waits: int = 1


def http_readback(client: ProviderClient, env: Mapping[str, str]) -> ReadbackFn:
    """Readback through the shared provider code (same adapters, `${ENV}` headers)."""

    async def run(tool: Tool, cmd: ReconcileOperation) -> ReadbackResult:
        return await provider_readback(client, tool, cmd.operation_key, cmd.operation_id,
                                       dict(cmd.arguments), env)

    return run


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
    # (operation id, epoch) of the commands this replica is waiting on (see the module doc).
    _waiting: dict[tuple[str, int], _Waiting] = field(default_factory=dict)

    async def handle(self, d: Delivery) -> None:
        try:
            await self._handle(d)
        except Exception:
            # A bug or an unexpected library error: never lose the command, look again later.
            log.exception("reconciler: unexpected error on %s", d.subject)
            await d.nak(delay=decisions.backoff(d.deliveries, self.timing))

    async def _handle(self, d: Delivery) -> None:
        try:
            cmd = parse(ReconcileOperation, d.data)
        except (PoisonMessage, PayloadTooLarge) as exc:
            await self._reject(d, exc.message)
            return
        with logs.bind(operation_id=cmd.operation_id, epoch=cmd.epoch, tool=cmd.tool,
                       attempt_id=cmd.attempt_id):
            await self._reconcile(d, cmd)

    async def _reconcile(self, d: Delivery, cmd: ReconcileOperation) -> None:
        try:
            op = await self.ledger.operation(cmd.operation_id)
        except LedgerUnavailable as exc:
            self.stats["ledger_unavailable"] += 1
            log.warning("reconcile: ledger unavailable: %s", exc.message)
            await self._wait(d, cmd, strategy.ledger_unavailable(d.deliveries, self.timing))
            return
        try:
            tool: Tool | None = self.catalog.get(cmd.tool)
        except UnknownTool:
            tool = None
        decision = strategy.decide(cmd, op, tool, now=self.clock(), deliveries=d.deliveries,
                                   timing=self.timing)
        if isinstance(decision, decisions.NeedReadback):
            assert tool is not None
            decision = await self._readback(d, cmd, tool)
        if isinstance(decision, decisions.Done):
            self.stats["done"] += 1
            log.info("reconcile: no verdict to give: %s%s", decision.reason, self._waited(cmd))
            await d.ack()
        elif isinstance(decision, decisions.Wait):
            await self._wait(d, cmd, decision)
        elif isinstance(decision, decisions.Reject):
            self._waited(cmd)
            await self._reject(d, decision.reason)
        else:
            await self._verdict(d, cmd, decision)

    async def _readback(self, d: Delivery, cmd: ReconcileOperation,
                        tool: Tool) -> decisions.AfterReadback:
        self.stats["readbacks"] += 1
        sent_at = self.clock()  # taken before sending: "not found" counts from here
        async with heartbeat(d, self.ack_wait_s / 3):
            with tracing.span("readback", kind=tracing.SpanKind.CLIENT,
                              attributes={"effectledger.tool": tool.name,
                                          "effectledger.operation_id": cmd.operation_id}):
                answer = await self.readback(tool, cmd)
        result = ("found" if answer.found else "not_found" if answer.found is False
                  else "error")
        metrics.inc(metrics.READBACKS, tool.name, result)
        if result == "error":
            # Not silent: an unset `${VAR}` or a provider outage shows on every attempt.
            log.warning("readback failed: %s (http=%s)", (answer.error or "no answer")[:300],
                        answer.http_status)
        else:
            # The wait and the verdict lines say what it led to; one line per poll is noise.
            log.debug("readback: %s (http=%s)", result, answer.http_status)
        return strategy.after_readback(cmd, tool, answer, sent_at=sent_at,
                                       answered_at=self.clock(), deliveries=d.deliveries,
                                       timing=self.timing)

    async def _wait(self, d: Delivery, cmd: ReconcileOperation, wait: decisions.Wait) -> None:
        self.stats["waits"] += 1
        key = (cmd.operation_id, cmd.epoch)
        waiting = self._waiting.get(key)
        if waiting is None:
            self._waiting[key] = _Waiting(self.clock())
            while len(self._waiting) > MAX_WAITING:
                del self._waiting[next(iter(self._waiting))]
            log.info("reconcile: waiting %.2fs: %s", wait.delay_s, wait.reason)
        else:
            waiting.waits += 1
            log.debug("reconcile: still waiting %.2fs (wait %d): %s", wait.delay_s,
                      waiting.waits, wait.reason)
        await d.nak(delay=wait.delay_s)

    def _waited(self, cmd: ReconcileOperation) -> str:
        """Forget a command's wait once decided; how long it was, for the decision's line."""
        waiting = self._waiting.pop((cmd.operation_id, cmd.epoch), None)
        if waiting is None:
            return ""
        seconds = (self.clock() - waiting.since).total_seconds()
        return f" (after {waiting.waits} wait(s) over {seconds:.1f}s)"

    async def _verdict(self, d: Delivery, cmd: ReconcileOperation,
                       decision: decisions.Decide) -> None:
        verdict = VerdictReached(operation_id=cmd.operation_id, epoch=cmd.epoch,
                                 verdict=decision.verdict, evidence=decision.evidence,
                                 reconciler_id=self.reconciler_id, reason=decision.reason,
                                 at=self.clock(), result=decision.result)
        try:
            async with heartbeat(d, self.ack_wait_s / 3):
                await self._publish(self.subjects.verdict, encode(verdict),
                                    catalogue.message_id(verdict))
        except BrokerUnavailable as exc:
            self.stats["publish_failed"] += 1
            log.error("reconcile: verdict not stored: %s", exc.message)
            await d.nak(delay=decisions.backoff(d.deliveries, self.timing))
            return
        self.stats[decision.verdict] += 1
        source = decision.evidence.source if decision.evidence is not None else "none"
        metrics.inc(metrics.VERDICTS_PUBLISHED, decision.verdict, source)
        log.info("reconcile: verdict %s: %s%s", decision.verdict, decision.reason,
                 self._waited(cmd))
        await d.ack()

    async def _reject(self, d: Delivery, error: str) -> None:
        letter = dead_letter(d, consumer=CONSUMER, error=error)
        try:
            await self._publish(self.subjects.deadletter, encode(letter),
                                catalogue.message_id(letter))
        except BrokerUnavailable as exc:
            log.error("could not dead-letter a message on %s: %s", d.subject, exc.message)
            await d.nak(delay=decisions.backoff(d.deliveries, self.timing))
            return
        self.stats["dead_lettered"] += 1
        log.warning("dead-lettered a message on %s: %s", d.subject, error)
        await d.ack()

    async def _publish(self, subject: str, payload: bytes, msg_id: str) -> None:
        await publish_with_retries(self.publisher, subject, payload, msg_id=msg_id,
                                   attempts=PUBLISH_ATTEMPTS, first_wait_s=self.publish_retry_s)
