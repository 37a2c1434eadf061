"""The ledger's NATS side on nats-py: request-reply for intents and claims, and the inbox.

The inbox is a durable JetStream consumer with explicit acks. A message is acked only after the
ledger transaction that it caused has committed; poison messages are recorded and then acked.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from effectledger_bus.pull import PullConsumer
from effectledger_bus.rpc import RequestServer
from effectledger_core.config import Settings
from effectledger_core.errors import (
    EffectLedgerError,
    InvalidRequest,
    PayloadTooLarge,
    PoisonMessage,
)
from effectledger_core.messages import (
    ClaimAttempt,
    DeadLetter,
    SubmitIntent,
    VerdictReached,
    WebhookReceived,
    encode,
    excerpt,
    parse,
    parse_ledger_event,
)

from .service import LedgerService

log = logging.getLogger(__name__)
INBOX_CONSUMER = "ledger-inbox"


def _error_reply(exc: EffectLedgerError) -> str:
    return json.dumps({"ok": False, "error": exc.to_dict()})


class Requests:
    """The ledger's request-reply handlers: payload bytes in, reply bytes out, never raising
    for bad input (served by effectledger_bus.rpc on plain nats-py subscriptions)."""

    def __init__(self, service: LedgerService, *, max_wait_s: float = 60.0) -> None:
        self.service = service
        self.max_wait_s = max_wait_s

    async def intent(self, raw: bytes) -> bytes:
        try:
            intent = parse(SubmitIntent, raw)
            submitted = await self.service.submit(intent, actor="agent:nats")
        except EffectLedgerError as exc:
            return _error_reply(exc).encode()
        op = submitted.operation
        return json.dumps({"ok": True, "created": submitted.created, "operation": {
            "id": op["id"], "state": op["state"], "epoch": op["epoch"],
            "operation_key": op["operation_key"], "tool": op["tool"]}}).encode()

    async def claim(self, raw: bytes) -> bytes:
        try:
            claim = parse(ClaimAttempt, raw)
            return encode(await self.service.claim(claim))
        except EffectLedgerError as exc:
            # No reply would leave the dispatcher waiting; an error reply makes it retry later.
            return _error_reply(exc).encode()

    async def operation(self, raw: bytes) -> bytes:
        return await self._operation(raw, waits=False)

    async def operation_wait(self, raw: bytes) -> bytes:
        """Like `operation`, answered once the operation is settled or `wait_s` is over."""
        return await self._operation(raw, waits=True)

    async def _operation(self, raw: bytes, *, waits: bool) -> bytes:
        try:
            query = json.loads(raw)
            # .get: an object without the field must get an error reply, not a KeyError.
            op_id = query.get("operation_id") if isinstance(query, dict) else None
            if not isinstance(op_id, str) or not 0 < len(op_id) <= 1024:
                raise InvalidRequest("expected {\"operation_id\": \"...\"}")
            wait_s = query.get("wait_s", 0) if waits else 0
            if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or wait_s < 0:
                raise InvalidRequest("wait_s must be a non-negative number of seconds")
            if wait_s > 0:
                op = await self.service.wait_operation(op_id, min(float(wait_s),
                                                                  self.max_wait_s))
            else:
                op = await self.service.operation(op_id)
        except EffectLedgerError as exc:
            return _error_reply(exc).encode()
        except (ValueError, RecursionError):
            # RecursionError: deeply nested JSON; without this the requester gets no reply.
            return _error_reply(InvalidRequest("payload is not JSON")).encode()
        return json.dumps({"ok": True, "operation": {
            k: op[k] for k in ("id", "state", "epoch", "operation_key", "tool",
                               "provider_ref")}}).encode()


async def serve_requests(nc: NatsClient, settings: Settings,
                         service: LedgerService) -> RequestServer:
    """Intents, claims and operation reads (request-reply), queue group `ledger`."""
    subjects, handlers = settings.subjects, Requests(service, max_wait_s=settings.wait_max_s)
    server = RequestServer(nc)
    await server.serve(subjects.rpc_intents, handlers.intent, queue="ledger", concurrency=256)
    await server.serve(subjects.rpc_claim, handlers.claim, queue="ledger", concurrency=256)
    await server.serve(subjects.rpc_operation, handlers.operation, queue="ledger",
                       concurrency=16)
    # Waits sleep on the in-process notifier, not on a database connection: many may be open.
    await server.serve(subjects.rpc_operation_wait, handlers.operation_wait, queue="ledger",
                       concurrency=16384)
    return server


def build_inbox(nc: NatsClient, settings: Settings, service: LedgerService) -> PullConsumer:
    """The inbox: a durable JetStream pull consumer of outcomes, verdicts, webhooks and dead
    letters (plain nats-py; see effectledger_bus.pull for why not FastStream here)."""
    subjects = settings.subjects
    max_deliver = settings.max_deliver

    async def on_event(msg: Msg) -> None:
        headers = msg.headers or {}
        deliveries = msg.metadata.num_delivered
        try:
            await _handle_event(service, subjects.deadletter, msg.subject, msg.data, headers,
                                deliveries)
        except EffectLedgerError as exc:
            if exc.retryable and deliveries < max_deliver:
                await msg.nak(delay=min(30.0, 0.5 * 2 ** deliveries))
                return
            await _dead_letter(service, msg.subject, msg.data, headers, deliveries,
                               exc.message)
        except Exception as exc:
            log.exception("inbox: unexpected error on %s", msg.subject)
            if deliveries < max_deliver:
                await msg.nak(delay=min(30.0, 0.5 * 2 ** deliveries))
                return
            await _dead_letter(service, msg.subject, msg.data, headers, deliveries,
                               f"{type(exc).__name__}: {exc}")
        await msg.ack()

    return PullConsumer(
        nc, subject=subjects.ledger_all, stream=subjects.events_stream,
        durable=INBOX_CONSUMER, handler=on_event, name="ledger.inbox",
        concurrency=settings.inbox_concurrency, batch=64,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=settings.inbox_ack_wait_s,
                              max_deliver=max_deliver, max_ack_pending=4096))


async def _handle_event(service: LedgerService, deadletter_subject: str, subject: str,
                        data: bytes, headers: dict[str, Any], deliveries: int) -> None:
    try:
        event = parse_ledger_event(data)
    except (PoisonMessage, PayloadTooLarge) as exc:
        await _dead_letter(service, subject, data, headers, deliveries, exc.message)
        return
    message_id = headers.get("Nats-Msg-Id")
    if isinstance(event, DeadLetter):
        await service.record_dead_letter(event)
    elif isinstance(event, VerdictReached):
        await service.record_verdict(
            event, consumer=INBOX_CONSUMER,
            message_id=message_id or f"verdict:{event.operation_id}:{event.epoch}:"
                                     f"{event.reconciler_id}:{event.verdict}")
    elif isinstance(event, WebhookReceived):
        await service.record_webhook(event)  # deduplicated by (provider, webhook id)
    else:
        await service.record_outcome(
            event, consumer=INBOX_CONSUMER,
            message_id=message_id or f"{event.type}:{event.attempt_id}")


async def _dead_letter(service: LedgerService, subject: str, data: bytes,
                       headers: dict[str, Any], deliveries: int, error: str) -> None:
    await service.record_dead_letter(DeadLetter(
        consumer=INBOX_CONSUMER, subject=subject[:1024],
        message_id=(headers.get("Nats-Msg-Id") or None), error=error[:1024],
        payload_excerpt=excerpt(data), deliveries=deliveries))
