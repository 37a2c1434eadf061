"""`effectledger mcp`: the catalog as MCP tools, served with the official SDK's low-level
`Server` on stdio or streamable HTTP.

The low-level server rather than FastMCP: the tools are the catalog's, known only at run
time, with their own JSON schemas and annotations, and a call needs the raw request params
(SEP-3182's `idempotencyKey`, `_meta`) that FastMCP's function signatures hide.

Whose agent it is: on stdio, the one ledger token it was started with; over HTTP, each
caller's own agent token (auth.py), so one server serves many tenants and the ledger keeps them
apart exactly as it does for its own API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.shared.exceptions import MCPError

from effectledger_client import (
    AsyncClient,
    Forbidden,
    IdempotencyConflict,
    InvalidRequest,
    LedgerError,
    NotFound,
    OperationView,
    RateLimited,
    Unauthenticated,
)
from effectledger_core.argschema import errors_against
from effectledger_core.states import TERMINAL
from effectledger_core.waiting import SETTLED

from .defaults import DEFAULT_WAIT_S
from .mapping import (
    META_KEY,
    OUTPUT_SCHEMA,
    RESOURCE_PREFIX,
    STATUS_TOOL,
    description,
    error_result,
    expected_at,
    idempotency_key,
    joins_identical,
    published_schema,
    render,
    task_id,
    title,
    tool_annotations,
)
from .mapping import (
    REPEAT as REPEAT_ARG,
)

log = logging.getLogger(__name__)
# Settled but not final: waiting for a human (an approval or a review), which wakes no wait.
WAITING_FOR_HUMAN = SETTLED - TERMINAL
# A human's decision (approval, review) wakes no wait: a watched operation waiting for one is
# looked at this often.
HUMAN_POLL_S = 5.0
# Which ledger client answers a request: stdio has one; over HTTP it is the caller's token's.
ClientFor = Callable[[ServerRequestContext[Any]], AsyncClient]

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "operation_id": {"type": "string",
                         "description": "The operation_id a tool result named.",
                         "examples": ["0190f3c2a1b27c4e8d5f6a7b8c9d0e1f"]},
        "wait_s": {"type": ["number", "null"],
                   "description": "Seconds to wait for the outcome if it is not settled yet "
                                  "(null: answer at once). Keep it short; ask again later.",
                   "examples": [None, 3]},
    },
    "required": ["operation_id", "wait_s"],
    "additionalProperties": False,
}


class Tools:
    """The handlers, on the caller's ledger client."""

    def __init__(self, client_for: ClientFor, *, wait_s: float = DEFAULT_WAIT_S,
                 catalog_ttl_s: float = 10.0) -> None:
        self.client_for = client_for
        self.wait_s = wait_s
        self.catalog_ttl_s = catalog_ttl_s
        self._cached: tuple[float, dict[str, dict[str, Any]]] | None = None
        self._watches: dict[tuple[int, str], asyncio.Task[None]] = {}

    async def _catalog(self, client: AsyncClient) -> dict[str, dict[str, Any]]:
        # The catalog changes only when the ledger restarts with another one: a call need not
        # fetch it again each time (the ledger still checks every intent against its own). It
        # is the same for every tenant.
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self.catalog_ttl_s:
            return self._cached[1]
        try:
            listing = await client.tools()
        except LedgerError as exc:
            raise MCPError(types.INTERNAL_ERROR, f"the ledger did not list its tools: {exc}",
                           ) from exc
        tools = {str(t["name"]): t for t in listing.tools if t["name"] != STATUS_TOOL}
        self._cached = (now, tools)
        return tools

    async def list_tools(self, ctx: ServerRequestContext[Any],
                         params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        tools = [types.Tool(
            name=name, title=title(tool), description=description(tool),
            input_schema=published_schema(tool), output_schema=OUTPUT_SCHEMA,
            annotations=types.ToolAnnotations.model_validate(tool_annotations(tool)))
            for name, tool in sorted((await self._catalog(self.client_for(ctx))).items())]
        tools.append(types.Tool(
            name=STATUS_TOOL, title="Operation status",
            description="The outcome of an earlier tool call, by its operation_id: settled or "
                        "not, the provider's result, and who decided it (provider, readback, "
                        "webhook, operator review). Use it instead of calling a tool again "
                        "when a result said the outcome is unknown or still in progress.",
            input_schema=STATUS_SCHEMA, output_schema=OUTPUT_SCHEMA,
            annotations=types.ToolAnnotations(title="Operation status", read_only_hint=True,
                                              destructive_hint=False, idempotent_hint=True,
                                              open_world_hint=False)))
        return types.ListToolsResult(tools=tools)

    async def call_tool(self, ctx: ServerRequestContext[Any],
                        params: types.CallToolRequestParams) -> types.CallToolResult:
        client = self.client_for(ctx)
        if params.name == STATUS_TOOL:
            return await self._status(client, dict(params.arguments or {}))
        tool = (await self._catalog(client)).get(params.name)
        if tool is None:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}")
        arguments = dict(params.arguments or {})
        schema = published_schema(tool)
        ours = joins_identical(tool) and (tool.get("input_schema") or {}).get(
            "properties", {}).get(REPEAT_ARG) is None
        if ours:
            arguments.setdefault(REPEAT_ARG, None)  # listed as required for strict mode only
        problems = errors_against(schema, arguments)
        if problems:
            return _invalid(params.name, schema, problems)
        repeat = arguments.pop(REPEAT_ARG, None) if ours else None
        raw: Mapping[str, Any] = ctx.params or {}
        key, _source = idempotency_key(raw)
        join = joins_identical(tool)
        try:
            if _wants_progress(raw):
                # Progress needs each state: submit, then the ledger's waits per change.
                submitted = await client.submit(params.name, arguments, idempotency_key=key,
                                                task_id=task_id(raw), join_identical=join,
                                                repeat=repeat)
                op = await client.wait(submitted.operation.id, self.wait_s,
                                       on_change=_progress(ctx), current=submitted.operation)
            else:
                # One round trip: the submission waits and answers with all the result needs.
                submitted = await client.submit(params.name, arguments, idempotency_key=key,
                                                task_id=task_id(raw), join_identical=join,
                                                repeat=repeat, wait_s=self.wait_s)
                op = submitted.operation
        except LedgerError as exc:
            return _refused(exc, key)
        text, data, is_error = render(op, replayed=not submitted.created, repeat=repeat)
        return _result(text, data, is_error)

    async def _status(self, client: AsyncClient, arguments: dict[str, Any]
                      ) -> types.CallToolResult:
        arguments.setdefault("wait_s", None)
        problems = errors_against(STATUS_SCHEMA, arguments)
        if problems:
            return _invalid(STATUS_TOOL, STATUS_SCHEMA, problems)
        op_id = str(arguments["operation_id"])
        wait_s = min(float(arguments["wait_s"] or 0), self.wait_s)
        try:
            op = await (client.wait(op_id, wait_s) if wait_s > 0 else client.get(op_id))
            receipt = await client.receipt(op_id)
        except NotFound:
            text, data = error_result(
                "not_found", f"No operation {op_id} for this agent: check the operation_id "
                "a tool result gave.", operation_id=op_id)
            return _result(text, data, True)
        except LedgerError as exc:
            return _refused(exc, None)
        text, data, _ = render(op, replayed=None, extra={
            "open_uncertainties": receipt.open_uncertainties})
        # The status itself is a success even when the operation failed: the answer is what
        # the model asked for, and `outcome` says what happened.
        return _result(text, data, False)

    # -- resources: one per operation, with subscribe --------------------------------------

    async def list_templates(self, ctx: ServerRequestContext[Any],
                             params: types.PaginatedRequestParams | None
                             ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
            uri_template=RESOURCE_PREFIX + "{operation_id}", name="operation",
            title="An operation's outcome", mime_type="application/json",
            description="The operation as operation_status shows it; subscribe to hear when "
                        "it changes (notifications/resources/updated).")])

    async def list_resources(self, ctx: ServerRequestContext[Any],
                             params: types.PaginatedRequestParams | None
                             ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[])  # one per operation: see the template

    async def read_resource(self, ctx: ServerRequestContext[Any],
                            params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        op_id = _operation_of(str(params.uri))
        try:
            op = await self.client_for(ctx).get(op_id)
        except NotFound as exc:
            raise MCPError(types.INVALID_PARAMS, f"no operation {op_id}") from exc
        except LedgerError as exc:
            raise MCPError(types.INTERNAL_ERROR, f"{exc.code}: {exc.message}") from exc
        _, data, _ = render(op, replayed=None)
        return types.ReadResourceResult(contents=[types.TextResourceContents(
            uri=str(params.uri), mime_type="application/json",
            text=json.dumps(data, sort_keys=True, default=str))])

    async def subscribe(self, ctx: ServerRequestContext[Any],
                        params: types.SubscribeRequestParams) -> types.EmptyResult:
        uri = str(params.uri)
        op_id = _operation_of(uri)
        client = self.client_for(ctx)
        try:
            op = await client.get(op_id)  # the caller's tenant only: a stranger's is missing
        except NotFound as exc:
            raise MCPError(types.INVALID_PARAMS, f"no operation {op_id}") from exc
        watch = (id(ctx.session), uri)
        if watch not in self._watches:
            task = asyncio.create_task(self._watch(client, ctx, uri, op))
            self._watches[watch] = task
            task.add_done_callback(lambda _t: self._watches.pop(watch, None))
        return types.EmptyResult()

    async def unsubscribe(self, ctx: ServerRequestContext[Any],
                          params: types.UnsubscribeRequestParams) -> types.EmptyResult:
        task = self._watches.pop((id(ctx.session), str(params.uri)), None)
        if task is not None:
            task.cancel()
        return types.EmptyResult()

    async def _watch(self, client: AsyncClient, ctx: ServerRequestContext[Any], uri: str,
                     op: OperationView) -> None:
        """Tell the subscriber at each change until the operation is final. The ledger's
        waits push each change; only an operator's approval or review, which no wait
        reports, is looked at every HUMAN_POLL_S."""
        seen = {"state": op.state}

        async def changed(now: OperationView) -> None:
            if now.state != seen["state"]:
                seen["state"] = now.state
                await ctx.session.send_resource_updated(uri)

        try:
            while op.state not in TERMINAL:
                if op.state in WAITING_FOR_HUMAN:
                    await asyncio.sleep(HUMAN_POLL_S)
                    op = await client.get(op.id)
                else:
                    op = await client.wait(op.id, 300.0, on_change=changed, current=op)
                await changed(op)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the session went away, or the ledger: the watch ends
            log.debug("resource watch on %s ended: %s", uri, exc)


def _operation_of(uri: str) -> str:
    if not uri.startswith(RESOURCE_PREFIX) or len(uri) == len(RESOURCE_PREFIX):
        raise MCPError(types.INVALID_PARAMS, f"not an operation resource: {uri}")
    return uri[len(RESOURCE_PREFIX):]


def _wants_progress(raw: Mapping[str, Any]) -> bool:
    meta = raw.get("_meta")
    return isinstance(meta, Mapping) and meta.get("progressToken") is not None


def _result(text: str, data: dict[str, Any], is_error: bool) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)],
                                structured_content=data, is_error=is_error)


