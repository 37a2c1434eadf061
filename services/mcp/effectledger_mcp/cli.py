"""`effectledger mcp [--http HOST:PORT] [--token T | --token-file F]`: arguments and entry point.

The CLI builds every subcommand's arguments in every `effectledger` process, the services
included, so this module imports the MCP SDK and the ledger client only in `run`: loaded at
the top they added about 24 MiB to each service's resident memory.

Before serving, one check and one line on stderr (stdout is the protocol on stdio): the ledger
answers, and on stdio it accepts the token. A host that starts the server sees at once why it
cannot work, instead of a first call failing "unauthenticated".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .defaults import DEFAULT_WAIT_S

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger-url", default=os.environ.get("EFFECTLEDGER_LEDGER_URL",
                                                          "http://127.0.0.1:8600"))
    p.add_argument("--http", metavar="HOST:PORT",
                   help="serve streamable HTTP at http://HOST:PORT/mcp, each caller with its "
                        "own ledger agent token as a bearer (default: stdio)")
    p.add_argument("--public-url", metavar="URL",
                   help="--http: the endpoint's address as clients reach it (behind a proxy), "
                        "named in the protected-resource metadata (default http://HOST:PORT/mcp)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S,
                   help="seconds a tool call waits for its operation to settle (default "
                        f"{DEFAULT_WAIT_S:g}: under the common clients' timeouts)")
    p.add_argument("--unsafe-open-http", action="store_true",
                   help="UNSAFE: serve --http in front of a ledger that runs without tokens "
                        "(whoever reaches the endpoint acts for it), loopback included")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--token", help="stdio: the tenant's ledger agent token (default: "
                                     "EFFECTLEDGER_TOKEN; hosts often start servers with an "
                                     "empty environment, so pass it here)")
    who.add_argument("--token-file", type=Path,
                     help="stdio: a file holding the agent token (kept out of process lists)")


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        return args.token_file.read_text().strip() or None
    return args.token or os.environ.get("EFFECTLEDGER_TOKEN") or None


def run(args: argparse.Namespace) -> int:
    if args.http:
        host, _, port = args.http.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            print("effectledger mcp: --http needs HOST:PORT", file=sys.stderr)
            return 2
        if args.token or args.token_file:
            print("effectledger mcp: over HTTP each caller sends its own agent token; "
                  "--token is for stdio", file=sys.stderr)
            return 2
        return asyncio.run(_serve_http(args.ledger_url, host, int(port), args.wait,
                                       args.public_url,
                                       open_on_purpose=lambda: _open_on_purpose(args)))
    try:
        token = _token(args)
    except OSError as exc:
        print(f"effectledger mcp: cannot read --token-file: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve_stdio(args.ledger_url, token, args.wait))


async def _serve_stdio(url: str, token: str | None, wait_s: float) -> int:
    from effectledger_client import AsyncClient, LedgerError, Unauthenticated

    from .server import serve_stdio

    async with AsyncClient(url, token=token, timeout_s=10.0) as client:
        try:
            tools = await client.tools()
        except Unauthenticated:
            why = "none given: pass --token or --token-file" if token is None \
                else "unknown token"
            print(f"effectledger mcp: the ledger at {url} refused the agent token ({why})",
                  file=sys.stderr)
            return 2
        except LedgerError as exc:
            print(f"effectledger mcp: the ledger at {url} is not usable: {exc}",
                  file=sys.stderr)
            return 1
        if token is not None and not await _is_agent_token(client, url):
            print("effectledger mcp: the token is an operator's token; the MCP server acts "
                  "as one tenant's agent: give it an agent token", file=sys.stderr)
            return 2
        print(f"effectledger mcp: ledger {url} ok, {len(tools.tools)} tools, serving stdio "
              f"as {'the token given' if token else 'an open ledger (no token)'}",
              file=sys.stderr, flush=True)
        await serve_stdio(client, wait_s=wait_s)
    return 0


async def _is_agent_token(client: Any, url: str) -> bool:
    """Agents may not read the review queue (operators only); an open ledger lets anyone."""
    from effectledger_client import AsyncClient, Forbidden, LedgerError

    try:
        await client.review_queue(limit=1)
    except Forbidden:
        return True
    except LedgerError:
        return False
    async with AsyncClient(url, token="", timeout_s=10.0) as anonymous:
        try:
            await anonymous.tools()
        except LedgerError:
            return False
    return True  # an open ledger: no tokens to tell apart


async def _serve_http(url: str, host: str, port: int, wait_s: float,
                      public_url: str | None, *,
                      open_on_purpose: Callable[[], bool]) -> int:
    import httpx

    from .server import serve_http

    try:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
            open_ledger = (await http.get("/v1/tools")).status_code == 200
    except httpx.TransportError as exc:
        print(f"effectledger mcp: cannot reach the ledger at {url}: {exc}", file=sys.stderr)
        return 1
    if open_ledger and host in LOOPBACK and not open_on_purpose():
        # Loopback is no excuse: every local process and every user of the machine reaches
        # it, and a browser page can too.
        print(f"effectledger mcp: the ledger at {url} runs without tokens, so whoever reaches "
              "this endpoint would act for it; give the ledger EFFECTLEDGER_AGENT_TOKENS (as "
              "`effectledger up` does), or --unsafe-open-http", file=sys.stderr)
        return 2
    if open_ledger and host not in LOOPBACK:
        # An open ledger accepts any bearer: whoever reaches the endpoint would act for it.
        print(f"effectledger mcp: the ledger at {url} runs without tokens; serving on {host} "
              "needs a ledger with EFFECTLEDGER_AGENT_TOKENS", file=sys.stderr)
        return 2
    print(f"effectledger mcp: ledger {url} ok ({'open' if open_ledger else 'agent tokens'}); "
          f"mcp ready: http://{host}:{port}/mcp (each caller's own agent token)",
          file=sys.stderr, flush=True)
    print(f"mcp ready: http://{host}:{port}/mcp", flush=True)
    await serve_http(url, host, port, wait_s=wait_s, open_ledger=open_ledger,
                     public_url=public_url)
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
