"""pydantic-ai: the ledger's catalog as a toolset (docs/integrations/pydantic-ai.md).

    from effectledger_client import AsyncClient
    from effectledger_integrations.pydantic_ai import LedgerToolset

    agent = Agent(model, toolsets=[LedgerToolset(AsyncClient())])

Every call goes through the ledger under the key `pydantic-ai:<digest of run_id, tool_call_id>`.
pydantic-ai keeps `run_id` when a durable engine (Temporal, DBOS, Prefect) re-executes a run,
and the model's tool-call id is part of the replayed history, so a replayed call finds its first
operation. A tool result is a dict (pydantic-ai shows it to the model as JSON), never an
exception: pydantic-ai would end the run on one, or, for `ModelRetry`, ask the model to retry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool
from pydantic_core import SchemaValidator, core_schema

from effectledger_client import AsyncClient

from .calls import (
    DEFAULT_SUBMIT_RETRY_S,
    DEFAULT_WAIT_S,
    STATUS_DESCRIPTION,
    STATUS_SCHEMA,
    STATUS_TOOL,
    LedgerCalls,
    call_key,
)

FRAMEWORK = "pydantic-ai"
# The ledger validates the arguments against the catalog's schema (and refuses with the
# field named): here any JSON object passes to it.
_ANY_OBJECT = SchemaValidator(core_schema.dict_schema(core_schema.str_schema(),
                                                      core_schema.any_schema()))


class LedgerToolset(AbstractToolset[Any]):
    """The catalog's tools (all, or `tools`), plus `effectledger_status` unless
    `status_tool=False`. `scope`: an extra identity for the keys (a tenant's conversation id)
    when run ids are not unique to the application."""

    def __init__(self, client: AsyncClient, *, tools: Iterable[str] | None = None,
                 wait_s: float = DEFAULT_WAIT_S, submit_retry_s: float = DEFAULT_SUBMIT_RETRY_S,
                 status_tool: bool = True, scope: str | None = None,
                 id: str | None = "effectledger") -> None:
        self.calls = LedgerCalls(client, tools=tools, wait_s=wait_s,
                                 submit_retry_s=submit_retry_s)
        self.status_tool = status_tool
        self.scope = scope
        self._id = id

    @property
    def id(self) -> str | None:
        return self._id

    def _tool(self, definition: ToolDefinition) -> ToolsetTool[Any]:
        # max_retries 0: a retry pydantic-ai would start is the model's, with a new call id.
        return ToolsetTool(toolset=self, tool_def=definition, max_retries=0,
                           args_validator=_ANY_OBJECT)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = {spec.name: self._tool(ToolDefinition(
            name=spec.name, description=spec.description,
            parameters_json_schema=spec.parameters,
            metadata={"effectledger": {"effect_class": spec.effect_class}}))
            for spec in await self.calls.specs()}
        if self.status_tool:
            tools[STATUS_TOOL] = self._tool(ToolDefinition(
                name=STATUS_TOOL, description=STATUS_DESCRIPTION,
                parameters_json_schema=STATUS_SCHEMA))
        return tools

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> dict[str, Any]:
        if name == STATUS_TOOL and self.status_tool:
            return (await self.calls.status(tool_args)).data
        call_id = ctx.tool_call_id
        if not call_id:
            raise RuntimeError("pydantic-ai gave this tool call no tool_call_id; without it no "
                               "stable idempotency key can be made")
        key = call_key(FRAMEWORK, call_id, self.scope, ctx.run_id)
        return (await self.calls.call(name, tool_args, key=key)).data
