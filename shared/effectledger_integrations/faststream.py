"""FastStream: a `NatsRouter` that a platform team's FastStream app includes to submit intents
and receive settled operations as the project's message models (docs/integrations/faststream.md).

    broker = NatsBroker(url, user="agent-acme", password=..., inbox_prefix="_INBOX_agent-acme")
    ledger = LedgerRouter("acme")

    @ledger.on_settled
    async def settled(reply: OperationReply) -> None: ...

    broker.include_router(ledger)
    reply = await ledger.submit(SubmitIntent(tool="create_ticket", arguments={...},
                                             idempotency_key="order-17"))

It speaks only what the tenant's least-privilege NATS user may (`effectledger_bus.permissions`:
publish under `<prefix>.rpc.v1.tenant.<tenant>.>`, receive on its own `_INBOX_agent-<tenant>.>`):
an intent is a request on the tenant's intents subject; the settled operation is the ledger's
answer to a wait request on the tenant's wait subject whose reply subject is this router's own
subscriber, under the user's inbox prefix. A wait that ends before the operation is at rest is
asked again, so the handlers see each operation once it is `succeeded`, `failed`, `cancelled`
or `needs_review`.

Acknowledgement: the subscriber is a core NATS one with `AckPolicy.MANUAL` (FastStream's
default would "reject" a message whose handler raised; core NATS has nothing to redeliver). A
handler that raises is given the operation again: the router asks the ledger again after
`retry_delay_s` (the operation is settled, so the answer is immediate), up to `redeliveries`
times, then logs it. Answers travel on core NATS: one sent while the app is down is lost, so an
app keeps the ids it submitted and calls `watch()` for the unhandled ones when it starts.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from faststream import AckPolicy
from faststream.nats import NatsMessage, NatsRouter

from effectledger_bus import permissions
from effectledger_core.errors import PayloadTooLarge, PoisonMessage
from effectledger_core.messages import (
    ErrorReply,
    IntentReply,
    OperationReply,
    OperationWait,
    SubmitIntent,
    parse_answer,
)
from effectledger_core.states import AT_REST, State
from effectledger_core.subjects import Subjects

log = logging.getLogger(__name__)
SettledHandler = Callable[[OperationReply], Awaitable[Any]]
_AT_REST = frozenset(s.value for s in AT_REST)


class LedgerRefused(Exception):
    """The ledger answered the request with an error (`reply.error.code`: invalid_request,
    idempotency_key_conflict, ...). Nothing was submitted."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.error.code}: {reply.error.message}")
        self.reply = reply


class LedgerUnanswered(Exception):
    """No answer from the ledger in time. Submitting the same intent again (same idempotency
    key) is safe: it finds the same operation."""


