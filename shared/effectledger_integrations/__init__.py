"""Agent frameworks and messaging frameworks on effectledger (docs/integrations/).

Each integration lives in its own module and imports its framework there, so the product runs
without any of them; install the `integrations` extra (or the framework alone) to use one:

- `effectledger_integrations.pydantic_ai`: `LedgerToolset`, a pydantic-ai toolset;
- `effectledger_integrations.openai_agents`: `ledger_function_tools`, OpenAI Agents SDK tools;
- `effectledger_integrations.langgraph`: `ledger_tools` / `ledger_tool_node`, LangGraph tools;
- `effectledger_integrations.faststream`: `LedgerRouter`, a FastStream NATS router.

`effectledger_integrations.calls` is what the agent integrations share (no framework import):
each tool call goes through the ledger under a key made from the framework's own call identity,
and its answer is a result for the model, never an exception a framework would retry.
"""
