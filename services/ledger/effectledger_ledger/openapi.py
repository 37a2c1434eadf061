"""What the OpenAPI document says beyond the routes' signatures: the real error body and its
stable codes per status, the request body of `POST /v1/intents` (read raw, size-bounded,
so FastAPI cannot infer it), and the bearer token on every route that authenticates."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import fastapi.routing
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.encoders import jsonable_encoder
from fastapi.routing import APIRoute
from fastapi.security.http import HTTPBase

from effectledger_core.messages import SubmitIntent
from effectledger_core.views import ErrorResponse

# The stable error codes each status carries; clients branch on the code.
ERROR_CODES: dict[int, tuple[str, ...]] = {
    401: ("unauthenticated",),
    403: ("forbidden",),
    404: ("not_found",),
    409: ("idempotency_key_conflict", "action_rejected", "retry_refused"),
    413: ("payload_too_large",),
    422: ("invalid_request", "unknown_tool", "invalid_arguments"),
    503: ("store_unavailable", "broker_unavailable"),
}

WAIT_DOC = ("how long to wait for the operation to settle (succeeded, failed, cancelled, "
            "needs_review, awaiting_approval), e.g. `10s`, `500ms`, `2.5`; capped by the "
            "ledger (EFFECTLEDGER_WAIT_MAX_S). The answer comes as soon as it settles, else at "
            "the end of the wait with the state then.")


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these statuses, each `{"error": {code, message, details}}`.
    Every authenticated route may answer 401 (credentials) and 422 (a malformed parameter)."""
    return {status: {"model": ErrorResponse,
                     "description": "error codes: " + ", ".join(
                         f"`{c}`" for c in ERROR_CODES[status])}
            for status in sorted({401, 422, *statuses})}


def submit_intent_body() -> dict[str, Any]:
    schema = SubmitIntent.model_json_schema()
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def document_bearer(app: FastAPI, scheme: HTTPBase, authenticates: Callable[..., Any]) -> None:
    """Declare `scheme` in `app`'s OpenAPI document, and as the security of every route whose
    dependencies include `authenticates`, as a FastAPI `Security` parameter would, without
    resolving one on every request (the document is built once; requests are many)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        doc = build()
        if fresh:
            name = scheme.scheme_name
            doc.setdefault("components", {}).setdefault("securitySchemes", {})[name] = \
                jsonable_encoder(scheme.model, by_alias=True, exclude_none=True)
            for path, methods, dependant in _documented_routes(app):
                if _depends_on(dependant, authenticates):
                    for method in methods:
                        doc["paths"][path][method.lower()]["security"] = [{name: []}]
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _documented_routes(app: FastAPI) -> Iterator[tuple[str, set[str], Dependant]]:
    # FastAPI from 0.16x keeps an included router as one entry of `app.routes` and walks it
    # with iter_route_contexts (the route as included: prefix, router dependencies); older
    # versions copy the routes in.
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    routes: Iterable[Any] = (
        [r for r in app.routes if isinstance(r, APIRoute)] if flatten is None
        else [c for c in flatten(app.routes) if isinstance(c.original_route, APIRoute)])
    for r in routes:
        if r.include_in_schema:
            yield r.path_format, set(r.methods or ()), r.dependant


def _depends_on(dependant: Dependant, call: Callable[..., Any]) -> bool:
    return any(d.call is call or _depends_on(d, call) for d in dependant.dependencies)
