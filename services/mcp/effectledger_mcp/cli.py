"""`effectledger mcp [--http HOST:PORT]`: arguments and entry point.

The CLI builds every subcommand's arguments in every `effectledger` process, the services
included, so this module imports the MCP SDK and the ledger client only in `run`: loaded at
the top they added about 24 MiB to each service's resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from .mapping import DEFAULT_WAIT_S


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger-url", default=os.environ.get("EFFECTLEDGER_LEDGER_URL",
                                                          "http://127.0.0.1:8600"))
    p.add_argument("--http", metavar="HOST:PORT",
                   help="serve streamable HTTP at http://HOST:PORT/mcp (default: stdio)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S,
                   help="seconds a tool call waits for its operation to settle")
    p.add_argument("--unsafe-open-http", action="store_true",
                   help="UNSAFE: serve --http without EFFECTLEDGER_MCP_TOKEN (whoever reaches "
                        "the endpoint acts as this server's agent)")


def run(args: argparse.Namespace) -> int:
    from effectledger_client import AsyncClient

    from .server import serve_http, serve_stdio

    # The agent's credentials: one tenant's token (EFFECTLEDGER_TOKEN, else the agent token
    # `effectledger up` wrote, for a ledger on loopback), never an operator's.
    client = AsyncClient(args.ledger_url, timeout_s=10.0)
    if args.http:
        host, _, port = args.http.rpartition(":")
        if not host or not port.isdigit():
            print("effectledger mcp: --http needs HOST:PORT", file=sys.stderr)
            return 2
        token = os.environ.get("EFFECTLEDGER_MCP_TOKEN") or None
        if token is None and not _open_on_purpose(args):
            # Whoever reaches the endpoint acts as this tenant's agent: never open by default,
            # on loopback neither (every local process and every user of the machine reaches
            # it, and a browser page can too).
            print("effectledger mcp: --http needs EFFECTLEDGER_MCP_TOKEN (clients then send it "
                  "as a bearer token), or --unsafe-open-http", file=sys.stderr)
            return 2
        asyncio.run(serve_http(client, host, int(port), wait_s=args.wait, token=token))
    else:
        asyncio.run(serve_stdio(client, wait_s=args.wait))
    return 0


def _open_on_purpose(args: argparse.Namespace) -> bool:
    import logging

    from effectledger_core.unsafe import OPEN_MCP_HTTP, announce, check

    log = logging.getLogger("effectledger.mcp")
    if args.unsafe_open_http:
        announce(OPEN_MCP_HTTP, log)
        print(f"effectledger mcp: {OPEN_MCP_HTTP.disables}", file=sys.stderr)
        return True
    return check(OPEN_MCP_HTTP, os.environ, log)