def _invalid(name: str, schema: Mapping[str, Any], problems: list[dict[str, str]]
             ) -> types.CallToolResult:
    """Invalid arguments: a tool result the model can correct itself from, nothing sent."""
    errors = [{**p, "expected": expected_at(schema, p["pointer"])} for p in problems]
    where = "; ".join(f"{e['pointer'] or '/'}: {e['message']}"
                      + (f" (expected {e['expected']})" if e["expected"] else "")
                      for e in errors[:5])
    text, data = error_result(
        "invalid_arguments", f"Invalid arguments for {name}, nothing was submitted: {where}. "
        "Fix these fields and call again.", errors=errors)
    return _result(text, data, True)


def _refused(exc: LedgerError, key: str | None) -> types.CallToolResult:
    """The ledger's refusal, or no answer, as a tool result saying what the model may do."""
    if isinstance(exc, RateLimited):
        wait = exc.retry_after_s
        text, data = error_result(
            "rate_limited", "Rate limited: nothing was submitted. Calling again with the same "
            f"arguments after {wait if wait is not None else 'a few'} seconds is safe.",
            retry_after_s=wait)
    elif isinstance(exc, IdempotencyConflict):
        text, data = error_result(
            "idempotency_key_conflict", f"The idempotency key {key!r} was already used with "
            "different arguments; nothing was submitted. Use a new key for a different call.")
    elif isinstance(exc, InvalidRequest):
        details = exc.details if isinstance(exc.details, dict) else {}
        text, data = error_result(
            "invalid_arguments" if exc.code == "invalid_arguments" else exc.code,
            f"Refused, nothing was submitted: {exc.message}",
            errors=details.get("errors") or [])
    elif isinstance(exc, Unauthenticated | Forbidden):
        text, data = error_result(exc.code, "The ledger refused this agent's credentials; "
                                  "nothing was submitted.")
    else:
        # Nothing is known to have happened. The same call again finds the operation if one
        # was recorded (same key, or the same arguments), so it can never apply twice.
        text, data = error_result(
            "unavailable", f"The ledger could not be reached ({exc.code}); it is not known "
            "whether the call was recorded. Calling again with the same arguments is safe: it "
            "joins the operation if there is one, it never runs twice.", safe_to_resend=True)
    return _result(text, data, True)


