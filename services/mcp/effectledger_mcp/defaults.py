"""The MCP server's defaults the CLI offers as flags: in a module of their own, with no
imports, because every `effectledger` process builds the `mcp` command's arguments."""

# How long a tool call waits for its operation to settle (`effectledger mcp --wait`): shorter
# than the common clients' default timeouts (the OpenAI Agents SDK's is 5 s), so the model gets
# "still in progress, ask for the status" rather than a client timeout.
DEFAULT_WAIT_S = 4.0
