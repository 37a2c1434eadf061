"""The sandbox provider's HTTP API: a careful payments-style provider with injectable faults.

`POST /v1/{route}/effects` is the side effect (`POST|PATCH /v1/{route}/objects/{id}` the same,
on the object the path names; `GET /v1/{route}/effects?key=K` lists a key's effects). Routes
named `idempotent*` deduplicate by the `Idempotency-Key` header (or the body's
`client_reference`); routes named `plain*` apply every POST. Routes named `*nofence` ignore
the `Fencing-Token` (a provider that never checks it); all others refuse a token lower than one
already seen for the key. The `/_...` endpoints (truth, request log, faults, config, reset) are
the test harness's back door and need no credentials.

A POST goes through fixed steps, and each step is where one class of faults acts:
arrival (counted in the truth; `status_before_apply`, `rate_limit`) -> fencing check ->
idempotency lookup (a new key is claimed "in progress" here) -> `delay` -> apply (or
`late_apply`) -> answer (`delay_after_apply`, `drop_after_apply`, `status_after_apply`,
`slow_body`). Faults change what the client sees, never the stored record: a retry after a
dropped or 5xx'd answer replays the true 201.

With a webhook URL and secret, routes with webhooks enabled also send signed Standard Webhooks
about their effects (webhooks.py); `/_webhooks` is their log, `/_webhooks/faults` their faults.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, unquote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from effectledger_obs.http import metrics_endpoint

from .faults import FaultError, Phase, parse_fault
from .responses import RAW_SEND, DropConnection, SlowBodyResponse
from .state import MAX_KEYS, Claim, Effect, SandboxState, body_digest
from .webhooks import SCHEMES, SEND_MODES, WebhookSender, parse_webhook_fault


class SandboxApp(Starlette):
    """Starlette, plus the server's own `send` kept in the scope so a fault can hang up."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def sandbox_state(app: Starlette) -> SandboxState:
    """The in-memory state behind an app from `create_app`, for in-process tests."""
    state: SandboxState = app.state.sandbox
    return state


# JSON escapes of NUL and of an unpaired surrogate: valid JSON, not storable in PostgreSQL.
HOSTILE_REFUSAL = (b'{"error": {"code": "invalid\\u0000argument", '
                   b'"message": "refused \\u0000 \\ud800 here"}}')


def error(status: int, code: str, message: str = "",
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message or code.replace("_", " ")}},
                        status_code=status, headers=headers)


