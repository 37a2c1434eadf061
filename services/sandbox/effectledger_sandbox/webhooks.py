"""The sandbox's webhook sender: signed Standard Webhooks, with injectable delivery faults.

When a URL and a secret are configured and a route has webhooks enabled, the sandbox tells the
URL about effects, like a payments provider would:
- `effect.applied` (final) after an effect is applied, including a late apply;
- `effect.pending` when a late apply is scheduled (accepted, still processing);
- `effect.not_applied` (final) when a request was refused before applying, if the route has
  `not_applied_webhooks` enabled. It describes *that request* (its `fencing_token` says which
  attempt) and is only sent while nothing is applied or in progress for the key.
Replays send nothing: the effect was announced when it was applied.

Payload: `{"type", "timestamp", "data": {"id", "idempotency_key", "fencing_token", "final",
"route", ...}}`. Headers: `webhook-id` (unique per event, shared by every delivery of it:
duplicates and retries), `webhook-timestamp`, `webhook-signature` (`standardwebhooks` signs).

Each event is delivered in a background task; a non-2xx answer or a connection error is retried
with exponential backoff, a bounded number of times. Every attempt is recorded in the log
(`GET /_webhooks`). Delivery faults (`/_webhooks/faults`), matched by route, key and type:
- `delay` {seconds}: wait before the first delivery;
- `duplicate` {copies, concurrent}: deliver `copies` times in all, the first `concurrent` of them
  at the same moment and the rest one after another;
- `reorder` {seconds}: hold the event until the next event on the same route has been
  delivered (or `seconds` passed, default 5), so a later event arrives before it;
- `resign`: sign every delivery afresh, with the current time plus the copy's index in seconds,
  so duplicates carry different timestamps and signatures under the same webhook id.
Several faults of different kinds can act on one event; `times` limits how many events a fault
affects.

A route may instead speak a provider's own dialect (`/_config/routes/{route}` with
`"scheme": "stripe"` and its own `"url"`): the same events, with the event id also at the top
level (`"id"`), signed as Stripe documents it (`Stripe-Signature: t=<ts>,v1=<hex HMAC-SHA256
(secret, "<ts>.<body>")>`, the secret string itself as the key), for tests of catalog-declared
native webhooks. `POST /_webhooks/send` sends one delivery now, valid or deliberately bad (forged,
wrong key, expired, future-dated, unsigned, tampered body), for tests of the receiving side.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from standardwebhooks import Webhook

from .faults import FaultError

EVENT_APPLIED = "effect.applied"
EVENT_NOT_APPLIED = "effect.not_applied"
EVENT_PENDING = "effect.pending"
FAULT_KINDS = ("delay", "duplicate", "reorder", "resign")
SCHEMES = ("standard", "stripe")
SEND_MODES = ("valid", "forged", "wrong_key", "expired", "future", "unsigned", "tampered_body")
LOG_LIMIT = 10_000
MAX_COPIES = 20


def new_secret() -> str:
    """A fresh Standard Webhooks secret: `whsec_` + base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


