"""MCP server."""
