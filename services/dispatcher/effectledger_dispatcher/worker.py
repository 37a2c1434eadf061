"""The dispatcher: claim, then exactly one provider attempt, then the outcome, then the ack.

Order matters and is the whole point:
1. claim the attempt in the ledger (durable) before anything reaches the provider;
2. one provider call with Idempotency-Key = operation key and Fencing-Token = epoch;
3. publish the outcome and wait for JetStream's publish-ack;
4. only then ack the dispatch command.
A crash anywhere leaves the command unacked; its redelivery finds the claim already taken and
turns into an ambiguous outcome ("dispatcher lost mid-attempt"), never a second call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from effectledger_core import unsafe
from effectledger_core.catalog import Catalog
from effectledger_core.crash import crash_point
from effectledger_core.errors import EffectLedgerError, PayloadTooLarge, PoisonMessage
from effectledger_core.ids import Clock, IdFactory, new_id, utcnow
from effectledger_core.messages import (
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    DeadLetter,
    DispatchAttempt,
    Outcome,
    OutcomeAmbiguous,
    encode,
    excerpt,
    parse,
)
from effectledger_core.subjects import Subjects

from .provider import call_provider

log = logging.getLogger(__name__)
CONSUMER = "dispatcher"
# Beyond a tool's timeout, how long a claim may go unanswered before it is presumed lost.
LOST_GRACE_S = 5.0
# TEST-ONLY: disables claim-before-call, so the chaos harness can prove it detects duplicates.
UNSAFE_SKIP_CLAIM_ENV = unsafe.SKIP_CLAIM.env


def unsafe_skip_claim(env: Mapping[str, str]) -> bool:
    return unsafe.armed(unsafe.SKIP_CLAIM, env)


class Delivery:
    """What the worker needs of a JetStream delivery (a nats-py message, or a fake)."""

    subject: str
    data: bytes
    headers: Mapping[str, str]
    deliveries: int

    async def ack(self) -> None: ...
    async def nak(self, delay: float) -> None: ...
    async def in_progress(self) -> None: ...


@dataclass
class Dispatcher:
    nc: NatsClient
    http: httpx.AsyncClient
    catalog: Catalog
    subjects: Subjects
    dispatcher_id: str
    claim_timeout_s: float = 5.0
    ack_wait_s: float = 60.0
    max_deliver: int = 20
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    clock: Clock = utcnow
    ids: IdFactory = new_id
    # Counters for logs and tests.
    stats: dict[str, int] = field(default_factory=lambda: {
        "granted": 0, "already_claimed": 0, "stale": 0, "lost_mid_attempt": 0,
        "dead_lettered": 0, "claim_unavailable": 0})
    # Attempt ids whose claim got no answer at all, by (operation, epoch). Such an attempt never
    # reached the provider (this process calls only after a granted reply), so when the command
    # comes back to this process it asks again with the same id, which the ledger re-grants if
    # the claim was recorded and its reply lost. A fresh id would find its own lost claim
    # "already claimed" and needlessly declare an untouched operation ambiguous.
    unanswered_claims: dict[tuple[str, int], str] = field(default_factory=dict)
    # More clients to spread provider calls over, round robin (provider.make_clients).
    http_pool: list[httpx.AsyncClient] = field(default_factory=list)
    _next_client: int = 0

    def _client(self) -> httpx.AsyncClient:
        if not self.http_pool:
            return self.http
        self._next_client = (self._next_client + 1) % len(self.http_pool)
        return self.http_pool[self._next_client]

    def __post_init__(self) -> None:
        unsafe.check(unsafe.SKIP_CLAIM, self.env, log)

    async def handle(self, d: Delivery) -> None:
        try:
            cmd = parse(DispatchAttempt, d.data)
        except (PoisonMessage, PayloadTooLarge) as exc:
            await self._dead_letter(d, exc.message)
            await d.ack()
            return
        try:
            self.catalog.get(cmd.tool)
        except EffectLedgerError as exc:
            # The ledger accepted it, so our catalog is behind: wait for a rollout, then give up
            # into the dead-letter record rather than loop forever.
            if d.deliveries >= self.max_deliver:
                await self._dead_letter(d, exc.message)
                await d.ack()
            else:
                await d.nak(delay=10.0)
            return

        attempt_id = self.unanswered_claims.pop((cmd.operation_id, cmd.epoch), None) \
            or self.ids()
        reply = await self._claim(cmd, attempt_id, d)
        if reply is None:
            self.stats["claim_unavailable"] += 1
            self.unanswered_claims[(cmd.operation_id, cmd.epoch)] = attempt_id
            if len(self.unanswered_claims) > 10_000:  # commands redelivered elsewhere
                del self.unanswered_claims[next(iter(self.unanswered_claims))]
            await d.nak(delay=min(10.0, 0.5 * 2 ** d.deliveries))
            return
        if reply.status is ClaimStatus.GRANTED:
            self.stats["granted"] += 1
            crash_point("dispatcher.after_claim")
            outcome = await self._attempt(d, cmd, reply.attempt_id or attempt_id)
        elif reply.status is ClaimStatus.ALREADY_CLAIMED and unsafe_skip_claim(self.env):
            # The guard this whole service exists for, switched off: a redelivered command
            # reaches the provider again. Only the chaos harness's "can it fail" runs do this.
            self.stats["already_claimed"] += 1
            log.warning("UNSAFE: %s=1: calling the provider for %s epoch %d although the claim "
                        "is already held (claim-before-call disabled; never use in production)",
                        UNSAFE_SKIP_CLAIM_ENV, cmd.operation_id, cmd.epoch)
            outcome = await self._attempt(d, cmd, reply.attempt_id or attempt_id)
        elif reply.status is ClaimStatus.ALREADY_CLAIMED:
            self.stats["already_claimed"] += 1
            if reply.outcome_recorded:
                await d.ack()  # a duplicate delivery of a finished attempt
                return
            patience = self.catalog.get(cmd.tool).timeout_s + LOST_GRACE_S
            if reply.claim_age_s is not None and reply.claim_age_s < patience:
                # A duplicate (a sweeper republish, a redelivery) while the claimer may still be
                # mid-call: come back once its attempt must have ended, rather than declaring a
                # live attempt lost. A dead claimer is only redelivered after ack_wait anyway.
                await d.nak(delay=patience - reply.claim_age_s + 0.5)
                return
            # Someone claimed this epoch and never reported: we cannot know whether the
            # provider saw the request, so it is ambiguous. We never call the provider here.
            self.stats["lost_mid_attempt"] += 1
            assert reply.attempt_id is not None
            outcome = OutcomeAmbiguous(
                operation_id=cmd.operation_id, epoch=cmd.epoch, attempt_id=reply.attempt_id,
                dispatcher_id=self.dispatcher_id, at=self.clock(),
                reason="dispatcher_lost_mid_attempt",
                message="the attempt was claimed but its dispatcher never reported an outcome")
        else:
            self.stats["stale"] += 1  # the ledger journaled the rejected claim
            await d.ack()
            return
        if not await self._publish_outcome(d, outcome):
            return  # not acked: redelivery will find the claim and go the ambiguous path
        crash_point("dispatcher.after_outcome_publish")
        await d.ack()

    async def _attempt(self, d: Delivery, cmd: DispatchAttempt, attempt_id: str) -> Outcome:
        tool = self.catalog.get(cmd.tool)
        heartbeat = asyncio.create_task(self._heartbeat(d))
        try:
            outcome = await call_provider(
                self._client(), tool, cmd, attempt_id=attempt_id,
                dispatcher_id=self.dispatcher_id,
                env=self.env, clock=self.clock,
                on_sent=lambda: crash_point("dispatcher.before_call"))
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await heartbeat
        crash_point("dispatcher.after_response")
        return outcome

    async def _heartbeat(self, d: Delivery) -> None:
        # Long provider calls must not let ack_wait expire: that would redeliver the command
        # to another dispatcher, which would (safely, but needlessly) declare it ambiguous.
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            with contextlib.suppress(Exception):
                await d.in_progress()

    async def _claim(self, cmd: DispatchAttempt, attempt_id: str,
                     d: Delivery | None = None) -> ClaimReply | None:
        request = ClaimAttempt(operation_id=cmd.operation_id, epoch=cmd.epoch,
                               attempt_id=attempt_id, dispatcher_id=self.dispatcher_id)
        # Retrying with the same attempt id is safe: the ledger re-grants the same attempt.
        for tries in range(3):
            if tries and d is not None:
                # Keep the command ours while a slow ledger answers: a redelivery meanwhile
                # would find our claim and declare the attempt lost for nothing.
                with contextlib.suppress(Exception):
                    await d.in_progress()
            try:
                msg = await self.nc.request(self.subjects.rpc_claim, encode(request),
                                            timeout=self.claim_timeout_s)
            except (TimeoutError, NatsTimeout, NoRespondersError) as exc:
                log.warning("claim for %s: %s", cmd.operation_id, type(exc).__name__)
                continue
            try:
                return parse(ClaimReply, msg.data)
            except PoisonMessage:
                log.warning("claim for %s refused: %s", cmd.operation_id, excerpt(msg.data, 300))
                return None
        return None

    async def _publish_outcome(self, d: Delivery, outcome: Outcome) -> bool:
        js = self.nc.jetstream()
        msg_id = f"{outcome.type}:{outcome.attempt_id}"
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(Exception),
                stop=stop_after_delay(max(5.0, self.ack_wait_s / 2)),
                wait=wait_exponential(multiplier=0.2, max=3.0), reraise=True):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        # A slow or failing publish: keep the command ours meanwhile. Not on
                        # the first try: the call's heartbeat covered us until just now.
                        await d.in_progress()
                    await js.publish(self.subjects.outcome(outcome.type), encode(outcome),
                                     headers={"Nats-Msg-Id": msg_id}, timeout=5.0)
        except Exception as exc:
            log.error("could not publish outcome of %s: %s", outcome.operation_id, exc)
            return False
        return True

    async def _dead_letter(self, d: Delivery, error: str) -> None:
        self.stats["dead_lettered"] += 1
        letter = DeadLetter(consumer=CONSUMER, subject=d.subject[:1024],
                            message_id=(d.headers.get("Nats-Msg-Id") or "")[:1024] or None,
                            error=error[:1024], payload_excerpt=excerpt(d.data),
                            deliveries=d.deliveries)
        await self.nc.jetstream().publish(self.subjects.deadletter, encode(letter), timeout=5.0)


class JsDelivery(Delivery):
    """`Delivery` over a nats-py JetStream message."""

    __slots__ = ("data", "deliveries", "headers", "msg", "subject")

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        self.subject = msg.subject
        self.data = msg.data
        self.headers = msg.headers or {}
        self.deliveries = msg.metadata.num_delivered if msg.reply else 1

    async def ack(self) -> None:
        await self.msg.ack()

    async def nak(self, delay: float) -> None:
        await self.msg.nak(delay=delay)

    async def in_progress(self) -> None:
        await self.msg.in_progress()