def parse_body(raw: bytes, content_type: str | None) -> Any:
    """JSON or form-encoded; raises ValueError (incl. JSON and Unicode errors) if neither."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime == "application/x-www-form-urlencoded":
        return dict(parse_qsl(raw.decode("utf-8"), keep_blank_values=True))
    if not raw.strip():
        return {}
    return json.loads(raw)


def _body_key(body: Any) -> str | None:
    ref = body.get("client_reference") if isinstance(body, dict) else None
    if isinstance(ref, bool) or not isinstance(ref, str | int) or ref == "":
        return None
    return str(ref)


class _Api:
    def __init__(self, state: SandboxState, api_key: str | None,
                 hooks: WebhookSender) -> None:
        self.state = state
        self.hooks = hooks
        self._bearer = f"Bearer {api_key}".encode() if api_key else None
        self.background: set[asyncio.Task[None]] = set()
        self._generation = 0  # bumped by /_reset so a late apply never lands in a fresh world

    def denied(self, request: Request) -> Response | None:
        if self._bearer is None:
            return None
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, self._bearer):
            return None
        return error(401, "unauthenticated", "missing or wrong bearer token",
                     {"WWW-Authenticate": "Bearer"})

    # -- the side effect ----------------------------------------------------------------------

    async def create_effect(self, request: Request) -> Response:
        return await self._effect(request, target=None)

    async def update_object(self, request: Request) -> Response:
        """`POST|PATCH /v1/{route}/objects/{id}`: an effect on the object the path names.

        The id is read from the raw path, before any percent-decoding, so a request whose
        id arrived as several segments (an unencoded `/`) or as a dot segment is refused
        (404), as a real provider's router would route it elsewhere.
        """
        route: str = request.path_params["route"]
        raw = request.scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0]
        prefix = f"/v1/{route}/objects/"
        rest = raw[len(prefix):] if raw.startswith(prefix) else ""
        if not rest or "/" in rest or unquote(rest) in (".", ".."):
            return error(404, "not_found", f"no object at {raw!r}")
        return await self._effect(request, target=unquote(rest))

    async def _effect(self, request: Request, *, target: str | None) -> Response:
        if (denied := self.denied(request)) is not None:
            return denied
        route: str = request.path_params["route"]
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
        except ValueError:
            return error(400, "invalid_body", "body must be JSON or form-encoded")
        key = request.headers.get("idempotency-key") or _body_key(body)
        token: int | None = None
        if (raw_token := request.headers.get("fencing-token")) is not None:
            try:
                token = int(raw_token)
            except ValueError:
                return error(400, "invalid_fencing_token", "Fencing-Token must be an integer")

        state = self.state
        entry = state.arrive(route, key, token)
        # The caller's W3C trace context, kept so tests can see it reached the provider.
        entry["traceparent"] = request.headers.get("traceparent")
        headers = {"X-Request-Id": f"req_{entry['seq']}"}
        before = state.faults.pick(Phase.BEFORE, route, key)
        if before is not None and before.kind == "status_before_apply":
            entry["outcome"] = f"fault:status_before_apply:{before.status}"
            if before.retry_after is not None:
                headers["Retry-After"] = before.retry_after
            self._refused(route, key, token, "injected_fault")
            return error(before.status, "injected_fault", "injected before apply", headers)
        if before is not None and before.kind == "hostile_refusal":
            entry["outcome"] = "fault:hostile_refusal"
            self._refused(route, key, token, "injected_fault")
            return Response(HOSTILE_REFUSAL, status_code=400, headers=headers,
                            media_type="application/json")
        if before is not None and before.kind == "rate_limit":
            entry["outcome"] = "fault:rate_limit"
            headers["Retry-After"] = before.retry_after or "1"
            self._refused(route, key, token, "rate_limited")
            return error(429, "rate_limited", "too many requests", headers)

        rejection: tuple[int, str, str] | None = None
        claim, replayed = Claim.NEW, None
        idempotent = key is not None and state.is_idempotent(route)
        if token is not None and key is not None and state.checks_fencing(route) \
                and not state.check_fencing(route, key, token):
            rejection = (409, "stale_fencing_token", "a higher fencing token was seen")
        elif idempotent:
            assert key is not None
            # Claimed synchronously, before any await: a concurrent twin sees it in progress.
            claim, replayed = state.claim(route, key, body_digest(body))
            if claim is Claim.IN_PROGRESS:
                rejection = (409, "request_in_progress", "a request with this key is in progress")
            elif claim is Claim.MISMATCH:
                rejection = (422, "idempotency_key_reused", "this key was used with another body")
        owns_claim = idempotent and rejection is None and claim is Claim.NEW
        generation = self._generation
        try:
            if before is not None and before.kind == "delay":
                await asyncio.sleep(before.seconds)
                if generation != self._generation:
                    # /_reset ran meanwhile: applying now would land in the next scenario.
                    owns_claim = False
                    return error(503, "sandbox_reset", "the sandbox was reset", headers)
            if rejection is not None:
                entry["outcome"] = f"rejected:{rejection[1]}"
                if rejection[1] == "stale_fencing_token":
                    self._refused(route, key, token, rejection[1])
                return error(*rejection, headers)
            if replayed is not None:
                entry["outcome"] = "replayed"
                return await self._answer(route, key, replayed, entry, headers, replay=True)
            late = state.faults.pick(Phase.APPLY, route, key)
            if late is not None and late.kind == "duplicate_apply":
                state.apply(route, key, body, token, target)  # the extra effect
                late = None
            if late is not None:
                entry["outcome"] = "late_apply:scheduled"
                self._apply_later(route, key, body, token, late.seconds, entry, target)
                owns_claim = False  # the background apply now holds the key in progress
                self.hooks.pending(route, key, token)
                return DropConnection()
            effect = state.apply(route, key, body, token, target)
            owns_claim = False
            entry["outcome"] = "applied"
            entry["effect_id"] = effect.id
            self.hooks.applied(route, key, effect.to_json())
        finally:
            if owns_claim and key is not None:
                state.release(route, key)  # cancelled or failed before applying
        return await self._answer(route, key, effect, entry, headers, replay=False)

    def _refused(self, route: str, key: str | None, token: int | None, reason: str) -> None:
        # Only while the key is untouched: a refused duplicate of an applied (or in-progress)
        # request must not be reported as "not applied".
        if key is not None and self.state.key_untouched(route, key):
            self.hooks.not_applied(route, key, token, reason)

    async def _answer(self, route: str, key: str | None, effect: Effect, entry: dict[str, Any],
                      headers: dict[str, str], *, replay: bool) -> Response:
        if replay:
            headers["Idempotent-Replayed"] = "true"
        after = self.state.faults.pick(Phase.AFTER, route, key)
        if after is None:
            return JSONResponse(effect.to_json(), status_code=201, headers=headers)
        entry["outcome"] += f"+{after.kind}"
        if after.kind == "delay_after_apply":
            await asyncio.sleep(after.seconds)
            return JSONResponse(effect.to_json(), status_code=201, headers=headers)
        if after.kind == "drop_after_apply":
            return DropConnection()
        if after.kind == "status_after_apply":
            return error(after.status, "injected_fault", "injected after apply", headers)
        if after.kind == "hostile_answer":
            answer = {**effect.to_json(), "id": f"{effect.id}\u0000x"}
            return JSONResponse(answer, status_code=201, headers=headers)
        return SlowBodyResponse(effect.to_json(), status_code=201, headers=headers,
                                seconds=after.seconds)

    def _apply_later(self, route: str, key: str | None, body: Any, token: int | None,
                     seconds: float, entry: dict[str, Any], target: str | None = None) -> None:
        generation = self._generation

        async def apply_later() -> None:
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                if key is not None and generation == self._generation:
                    self.state.release(route, key)
                raise
            if generation == self._generation:
                effect = self.state.apply(route, key, body, token, target)
                entry["outcome"] = "late_apply:applied"
                entry["effect_id"] = effect.id
                self.hooks.applied(route, key, effect.to_json())

        task = asyncio.get_running_loop().create_task(apply_later())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- reads --------------------------------------------------------------------------------

    async def effect_by_key(self, request: Request) -> Response:
        if (denied := self.denied(request)) is not None:
            return denied
        route, key = request.path_params["route"], request.path_params["key"]
        lag = self.state.faults.pick(Phase.READBACK, route, key)
        effect = self.state.readback(route, key, lag.seconds if lag is not None else 0.0)
        if effect is None:
            return error(404, "not_found", f"no effect for key {key!r} on route {route!r}")
        return JSONResponse(effect.to_json())

    async def effects_by_query(self, request: Request) -> Response:
        """`GET /v1/{route}/effects?key=K`: a search answer, `{"data": [every effect]}`."""
        if (denied := self.denied(request)) is not None:
            return denied
        route, key = request.path_params["route"], request.query_params.get("key")
        if not key:
            return error(400, "invalid_query", "the 'key' query parameter is required")
        return JSONResponse({"data": [e.to_json() for e in self.state.listed(route, key)]})

    async def effect_by_id(self, request: Request) -> Response:
        if (denied := self.denied(request)) is not None:
            return denied
        route, effect_id = request.path_params["route"], request.path_params["effect_id"]
        effect = self.state.get(route, effect_id)
        if effect is None:
            return error(404, "not_found", f"no effect {effect_id!r} on route {route!r}")
        return JSONResponse(effect.to_json())

    # -- the harness's back door --------------------------------------------------------------

    async def truth(self, request: Request) -> Response:
        return JSONResponse(self.state.truth_json())

    async def key_truth(self, request: Request) -> Response:
        return JSONResponse(self.state.key_truth_json(request.path_params["key"]))

    async def requests(self, request: Request) -> Response:
        entries = self.state.requests_json(request.query_params.get("key"))
        return JSONResponse({"requests": entries})

    async def get_faults(self, request: Request) -> Response:
        return JSONResponse(self.state.faults.to_json())

    async def set_faults(self, request: Request) -> Response:
        try:
            raw = await request.json()
            items, seed = (raw, None) if isinstance(raw, list) else _faults_and_seed(raw)
            faults = [parse_fault(item) for item in items]
        except ValueError as exc:
            return error(400, "invalid_fault", str(exc))
        self.state.faults.replace(faults, seed)
        return JSONResponse(self.state.faults.to_json())

    async def append_fault(self, request: Request) -> Response:
        try:
            fault = parse_fault(await request.json())
        except ValueError as exc:
            return error(400, "invalid_fault", str(exc))
        self.state.faults.append(fault)
        return JSONResponse(self.state.faults.to_json())

    async def clear_faults(self, request: Request) -> Response:
        self.state.faults.clear()
        return JSONResponse(self.state.faults.to_json())

    async def get_route(self, request: Request) -> Response:
        route = request.path_params["route"]
        hooks = self.hooks.route(route)
        return JSONResponse({"route": route, "idempotent": self.state.is_idempotent(route),
                             "webhooks": hooks.webhooks,
                             "not_applied_webhooks": hooks.not_applied_webhooks,
                             "scheme": hooks.scheme, "url": hooks.url})

    async def set_route(self, request: Request) -> Response:
        """Set any of `idempotent`, `webhooks`, `not_applied_webhooks` (booleans), `scheme`
        ("standard" or "stripe") and `url` (this route's webhook receiver); echoes what was set."""
        route = request.path_params["route"]
        try:
            raw = await request.json()
        except ValueError:
            raw = None
        flags = ("idempotent", "webhooks", "not_applied_webhooks")
        ok = isinstance(raw, dict) and bool(raw) \
            and not set(raw) - {*flags, "scheme", "url"} \
            and all(isinstance(raw[k], bool) for k in flags if k in raw) \
            and raw.get("scheme", "standard") in SCHEMES \
            and isinstance(raw.get("url", ""), str)
        if not ok:
            return error(400, "invalid_config", 'expected {"idempotent": true|false} and/or '
                         '{"webhooks": true|false, "not_applied_webhooks": true|false, '
                         f'"scheme": one of {list(SCHEMES)}, "url": "http://..."}}')
        if "idempotent" in raw:
            self.state.configure_route(route, idempotent=raw["idempotent"])
        self.hooks.configure_route(route, webhooks=raw.get("webhooks"),
                                   not_applied_webhooks=raw.get("not_applied_webhooks"),
                                   scheme=raw.get("scheme"), url=raw.get("url") or None)
        return JSONResponse({"route": route, **raw})

    # -- webhooks (the sending side's log, faults and a send-now helper) ------------------

    async def webhook_log(self, request: Request) -> Response:
        return JSONResponse(self.hooks.log_json(request.query_params.get("key")))

    async def get_webhook_faults(self, request: Request) -> Response:
        return JSONResponse(self.hooks.faults.to_json())

    async def set_webhook_faults(self, request: Request) -> Response:
        try:
            raw = await request.json()
            items = raw.get("faults") if isinstance(raw, dict) else raw
            if not isinstance(items, list):
                raise FaultError('expected {"faults": [...]} or a list of faults')
            faults = [parse_webhook_fault(item) for item in items]
        except ValueError as exc:
            return error(400, "invalid_fault", str(exc))
        self.hooks.faults.faults = faults
        return JSONResponse(self.hooks.faults.to_json())

    async def clear_webhook_faults(self, request: Request) -> Response:
        self.hooks.faults.faults = []
        return JSONResponse(self.hooks.faults.to_json())

    async def send_webhook(self, request: Request) -> Response:
        """`{"type", "data", "mode"?, "webhook_id"?, "skew_s"?}`: one delivery now, no retry."""
        if not self.hooks.enabled:
            return error(409, "webhooks_not_configured", "start with a webhook URL and secret")
        try:
            raw = await request.json()
        except ValueError:
            raw = None
        ok = isinstance(raw, dict) and isinstance(raw.get("type"), str) \
            and isinstance(raw.get("data", {}), dict) \
            and raw.get("mode", "valid") in SEND_MODES \
            and isinstance(raw.get("webhook_id", ""), str) \
            and isinstance(raw.get("skew_s", 600), int)
        if not ok:
            return error(400, "invalid_webhook", f'expected {{"type": str, "data": {{...}}, '
                         f'"mode": one of {list(SEND_MODES)}, "webhook_id"?, "skew_s"?}}')
        result = await self.hooks.send_now(raw["type"], raw.get("data", {}),
                                           mode=raw.get("mode", "valid"),
                                           webhook_id=raw.get("webhook_id") or None,
                                           skew_s=raw.get("skew_s", 600))
        return JSONResponse(result)

    async def reset(self, request: Request) -> Response:
        self.cancel_background()
        self.state.reset()
        self.hooks.reset()
        return JSONResponse({"ok": True})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    def cancel_background(self) -> None:
        self._generation += 1
        for task in list(self.background):
            task.cancel()


def _faults_and_seed(raw: Any) -> tuple[list[Any], int | None]:
    if not isinstance(raw, dict) or not isinstance(raw.get("faults"), list):
        raise FaultError('expected {"faults": [...], "seed": optional int} or a list of faults')
    seed = raw.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise FaultError("'seed' must be an integer")
    return raw["faults"], seed


async def _http_error(request: Request, exc: Exception) -> Response:
    # Unknown paths and methods answer in the same JSON error shape as everything else.
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "error")
    return error(status, code, f"{request.method} {request.url.path}")


