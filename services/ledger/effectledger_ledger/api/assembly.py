"""`create_app`: the ledger's HTTP application assembled from its routers."""

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI

from effectledger_bus.httpedge import NulFree
from effectledger_core.waiting import DEFAULT_MAX_WAIT_S
from effectledger_obs.http import HttpObservability, without_fastapi_telemetry

from .. import console
from ..auth import Authenticator
from ..openapi import document_bearer
from ..service import LedgerService
from . import deps, errors, health, intents, operations, operators, overview
from .deps import ApiState

# In this order: the OpenAPI document lists the paths as the routers add them.
ROUTERS = (intents.router, operations.router, operators.router, overview.router,
           health.router)


def create_app(service: LedgerService, *, ready: Callable[[], Awaitable[dict[str, Any]]],
               auth: Authenticator | None = None,
               max_wait_s: float = DEFAULT_MAX_WAIT_S,
               before_scrape: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    app = FastAPI(title="effectledger ledger", version="1",
                  description="Side-effecting tool calls, attempted at most once per decision.",
                  **without_fastapi_telemetry())
    authenticator = auth or Authenticator({}, {})
    app.state.effectledger_api = ApiState(service=service, authenticator=authenticator,
                                          ready=ready, max_wait_s=max_wait_s,
                                          before_scrape=before_scrape)
    # Request counts by route template and, when tracing is on, a span per request.
    app.add_middleware(HttpObservability)
    # The server edge (effectledger_bus.httpedge) already answers 400 to NUL in the path or
    # query; the app says so itself too, so no other ASGI server (or in-process client) can
    # carry one into a query, where PostgreSQL refuses it with a 500.
    app.add_middleware(NulFree)
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    document_bearer(app, deps.bearer, deps.caller)
    # The operator console at /console, and /docs from its vendored Swagger UI (no CDN).
    console.mount(app, service, authenticator)
    return app
