"""The dispatcher: claim, then exactly one provider attempt, then the outcome, then the ack.

Order matters and is the whole point:
1. claim the attempt in the ledger (durable) before anything reaches the provider;
2. one provider call with Idempotency-Key = operation key and Fencing-Token = epoch, written
   only while the send deadline holds (a fraction of the tool's horizon since the claim was
   requested, `effectledger_core/send_deadline.py`); past it nothing is sent and the attempt
   is reported as not sent, a known-not-applied failure the retry policy may retry;
3. report the outcome: first by request to the ledger, which answers only after its inbox
   committed it; without that answer, publish it to JetStream and wait for the publish-ack
   (the same message id: whichever copy comes second is a duplicate in the ledger's inbox);
4. only then ack the dispatch command.
A crash anywhere leaves the command unacked; its redelivery finds the claim already taken and
turns into an ambiguous outcome ("dispatcher lost mid-attempt"), never a second call (or, once
the outcome is recorded, just acks).

The request saves the stream's round trip (publish-ack, then the inbox's delivery, commit and
ack) on the way to a waiting agent; it is an optimisation only. Nothing but the ledger's answer
after its commit counts as delivered: no reply, a timeout, an error reply or anything
unexpected falls back to the stream, which remains the guarantee.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from effectledger_bus import catalogue
from effectledger_bus.delivery import Delivery, dead_letter, heartbeat, keep
from effectledger_bus.publish import publish_with_retries
from effectledger_bus.rpc import NoReply
from effectledger_core import unsafe
from effectledger_core.catalog import Catalog, Tool
from effectledger_core.commands import arguments_digest
from effectledger_core.crash import crash_point
from effectledger_core.errors import (
    BrokerUnavailable,
    EffectLedgerError,
    PayloadTooLarge,
    PoisonMessage,
)
from effectledger_core.ids import Clock, IdFactory, new_id, utcnow
from effectledger_core.messages import (
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    DispatchAttempt,
    ErrorReply,
    Outcome,
    OutcomeAmbiguous,
    encode,
    parse,
)
from effectledger_core.send_deadline import NOT_SENT_CODE, SendWindow
from effectledger_core.subjects import Subjects
from effectledger_obs import logs, metrics, tracing
from effectledger_providers.calls import SendRefused

from . import decision
from .ports import LedgerClient, ProviderCaller, Publisher

log = logging.getLogger(__name__)
CONSUMER = catalogue.DISPATCHER
# While our catalog lacks a tool the ledger accepted (a rollout in progress), look again this
# often, until max_deliver sends the command to the dead letters.
UNKNOWN_TOOL_RETRY_S = 10.0
CLAIM_TRIES = 3
# TEST-ONLY: disables claim-before-call, so the chaos harness can prove it detects duplicates.
UNSAFE_SKIP_CLAIM_ENV = unsafe.SKIP_CLAIM.env


def unsafe_skip_claim(env: Mapping[str, str]) -> bool:
    return unsafe.armed(unsafe.SKIP_CLAIM, env)


@dataclass
class Dispatcher:
    ledger: LedgerClient
    publisher: Publisher
    call: ProviderCaller
    catalog: Catalog
    subjects: Subjects
    dispatcher_id: str
    ack_wait_s: float = 60.0
    max_deliver: int = 20
    # How long to keep retrying an outcome publish; None: half of ack_wait, at least 5 s.
    publish_within_s: float | None = None
    # How long to wait for the ledger's answer to an outcome sent by request before publishing
    # it on the stream instead; 0: never ask, always the stream (the service's setting is
    # EFFECTLEDGER_DISPATCHER_OUTCOME_REQUEST_TIMEOUT_S).
    outcome_request_s: float = 0.0
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    clock: Clock = utcnow
    ids: IdFactory = new_id
    # The send deadline's clock (monotonic seconds); injected so tests decide elapsed time.
    monotonic: Callable[[], float] = time.monotonic
    # Counters for logs and tests.
    stats: dict[str, int] = field(default_factory=lambda: {
        "granted": 0, "already_claimed": 0, "stale": 0, "lost_mid_attempt": 0,
        "dead_lettered": 0, "claim_unavailable": 0, "outcome_by_request": 0,
        "outcome_by_stream": 0})
    # Attempt ids whose claim got no answer at all, by (operation, epoch). Such an attempt never
    # reached the provider (this process calls only after a granted reply), so when the command
    # comes back to this process it asks again with the same id, which the ledger re-grants if
    # the claim was recorded and its reply lost. A fresh id would find its own lost claim
    # "already claimed" and needlessly declare an untouched operation ambiguous.
    unanswered_claims: dict[tuple[str, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.skip_claim = unsafe.check(unsafe.SKIP_CLAIM, self.env, log)
        self.no_send_deadline = unsafe.check(unsafe.NO_SEND_DEADLINE, self.env, log)
        self.stats["not_sent_deadline"] = 0

    async def handle(self, d: Delivery) -> None:
        try:
            cmd = parse(DispatchAttempt, d.data)
        except (PoisonMessage, PayloadTooLarge) as exc:
            await self._dead_letter(d, exc.message)
            await d.ack()
            return
        try:
            tool = self.catalog.get(cmd.tool)
        except EffectLedgerError as exc:
            # The ledger accepted it, so our catalog is behind: wait for a rollout, then give up
            # into the dead-letter record rather than loop forever.
            if d.deliveries >= self.max_deliver:
                await self._dead_letter(d, exc.message)
                await d.ack()
            else:
                await d.nak(delay=UNKNOWN_TOOL_RETRY_S)
            return

        with logs.bind(operation_id=cmd.operation_id, epoch=cmd.epoch, tool=cmd.tool):
            tracing.annotate(operation_id=cmd.operation_id, epoch=cmd.epoch, tool=cmd.tool)
            await self._handle(d, cmd, tool)

    async def _handle(self, d: Delivery, cmd: DispatchAttempt, tool: Tool) -> None:
        key = (cmd.operation_id, cmd.epoch)
        attempt_id = self.unanswered_claims.pop(key, None) or self.ids()
        # Before the claim request: the ledger's claimed_at is later, so this never
        # under-counts the time that the reconciler's horizon counts.
        window = SendWindow.for_horizon(self.monotonic(), tool.horizon_s)
        # Computed from the arguments this process would send, never copied from the
        # command's own `arguments_digest` field, which a forger writes as easily.
        digest = arguments_digest(cmd.arguments)
        with tracing.span("claim", attributes={"effectledger.attempt_id": attempt_id}):
            reply = await self._claim(cmd, attempt_id, digest, d)
        step = decision.decide(reply, attempt_id=attempt_id, deliveries=d.deliveries,
                               tool_timeout_s=tool.timeout_s, skip_claim=self.skip_claim,
                               tool=cmd.tool, arguments_digest=digest)
        self._note_claim(key, attempt_id, reply)
        if isinstance(step, decision.Nak):
            await d.nak(delay=step.delay_s)
            return
        if isinstance(step, decision.Ack):
            if step.reason == "command_mismatch" or (
                    reply is not None and reply.status is ClaimStatus.COMMAND_MISMATCH):
                log.error("refused %s epoch %d: the command (tool %r) is not the ledger's "
                          "operation: %s", cmd.operation_id, cmd.epoch, cmd.tool[:64],
                          (reply.reason if reply is not None else None) or "the grant differs")
            await d.ack()
            return
        if isinstance(step, decision.Attempt):
            if step.unsafe:
                log.warning("UNSAFE: %s=1: calling the provider for %s epoch %d although the "
                            "claim is already held (claim-before-call disabled; never use in "
                            "production)", UNSAFE_SKIP_CLAIM_ENV, cmd.operation_id, cmd.epoch)
            else:
                crash_point("dispatcher.after_claim", scope=cmd.tool)
            outcome = await self._attempt(d, cmd, tool, step.attempt_id, window)
        else:
            self.stats["lost_mid_attempt"] += 1
            outcome = OutcomeAmbiguous(
                operation_id=cmd.operation_id, epoch=cmd.epoch, attempt_id=step.attempt_id,
                dispatcher_id=self.dispatcher_id, at=self.clock(),
                reason="dispatcher_lost_mid_attempt",
                message="the attempt was claimed but its dispatcher never reported an outcome")
        why = await self._report(outcome)
        if why is None:
            # Committed by the ledger: the stream copy would only be a duplicate.
            self.stats["outcome_by_request"] += 1
            metrics.inc(metrics.DISPATCH_OUTCOMES, "request", "answered")
            crash_point("dispatcher.after_outcome_request")
        else:
            if not await self._publish_outcome(d, outcome):
                return  # not acked: redelivery will find the claim and go the ambiguous path
            self.stats["outcome_by_stream"] += 1
            metrics.inc(metrics.DISPATCH_OUTCOMES, "stream", why)
            crash_point("dispatcher.after_outcome_publish")
        await d.ack()

    def _note_claim(self, key: tuple[str, int], attempt_id: str,
                    reply: ClaimReply | None) -> None:
        """Count the reply; remember an unanswered attempt id for the redelivery."""
        metrics.inc(metrics.DISPATCH_CLAIM_REPLIES,
                    "no_reply" if reply is None else reply.status.value)
        if reply is None:
            self.stats["claim_unavailable"] += 1
            self.unanswered_claims[key] = attempt_id
            if len(self.unanswered_claims) > 10_000:  # commands redelivered elsewhere
                del self.unanswered_claims[next(iter(self.unanswered_claims))]
        elif reply.status is ClaimStatus.GRANTED:
            self.stats["granted"] += 1
        elif reply.status is ClaimStatus.ALREADY_CLAIMED:
            self.stats["already_claimed"] += 1
        else:
            self.stats["stale"] += 1  # the ledger journaled the rejected claim

    async def _attempt(self, d: Delivery, cmd: DispatchAttempt, tool: Tool,
                       attempt_id: str, window: SendWindow) -> Outcome:
        def before_write() -> None:
            now = self.monotonic()
            if window.is_open(now):
                return
            if self.no_send_deadline:
                log.warning("UNSAFE: %s=1: sending %s epoch %d %.3fs after its claim request, "
                            "past the send deadline of %.3fs", unsafe.NO_SEND_DEADLINE.env,
                            cmd.operation_id, cmd.epoch, window.elapsed(now), window.limit_s)
                return
            self.stats["not_sent_deadline"] += 1
            log.warning("not sending %s epoch %d: %s", cmd.operation_id, cmd.epoch,
                        window.explain(now))
            raise SendRefused(NOT_SENT_CODE, window.explain(now))

        # Long provider calls must not let ack_wait expire: that would redeliver the command
        # to another dispatcher, which would (safely, but needlessly) declare it ambiguous.
        async with heartbeat(d, self.ack_wait_s / 3):
            with tracing.span("provider call", kind=tracing.SpanKind.CLIENT,
                              attributes={"effectledger.tool": tool.name,
                                          "effectledger.attempt_id": attempt_id}) as sp:
                outcome = await self.call(tool, cmd, attempt_id=attempt_id,
                                          dispatcher_id=self.dispatcher_id,
                                          on_sent=lambda: crash_point("dispatcher.before_call"),
                                          before_write=before_write)
                if sp is not None:
                    sp.set_attribute("effectledger.outcome", outcome.type)
        _observe_call(tool, outcome, attempt_id)
        crash_point("dispatcher.after_response")
        return outcome

    async def _claim(self, cmd: DispatchAttempt, attempt_id: str, digest: str,
                     d: Delivery) -> ClaimReply | None:
        """The ledger's claim reply; None if it did not answer or refused the request."""
        request = ClaimAttempt(operation_id=cmd.operation_id, epoch=cmd.epoch,
                               attempt_id=attempt_id, dispatcher_id=self.dispatcher_id,
                               tool=cmd.tool, arguments_digest=digest)
        # Retrying with the same attempt id is safe: the ledger re-grants the same attempt.
        for tries in range(CLAIM_TRIES):
            if tries:
                # Keep the command ours while a slow ledger answers: a redelivery meanwhile
                # would find our claim and declare the attempt lost for nothing.
                await keep(d)
            try:
                answer = await self.ledger.claim(request)
            except NoReply as exc:
                log.warning("claim for %s: %s", cmd.operation_id, exc.message)
                continue
            except (PoisonMessage, PayloadTooLarge) as exc:
                log.warning("claim for %s: malformed reply: %s", cmd.operation_id, exc.message)
                return None
            if isinstance(answer, ErrorReply):
                log.warning("claim for %s refused: %s: %s", cmd.operation_id,
                            answer.error.code, answer.error.message[:300])
                return None
            return answer
        return None

    async def _report(self, outcome: Outcome) -> str | None:
        """None when the ledger answered that it committed `outcome` (sent by request); else
        why not (a metric label), which leaves the outcome to its JetStream copy: it may or may
        not be committed, and the copy's message id makes either case come out once."""
        if self.outcome_request_s <= 0:
            return "off"
        op = outcome.operation_id
        # No heartbeat runs now: a wait past ack_wait would hand the command to another
        # dispatcher (safe, but needless), so a short ack_wait shortens the wait too.
        timeout_s = min(self.outcome_request_s, self.ack_wait_s / 3)
        try:
            answer = await self.ledger.report(outcome, timeout_s=timeout_s)
        except NoReply as exc:
            log.info("outcome of %s by request: %s; publishing it on the stream", op,
                     exc.message)
            return "no_reply"
        except Exception as exc:  # malformed reply, closed connection, a bug: the stream
            log.warning("outcome of %s by request failed (%s: %s); publishing it on the "
                        "stream", op, type(exc).__name__, str(exc)[:300])
            return "failed"
        if isinstance(answer, ErrorReply):
            if answer.error.retryable:
                log.info("outcome of %s by request: %s; publishing it on the stream", op,
                         answer.error.code)
                return "retryable"
            # Never swallowed: the ledger refused it, which our own outcome should never be.
            # The stream copy goes where the inbox's checks apply and keep evidence.
            log.error("the ledger refused the outcome of %s sent by request: %s: %s; "
                      "publishing it on the stream", op, answer.error.code,
                      answer.error.message[:300])
            return "refused"
        if (answer.message_id, answer.attempt_id) != (catalogue.message_id(outcome),
                                                      outcome.attempt_id):
            log.error("the ledger's answer for outcome %s names %r: publishing it on the "
                      "stream", catalogue.message_id(outcome), answer.message_id[:200])
            return "mismatch"
        return None

    async def _publish_outcome(self, d: Delivery, outcome: Outcome) -> bool:
        try:
            # Not a heartbeat before the first try: the call's heartbeat covered us until now
            # (and the outcome request, if any, waits a few seconds at most).
            await publish_with_retries(
                self.publisher, self.subjects.outcome_by(self.dispatcher_id, outcome.type),
                encode(outcome),
                msg_id=catalogue.message_id(outcome), within_s=self._publish_window(),
                before_retry=lambda: keep(d))
        except BrokerUnavailable as exc:
            log.error("could not publish outcome of %s: %s", outcome.operation_id, exc.message)
            return False
        return True

    def _publish_window(self) -> float:
        if self.publish_within_s is not None:
            return self.publish_within_s
        return max(5.0, self.ack_wait_s / 2)

    async def _dead_letter(self, d: Delivery, error: str) -> None:
        self.stats["dead_lettered"] += 1
        letter = dead_letter(d, consumer=CONSUMER, error=error)
        await self.publisher.publish(self.subjects.deadletter, encode(letter),
                                     msg_id=catalogue.message_id(letter))


def _observe_call(tool: Tool, outcome: Outcome, attempt_id: str) -> None:
    """One metric sample and one INFO line per provider call (never the arguments or body)."""
    failure = getattr(outcome, "failure_class", None)
    failure_class = failure.value if failure is not None else "none"
    metrics.inc(metrics.PROVIDER_CALLS, tool.name, outcome.type, failure_class)
    if outcome.duration_ms is not None:
        metrics.observe(metrics.PROVIDER_CALL_DURATION, outcome.duration_ms / 1000,
                        tool.name, outcome.type)
    detail = getattr(outcome, "code", None) or getattr(outcome, "reason", None) or ""
    log.info("provider call: %s%s http=%s in %.0f ms", outcome.type,
             f" ({failure_class}: {detail})" if failure is not None else
             (f" ({detail})" if detail else ""), outcome.http_status,
             outcome.duration_ms or 0.0, extra={"attempt_id": attempt_id})