def check_secret(secret: str) -> None:
    """Raise ValueError unless `secret` is `whsec_` + strict base64 of 16..64 bytes."""
    body = secret.removeprefix("whsec_")
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except ValueError:
        raw = b""
    if not secret.startswith("whsec_") or not 16 <= len(raw) <= 64:
        raise ValueError("the webhook secret must be whsec_ + base64 of 16..64 random bytes")


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers for `body` signed at `timestamp` (seconds)."""
    signature = Webhook(secret).sign(webhook_id, datetime.fromtimestamp(timestamp, tz=UTC),
                                     body.decode())
    return {"webhook-id": webhook_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature, "content-type": "application/json"}


def sign_stripe(secret: str, webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Stripe's documented signature; `webhook-id`/`-timestamp` are kept for the sandbox's log."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={timestamp},v1={mac}", "webhook-id": webhook_id,
            "webhook-timestamp": str(timestamp), "content-type": "application/json"}


def bad_delivery(mode: str, secret: str, webhook_id: str, now: int, body: bytes,
                 skew_s: int = 600) -> tuple[dict[str, str], bytes]:
    """Headers and body for a delivery in `mode` (one of SEND_MODES); only "valid" verifies."""
    if mode == "valid":
        return sign(secret, webhook_id, now, body), body
    if mode == "forged":
        headers = sign(secret, webhook_id, now, body)
        headers["webhook-signature"] = "v1," + base64.b64encode(os.urandom(32)).decode()
        return headers, body
    if mode == "wrong_key":
        return sign(new_secret(), webhook_id, now, body), body
    if mode == "expired":
        return sign(secret, webhook_id, now - skew_s, body), body
    if mode == "future":
        return sign(secret, webhook_id, now + skew_s, body), body
    if mode == "unsigned":
        headers = sign(secret, webhook_id, now, body)
        del headers["webhook-signature"]
        return headers, body
    if mode == "tampered_body":
        return sign(secret, webhook_id, now, body), body.replace(b'"', b"'", 1) + b" "
    raise ValueError(f"mode must be one of {list(SEND_MODES)}")


# -- delivery faults --------------------------------------------------------------------------

@dataclass(slots=True)
class WebhookFault:
    kind: str
    route: str | None = None
    key: str | None = None
    event_type: str | None = None
    times: int | None = None
    seconds: float = 5.0
    copies: int = 2
    concurrent: int = 1
    fired: int = 0

    def matches(self, route: str, key: str | None, event_type: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        return ((self.route is None or self.route == route)
                and (self.key is None or self.key == key)
                and (self.event_type is None or self.event_type == event_type))

    def to_json(self) -> dict[str, Any]:
        match = {k: v for k, v in (("route", self.route), ("key", self.key),
                                   ("type", self.event_type)) if v is not None}
        action: dict[str, Any] = {"kind": self.kind}
        if self.kind in ("delay", "reorder"):
            action["seconds"] = self.seconds
        if self.kind == "duplicate":
            action.update(copies=self.copies, concurrent=self.concurrent)
        return {"match": match, "action": action, "times": self.times, "fired": self.fired}


def _int(raw: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FaultError(f"'action.{name}' must be an integer between {low} and {high}")
    return value


def parse_webhook_fault(raw: Any) -> WebhookFault:
    """Validate one webhook fault; raises FaultError naming the offending field."""
    if not isinstance(raw, dict) or set(raw) - {"match", "action", "times"}:
        raise FaultError("a webhook fault is an object with 'match', 'action' and 'times'")
    match = raw.get("match") or {}
    if not isinstance(match, dict) or set(match) - {"route", "key", "type"}:
        raise FaultError("'match' may have 'route', 'key' and 'type'")
    if any(v is not None and not isinstance(v, str) for v in match.values()):
        raise FaultError("'match' values must be strings")
    action = raw.get("action")
    if not isinstance(action, dict) or action.get("kind") not in FAULT_KINDS:
        raise FaultError(f"'action.kind' must be one of {list(FAULT_KINDS)}")
    times = raw.get("times")
    if times is not None and (not isinstance(times, int) or isinstance(times, bool) or times < 0):
        raise FaultError("'times' must be a non-negative integer")
    fault = WebhookFault(kind=action["kind"], route=match.get("route"), key=match.get("key"),
                         event_type=match.get("type"), times=times)
    if fault.kind in ("delay", "reorder"):
        seconds = action.get("seconds", 5.0)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
            raise FaultError("'action.seconds' must be a non-negative number")
        fault.seconds = float(seconds)
    if fault.kind == "duplicate":
        fault.copies = _int(action, "copies", 2, 2, MAX_COPIES)
        fault.concurrent = _int(action, "concurrent", (fault.copies + 1) // 2, 1, fault.copies)
    return fault


class WebhookFaults:
    def __init__(self) -> None:
        self.faults: list[WebhookFault] = []

    def pick(self, route: str, key: str | None, event_type: str) -> dict[str, WebhookFault]:
        """The first matching fault of each kind, each consuming one of its `times`."""
        picked: dict[str, WebhookFault] = {}
        for fault in self.faults:
            if fault.kind in picked or not fault.matches(route, key, event_type):
                continue
            if fault.times is not None:
                fault.times -= 1
            fault.fired += 1
            picked[fault.kind] = fault
        return picked

    def to_json(self) -> dict[str, Any]:
        return {"faults": [f.to_json() for f in self.faults]}


# -- the sender -------------------------------------------------------------------------------

@dataclass(slots=True)
class _Event:
    webhook_id: str
    type: str
    route: str
    key: str | None
    body: bytes
    entry: dict[str, Any]


@dataclass(slots=True)
class _Held:
    event: _Event
    faults: dict[str, WebhookFault]
    released: bool = False
    timer: asyncio.Task[None] | None = None


@dataclass
class RouteHooks:
    webhooks: bool = False
    not_applied_webhooks: bool = False
    scheme: str = "standard"  # or "stripe": the provider's own signature (see the docstring)
    url: str | None = None  # this route's receiver; default: the sender's URL


@dataclass
class WebhookSender:
    """Sends the sandbox's webhooks; disabled (every hook a no-op) without a URL and secret."""

    url: str | None = None
    secret: str | None = None
    default_routes: Iterable[str] = ()  # routes with webhooks on at start (and after reset)
    transport: httpx.AsyncBaseTransport | None = None
    wall_clock: Callable[[], float] = time.time
    retry_base_s: float = 0.2
    retry_cap_s: float = 5.0
    max_attempts: int = 6
    timeout_s: float = 5.0
    faults: WebhookFaults = field(default_factory=WebhookFaults)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.secret is not None:
            check_secret(self.secret)
        self.default_routes = frozenset(self.default_routes)
        self._client: httpx.AsyncClient | None = None
        self.reset()

    @property
    def enabled(self) -> bool:
        return bool(self.url and self.secret)

    # -- configuration --------------------------------------------------------------------------

    def route(self, route: str) -> RouteHooks:
        hooks = self._routes.get(route)
        if hooks is None:
            on = route in self.default_routes or "*" in self.default_routes
            hooks = RouteHooks(webhooks=on)
        return hooks

    def configure_route(self, route: str, *, webhooks: bool | None = None,
                        not_applied_webhooks: bool | None = None, scheme: str | None = None,
                        url: str | None = None) -> None:
        hooks = self.route(route)
        if webhooks is not None:
            hooks.webhooks = webhooks
        if not_applied_webhooks is not None:
            hooks.not_applied_webhooks = not_applied_webhooks
        if scheme is not None:
            if scheme not in SCHEMES:
                raise ValueError(f"scheme must be one of {list(SCHEMES)}")
            hooks.scheme = scheme
        if url is not None:
            hooks.url = url
        self._routes[route] = hooks

    def reset(self) -> None:
        """Forget the log, faults and route settings; stop every pending delivery."""
        self.cancel()
        self._routes: dict[str, RouteHooks] = {}
        self._held: dict[str, list[_Held]] = {}
        self.log: deque[dict[str, Any]] = deque(maxlen=LOG_LIMIT)
        self.faults.faults.clear()

    # -- what the provider reports ----------------------------------------------------------

    def applied(self, route: str, key: str | None, effect: dict[str, Any]) -> None:
        self._emit(route, key, EVENT_APPLIED, {
            "id": effect["id"], "idempotency_key": key,
            "fencing_token": effect.get("fencing_token"), "final": True, "route": route,
            "status": "applied"})

    def pending(self, route: str, key: str | None, fencing_token: int | None) -> None:
        self._emit(route, key, EVENT_PENDING, {
            "id": None, "idempotency_key": key, "fencing_token": fencing_token, "final": False,
            "route": route, "status": "processing"})

    def not_applied(self, route: str, key: str | None, fencing_token: int | None,
                    reason: str) -> None:
        if not self.route(route).not_applied_webhooks:
            return
        self._emit(route, key, EVENT_NOT_APPLIED, {
            "id": None, "idempotency_key": key, "fencing_token": fencing_token, "final": True,
            "route": route, "status": "refused", "reason": reason})

    def _emit(self, route: str, key: str | None, event_type: str,
              data: dict[str, Any]) -> None:
        if not self.enabled or not self.route(route).webhooks:
            return
        now = self.wall_clock()
        payload: dict[str, Any] = {
            "type": event_type,
            "timestamp": datetime.fromtimestamp(now, tz=UTC).isoformat().replace("+00:00", "Z"),
            "data": data}
        # Random ids: a restarted sandbox must never reuse an id the receiver deduplicates.
        webhook_id = "msg_" + uuid.uuid4().hex
        if self.route(route).scheme == "stripe":
            payload = {"id": webhook_id, **payload}
        entry: dict[str, Any] = {
            "webhook_id": webhook_id, "type": event_type, "route": route, "key": key,
            "effect_id": data.get("id"), "fencing_token": data.get("fencing_token"),
            "created_at": now, "state": "scheduled", "faults": [], "status_codes": [],
            "deliveries": []}
        self.log.append(entry)
        event = _Event(webhook_id, event_type, route, key,
                       json.dumps(payload, separators=(",", ":")).encode(), entry)
        faults = self.faults.pick(route, key, event_type)
        entry["faults"] = sorted(faults)
        if "reorder" in faults:
            self._hold(event, faults)
            return
        then = self._held.pop(route, [])
        self._spawn(self._run(event, faults, then))

    # -- delivery -------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _hold(self, event: _Event, faults: dict[str, WebhookFault]) -> None:
        held = _Held(event, faults)
        event.entry["state"] = "held"
        self._held.setdefault(event.route, []).append(held)

        async def release_after() -> None:
            await asyncio.sleep(faults["reorder"].seconds)
            waiting = self._held.get(event.route, [])
            if held in waiting:
                waiting.remove(held)
            await self._release(held)

        held.timer = self._spawn(release_after())

    async def _release(self, held: _Held) -> None:
        if not held.released:
            held.released = True
            await self._send(held.event, held.faults)

    async def _run(self, event: _Event, faults: dict[str, WebhookFault],
                   then: list[_Held]) -> None:
        await self._send(event, faults)
        for held in then:  # the earlier events, now after the later one
            if held.released:
                continue  # its hold timer ran out first and already sent it
            if held.timer is not None:
                held.timer.cancel()  # still sleeping: `released` is set before any await
            self._spawn(self._release(held))

    async def _send(self, event: _Event, faults: dict[str, WebhookFault]) -> None:
        entry = event.entry
        if (delay := faults.get("delay")) is not None:
            entry["state"] = "delayed"
            await asyncio.sleep(delay.seconds)
        entry["state"] = "sending"
        resign = "resign" in faults
        signed = self._sign(event, int(self.wall_clock()))
        dup = faults.get("duplicate")
        copies, concurrent = (dup.copies, dup.concurrent) if dup is not None else (1, 1)
        results = list(await asyncio.gather(*(
            self._deliver(event, copy, signed, resign) for copy in range(concurrent))))
        for copy in range(concurrent, copies):
            results.append(await self._deliver(event, copy, signed, resign))
        entry["state"] = "delivered" if any(results) else "failed"

    async def _deliver(self, event: _Event, copy: int, signed: dict[str, str],
                       resign: bool) -> bool:
        """One copy of the event, retried with backoff until a 2xx or the attempts run out."""
        for attempt in range(1, self.max_attempts + 1):
            headers = signed
            if resign:
                headers = self._sign(event, int(self.wall_clock()) + copy)
            status: int | None = None
            error: str | None = None
            try:
                response = await self._http().post(self.route(event.route).url or self._url,
                                                   content=event.body, headers=headers)
                status = response.status_code
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
            event.entry["status_codes"].append(status)
            event.entry["deliveries"].append({
                "copy": copy, "attempt": attempt, "status": status, "error": error,
                "timestamp": int(headers["webhook-timestamp"]), "at": self.wall_clock()})
            if status is not None and 200 <= status < 300:
                return True
            if attempt < self.max_attempts:
                await asyncio.sleep(min(self.retry_cap_s, self.retry_base_s * 2 ** (attempt - 1)))
        return False

    def _sign(self, event: _Event, timestamp: int) -> dict[str, str]:
        signer = sign_stripe if self.route(event.route).scheme == "stripe" else sign
        return signer(self._secret, event.webhook_id, timestamp, event.body)

    # -- the harness's helpers ------------------------------------------------------------------

    async def send_now(self, event_type: str, data: dict[str, Any], *, mode: str = "valid",
                       webhook_id: str | None = None, skew_s: int = 600) -> dict[str, Any]:
        """One delivery now (no faults, no retries), valid or deliberately bad; logged."""
        webhook_id = webhook_id or "msg_" + uuid.uuid4().hex
        body = json.dumps({"type": event_type, "data": data}, separators=(",", ":")).encode()
        now = int(self.wall_clock())
        headers, sent = bad_delivery(mode, self._secret, webhook_id, now, body, skew_s)
        status: int | None = None
        error: str | None = None
        try:
            response = await self._http().post(self._url, content=sent, headers=headers)
            status = response.status_code
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        self.log.append({
            "webhook_id": webhook_id, "type": event_type, "route": data.get("route"),
            "key": data.get("idempotency_key"), "effect_id": data.get("id"),
            "fencing_token": data.get("fencing_token"), "created_at": self.wall_clock(),
            "state": "sent_by_harness", "mode": mode, "faults": [], "status_codes": [status],
            "deliveries": [{"copy": 0, "attempt": 1, "status": status, "error": error,
                            "timestamp": int(headers["webhook-timestamp"]),
                            "at": self.wall_clock()}]})
        return {"webhook_id": webhook_id, "mode": mode, "status": status, "error": error}

    def log_json(self, key: str | None = None) -> dict[str, Any]:
        entries = [_copy(e) for e in self.log if key is None or e["key"] == key]
        return {"enabled": self.enabled, "url": self.url, "webhooks": entries,
                "pending": len(self.tasks)}

    async def drain(self) -> None:
        """Wait until every scheduled delivery (and held event) has finished; for tests."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()

    async def aclose(self) -> None:
        self.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def _secret(self) -> str:
        if self.secret is None:
            raise RuntimeError("webhooks are not configured (no secret)")
        return self.secret

    @property
    def _url(self) -> str:
        if self.url is None:
            raise RuntimeError("webhooks are not configured (no URL)")
        return self.url

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self.transport, timeout=self.timeout_s,
                                             follow_redirects=False)
        return self._client


def _copy(entry: dict[str, Any]) -> dict[str, Any]:
    out = dict(entry)
    out["status_codes"] = list(entry["status_codes"])
    out["deliveries"] = [dict(d) for d in entry["deliveries"]]
    return out
