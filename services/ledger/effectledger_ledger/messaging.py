"""The ledger's NATS side on nats-py: request-reply for intents, claims and outcomes, and the
inbox.

The inbox is a durable JetStream consumer with explicit acks. A message is acked only after the
ledger transaction that it caused has committed; poison messages are recorded and then acked.
Each message type the inbox consumes (its rows in `effectledger_bus.catalogue`) has its handler
in `INBOX_HANDLERS`.

An outcome may also come by request, on its dispatcher's own `rpc.v1.outcome.<id>`
(`Requests.outcome_by`): it goes into the same inbox transaction, under the same consumer name
and message id its JetStream copy carries, and is answered only after that commit. Whichever
copy comes second is a duplicate in the `inbox` table and changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from pydantic import BaseModel

from effectledger_bus import catalogue
from effectledger_bus.backoff import nak_backoff
from effectledger_bus.delivery import Delivery, dead_letter, message_id
from effectledger_bus.pull import PullConsumer, durable_consumer
from effectledger_bus.replies import ReplyPolicy
from effectledger_bus.rpc import RequestServer
from effectledger_core.commands import arguments_digest
from effectledger_core.config import Settings
from effectledger_core.errors import (
    EffectLedgerError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    PoisonMessage,
)
from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    ClaimAttempt,
    DeadLetter,
    ErrorDetail,
    ErrorReply,
    IntentReply,
    OperationQuery,
    OperationReply,
    OperationSummary,
    OperationWait,
    Outcome,
    OutcomeAmbiguous,
    OutcomeRecorded,
    SubmitIntent,
    VerdictReached,
    WebhookReceived,
    encode,
    excerpt,
    parse,
    parse_ledger_event,
    parse_outcome,
)
from effectledger_core.views import OperationView

from .service import LedgerService

log = logging.getLogger(__name__)
INBOX_CONSUMER = catalogue.LEDGER_INBOX
# Longest pause before a failed inbox message is delivered again.
INBOX_BACKOFF_CAP_S = 30.0


def _error_reply(exc: EffectLedgerError, *, with_retryable: bool = False) -> bytes:
    """The refusal as an ErrorReply; `with_retryable`: say whether asking again may help (the
    outcome request's dispatcher falls back to the stream on either answer)."""
    detail = {**exc.to_dict(), **({"retryable": exc.retryable} if with_retryable else {})}
    return encode(ErrorReply(error=ErrorDetail.model_validate(detail)))


def _summary(op: OperationView, *, with_ref: bool) -> OperationSummary:
    return OperationSummary(id=op.id, state=op.state, epoch=op.epoch,
                            operation_key=op.operation_key, tool=op.tool,
                            provider_ref=op.provider_ref if with_ref else None,
                            # Of the arguments as stored, which is what every reconcile
                            # command is rendered from (jsonb may rewrite a large number).
                            arguments_digest=arguments_digest(op.arguments))


def _submitted(op: dict[str, Any]) -> OperationSummary:
    """A new intent's operation, from the columns its transaction wrote (`Submitted`)."""
    return OperationSummary(id=op["id"], state=op["state"], epoch=op["epoch"],
                            operation_key=op["operation_key"], tool=op["tool"],
                            arguments_digest=arguments_digest(op["arguments"])
                            if "arguments" in op else op.get("arguments_digest"))


class Requests:
    """The ledger's request-reply handlers: payload bytes in, reply bytes out, never raising
    for bad input (served by effectledger_bus.rpc on plain nats-py subscriptions). Replies are
    the typed models of effectledger_core.messages."""

    def __init__(self, service: LedgerService, *, max_wait_s: float = 60.0) -> None:
        self.service = service
        self.max_wait_s = max_wait_s

    async def intent(self, raw: bytes) -> bytes:
        try:
            intent = parse(SubmitIntent, raw)
            submitted = await self.service.submit(intent, actor="agent:nats")
        except EffectLedgerError as exc:
            return _error_reply(exc)
        return encode(IntentReply(created=submitted.created,
                                  operation=_submitted(submitted.operation)))

    async def intent_for(self, subject: str, raw: bytes) -> bytes:
        """An agent's intent on its tenant's subject: the tenant is the subject's, whatever the
        payload says (NATS lets an agent publish only on its own tenant's subject)."""
        try:
            tenant = self.service.subjects.tenant_of(subject)
            intent = parse(SubmitIntent, raw)
            if tenant is None:
                raise InvalidRequest(f"no tenant in subject {subject[:200]!r}")
            if "tenant" in intent.model_fields_set and intent.tenant != tenant:
                raise InvalidRequest(f"tenant {intent.tenant!r} in the payload differs from "
                                     f"the credentials' tenant {tenant!r}")
            bound = intent.model_copy(update={"tenant": tenant})
            submitted = await self.service.submit(bound, actor=f"agent:{tenant}")
        except EffectLedgerError as exc:
            return _error_reply(exc)
        return encode(IntentReply(created=submitted.created,
                                  operation=_submitted(submitted.operation)))

    async def _tenants_operation(self, subject: str, operation_id: str) -> OperationView:
        """The operation if it belongs to the subject's tenant; otherwise exactly as missing."""
        tenant = self.service.subjects.tenant_of(subject)
        try:
            op = await self.service.operation(operation_id)
        except NotFound:
            op = None
        if op is None or tenant is None or op.tenant != tenant:
            raise NotFound(f"operation {operation_id!r} not found")
        return op

    async def operation_for(self, subject: str, raw: bytes) -> bytes:
        """An agent's read: another tenant's operation reads exactly like a missing one."""
        try:
            query = parse(OperationQuery, raw)
            op = await self._tenants_operation(subject, query.operation_id)
        except EffectLedgerError as exc:
            return _error_reply(exc)
        return encode(OperationReply(operation=_summary(op, with_ref=False)))

    async def operation_wait_for(self, subject: str, raw: bytes) -> bytes:
        """An agent's wait on its own tenant's operation; another tenant's reads as missing."""
        try:
            query = parse(OperationWait, raw)
            op = await self._tenants_operation(subject, query.operation_id)
            if query.wait_s > 0:
                op = await self.service.wait_operation(query.operation_id,
                                                       min(query.wait_s, self.max_wait_s))
        except EffectLedgerError as exc:
            return _error_reply(exc)
        return encode(OperationReply(operation=_summary(op, with_ref=False)))

    async def claim(self, raw: bytes) -> bytes:
        try:
            claim = parse(ClaimAttempt, raw)
            return encode(await self.service.claim(claim))
        except EffectLedgerError as exc:
            # No reply would leave the dispatcher waiting; an error reply makes it retry later.
            return _error_reply(exc)

    async def claim_by(self, subject: str, raw: bytes) -> bytes:
        """A claim on a dispatcher's own subject: the holder recorded is the subject's sender,
        so a claim in another dispatcher's name is refused."""
        try:
            sender = self.service.subjects.rpc_tail(subject, self.service.subjects.rpc_claim)
            claim = parse(ClaimAttempt, raw)
            if sender != claim.dispatcher_id:
                raise InvalidRequest(f"claim for dispatcher {claim.dispatcher_id!r} sent on "
                                     f"{subject[:200]!r}: a dispatcher claims only in its "
                                     "own name")
            if claim.tool is None or claim.arguments_digest is None:
                raise InvalidRequest("a claim must name the tool and the arguments digest of "
                                     "the command it is for")
            return encode(await self.service.claim(claim))
        except EffectLedgerError as exc:
            return _error_reply(exc)

    async def outcome_by(self, subject: str, raw: bytes) -> bytes:
        """An outcome on a dispatcher's own subject, committed to the inbox exactly as its
        JetStream copy would be (same consumer, same message id) and answered only after the
        commit. One naming another dispatcher is refused and kept as a dead letter, like its
        stream copy would be. Every refusal is an ErrorReply saying whether asking again may
        help; the dispatcher then publishes the stream copy, where the inbox's checks apply."""
        try:
            sender = self.service.subjects.rpc_tail(subject, self.service.subjects.rpc_outcome)
            if sender is None:
                raise InvalidRequest(f"no dispatcher in subject {subject[:200]!r}")
            outcome = parse_outcome(raw)
            msg_id = catalogue.message_id(outcome)
            if sender != outcome.dispatcher_id:
                error = (f"outcome from {sender!r} names dispatcher "
                         f"{outcome.dispatcher_id!r}")
                await self.service.record_dead_letter(DeadLetter(
                    consumer=INBOX_CONSUMER, subject=subject[:1024], message_id=msg_id[:1024],
                    error=error[:1024], payload_excerpt=excerpt(raw)))
                raise InvalidRequest(f"{error}: a dispatcher reports only in its own name")
            recorded = await self.service.record_outcome(outcome, consumer=INBOX_CONSUMER,
                                                         message_id=msg_id)
        except EffectLedgerError as exc:
            return _error_reply(exc, with_retryable=True)
        return encode(OutcomeRecorded(status=recorded.status, operation_id=outcome.operation_id,
                                      attempt_id=outcome.attempt_id, message_id=msg_id,
                                      reason=recorded.reason))

    async def operation(self, raw: bytes) -> bytes:
        try:
            query = parse(OperationQuery, raw)
            op = await self.service.operation(query.operation_id)
        except EffectLedgerError as exc:
            return _error_reply(exc)
        return encode(OperationReply(operation=_summary(op, with_ref=True)))

    async def operation_wait(self, raw: bytes) -> bytes:
        """Like `operation`, answered once the operation is settled or `wait_s` is over."""
        try:
            query = parse(OperationWait, raw)
            op = await self.service.wait_operation(query.operation_id,
                                                   min(query.wait_s, self.max_wait_s))
        except EffectLedgerError as exc:
            return _error_reply(exc)
        return encode(OperationReply(operation=_summary(op, with_ref=True)))


async def serve_requests(nc: NatsClient, settings: Settings,
                         service: LedgerService) -> RequestServer:
    """Intents, claims and operation reads (request-reply), queue group `ledger`.

    The subjects naming a sender (`.tenant.<tenant>.intents`, `.tenant.<tenant>.operation`,
    `.claim.<dispatcher id>`, `.outcome.<dispatcher id>`) bind it: NATS permissions let each
    principal publish only on its own. The plain subjects serve trusted callers (operator
    tools, older dispatchers)."""
    subjects, handlers = settings.subjects, Requests(service, max_wait_s=settings.wait_max_s)
    # Answers go only to the requester's own inbox (effectledger_bus.replies): with users on
    # the broker (the ledger has one), each requester's `_INBOX_<user>.` namespace.
    policy = ReplyPolicy(subjects, per_user_inboxes=bool(settings.nats_user))
    server = RequestServer(nc, reply_check=policy.refusal)
    await server.serve(subjects.rpc_intents, handlers.intent, queue="ledger", concurrency=256)
    await server.serve_by_subject(subjects.rpc_intents_for("*"), handlers.intent_for,
                                  queue="ledger", concurrency=256)
    await server.serve(subjects.rpc_claim, handlers.claim, queue="ledger", concurrency=256)
    await server.serve_by_subject(subjects.rpc_claim_by(">"), handlers.claim_by,
                                  queue="ledger", concurrency=256)
    # One outcome transaction each, group-committed like the claims.
    await server.serve_by_subject(subjects.rpc_outcome_by(">"), handlers.outcome_by,
                                  queue="ledger", concurrency=256)
    await server.serve(subjects.rpc_operation, handlers.operation, queue="ledger",
                       concurrency=16)
    # Waits sleep on the in-process notifier, not on a database connection: many may be open.
    await server.serve(subjects.rpc_operation_wait, handlers.operation_wait, queue="ledger",
                       concurrency=16384)
    await server.serve_by_subject(subjects.rpc_operation_for("*"), handlers.operation_for,
                                  queue="ledger", concurrency=16)
    await server.serve_by_subject(subjects.rpc_operation_wait_for("*"),
                                  handlers.operation_wait_for, queue="ledger", concurrency=16384)
    return server


def build_inbox(nc: NatsClient, settings: Settings, service: LedgerService) -> PullConsumer:
    """The inbox: a durable JetStream pull consumer of outcomes, verdicts, webhooks and dead
    letters (plain nats-py; see effectledger_bus.pull for why not FastStream here)."""
    max_deliver = settings.max_deliver

    async def on_event(d: Delivery) -> None:
        try:
            await _handle_event(service, d)
        except EffectLedgerError as exc:
            if exc.retryable and d.deliveries < max_deliver:
                await d.nak(delay=nak_backoff(d.deliveries, base_s=1.0, cap_s=INBOX_BACKOFF_CAP_S))
                return
            await service.record_dead_letter(
                dead_letter(d, consumer=INBOX_CONSUMER, error=exc.message))
        except Exception as exc:
            log.exception("inbox: unexpected error on %s", d.subject)
            if d.deliveries < max_deliver:
                await d.nak(delay=nak_backoff(d.deliveries, base_s=1.0, cap_s=INBOX_BACKOFF_CAP_S))
                return
            await service.record_dead_letter(dead_letter(
                d, consumer=INBOX_CONSUMER, error=f"{type(exc).__name__}: {exc}"))
        await d.ack()

    return durable_consumer(nc, settings, INBOX_CONSUMER, on_event, name="ledger.inbox",
                            concurrency=settings.inbox_concurrency, batch=64)


async def _handle_event(service: LedgerService, d: Delivery) -> None:
    try:
        event = parse_ledger_event(d.data)
    except (PoisonMessage, PayloadTooLarge) as exc:
        await service.record_dead_letter(
            dead_letter(d, consumer=INBOX_CONSUMER, error=exc.message))
        return
    # A message published without an id (by hand, by an old publisher) is deduplicated under
    # the id its publisher would have given it.
    await INBOX_HANDLERS[type(event)](service, event, d,
                                      message_id(d) or catalogue.message_id(event))


# --- the inbox's handlers, one per message it consumes (effectledger_bus.catalogue) ---

InboxHandler = Callable[[LedgerService, Any, Delivery, str], Awaitable[None]]


async def _on_dead_letter(service: LedgerService, letter: DeadLetter, d: Delivery,
                          msg_id: str) -> None:
    await service.record_dead_letter(letter)


async def _on_verdict(service: LedgerService, verdict: VerdictReached, d: Delivery,
                      msg_id: str) -> None:
    await service.record_verdict(verdict, consumer=INBOX_CONSUMER, message_id=msg_id)


async def _on_webhook(service: LedgerService, hook: WebhookReceived, d: Delivery,
                      msg_id: str) -> None:
    await service.record_webhook(hook)  # deduplicated by (provider, webhook id)


async def _on_outcome(service: LedgerService, outcome: Outcome, d: Delivery,
                      msg_id: str) -> None:
    sender = service.subjects.outcome_sender(d.subject)
    if sender is not None and sender != outcome.dispatcher_id:
        # The subject is the sender's identity (only that dispatcher may publish on it);
        # an outcome claiming another dispatcher's name is a forgery, kept as evidence.
        await service.record_dead_letter(dead_letter(
            d, consumer=INBOX_CONSUMER,
            error=f"outcome from {sender!r} names dispatcher {outcome.dispatcher_id!r}"))
        return
    await service.record_outcome(outcome, consumer=INBOX_CONSUMER, message_id=msg_id)


INBOX_HANDLERS: dict[type[BaseModel], InboxHandler] = {
    AttemptSucceeded: _on_outcome, AttemptAccepted: _on_outcome, AttemptFailed: _on_outcome,
    OutcomeAmbiguous: _on_outcome, VerdictReached: _on_verdict, WebhookReceived: _on_webhook,
    DeadLetter: _on_dead_letter,
}
