"""LangGraph: the ledger's catalog as LangChain tools for a `ToolNode`
(docs/integrations/langgraph.md).

    from effectledger_client import AsyncClient
    from effectledger_integrations.langgraph import ledger_tool_node

    graph.add_node("tools", await ledger_tool_node(AsyncClient()))

Every call goes through the ledger under `langgraph:<digest of scope, thread id, tool-call id>`:
the tool-call id of the model's message within the checkpointer's thread. A graph resumed or
replayed from a checkpoint runs the same message's calls again with the same ids, so each finds
its first operation. A result is a `ToolMessage` whose content is the answer as JSON and whose
artifact is the same answer as a dict; nothing is raised, so neither `handle_tool_errors` nor a
retry policy turns an unknown outcome into a second attempt.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from typing import Any, Literal

from langchain_core.messages import ToolCall
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode

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

FRAMEWORK = "langgraph"
# The identity of the call being run (tool-call id, thread id), from `ainvoke` to `_arun`:
# LangChain hands a tool with a JSON-schema `args_schema` only the arguments.
_CALL: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "effectledger_langgraph_call", default=(None, None))


class LedgerTool(BaseTool):
    """One catalog tool (or `effectledger_status`); async only."""

    calls: LedgerCalls
    scope: str | None = None
    status: bool = False
    response_format: Literal["content", "content_and_artifact"] = "content_and_artifact"

    model_config = {"arbitrary_types_allowed": True}

    async def ainvoke(self, input: str | dict[str, Any] | ToolCall,
                      config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        call_id = input.get("id") if isinstance(input, dict) and \
            input.get("type") == "tool_call" else None
        thread = ((config or {}).get("configurable") or {}).get("thread_id")
        token = _CALL.set((call_id, None if thread is None else str(thread)))
        try:
            return await super().ainvoke(input, config, **kwargs)
        finally:
            _CALL.reset(token)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self.name} runs through effectledger asynchronously: use "
                                  "the graph's ainvoke / astream")

    async def _arun(self, *args: Any, **arguments: Any) -> tuple[str, dict[str, Any]]:
        if self.status:
            answer = await self.calls.status(arguments)
            return answer.text, answer.data
        call_id, thread = _CALL.get()
        if not call_id:
            raise ValueError(f"{self.name} must be called with a model's tool call (its id "
                             "makes the idempotency key), as ToolNode does")
        answer = await self.calls.call(self.name, arguments,
                                       key=call_key(FRAMEWORK, call_id, self.scope, thread))
        return answer.text, answer.data


async def ledger_tools(client: AsyncClient, *, tools: Iterable[str] | None = None,
                       wait_s: float = DEFAULT_WAIT_S,
                       submit_retry_s: float = DEFAULT_SUBMIT_RETRY_S, status_tool: bool = True,
                       scope: str | None = None) -> list[BaseTool]:
    """One LangChain tool per catalog tool (all, or `tools`), plus `effectledger_status`.
    Bind them to the chat model (`model.bind_tools(tools)`) and give them to a `ToolNode`."""
    calls = LedgerCalls(client, tools=tools, wait_s=wait_s, submit_retry_s=submit_retry_s)
    made: list[BaseTool] = [
        LedgerTool(name=spec.name, description=spec.description,
                   args_schema=dict(spec.parameters), calls=calls, scope=scope)
        for spec in await calls.specs()]
    if status_tool:
        made.append(LedgerTool(name=STATUS_TOOL, description=STATUS_DESCRIPTION,
                               args_schema=dict(STATUS_SCHEMA), calls=calls, status=True))
    return made


async def ledger_tool_node(client: AsyncClient, *, name: str = "tools",
                           **options: Any) -> ToolNode:
    """A `ToolNode` of `ledger_tools(client, **options)`."""
    return ToolNode(await ledger_tools(client, **options), name=name)
