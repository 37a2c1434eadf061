"""The ledger's OpenAPI document matches its routes: every route is there with its request
and response models, the real error body (never FastAPI's validation error), and bearer
security."""

from __future__ import annotations

from typing import Any

import fastapi.routing
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from effectledger_ledger.api import create_app
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.integration.test_api_auth import CATALOG, SUBJECTS

OPEN = {"/healthz", "/readyz", "/readyz/relay"}  # probes: no credentials


async def _ready() -> dict[str, Any]:
    return {}


@pytest.fixture
def app_and_doc(tmp_path: Any) -> tuple[Any, dict[str, Any]]:
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'unused.db'}")  # never connected
    app = create_app(LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS),
                     ready=_ready)
    return app, app.openapi()


def api_routes(app: FastAPI) -> list[APIRoute]:
    """Every route of the app, through its included routers."""
    # FastAPI from 0.16x keeps an included router as one entry of `app.routes`; older
    # versions copy its routes in.
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    if flatten is None:
        return [r for r in app.routes if isinstance(r, APIRoute)]
    return [r for c in flatten(app.routes) if isinstance(r := c.original_route, APIRoute)]


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_every_route_is_documented_with_models_errors_and_security(
        app_and_doc: tuple[Any, dict[str, Any]]) -> None:
    app, doc = app_and_doc
    routes = [r for r in api_routes(app) if r.include_in_schema]
    assert len(routes) >= 17
    for route in routes:
        for method in route.methods:
            op = doc["paths"][route.path][method.lower()]
            where = f"{method} {route.path}"
            ok = {s: r for s, r in op["responses"].items() if s.startswith("2")}
            assert ok, where
            for status, resp in ok.items():
                schema = resp["content"]["application/json"]["schema"]
                assert _resolve(doc, schema).get("properties"), f"{where} {status} untyped"
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")) and route.path not in OPEN:
                    schema = resp["content"]["application/json"]["schema"]
                    assert schema["$ref"].endswith("/ErrorResponse"), f"{where} {status}"
            if route.path in OPEN:
                assert "security" not in op, where
            else:
                assert op["security"] == [{"HTTPBearer": []}], where
                assert "401" in op["responses"], where
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_intents_document_their_body_wait_and_both_success_codes(
        app_and_doc: tuple[Any, dict[str, Any]]) -> None:
    _, doc = app_and_doc
    post = doc["paths"]["/v1/intents"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["tool"] and {"arguments", "idempotency_key"} <= set(
        body["properties"])
    assert {"200", "201", "409", "413", "422"} <= set(post["responses"])
    params = {p["name"] for p in post["parameters"]}
    assert "wait" in params
    get = doc["paths"]["/v1/operations/{operation_id}"]["get"]
    assert {"wait", "changed_from"} <= {p["name"] for p in get["parameters"]}
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"]
    codes = " ".join(r.get("description", "") for r in post["responses"].values())
    assert "idempotency_key_conflict" in codes and "unknown_tool" in codes


def test_retry_plan_use_route_is_documented(app_and_doc: tuple[Any, dict[str, Any]]) -> None:
    _, doc = app_and_doc
    use = doc["paths"]["/v1/retry-plans/{plan_id}/use"]["post"]
    assert use["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/Admission")
    assert "409" in use["responses"]