def _progress(ctx: ServerRequestContext[Any]) -> Any:
    """Report each state the operation passes through as an MCP progress notification."""
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
    "param": "idempotencyKey", "meta": META_KEY,
    "default": "identical calls (tenant, task, tool, arguments, repeat) join within the "
               "tool's window; failed or cancelled ones run anew",
    "repeatArgument": REPEAT_ARG, "sameKeyDifferentArguments": "refused",
    "statusTool": STATUS_TOOL}}


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


def build_server(client_for: ClientFor, *, wait_s: float = DEFAULT_WAIT_S) -> Server[Any]:
    tools = Tools(client_for, wait_s=wait_s)
    server: Server[Any] = _Server(
        "effectledger", version="1",
        instructions="Tools run through effectledger: each call is attempted at most once, and "
                     "calling again with the same arguments joins the first call. A result "
                     f"saying the outcome is unknown must not be retried: ask {STATUS_TOOL}.",
        on_list_tools=tools.list_tools, on_call_tool=tools.call_tool,
        on_list_resources=tools.list_resources,
        on_list_resource_templates=tools.list_templates,
        on_read_resource=tools.read_resource, on_subscribe_resource=tools.subscribe,
        on_unsubscribe_resource=tools.unsubscribe)
    server.extensions.update(IDEMPOTENCY_EXTENSION)
    return server


