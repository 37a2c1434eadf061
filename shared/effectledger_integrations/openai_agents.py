"""OpenAI Agents SDK: the ledger's catalog as function tools (docs/integrations/openai-agents.md).

    from agents import Agent
    from effectledger_client import AsyncClient
    from effectledger_integrations.openai_agents import ledger_function_tools

    tools = await ledger_function_tools(AsyncClient(), scope=conversation_id)
    agent = Agent(name="ops", tools=tools)

Every call goes through the ledger under `openai-agents:<digest of scope, group id, call id>`:
the model's `call_id` (unique per call; the same when a run resumed from its `RunState` executes
an approved call) within the application's `scope` and the run's `RunConfig.group_id`. The tool
returns the answer as a JSON string and never raises: the SDK's default for a tool's exception
is a message inviting the model to try again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from agents import FunctionTool, RunContextWrapper
from agents.tool_context import ToolContext

from effectledger_client import AsyncClient

from .calls import (
    DEFAULT_SUBMIT_RETRY_S,
    DEFAULT_WAIT_S,
    STATUS_DESCRIPTION,
    STATUS_SCHEMA,
    STATUS_TOOL,
    Answer,
    LedgerCalls,
    ToolSpec,
    call_key,
)

FRAMEWORK = "openai-agents"


async def ledger_function_tools(client: AsyncClient, *, tools: Iterable[str] | None = None,
                                wait_s: float = DEFAULT_WAIT_S,
                                submit_retry_s: float = DEFAULT_SUBMIT_RETRY_S,
                                status_tool: bool = True, scope: str | None = None,
                                strict: bool | None = None) -> list[FunctionTool]:
    """One `FunctionTool` per catalog tool (all, or `tools`), plus `effectledger_status`.

    `strict`: OpenAI's strict function mode; None (default) uses it for the tools whose schema
    is already closed and typed (strict mode would otherwise narrow an open schema to `{}`)."""
    calls = LedgerCalls(client, tools=tools, wait_s=wait_s, submit_retry_s=submit_retry_s)
    made = [_function_tool(calls, spec, scope, strict) for spec in await calls.specs()]
    if status_tool:
        made.append(_status_tool(calls))
    return made


def strict_ready(schema: dict[str, Any]) -> bool:
    """A schema OpenAI's strict mode takes as it is: closed, every property typed and
    required."""
    props = schema.get("properties")
    if schema.get("additionalProperties") is not False or not isinstance(props, dict):
        return False
    return (set(schema.get("required") or []) == set(props)
            and all(isinstance(p, dict) and "type" in p for p in props.values()))


def _arguments(raw: str) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _bad_json(tool: str) -> str:
    return Answer({"outcome": "refused", "do_not_retry": False, "state": None,
                   "operation_id": None, "tool": tool, "error": "invalid_request",
                   "message": "The arguments were not a JSON object; nothing was submitted. "
                              "Call again with a JSON object."}).text


def _function_tool(calls: LedgerCalls, spec: ToolSpec, scope: str | None,
                   strict: bool | None) -> FunctionTool:
    async def invoke(ctx: ToolContext[Any], raw: str) -> str:
        arguments = _arguments(raw)
        if arguments is None:
            return _bad_json(spec.name)
        group = ctx.run_config.group_id if ctx.run_config is not None else None
        key = call_key(FRAMEWORK, ctx.tool_call_id, scope, group)
        return (await calls.call(spec.name, arguments, key=key)).text

    use_strict = strict_ready(spec.parameters) if strict is None else strict
    return FunctionTool(name=spec.name, description=spec.description,
                        params_json_schema=dict(spec.parameters), on_invoke_tool=invoke,
                        strict_json_schema=use_strict)


def _status_tool(calls: LedgerCalls) -> FunctionTool:
    async def invoke(ctx: RunContextWrapper[Any], raw: str) -> str:
        arguments = _arguments(raw)
        if arguments is None:
            return _bad_json(STATUS_TOOL)
        return (await calls.status(arguments)).text

    return FunctionTool(name=STATUS_TOOL, description=STATUS_DESCRIPTION,
                        params_json_schema=dict(STATUS_SCHEMA), on_invoke_tool=invoke,
                        strict_json_schema=True)