def create_app(*, api_key: str | None = None, webhook_secret: str | None = None,
               webhook_url: str | None = None, webhook_routes: Iterable[str] = (),
               webhooks: WebhookSender | None = None, retention_s: float = 86400.0,
               clock: Callable[[], float] = time.monotonic,
               max_keys: int = MAX_KEYS) -> SandboxApp:
    """Build the sandbox app; its state is `app.state.sandbox` (or `sandbox_state(app)`).

    `clock` drives the idempotency retention window, readback lag and request log times;
    injected delays always use real time (asyncio.sleep). Webhooks are sent when both
    `webhook_url` and `webhook_secret` are given, for the routes in `webhook_routes` ("*": all)
    and those enabled later; `webhooks` replaces the sender (tests: transport, clock, retries).
    `max_keys` bounds what it remembers: past it the oldest key's effects are forgotten.
    """
    state = SandboxState(retention_s=retention_s, clock=clock, max_keys=max_keys)
    hooks = webhooks or WebhookSender(url=webhook_url, secret=webhook_secret,
                                      default_routes=webhook_routes)
    api = _Api(state, api_key, hooks)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        api.cancel_background()  # pending late applies must not outlive the server
        await hooks.aclose()  # nor pending webhook deliveries

    routes = [
        Route("/v1/{route}/effects", api.create_effect, methods=["POST"]),
        Route("/v1/{route}/effects", api.effects_by_query, methods=["GET"]),
        Route("/v1/{route}/objects/{object_id:path}", api.update_object,
              methods=["POST", "PATCH"]),
        Route("/v1/{route}/effects/by-key/{key:path}", api.effect_by_key, methods=["GET"]),
        Route("/v1/{route}/effects/{effect_id}", api.effect_by_id, methods=["GET"]),
        Route("/_truth", api.truth, methods=["GET"]),
        Route("/_truth/{key:path}", api.key_truth, methods=["GET"]),
        Route("/_requests", api.requests, methods=["GET"]),
        Route("/_faults", api.get_faults, methods=["GET"]),
        Route("/_faults", api.set_faults, methods=["POST"]),
        Route("/_faults", api.clear_faults, methods=["DELETE"]),
        Route("/_faults/append", api.append_fault, methods=["POST"]),
        Route("/_config/routes/{route}", api.get_route, methods=["GET"]),
        Route("/_config/routes/{route}", api.set_route, methods=["POST"]),
        Route("/_reset", api.reset, methods=["POST"]),
        Route("/_webhooks", api.webhook_log, methods=["GET"]),
        Route("/_webhooks/faults", api.get_webhook_faults, methods=["GET"]),
        Route("/_webhooks/faults", api.set_webhook_faults, methods=["POST"]),
        Route("/_webhooks/faults", api.clear_webhook_faults, methods=["DELETE"]),
        Route("/_webhooks/send", api.send_webhook, methods=["POST"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),  # the process's own figures
    ]
    app = SandboxApp(routes=routes, lifespan=lifespan,
                     exception_handlers={404: _http_error, 405: _http_error})
    app.state.sandbox = state
    app.state.background_tasks = api.background  # pending late applies, for tests to await
    app.state.webhook_secret = hooks.secret
    app.state.webhooks = hooks
    app.state.webhook_tasks = hooks.tasks  # pending deliveries, for tests to await
    return app
