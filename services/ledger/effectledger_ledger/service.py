"""The ledger's use cases: each one transaction through `Store.run`, time and ids injected."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy.exc import IntegrityError

from effectledger_core.argschema import check_arguments
from effectledger_core.catalog import Catalog, Tool
from effectledger_core.config import default_batch_workers
from effectledger_core.crash import crash_point
from effectledger_core.errors import EffectLedgerError, NotFound, UnknownTool
from effectledger_core.failures import Failure
from effectledger_core.ids import Clock, IdFactory, id_unix_ms, new_id, utcnow
from effectledger_core.messages import (
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    DeadLetter,
    Outcome,
    SubmitIntent,
    VerdictReached,
    WebhookReceived,
)
from effectledger_core.quotas import QuotaLimits, TenantRates, check_open, check_rate
from effectledger_core.recovery import Assessment, Review, inspect_recovery, prepare_retry
from effectledger_core.retry_policy import RetryBudget, RetryContext, RetryDecision, decide_retry
from effectledger_core.states import ACTIVE, State
from effectledger_core.subjects import Subjects
from effectledger_core.views import (
    Journal,
    OperationPage,
    OperationView,
    Receipt,
    ReviewItem,
    Stats,
)
from effectledger_core.waiting import wait_over
from effectledger_obs import metrics, tracing

from .db import duplicates, reads
from .db import recovery as rec
from .db.batch import GroupCommit
from .db.claims import ClaimCall
from .db.intents import SubmitCall, Submitted
from .db.outcomes import OutcomeCall, record_dead_letter_txn
from .db.resolution import record_verdict_txn, record_webhook_txn
from .db.rows import JournalRow, OperationRow, Recorded
from .db.store import OnCommit, Store
from .db.watch import states_of
from .observe import Observer, keep_trace_txn
from .waiters import Waiters

if TYPE_CHECKING:
    from .relay import DirectPublisher

log = logging.getLogger(__name__)
# The consumers that record dead letters (a label must not take a message's free text).
DEAD_LETTER_CONSUMERS = frozenset({"ledger-inbox", "dispatcher", "reconciler"})
# A claim not found for an operation whose id was made less than this long ago (by any
# replica's clock: skew beyond it only forgoes the second look) is asked again after each of
# these delays before `not_found` goes back: another replica may be committing its intent
# (docs/design.md, "A command published with its commit"). Far below the dispatcher's 20 ms
# nak, which follows a `not_found` answer.
YOUNG_ID_MS = 1000
NOT_FOUND_AGAIN_S = (0.002, 0.006)
# States an outcome leaves with a new outbox command (reconcile, or a retry's dispatch).
_NEW_COMMAND = frozenset({State.AMBIGUOUS.value, State.PENDING.value})


@dataclass
class LedgerService:
    store: Store
    catalog: Catalog
    subjects: Subjects
    clock: Clock = utcnow
    ids: IdFactory = new_id
    # Set after every commit that adds outbox rows, so the in-process relay wakes at once.
    outbox_wake: asyncio.Event = field(default_factory=asyncio.Event)
    rng: random.Random = field(default_factory=random.Random)
    budget: RetryBudget = field(default_factory=lambda: RetryBudget(now=time.monotonic()))
    # Intents, claims and outcomes arriving together share a transaction (db/batch.py).
    batch_max: int = 64
    batch_workers: int | None = None  # None: config.default_batch_workers
    writes: GroupCommit = field(init=False)
    # Publishes new intents' commands right after their commit (relay.DirectPublisher); set by
    # the app once NATS is connected. Without it every command goes through the relay.
    publisher: DirectPublisher | None = None
    direct_lease_s: float = 10.0
    # An intent alone hands its command to the publisher before its statement is sent, not
    # after its commit (docs/design.md, "A command published with its commit").
    publish_with_commit: bool = True
    # Submit-and-wait: signalled after each commit that moves an operation (waiters.py).
    waiters: Waiters = field(init=False)
    wait_recheck_s: float = 2.0
    quotas: QuotaLimits = field(default_factory=QuotaLimits)  # all off unless configured
    rates: TenantRates = field(init=False)
    # Counts, times and logs committed transitions (observe.py), fed by the store.
    observer: Observer = field(default_factory=Observer)
    # The pause before a claim not found is asked again (injected: a test lets another
    # replica commit there).
    sleep: Callable[[float], Awaitable[None]] = field(default_factory=lambda: asyncio.sleep)
    claims_asked_again: int = 0  # claims not found at first for a young operation (see `claim`)

    def __post_init__(self) -> None:
        self.rates = TenantRates(self.quotas.rate_per_s, self.quotas.burst)
        workers = self.batch_workers or default_batch_workers(self.store.is_postgres)
        self.writes = GroupCommit(self.store, name="ledger", max_batch=self.batch_max,
                                  workers=workers)
        self.waiters = Waiters(self._states_of, recheck_s=self.wait_recheck_s)
        # What sees every committed transition: the observer, and (with PostgreSQL, from
        # app.py) the announcements to the other replicas' waits (peers.py).
        self.commit_hooks: list[OnCommit] = [self.observer.committed]
        self.store.on_commit = self._committed
        metrics.RETRY_BUDGET_TOKENS.set_function(lambda: self.budget.tokens)

    def _committed(self, rows: list[JournalRow]) -> None:
        for hook in self.commit_hooks:
            hook(rows)

    async def close(self) -> None:
        await self.waiters.close()
        if self.publisher is not None:
            await self.publisher.close()
        await self.writes.close()

    def decide_retry(self, op: OperationRow, failure: Failure) -> RetryDecision:
        """The automatic retry policy applied to a known-not-applied failure of `op`'s epoch."""
        try:
            tool = self.catalog.get(op.tool)
        except UnknownTool:
            return RetryDecision(False, "tool_not_in_catalog")
        ctx = RetryContext(
            effect_class=tool.effect_class, failure=failure, attempts_made=op.epoch,
            max_attempts=tool.max_attempts,
            elapsed_s=(self.clock() - op.created_at).total_seconds(),
            deadline_s=tool.retry_deadline_s,
            contract_changed=tool.contract_revision != op.contract_revision)
        decision = decide_retry(ctx, self.rng)
        if decision.retry and not self.budget.try_take(time.monotonic()):
            return RetryDecision(False, "retry_budget_exhausted")
        return decision

    async def submit(self, intent: SubmitIntent, *, actor: str = "agent") -> Submitted:
        try:
            result = await self._submit(intent, actor=actor)
        except EffectLedgerError as exc:
            metrics.child(metrics.INTENTS_REFUSED, exc.code).inc()
            raise
        op = result.operation
        metrics.inc(metrics.INTENTS, op["tool"], "created" if result.created else "existing")
        tracing.annotate(operation_id=op["id"], tool=op["tool"], epoch=op["epoch"])
        if result.created:
            self.observer.accepted(op)
        return result

    async def _submit(self, intent: SubmitIntent, *, actor: str) -> Submitted:
        # Unknown tool or arguments the tool can never be sent with: a clear error (422, with
        # the JSON pointer of each bad field) before any transaction, so nothing is enqueued.
        tool = self.catalog.get(intent.tool)
        check_arguments(tool, intent.arguments)
        await self._admit(intent, tool)
        # The request's trace context, kept in the outbox row for whoever publishes it.
        traceparent = tracing.current_traceparent()
        direct = self.publisher is not None and self.direct_lease_s > 0
        early = (self.publisher.early if self.publisher is not None and direct
                 and self.publish_with_commit else None)
        for _ in range(3):
            now = self.clock()
            try:
                result = await self.writes.call(SubmitCall(
                    catalog=self.catalog, intent=intent, subjects=self.subjects,
                    operation_id=self.ids(), outbox_id=self.ids(), now=now, actor=actor,
                    lease_until=now + timedelta(seconds=self.direct_lease_s) if direct else None,
                    traceparent=traceparent, early=early))
            except IntegrityError:
                # Two submissions with the same key raced; the loser retries and finds the
                # winner's operation (same arguments) or a conflict (different arguments).
                continue
            if result.created:
                crash_point("ledger.after_intent_commit")
                if result.command is not None and self.publisher is not None:
                    if not result.published:  # else handed over with its statement (early)
                        self.publisher.submit(result.command, operation=(
                            result.operation["id"], result.operation["epoch"]))
                else:
                    self.outbox_wake.set()
            return result
        raise RuntimeError("intent submission kept conflicting")

    async def _admit(self, intent: SubmitIntent, tool: Tool) -> None:
        """The tenant's quotas (HTTP and NATS intents both come here); QuotaExceeded if over.

        The counts are read before the intent's own transaction, so concurrent submissions of
        one tenant may overshoot a count limit by their number: a bound, not an exact cap."""
        q = self.quotas
        if not q.any:
            return
        check_rate(self.rates, intent.tenant, time.monotonic())
        gated = q.max_awaiting_approval > 0 and tool.commit_policy == "approval"
        if q.max_in_flight <= 0 and not gated:
            return
        async with self.store.transaction() as conn:
            if q.max_in_flight > 0:
                n = await reads.count_in_states(conn, intent.tenant, ACTIVE,
                                                cap=q.max_in_flight)
                check_open(q.max_in_flight, n, tenant=intent.tenant, what="in flight",
                           retry_after_s=1.0)
            if gated:
                n = await reads.count_in_states(conn, intent.tenant,
                                                {State.AWAITING_APPROVAL},
                                                cap=q.max_awaiting_approval)
                check_open(q.max_awaiting_approval, n, tenant=intent.tenant,
                           what="awaiting approval", retry_after_s=60.0)

    async def claim(self, claim: ClaimAttempt) -> ClaimReply:
        # The message's trace context, taken here: the group-committed transaction runs in
        # another task, which does not carry it (None, at no cost, when not traced).
        traceparent = tracing.current_traceparent()
        if self.publisher is not None:  # its command may be out before its intent's commit
            await self.publisher.answered(claim.operation_id, claim.epoch)
        reply = await self._decide_claim(claim, traceparent)
        if reply.status is ClaimStatus.NOT_FOUND and self._committing_elsewhere(claim):
            # Another replica's intent, published with its commit: its commit is likely a
            # moment away. Asked again here, a few milliseconds later, rather than answered
            # now and asked again by the dispatcher 20 ms later after a nak and a redelivery.
            self.claims_asked_again += 1
            for delay_s in NOT_FOUND_AGAIN_S:
                await self.sleep(delay_s)
                reply = await self._decide_claim(claim, traceparent)
                if reply.status is not ClaimStatus.NOT_FOUND:
                    break
            metrics.child(metrics.CLAIMS_ASKED_AGAIN, reply.status.value).inc()
        metrics.child(metrics.CLAIMS, reply.status.value).inc()
        if reply.status is ClaimStatus.GRANTED:
            self.waiters.changed(claim.operation_id, State.IN_FLIGHT)
            if self.publisher is not None:
                self.publisher.consumed(claim.operation_id, claim.epoch)
        return reply

    async def _decide_claim(self, claim: ClaimAttempt, traceparent: str | None) -> ClaimReply:
        for _ in range(3):
            try:
                return await self.writes.call(ClaimCall(claim, now=self.clock(),
                                                        traceparent=traceparent))
            except IntegrityError:
                continue  # a concurrent claim for this epoch won; re-read answers "already"
        raise RuntimeError("claim kept conflicting")

    def _committing_elsewhere(self, claim: ClaimAttempt) -> bool:
        """Whether the claim's operation may be an intent another replica is committing
        now: its id was made moments ago (ids are UUIDv7), and not by an intent this replica
        handed over (whose statement `answered` has already waited for: one that wrote
        nothing is a retried key's command, which will never be found)."""
        made = id_unix_ms(claim.operation_id)
        # The wall clock the id was made with (`new_id`), not the injected one.
        if made is None or abs(time.time() * 1000 - made) > YOUNG_ID_MS:
            return False
        return self.publisher is None or not self.publisher.handed_over(claim.operation_id,
                                                                        claim.epoch)

    async def record_outcome(self, outcome: Outcome, *, consumer: str,
                             message_id: str) -> Recorded:
        follow_up = self.ids()  # the reconcile or retry command's outbox row, if one is due
        traceparent = tracing.current_traceparent()
        result = await self.writes.call(OutcomeCall(
            outcome, consumer=consumer, message_id=message_id, subjects=self.subjects,
            now=self.clock(), ambiguous_outbox_id=follow_up, decide_retry=self.decide_retry,
            webhook_binding=self.catalog.webhook_speaks_for, traceparent=traceparent))
        crash_point("ledger.inbox.after_commit")
        metrics.child(metrics.OUTCOMES, outcome.type, result.status).inc()
        if result.duplicate is not None:  # stored webhooks that settled it named two objects
            duplicates.announce(result.duplicate.tool, result.duplicate.matches,
                                result.duplicate.operation_id)
        if result.status == "duplicate":
            metrics.child(metrics.INBOX_DUPLICATES, "outcome").inc()
        else:
            self.observer.outcome_reported(operation_id=outcome.operation_id, at=outcome.at,
                                           now=self.clock())
        # The view its own statement returned (a success alone), built only for a waiter.
        view = (reads.view_of(result.view_rows) if result.view_rows
                and self.waiters.watching(outcome.operation_id) else None)
        self.waiters.changed(outcome.operation_id,
                             result.to_state if result.status == "applied" else None, view=view)
        if result.to_state in _NEW_COMMAND:
            await self._keep_trace(follow_up, traceparent)
            self.outbox_wake.set()
        if result.status == "rejected":
            log.info("outcome rejected: op=%s reason=%s", outcome.operation_id, result.reason)
        return result

    async def record_verdict(self, verdict: VerdictReached, *, consumer: str,
                             message_id: str) -> Recorded:
        follow_up = self.ids()
        traceparent = tracing.current_traceparent()
        result = await self.store.run(
            record_verdict_txn, verdict, consumer=consumer, message_id=message_id,
            subjects=self.subjects, now=self.clock(), outbox_id=follow_up,
            decide_retry=self.decide_retry, traceparent=traceparent)
        metrics.child(metrics.VERDICTS, verdict.verdict, result.status).inc()
        if result.status == "duplicate":
            metrics.child(metrics.INBOX_DUPLICATES, "verdict").inc()
        self.waiters.changed(verdict.operation_id,
                             result.to_state if result.status == "applied" else None)
        if result.to_state == State.PENDING:
            await self._keep_trace(follow_up, traceparent)
            self.outbox_wake.set()
        evidence = verdict.evidence
        if result.status == "applied" and evidence is not None and (evidence.matches or 0) > 1:
            op = await self.operation(verdict.operation_id)  # rare: one read for the label
            duplicates.announce(op.tool, evidence.matches or 0, verdict.operation_id)
        return result

    async def record_webhook(self, hook: WebhookReceived) -> Recorded:
        follow_up = self.ids()
        traceparent = tracing.current_traceparent()
        result = await self.store.run(
            record_webhook_txn, hook, now=self.clock(), subjects=self.subjects,
            outbox_id=follow_up, decide_retry=self.decide_retry,
            tools=self.catalog.webhook_tools(hook.provider), traceparent=traceparent)
        metrics.child(metrics.WEBHOOKS_RECORDED, result.status).inc()
        if result.reason == "provider_not_bound":
            # Journaled `webhook_refused` in the transaction; counted here, by a label the
            # catalog bounds (the provider name comes from the reconciler's URL path).
            metrics.inc(metrics.WEBHOOKS_UNBOUND,
                        metrics.bounded(hook.provider, self.catalog.webhook_providers()))
            log.warning("webhook from %s refused: it names an operation of a tool bound to "
                        "another provider or to none (webhook id %s)", hook.provider[:64],
                        hook.webhook_id[:128])
        if result.status == "duplicate":
            metrics.child(metrics.INBOX_DUPLICATES, "webhook").inc()
        if result.duplicate is not None:
            duplicates.announce(result.duplicate.tool, result.duplicate.matches,
                                result.duplicate.operation_id)
        if result.to_state == State.PENDING:
            await self._keep_trace(follow_up, traceparent)
            self.outbox_wake.set()
        return result

    async def _keep_trace(self, outbox_id: str, traceparent: str | None) -> None:
        """Keep the current trace context in a follow-up command's outbox row, so that the
        reconciler's or the retry's work joins the operation's trace. Written after the
        commit, not in it: the group-committed transaction runs in another task, which does
        not carry this message's context. Best effort: the relay may publish first."""
        if traceparent is None:
            return
        try:
            await self.store.run(keep_trace_txn, outbox_id, traceparent)
        except Exception as exc:  # a trace is never worth failing a recorded outcome
            log.debug("trace context not kept for %s: %s", outbox_id, exc)

    async def repair_lost_outcomes(self, older_than_s: float) -> int:
        """In-flight attempts with no outcome for `older_than_s`: ambiguous (db/lost.py).
        Nearly always there are none: one lockless read says so (an idle sweep)."""
        from .db.lost import any_lost_outcomes, sweep_lost_outcomes_txn

        async with self.store.read() as conn:
            if not await any_lost_outcomes(conn, now=self.clock(), older_than_s=older_than_s):
                return 0
        lost: int = await self.store.run(
            sweep_lost_outcomes_txn, now=self.clock(), older_than_s=older_than_s,
            subjects=self.subjects, new_id=self.ids, decide_retry=self.decide_retry,
            webhook_binding=self.catalog.webhook_speaks_for)
        metrics.LOST_OUTCOMES.inc(lost)
        return lost

    async def record_dead_letter(self, letter: DeadLetter) -> None:
        await self.store.run(record_dead_letter_txn, letter, now=self.clock())
        metrics.inc(metrics.DEAD_LETTERS, metrics.bounded(letter.consumer, DEAD_LETTER_CONSUMERS))
        log.warning("dead-lettered %s from %s: %s", letter.message_id, letter.consumer,
                    letter.error)

    async def operation(self, operation_id: str) -> OperationView:
        async with self.store.read() as conn:
            return await reads.get_operation(conn, operation_id)

    async def wait_operation(self, operation_id: str, wait_s: float, *,
                             changed_from: str | None = None,
                             created_as: str | None = None) -> OperationView:
        """The operation once it is settled (or, with `changed_from`, once its state is no
        longer that one), else after `wait_s` as it is then. Woken by commits, not polling;
        while it waits only its state is read (batched with other waits, waiters.py).

        `created_as`: the state the caller's own commit just created the operation in, with
        nothing awaited since; it stands for the first read (a round trip on every submit-and-
        wait). Nothing can have changed the operation meanwhile: only its creator knows it
        exists until its command is published, and the publish runs in another task (the direct
        publisher, the relay), which this loop runs only once this call has registered its
        watch and awaits; another replica's change is caught by the re-check as ever."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        with self.waiters.watch(operation_id) as watch:  # before the read: no missed change
            watch.told = created_as
            watch.ends_on = lambda state: wait_over(state, changed_from)
            while True:
                state = watch.take_told() or await self.waiters.state(operation_id)
                if state is None:
                    raise NotFound(f"operation {operation_id!r} not found")
                watch.seen = state
                remaining = deadline - loop.time()
                if remaining <= 0 or wait_over(state, changed_from):
                    # The view the waking commit returned, if it did (a success alone):
                    # the operation as that commit left it, which a read would also give.
                    told: OperationView | None = watch.take_view(state)
                    return told if told is not None else await self.operation(operation_id)
                await watch.sleep(remaining)

    async def _states_of(self, operation_ids: list[str]) -> dict[str, str]:
        async with self.store.read() as conn:
            return await states_of(conn, operation_ids)

    async def journal(self, operation_id: str) -> Journal:
        async with self.store.transaction() as conn:
            return Journal(operation_id=operation_id,
                           entries=await reads.get_journal(conn, operation_id))

    async def receipt(self, operation_id: str) -> Receipt:
        return reads.build_receipt(await self.operation(operation_id))

    async def list_operations(self, *, state: str | None, limit: int,
                              cursor: str | None, tenant: str | None = None) -> OperationPage:
        async with self.store.transaction() as conn:
            return await reads.list_operations(conn, state=state, limit=limit, cursor=cursor,
                                               tenant=tenant)

    async def stats(self, tenant: str | None = None) -> Stats:
        """Counts by state; for one tenant only its operations (the outbox is not per tenant,
        so it is left out: unset, not null, so the JSON has no `outbox` at all)."""
        from .db.outbox import backlog_txn

        async with self.store.transaction() as conn:
            if tenant is not None:
                return Stats(operations=await reads.count_by_state(conn, tenant))
            return Stats(operations=await reads.count_by_state(conn),
                         outbox=await backlog_txn(conn))

    # ---- operator actions -------------------------------------------------------------

    async def approve(self, operation_id: str, *, epoch: int, arguments_digest: str,
                      operator: str) -> OperationRow:
        op = await self.store.run(rec.approve_txn, operation_id, epoch=epoch,
                                  arguments_digest=arguments_digest, operator=operator,
                                  subjects=self.subjects, outbox_id=self.ids(), now=self.clock(),
                                  traceparent=tracing.current_traceparent())
        self.waiters.changed(operation_id)
        self.outbox_wake.set()
        return op

    async def reject(self, operation_id: str, *, epoch: int, operator: str,
                     reason: str) -> OperationRow:
        op = await self.store.run(rec.reject_txn, operation_id, epoch=epoch, operator=operator,
                                  reason=reason, subjects=self.subjects, now=self.clock(),
                                  traceparent=tracing.current_traceparent())
        self.waiters.changed(operation_id)
        return op

    async def cancel(self, operation_id: str, *, operator: str, reason: str) -> OperationRow:
        op = await self.store.run(rec.cancel_txn, operation_id, operator=operator,
                                  reason=reason, subjects=self.subjects, now=self.clock(),
                                  traceparent=tracing.current_traceparent())
        self.waiters.changed(operation_id)
        return op

    async def inspect(self, operation_id: str) -> Assessment:
        async with self.store.transaction() as conn:
            return inspect_recovery(rec.facts(await rec.load_op(conn, operation_id)))

    async def retry(self, operation_id: str, *, operator: str, review: Review | None = None,
                    for_epoch: int | None = None) -> tuple[str, rec.Admission]:
        """Prepare a single-use plan and submit it to admission. Refusals raise or return."""
        from .db.reviews import latest_review

        async with self.store.transaction() as conn:
            op = await rec.load_op(conn, operation_id)
            if review is None:
                # An operator's earlier review of this epoch (e.g. not_executed) counts.
                review = await latest_review(conn, operation_id, op.epoch)
        plan = prepare_retry(rec.facts(op), review, for_epoch=for_epoch)
        plan_id = self.ids()
        await self.store.run(rec.record_plan_txn, plan, plan_id=plan_id, requested_by=operator,
                             now=self.clock())
        return plan_id, await self.use_plan(plan_id)

    async def use_plan(self, plan_id: str) -> rec.Admission:
        admission = await self.store.run(rec.consume_plan_txn, plan_id, catalog=self.catalog,
                                         subjects=self.subjects, outbox_id=self.ids(),
                                         now=self.clock(),
                                         traceparent=tracing.current_traceparent())
        if admission.admitted:
            self.waiters.changed(admission.operation.id if admission.operation else None)
            self.outbox_wake.set()
        return admission

    # ---- human review -----------------------------------------------------------------

    async def review(self, operation_id: str, review: Review) -> OperationRow:
        from .db.reviews import record_review_txn

        op = await self.store.run(record_review_txn, operation_id, review=review,
                                  review_id=self.ids(), subjects=self.subjects,
                                  now=self.clock(), traceparent=tracing.current_traceparent())
        self.waiters.changed(operation_id)
        return op

    async def review_queue(self, limit: int = 100) -> list[ReviewItem]:
        from .db.reviews import review_queue

        async with self.store.transaction() as conn:
            return await review_queue(conn, limit=limit)
