"""The HTTP reference: every route of the ledger's API, read from its OpenAPI document."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .md import banner, cell, code, prose, slug, table

METHODS = ("get", "post", "put", "patch", "delete")


def openapi() -> dict[str, Any]:
    """The document the ledger serves at `/openapi.json`, from an app that never connects."""
    from effectledger_core.catalog import Catalog
    from effectledger_core.config import DEMO_CATALOG
    from effectledger_core.subjects import Subjects
    from effectledger_ledger.api import create_app
    from effectledger_ledger.auth import Authenticator
    from effectledger_ledger.db.store import Store
    from effectledger_ledger.service import LedgerService

    async def ready() -> dict[str, Any]:
        return {}

    with tempfile.TemporaryDirectory() as tmp:
        # The store is built but never connected: the document needs the routes, not data.
        store = Store(f"sqlite+aiosqlite:///{Path(tmp) / 'unused.db'}")
        service = LedgerService(store=store, catalog=Catalog.load(DEMO_CATALOG),
                                subjects=Subjects())
        # Tokens configured (never used) so the app does not log that authentication is off.
        auth = Authenticator({"unused-agent-token": "docs"}, {"unused-operator-token": "docs"})
        doc: dict[str, Any] = create_app(service, ready=ready, auth=auth).openapi()
    return doc


def _type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{slug(name)})"
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return " or ".join(_type(s) for s in schema[union])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(code(v) for v in schema["enum"])
    if "const" in schema:
        return code(schema["const"])
    return str(kind or "any")


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}`\n"]
    for text in (op.get("summary"), op.get("description")):
        if text:
            out.append(prose(text.strip()) + "\n")
    params = op.get("parameters", [])
    if params:
        out.append(table(["parameter", "in", "type", "required", "meaning"], [
            (code(p["name"]), p["in"], _type(p.get("schema", {})),
             "yes" if p.get("required") else "", prose(p.get("description", "")))
            for p in params]))
    body = op.get("requestBody", {}).get("content", {}).get("application/json")
    if body is not None:
        schema = body.get("schema", {})
        if "properties" in schema:  # declared inline (openapi_extra), not as a model
            out.append("Request body (JSON):\n")
            out += _schema("", schema)[1:]
        else:
            out.append(f"Request body: {_type(schema)}\n")
    responses = []
    for status, resp in sorted(op.get("responses", {}).items()):
        schema = resp.get("content", {}).get("application/json", {}).get("schema")
        responses.append((code(status), prose(resp.get("description", "")),
                          _type(schema) if schema else ""))
    out.append(table(["status", "meaning", "body"], responses))
    if op.get("security"):
        out.append("Needs a bearer token (`Authorization: Bearer <agent or operator "
                   "token>`) when tokens are configured.\n")
    return out


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name}\n"]
    if schema.get("description"):
        out.append(cell(prose(schema["description"])) + "\n")
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    if props:
        out.append(table(["field", "type", "required", "meaning"], [
            (code(field), _type(spec), "yes" if field in required else "",
             prose(spec.get("description", "")))
            for field, spec in props.items()]))
    elif "enum" in schema:
        out.append("One of " + ", ".join(code(v) for v in schema["enum"]) + ".\n")
    return out


def render(doc: dict[str, Any] | None = None) -> str:
    doc = doc if doc is not None else openapi()
    out = ["# HTTP API reference\n", banner("effectledger_docsgen.http"),
           f"The ledger's API, {doc['info']['title']} version {doc['info']['version']}. "
           "A running ledger serves the same document at `/openapi.json` and a Swagger UI at "
           "`/docs`. Errors are JSON: `{\"error\": {\"code\": \"<stable code>\", "
           "\"message\": \"…\", \"details\": …}}`.\n",
           "## Routes\n"]
    rows = []
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                heading = f"{method.upper()} {path}"
                rows.append((f"[`{heading}`](#{slug(heading)})",
                             prose(item[method].get("summary", ""))))
    out.append(table(["route", "summary"], rows))
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                out += _operation(path, method, item[method])
    out.append("## Models\n")
    for name, schema in sorted(doc.get("components", {}).get("schemas", {}).items()):
        out += _schema(name, schema)
    return "\n".join(out)