class LedgerRouter(NatsRouter):
    """Submit intents and receive settled operations for one tenant.

    `subjects`: the deployment's (`EFFECTLEDGER_SUBJECT_PREFIX`, default `effects`).
    `inbox_prefix`: where the NATS user receives replies; by default the agent user's
    (`_INBOX_agent-<tenant>`), which the broker must also be given (`NatsBroker(inbox_prefix=)`).
    `wait_s`: one wait request (the ledger caps it, 60 s by default).
    `approval_poll_s`: how often an operation awaiting an operator's approval is asked about
    (the ledger answers a wait on it at once)."""

    def __init__(self, tenant: str, *, subjects: Subjects | None = None,
                 inbox_prefix: str | None = None, wait_s: float = 30.0,
                 request_timeout_s: float = 10.0, redeliveries: int = 5,
                 retry_delay_s: float = 1.0, approval_poll_s: float = 5.0) -> None:
        super().__init__()
        self.tenant = tenant
        self.subjects = subjects or Subjects()
        agent = permissions.agent(self.subjects, tenant)
        prefix = inbox_prefix or permissions.inbox_prefix(agent.user)
        # One subject per router instance: each app replica receives the answers to its own
        # waits.
        self.settled_subject = f"{prefix}.effectledger.{uuid.uuid4().hex[:16]}"
        self.wait_s = wait_s
        self.request_timeout_s = request_timeout_s
        self.redeliveries = redeliveries
        self.retry_delay_s = retry_delay_s
        self.approval_poll_s = approval_poll_s
        self._on_settled: list[SettledHandler] = []
        self._failures: dict[str, int] = {}
        self._later: set[asyncio.Task[None]] = set()
        self._intents = self.publisher(self.subjects.rpc_intents_for(tenant),
                                       title="effectledger intents", schema=SubmitIntent)
        self._waits = self.publisher(self.subjects.rpc_operation_wait_for(tenant),
                                     reply_to=self.settled_subject,
                                     title="effectledger waits", schema=OperationWait)
        self.subscriber(self.settled_subject, ack_policy=AckPolicy.MANUAL, no_reply=True,
                        title="effectledger settled operations")(self._on_answer)

    def on_settled(self, handler: SettledHandler) -> SettledHandler:
        """Decorator: `handler(reply)` for every operation this router submitted or watches,
        once it is at rest."""
        self._on_settled.append(handler)
        return handler

    async def submit(self, intent: SubmitIntent, *, watch: bool = True) -> IntentReply:
        """Submit on the tenant's intents subject; with `watch`, the handlers receive the
        operation once settled. The intent needs an idempotency key (your own id for this
        effect): a resend after `LedgerUnanswered` must find the same operation."""
        if intent.idempotency_key is None:
            raise ValueError("SubmitIntent.idempotency_key is required: without it a resend "
                             "after a lost answer would apply the effect twice")
        if "tenant" in intent.model_fields_set and intent.tenant != self.tenant:
            raise ValueError(f"intent for tenant {intent.tenant!r} on {self.tenant!r}'s router")
        # The ledger takes the tenant from the subject and refuses a payload naming another
        # (a serialised intent always names one: "default" unless set).
        intent = intent.model_copy(update={"tenant": self.tenant})
        try:
            msg = await self._intents.request(intent, timeout=self.request_timeout_s)
        except TimeoutError as exc:
            raise LedgerUnanswered(f"no answer from the ledger within {self.request_timeout_s}"
                                   " s; submitting again with the same key is safe") from exc
        reply = parse_answer(IntentReply, msg.body)
        if isinstance(reply, ErrorReply):
            raise LedgerRefused(reply)
        if watch:
            await self.watch(reply.operation.id)
        return reply

    async def watch(self, operation_id: str) -> None:
        """Ask the ledger for `operation_id` once settled; the answer reaches the handlers."""
        await self._waits.publish(OperationWait(operation_id=operation_id, wait_s=self.wait_s))

    async def _on_answer(self, msg: NatsMessage) -> None:
        try:
            reply = parse_answer(OperationReply, msg.body)
        except (PoisonMessage, PayloadTooLarge) as exc:
            log.warning("effectledger: unreadable answer on %s: %s", self.settled_subject, exc)
            return
        if isinstance(reply, ErrorReply):
            # not_found: an id this tenant does not own (or a typo in a watch); nothing to ask.
            log.warning("effectledger: wait refused: %s: %s", reply.error.code,
                        reply.error.message)
            return
        op = reply.operation
        if op.state == State.AWAITING_APPROVAL:
            self._later_watch(op.id, self.approval_poll_s)
            return
        if op.state not in _AT_REST:
            await self.watch(op.id)  # the wait ended first: wait again
            return
        try:
            for handler in self._on_settled:
                await handler(reply)
        except Exception:
            failures = self._failures[op.id] = self._failures.get(op.id, 0) + 1
            if failures > self.redeliveries:
                log.exception("effectledger: handler failed on operation %s %d times; given up "
                              "(call watch() to deliver it again)", op.id, failures)
                self._failures.pop(op.id, None)
                return
            log.warning("effectledger: handler failed on operation %s (%d); asking again in "
                        "%.1f s", op.id, failures, self.retry_delay_s, exc_info=True)
            self._later_watch(op.id, self.retry_delay_s)
            return
        self._failures.pop(op.id, None)

    def _later_watch(self, operation_id: str, delay_s: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay_s)  # a back-off before asking again, not a sync point
            try:
                await self.watch(operation_id)
            except Exception:
                log.exception("effectledger: could not ask about operation %s", operation_id)

        task = asyncio.create_task(later())
        self._later.add(task)
        task.add_done_callback(self._later.discard)
