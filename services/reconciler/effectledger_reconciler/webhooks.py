"""Webhook ingestion: `POST /v1/webhooks/{provider}` → verified `WebhookReceived` on JetStream.

Steps, each one able to refuse with a 4xx JSON error before anything is published:
1. the provider must have configured secrets (404 otherwise), checked before reading the body;
2. the body is bounded: `Content-Length` first, then a streaming read that stops at the limit
   (413), so an oversized delivery is never read whole;
3. Standard Webhooks verification (signatures.py): signature over the raw bytes, any active
   secret, timestamp within the tolerance both ways (401; malformed headers 400);
4. the event is parsed into `WebhookReceived` (malformed JSON 400, out-of-bounds fields 422).
A provider declared in the catalog (`[webhooks.<provider>]`, native.py) is verified by its own
scheme (schemes.py: standard, stripe, github, hmac_header) and its events are read through the
catalog's paths and event-type table instead of steps 1, 3 and 4; ignored types get 200.
Then the message is published to `<prefix>.ledger.v1.webhook` with
`Nats-Msg-Id = webhook:<provider>:<webhook-id>` and the answer is 2xx only after JetStream's
publish-ack; if NATS cannot store it the answer is 503, so the provider retries. A valid
duplicate is also 2xx: JetStream collapses it within its duplicate window, and the ledger
deduplicates by (provider, webhook id) for much longer.

The sandbox's event schema: `{"type": "effect.applied" | "effect.not_applied" |
"effect.pending", "data": {"id": <provider ref>, "idempotency_key": <operation key>,
"fencing_token": int | null, "final": bool}}`; any other type is forwarded with outcome
"unknown" (kept as evidence, never acted on). The fencing token tells the ledger which epoch's
request the provider is talking about (a refusal of a superseded attempt says nothing about
the current one).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Literal

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from effectledger_bus import catalogue
from effectledger_bus.publish import Publisher
from effectledger_core import unsafe
from effectledger_core.errors import BrokerUnavailable
from effectledger_core.ids import Clock, utcnow
from effectledger_core.limits import declared_length
from effectledger_core.messages import WebhookReceived, encode
from effectledger_core.subjects import Subjects
from effectledger_obs import metrics
from effectledger_obs.http import HttpObservability, metrics_endpoint

from .native import NativeWebhooks
from .signatures import Verified, WebhookRejected, WebhookVerifier

log = logging.getLogger(__name__)
SKIP_VERIFICATION_ENV = unsafe.SKIP_WEBHOOK_VERIFICATION.env
Outcome = Literal["applied", "not_applied", "pending", "unknown"]
EVENT_OUTCOMES: dict[str, Outcome] = {
    "effect.applied": "applied",
    "effect.not_applied": "not_applied",
    "effect.pending": "pending",
}
Ready = Callable[[], Awaitable[dict[str, bool]]]


def error(status: int, code: str, message: str,
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status,
                        headers=headers)


async def read_bounded(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`, before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        length = declared_length(declared.strip())
        if length is None:
            raise WebhookRejected(400, "invalid_content_length", "invalid Content-Length")
        if length > limit:
            raise WebhookRejected(413, "payload_too_large", f"body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise WebhookRejected(413, "payload_too_large", f"body exceeds {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # Unauthenticated senders can do this at will: one log line (below), no traceback.
        raise WebhookRejected(400, "client_disconnected",
                              "the client went away before sending the whole body") from None
    return b"".join(chunks)


def to_message(provider: str, verified: Verified, body: bytes,
               received_at: datetime) -> WebhookReceived:
    """The evidence message for a verified delivery; raises WebhookRejected if unusable."""
    try:
        event: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting: not a 500
        raise WebhookRejected(400, "invalid_json", "the body is not JSON") from exc
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise WebhookRejected(400, "invalid_event", 'expected a JSON object with a "type"')
    data = event.get("data")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise WebhookRejected(400, "invalid_event", '"data" must be an object')
    key, ref = data.get("idempotency_key"), data.get("id")
    if key is not None and not isinstance(key, str):
        raise WebhookRejected(400, "invalid_event", '"data.idempotency_key" must be a string')
    if ref is not None and (isinstance(ref, bool) or not isinstance(ref, str | int)):
        raise WebhookRejected(400, "invalid_event", '"data.id" must be a string or an integer')
    token = data.get("fencing_token")
    if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
        raise WebhookRejected(400, "invalid_event", '"data.fencing_token" must be an integer')
    try:
        return WebhookReceived(
            provider=provider, webhook_id=verified.webhook_id, event_type=event["type"],
            operation_key=key or None, provider_ref=str(ref) if ref is not None else None,
            outcome=EVENT_OUTCOMES.get(event["type"], "unknown"), final=data.get("final") is True,
            fencing_token=token,
            body_digest="sha256:" + hashlib.sha256(body).hexdigest(),
            signed_at=verified.signed_at, received_at=received_at)
    except ValidationError as exc:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) for e in exc.errors()[:5])
        raise WebhookRejected(422, "invalid_event", f"out of bounds: {fields}") from exc


# What a 503 asks the provider to wait before delivering again.
RETRY_AFTER_S = "5"


class _Ingest:
    def __init__(self, verifier: WebhookVerifier, publisher: Publisher, subjects: Subjects,
                 clock: Clock, max_body_bytes: int, ready: Ready | None,
                 native: NativeWebhooks | None = None) -> None:
        self.verifier = verifier
        self.native = native
        self.publisher = publisher
        self.subjects = subjects
        self.clock = clock
        self.max_body_bytes = max_body_bytes
        self.ready_check = ready
        # Providers configured here: the only values the metrics' provider label takes.
        self.providers = frozenset(verifier.providers) | frozenset(
            native.providers if native is not None else ())
        self.stats: dict[str, int] = {"accepted": 0, "duplicates": 0, "rejected": 0,
                                      "unavailable": 0, "ignored": 0}

    async def receive(self, request: Request) -> Response:
        provider: str = request.path_params["provider"]
        label = metrics.bounded(provider, self.providers)  # the path is the sender's text
        metrics.inc(metrics.WEBHOOKS_RECEIVED, label)
        try:
            if self.native is not None and provider in self.native:
                # Declared in the catalog: the provider's own scheme and event shape.
                body = await read_bounded(request, self.max_body_bytes)
                native = self.native.message(provider, request.headers, body, self.clock())
                metrics.inc(metrics.WEBHOOKS_VERIFIED, label)
                if native is None:
                    self.stats["ignored"] += 1
                    return JSONResponse({"ok": True, "ignored": True})
                message = native
            else:
                self.verifier.check_provider(provider)  # before reading any of the body
                body = await read_bounded(request, self.max_body_bytes)
                verified = self.verifier.verify(provider, request.headers, body)
                if verified.verified:
                    metrics.inc(metrics.WEBHOOKS_VERIFIED, label)
                message = to_message(provider, verified, body, self.clock())
                if not verified.verified:
                    log.warning("UNSAFE: webhook %r from %r accepted WITHOUT signature "
                                "verification", verified.webhook_id, provider)
        except WebhookRejected as exc:
            metrics.inc(metrics.WEBHOOKS_REFUSED, label, exc.code)
            self.stats["rejected"] += 1
            log.info("webhook from %r rejected: %s (%s)", provider[:64], exc.code, exc.message)
            return error(exc.status, exc.code, exc.message)
        msg_id = catalogue.message_id(message)
        if not await self._ready():
            # The broker is away: say so now rather than wait out a publish timeout, so the
            # provider's retry schedule, not our socket, holds the event (never hangs).
            self.stats["unavailable"] += 1
            return error(503, "broker_unavailable", "the webhook cannot be stored now; retry",
                         {"Retry-After": RETRY_AFTER_S})
        try:
            duplicate = await self.publisher.publish(self.subjects.webhook, encode(message),
                                                     msg_id=msg_id)
        except BrokerUnavailable as exc:
            # Never 2xx without the publish-ack: the provider must deliver it again.
            self.stats["unavailable"] += 1
            log.warning("webhook %r from %r not stored: %s", message.webhook_id, provider,
                        exc.message)
            return error(503, "broker_unavailable", "the webhook could not be stored; retry",
                         {"Retry-After": RETRY_AFTER_S})
        self.stats["duplicates" if duplicate else "accepted"] += 1
        return JSONResponse({"ok": True, "webhook_id": message.webhook_id,
                             "duplicate": duplicate})

    async def _ready(self) -> bool:
        return self.ready_check is None or all((await self.ready_check()).values())

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(self, request: Request) -> Response:
        checks = await self.ready_check() if self.ready_check is not None else {}
        ok = all(checks.values())
        return JSONResponse({"ok": ok, "checks": checks}, status_code=200 if ok else 503)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "error")
    return error(status, code, f"{request.method} {request.url.path}")


def create_app(*, verifier: WebhookVerifier, publisher: Publisher, subjects: Subjects,
               clock: Clock = utcnow, max_body_bytes: int = 256 * 1024,
               ready: Ready | None = None, native: NativeWebhooks | None = None) -> Starlette:
    """The reconciler's HTTP app: webhook ingestion and health."""
    if verifier.skip_verification:
        unsafe.announce(unsafe.SKIP_WEBHOOK_VERIFICATION, log)
    ingest = _Ingest(verifier, publisher, subjects, clock, max_body_bytes, ready, native)
    app = Starlette(routes=[
        Route("/v1/webhooks/{provider}", ingest.receive, methods=["POST"]),
        Route("/healthz", ingest.healthz, methods=["GET"]),
        Route("/readyz", ingest.readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ], exception_handlers={404: _http_error, 405: _http_error},
        middleware=[Middleware(HttpObservability)])
    app.state.webhook_stats = ingest.stats
    return app
