"""Run the sandbox under uvicorn, programmatically (tests, `effectledger up`) or from the CLI.

`python -m effectledger_sandbox --port 8700 --api-key KEY`; the key defaults to the
EFFECTLEDGER_SANDBOX_API_KEY environment variable, which the demo catalog also sends.
`--webhook-url URL --webhook-secret whsec_...` (or EFFECTLEDGER_SANDBOX_WEBHOOK_URL / _SECRET)
make it send signed webhooks, for the routes in `--webhook-routes` and those enabled later.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from starlette.applications import Starlette

from .app import create_app
from .state import MAX_KEYS
from .webhooks import check_secret

API_KEY_ENV = "EFFECTLEDGER_SANDBOX_API_KEY"
WEBHOOK_URL_ENV = "EFFECTLEDGER_SANDBOX_WEBHOOK_URL"
WEBHOOK_SECRET_ENV = "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET"
WEBHOOK_ROUTES_ENV = "EFFECTLEDGER_SANDBOX_WEBHOOK_ROUTES"


def add_webhook_arguments(parser: argparse.ArgumentParser) -> None:
    """The webhook flags, shared by `python -m effectledger_sandbox` and `effectledger sandbox`."""
    parser.add_argument("--webhook-url", default=os.environ.get(WEBHOOK_URL_ENV),
                        help=f"where to send signed webhooks (default: ${WEBHOOK_URL_ENV})")
    parser.add_argument("--webhook-secret", default=os.environ.get(WEBHOOK_SECRET_ENV),
                        help=f"Standard Webhooks secret whsec_... (default: ${WEBHOOK_SECRET_ENV})")
    parser.add_argument("--webhook-routes", default=os.environ.get(WEBHOOK_ROUTES_ENV, ""),
                        help="comma-separated routes that send webhooks from the start, '*' for "
                             f"all (default: ${WEBHOOK_ROUTES_ENV}; more via /_config/routes)")


def webhook_options(args: argparse.Namespace) -> dict[str, Any]:
    """create_app keyword arguments from the webhook flags; ValueError if inconsistent."""
    url, secret = args.webhook_url or None, args.webhook_secret or None
    if (url is None) != (secret is None):
        raise ValueError("--webhook-url and --webhook-secret go together")
    if secret is not None:
        check_secret(secret)
    routes = [r.strip() for r in (args.webhook_routes or "").split(",") if r.strip()]
    return {"webhook_url": url, "webhook_secret": secret, "webhook_routes": routes}


class _Server(uvicorn.Server):
    """uvicorn.Server that reports the moment its sockets listen, instead of being polled."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[int], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else 0
            self._on_started(int(bound))


async def serve(host: str = "127.0.0.1", port: int = 8700, *, api_key: str | None = None,
                ready: asyncio.Event | None = None, app: Starlette | None = None,
                on_listening: Callable[[str, int], None] | None = None) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM); `ready` is set once the socket listens.

    `app` serves a prebuilt app (then `api_key` is ignored), so an in-process test can both
    hit it over TCP and inspect its state. `on_listening(host, port)` reports the bound port,
    which matters with `port=0`. Cancelling shuts uvicorn down gracefully rather than
    abandoning its listening socket.
    """
    def started(bound: int) -> None:
        if on_listening is not None:
            on_listening(host, bound)
        if ready is not None:
            ready.set()

    config = uvicorn.Config(app or create_app(api_key=api_key), host=host, port=port,
                            log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=2)
    server = _Server(config, started)

    async def run() -> None:
        try:
            await server.serve()
        except SystemExit as exc:
            # uvicorn exits the process when it cannot bind; inside a task that would
            # escape the event loop, so turn it into an ordinary error.
            raise RuntimeError(f"sandbox could not start on {host}:{port}") from exc

    task = asyncio.create_task(run())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        await task
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m effectledger_sandbox",
                                     description="The effectledger sandbox provider.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700, help="0 picks a free port")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"bearer token required on /v1 (default: ${API_KEY_ENV})")
    parser.add_argument("--retention-s", type=float, default=86400.0,
                        help="how long idempotency keys are remembered")
    parser.add_argument("--max-keys", type=int, default=MAX_KEYS,
                        help="keys remembered before the oldest is forgotten, with its effects "
                             f"(default {MAX_KEYS:,}): bounds the sandbox's memory")
    add_webhook_arguments(parser)
    args = parser.parse_args(argv)
    try:
        hooks = webhook_options(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_keys < 1:
        print(f"error: --max-keys must be at least 1, not {args.max_keys}", file=sys.stderr)
        return 2
    app = create_app(api_key=args.api_key or None, retention_s=args.retention_s,
                     max_keys=args.max_keys, **hooks)

    def announce(host: str, port: int) -> None:
        # A parseable line, so scripts using --port 0 can learn the port.
        print(f"effectledger sandbox listening on http://{host}:{port}", flush=True)

    try:
        asyncio.run(serve(args.host, args.port, app=app, on_listening=announce))
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
