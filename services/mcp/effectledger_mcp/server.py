"""`effectledger mcp`: the catalog as MCP tools, served with the official SDK's low-level
`Server` on stdio or streamable HTTP, as the agent of one tenant (its ledger token).

The low-level server rather than FastMCP: the tools are the catalog's, known only at run
time, with their own JSON schemas and annotations, and a call needs the raw request params
(SEP-3182's `idempotencyKey`, `_meta`) that FastMCP's function signatures hide.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Mapping
from typing import Any

import jsonschema
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.shared.exceptions import MCPError

from effectledger_client import AsyncClient, InvalidRequest, LedgerError, OperationView
from effectledger_client.errors import IdempotencyConflict, NotFound

from .mapping import (
    DEFAULT_WAIT_S,
    META_KEY,
    idempotency_key,
    input_schema,
    render,
    task_id,
    tool_annotations,
)

log = logging.getLogger(__name__)


class Tools:
    """The two handlers, on one ledger client."""

    def __init__(self, client: AsyncClient, *, wait_s: float = DEFAULT_WAIT_S,
                 catalog_ttl_s: float = 10.0) -> None:
        self.client = client
        self.wait_s = wait_s
        self.catalog_ttl_s = catalog_ttl_s
        self._cached: tuple[float, dict[str, dict[str, Any]]] | None = None

    async def _catalog(self) -> dict[str, dict[str, Any]]:
        # The catalog changes only when the ledger restarts with another one: a call need not
        # fetch it again each time (the ledger still checks every intent against its own).
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self.catalog_ttl_s:
            return self._cached[1]
        try:
            listing = await self.client.tools()
        except LedgerError as exc:
            raise MCPError(types.INTERNAL_ERROR, f"the ledger did not list its tools: {exc}",
                           ) from exc
        tools = {str(t["name"]): t for t in listing.tools}
        self._cached = (now, tools)
        return tools

    async def list_tools(self, ctx: ServerRequestContext[Any],
                         params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        tools = []
        for name, tool in sorted((await self._catalog()).items()):
            tools.append(types.Tool(
                name=name, description=tool.get("description") or None,
                input_schema=input_schema(tool),
                annotations=types.ToolAnnotations.model_validate(
                    tool_annotations(str(tool.get("effect_class", "unknown"))))))
        return types.ListToolsResult(tools=tools)

    async def call_tool(self, ctx: ServerRequestContext[Any],
                        params: types.CallToolRequestParams) -> types.CallToolResult:
        raw: Mapping[str, Any] = ctx.params or {}
        arguments = params.arguments or {}
        tool = (await self._catalog()).get(params.name)
        if tool is None:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}")
        _validate(params.name, input_schema(tool), arguments)
        key, _source = idempotency_key(params.name, arguments, raw)
        try:
            submitted = await self.client.submit(params.name, arguments, idempotency_key=key,
                                                 task_id=task_id(raw))
            op = await self.client.wait(submitted.operation.id, self.wait_s,
                                        on_change=_progress(ctx))
            receipt = await self.client.receipt(op.id)
        except IdempotencyConflict as exc:
            raise MCPError(types.INVALID_PARAMS, f"idempotency key {key!r} was already used "
                           "with different arguments", {"code": exc.code}) from exc
        except (InvalidRequest, NotFound) as exc:
            raise MCPError(types.INVALID_PARAMS, exc.message,
                           {"code": exc.code, "details": exc.details}) from exc
        except LedgerError as exc:
            # Nothing is known to have happened; the same call again uses the same key, so a
            # retry finds the same operation rather than creating a second one.
            raise MCPError(types.INTERNAL_ERROR, f"{exc.code}: {exc.message}",
                           {"code": exc.code, "retry_with_same_key": True}) from exc
        text, data, is_error = render(op, receipt)
        return types.CallToolResult(content=[types.TextContent(text=text)],
                                    structured_content=data, is_error=is_error)


def _validate(name: str, schema: dict[str, Any], arguments: dict[str, Any]) -> None:
    """Refuse invalid arguments before anything is submitted, naming the field."""
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.path) or "arguments"
        raise MCPError(types.INVALID_PARAMS, f"invalid arguments for {name}: {first.message} "
                       f"(at {where})", {"errors": [e.message for e in errors[:10]]})


def _progress(ctx: ServerRequestContext[Any]) -> Any:
    """Report each state the operation passes through as an MCP progress notification (a
    no-op when the caller sent no progress token)."""
    steps = {"count": 0}

    async def report(op: OperationView) -> None:
        steps["count"] += 1
        try:
            await ctx.session.report_progress(steps["count"], None, f"state: {op.state}")
        except Exception as exc:  # progress is a courtesy; the call's answer is what counts
            log.debug("progress not sent: %s", exc)

    return report


# Advertised under the server's capabilities (SEP-2133 extensions) until SEP-3182's
# `tools.idempotency` capability is in the SDK: where a call's idempotency key may come from.
IDEMPOTENCY_EXTENSION = {"effectledger/idempotency": {
    "param": "idempotencyKey", "meta": META_KEY, "default": "derived from tool and arguments",
    "sameKeyDifferentArguments": "refused"}}


class _Server(Server[Any]):
    """The SDK's server, advertising IDEMPOTENCY_EXTENSION in both protocol eras: as an
    extension (2026-07-28 sessions) and as an experimental capability (older sessions, whose
    capabilities have no extensions)."""

    def create_initialization_options(
            self, notification_options: NotificationOptions | None = None,
            experimental_capabilities: dict[str, dict[str, Any]] | None = None,
            extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options, {**IDEMPOTENCY_EXTENSION, **(experimental_capabilities or {})},
            extensions)


def build_server(client: AsyncClient, *, wait_s: float = DEFAULT_WAIT_S) -> Server[Any]:
    tools = Tools(client, wait_s=wait_s)
    server: Server[Any] = _Server(
        "effectledger", version="1",
        instructions="Tools run through effectledger: each call is attempted at most once. A "
                     "result saying the outcome is unknown must not be retried.",
        on_list_tools=tools.list_tools, on_call_tool=tools.call_tool)
    server.extensions.update(IDEMPOTENCY_EXTENSION)
    return server


async def serve_stdio(client: AsyncClient, *, wait_s: float = DEFAULT_WAIT_S) -> None:
    from mcp.server.stdio import stdio_server

    server = build_server(client, wait_s=wait_s)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(client: AsyncClient, host: str, port: int, *,
                     wait_s: float = DEFAULT_WAIT_S, token: str | None = None) -> None:
    import uvicorn

    app: Any = build_server(client, wait_s=wait_s).streamable_http_app(host=host)
    if token:
        app = BearerGate(app, token)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    print(f"mcp ready: http://{host}:{port}/mcp", flush=True)
    await server.serve()


class BearerGate:
    """Lets through only HTTP requests carrying `Authorization: Bearer <token>`: whoever
    reaches this endpoint acts with the tenant's ledger token, so on anything but localhost
    the endpoint needs its own credential."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b'Bearer realm="effectledger-mcp"')]})
                await send({"type": "http.response.body",
                            "body": b'{"error": "a bearer token is required"}'})
                return
        await self.app(scope, receive, send)