async def serve_stdio(client: AsyncClient, *, wait_s: float = DEFAULT_WAIT_S) -> None:
    from mcp.server.stdio import stdio_server

    from .pipes import open_pipes

    server = build_server(lambda _ctx: client, wait_s=wait_s)
    async with open_pipes() as pipes:
        # Our pipes where fd 0 and 1 are pipes (no thread per line), else the SDK's own.
        streams: Any = pipes or (None, None)
        async with stdio_server(*streams) as (read, write):
            await server.run(read, write, server.create_initialization_options())


async def serve_http(ledger_url: str, host: str, port: int, *,
                     wait_s: float = DEFAULT_WAIT_S, open_ledger: bool = False,
                     public_url: str | None = None) -> None:
    """Streamable HTTP at http://HOST:PORT/mcp: each caller's own ledger agent token (auth.py)
    decides its tenant; 401 with WWW-Authenticate and protected-resource metadata without one."""
    import uvicorn
    from mcp.server.auth.settings import AuthSettings

    from .auth import ClientPool, LedgerTokens

    tokens = LedgerTokens(ledger_url, open_ledger=open_ledger)
    resource = public_url or f"http://{host if ':' not in host else f'[{host}]'}:{port}/mcp"
    app: Any = build_server(ClientPool(ledger_url), wait_s=wait_s).streamable_http_app(
        host=host, token_verifier=tokens,
        # The ledger issues the tokens (its configured agent tokens; no OAuth flow).
        auth=AuthSettings(issuer_url=ledger_url, resource_server_url=resource,
                          validate_token_resource=False))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    try:
        await server.serve()
    finally:
        await tokens.aclose()
