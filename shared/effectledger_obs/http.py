"""Serving metrics and health over HTTP.

- `metrics_response()`: the Prometheus exposition of this process, for a `/metrics` route in an
  existing app (the ledger's API, the reconciler's webhook endpoint).
- `HttpObservability`: ASGI middleware counting requests by route template (never the raw path,
  which carries operation ids) and, when tracing is on, a server span per request that joins
  the caller's `traceparent`.
- `HealthServer`: a small HTTP port with `/metrics`, `/healthz` and `/readyz` for services that
  have no HTTP server of their own (the dispatcher).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import metrics, tracing

log = logging.getLogger(__name__)

Ready = Callable[[], Awaitable[Mapping[str, Any]]]
ASGIApp = Callable[[dict[str, Any], Callable[..., Awaitable[Any]],
                    Callable[..., Awaitable[None]]], Awaitable[None]]


def without_fastapi_telemetry() -> dict[str, Any]:
    """Keyword arguments for `FastAPI(...)` that turn FastAPI's own telemetry off.

    From 0.165 FastAPI traces every request itself (a server span, and spans around
    dependencies, endpoint and serialization) as soon as a tracer provider is set, which
    `tracing.configure_tracing` does: beside `HttpObservability`'s span that made two server
    spans per request, and its per-request check reads three providers even with tracing off.
    `HttpObservability` stays the one source of request spans and metrics. An older FastAPI
    keeps the argument in `app.extra` and ignores it."""
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def metrics_response() -> Response:
    if not metrics.ENABLED:
        # An empty page would read as a process that exports nothing by mistake.
        return Response("# metrics are off (EFFECTLEDGER_METRICS=off)\n",
                        media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def metrics_endpoint(_: Request) -> Response:
    """A Starlette route serving `metrics_response()` (the ledger's route first refreshes
    the gauges it reads from its database)."""
    return metrics_response()


class HttpObservability:
    """Pure ASGI middleware: request counts, durations and (when on) a span per request."""

    def __init__(self, app: ASGIApp, *, skip: frozenset[str] = frozenset({"/metrics"}),
                 untraced: frozenset[str] = frozenset({"/healthz", "/readyz"})) -> None:
        # `skip`: neither counted nor traced (scrapes); `untraced`: counted, no span (probes
        # every few seconds would fill the trace store with nothing about operations).
        self.app, self.skip, self.untraced = app, skip, untraced

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope.get("path") in self.skip:
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        method = scope.get("method", "GET")
        if not tracing.ENABLED or scope.get("path") in self.untraced:
            try:
                await self.app(scope, receive, send_status)
            finally:
                _count(scope, method, status, started)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in scope.get("headers", ()) if k in (b"traceparent", b"tracestate")}
        parent = tracing.extract(headers)
        with tracing.span(f"{method} http", kind=tracing.SpanKind.SERVER,
                          context=parent) as sp:
            try:
                await self.app(scope, receive, send_status)
            finally:
                route = _count(scope, method, status, started)
                if sp is not None:
                    sp.update_name(f"{method} {route}")
                    sp.set_attribute("http.route", route)
                    sp.set_attribute("http.response.status_code", status)


def _count(scope: dict[str, Any], method: str, status: int, started: float) -> str:
    route = _route(scope)
    metrics.child(metrics.HTTP_REQUESTS, route, method, str(status)).inc()
    metrics.child(metrics.HTTP_DURATION, route, method).observe(time.perf_counter() - started)
    return route


def _route(scope: dict[str, Any]) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return str(path) if path else "unmatched"


def health_app(ready: Ready) -> Starlette:
    """`/metrics`, `/healthz` (the process answers) and `/readyz` (`ready()` all true)."""

    async def healthz(_: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(_: Request) -> Response:
        try:
            checks = dict(await ready())
        except Exception as exc:  # a probe must answer, not raise
            return JSONResponse({"ok": False, "error": type(exc).__name__}, status_code=503)
        ok = all(v for v in checks.values() if isinstance(v, bool))
        return JSONResponse({"ok": ok, "checks": checks}, status_code=200 if ok else 503)

    return Starlette(routes=[Route("/metrics", metrics_endpoint),
                             Route("/healthz", healthz), Route("/readyz", readyz)])


class _Embedded(uvicorn.Server):
    """A uvicorn server inside a service that owns the process's signals: uvicorn would
    otherwise take SIGTERM for itself, stop only this port, and then re-raise it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HealthPortError(RuntimeError):
    """The health port could not be opened (in use, not permitted)."""


class HealthServer:
    """Runs `health_app` on `host:port` in the current event loop (port 0: any free port)."""

    def __init__(self, ready: Ready, *, host: str = "127.0.0.1", port: int = 0,
                 setting: str = "health port") -> None:
        self.host, self.setting, self.wanted_port = host, setting, port
        # log_config=None: uvicorn's own handlers would write text lines into JSON logs.
        config = uvicorn.Config(health_app(ready), host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off", log_config=None)
        self._server = _Embedded(config)
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Start serving; returns the bound port once the socket listens."""
        # The socket is bound here, not by uvicorn: uvicorn answers a failed bind with
        # sys.exit, which would end the whole service from inside a task.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.wanted_port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise HealthPortError(f"{self.setting}: cannot listen on {self.host}:"
                                  f"{self.wanted_port} ({exc.strerror or exc})") from None
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]),
                                         name="health-server")
        while not self._server.started:  # uvicorn exposes a flag, not an event
            if self._task.done():
                self._task.result()
                raise HealthPortError(f"{self.setting}: the health server stopped at start")
            await asyncio.sleep(0.01)  # polling uvicorn's flag; it offers no event to wait on
        return self.port

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
