"""`effectledger`: run the services, the embedded stack, and talk to a ledger.

Configuration comes from `EFFECTLEDGER_*` environment variables; flags override them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from effectledger_core.errors import EffectLedgerError

from .commands import discover

if TYPE_CHECKING:
    from effectledger_core.config import Settings

DEFAULT_LEDGER_URL = "http://127.0.0.1:8600"


def _settings(args: argparse.Namespace) -> Settings:
    from effectledger_core.config import Settings

    overrides: dict[str, Any] = {}
    for name in ("database_url", "nats_url", "catalog_path", "ledger_host", "ledger_port",
                 "subject_prefix", "stream_prefix", "dispatcher_id", "dispatcher_concurrency",
                 "reconciler_id", "reconciler_host", "reconciler_port"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def _logging(settings: Settings, service: str) -> None:
    """Logs as EFFECTLEDGER_LOG_LEVEL / _LOG_FORMAT say; traces if OTEL_* ask for them."""
    from effectledger_obs.logs import configure_logging
    from effectledger_obs.tracing import configure_tracing

    configure_logging(settings.log_level, settings.log_format)
    configure_tracing(f"effectledger-{service}")


def _logging_or_exit(settings: Settings, service: str) -> None:
    try:
        _logging(settings, service)
    except ValueError as exc:  # a bad level or format: one line naming the setting
        print(f"effectledger {service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _common(p: argparse.ArgumentParser, *, db: bool = False, nats: bool = False) -> None:
    if db:
        p.add_argument("--database-url", help="SQLAlchemy URL (env EFFECTLEDGER_DATABASE_URL)")
    if nats:
        p.add_argument("--nats-url", help="NATS server(s) (env EFFECTLEDGER_NATS_URL)")
        p.add_argument("--catalog", dest="catalog_path", help="tool catalog TOML")
        p.add_argument("--subject-prefix", help="subject prefix (default: effects)")
        p.add_argument("--stream-prefix", help="stream name prefix (default: EFFECTS)")


def port_number(text: str) -> int:
    """argparse type: a TCP port (0 where the flag allows "any free one")."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number (0-65535): {port}")
    return port


def _requested(argv: Sequence[str] | None) -> str | None:
    """The subcommand `argv` names (its first word that is not an option), if any."""
    return next((w for w in argv or () if not w.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole CLI; for an `argv` that names a built-in command, without the installed tools.

    Every `effectledger` process builds it, each service and each `submit` included, and
    loading the tools (bench, chaos) imported their libraries too; so did the built-in
    commands' modules, which import what they run with only when they run (about 0.8 s of
    imports before any command began, on a 2-core VM; `tests/unit/test_cli_startup.py`)."""
    from . import nats_config

    parser = argparse.ArgumentParser(prog="effectledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything on the embedded default (one command)")
    up.add_argument("--data-dir", default=os.environ.get("EFFECTLEDGER_DATA_DIR",
                                                         "effectledger-data"),
                    help="folder for the SQLite ledger, JetStream and the credentials "
                         "(env EFFECTLEDGER_DATA_DIR; default: effectledger-data)")
    up.add_argument("--database-url", help="use this database instead of the embedded SQLite")
    up.add_argument("--catalog", dest="catalog_path", help="replace the demo catalog")
    up.add_argument("--nats-port", type=port_number, default=0,
                    help="embedded NATS port (0: any free)")
    up.add_argument("--ledger-port", type=port_number, default=8600)
    up.add_argument("--sandbox-port", type=port_number, default=8700,
                    help="sandbox port (the demo catalog expects 8700)")
    up.add_argument("--reconciler-port", type=port_number, default=8800,
                    help="reconciler webhook port")
    up.add_argument("--metrics-port", type=port_number, default=0,
                    help="the first dispatcher's /metrics port, the next ones count up "
                         "(0: any free; the other children serve /metrics on their own port)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="N nats-server processes clustered on loopback, streams with N "
                         "replicas (at most 5) and a NATS user per service (default: 1)")
    for role, first in (("ledgers", "--ledger-port"), ("dispatchers", None),
                        ("reconcilers", "--reconciler-port")):
        up.add_argument(f"--{role}", type=int, default=1, metavar="N",
                        help=f"run N {role}" + (f" (ports from {first} up)" if first else ""))
    up.add_argument("--demo", type=int, default=0, metavar="N",
                    help="submit N demo intents once ready and print where they ended")
    up.add_argument("--exit-after-demo", action="store_true",
                    help="stop everything after the demo (for smoke tests)")
    up.add_argument("--max-restarts", type=int, default=5, metavar="N",
                    help="a child that dies is restarted, with backoff; more than N deaths "
                         "within --restart-window stop everything (default: 5)")
    up.add_argument("--restart-window", type=float, default=60.0, metavar="SECONDS",
                    help="the window of --max-restarts (default: 60)")
    up.add_argument("--unsafe-open-api", action="store_true",
                    help="UNSAFE: run the ledger's HTTP API without tokens (any local process "
                         "may then submit for any tenant and approve)")

    led = sub.add_parser("ledger", help="run the ledger service")
    _common(led, db=True, nats=True)
    led.add_argument("--host", dest="ledger_host")
    led.add_argument("--port", dest="ledger_port", type=port_number)

    dis = sub.add_parser("dispatcher", help="run a dispatcher")
    _common(dis, nats=True)
    dis.add_argument("--id", dest="dispatcher_id", help="dispatcher identity (default host-pid)")
    dis.add_argument("--concurrency", dest="dispatcher_concurrency", type=int)

    rec = sub.add_parser("reconciler", help="run the reconciler (and its webhook endpoint)")
    _common(rec, nats=True)
    rec.add_argument("--id", dest="reconciler_id", help="reconciler identity (default host-pid)")
    rec.add_argument("--host", dest="reconciler_host", help="webhook HTTP host (default 127.0.0.1)")
    rec.add_argument("--port", dest="reconciler_port", type=port_number,
                     help="webhook HTTP port (default 8800)")

    sb = sub.add_parser("sandbox", help="run the sandbox provider")
    sb.add_argument("--host", default="127.0.0.1")
    sb.add_argument("--port", type=port_number, default=8700)
    sb.add_argument("--max-keys", type=int, default=None,
                    help="keys remembered before the oldest is forgotten, with its effects "
                         "(default 100,000): bounds the sandbox's memory; a benchmark that "
                         "checks every effect needs more than it makes")
    sb.add_argument("--api-key", default=os.environ.get("EFFECTLEDGER_SANDBOX_API_KEY"),
                    help="bearer key required by /v1 routes (env EFFECTLEDGER_SANDBOX_API_KEY)")
    sb.add_argument("--webhook-url", default=os.environ.get("EFFECTLEDGER_SANDBOX_WEBHOOK_URL"),
                    help="send signed webhooks here (env EFFECTLEDGER_SANDBOX_WEBHOOK_URL)")
    sb.add_argument("--webhook-secret",
                    default=os.environ.get("EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET"),
                    help="whsec_... signing secret (env EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET)")
    sb.add_argument("--webhook-routes",
                    default=os.environ.get("EFFECTLEDGER_SANDBOX_WEBHOOK_ROUTES", ""),
                    help="comma-separated routes sending webhooks from the start, '*' for all")

    mig = sub.add_parser("migrate", help="create or upgrade the ledger schema")
    _common(mig, db=True)

    from .deploy_env import add_arguments as add_deploy_env_arguments

    add_deploy_env_arguments(sub.add_parser(
        "deploy-env", help="print fresh credentials for infra/compose.yaml as an .env file"))

    from .streams_cmd import add_arguments as add_streams_arguments

    add_streams_arguments(sub.add_parser(
        "streams", help="apply (or show) the JetStream streams and consumers: the one step "
                        "that owns their configuration"))

    sub.add_parser("unsafe-switches",
                   help="list the switches that turn a guarantee off, and which are armed here")
    nats_config.add_parser(sub)

    from effectledger_mcp.cli import add_arguments as add_mcp_arguments

    add_mcp_arguments(sub.add_parser(
        "mcp", help="serve the catalog to MCP agents (stdio, or --http HOST:PORT)"))

    for name, help_ in (("submit", "submit an intent"), ("show", "show an operation"),
                        ("list", "list operations"),
                        ("approve", "approve an operation awaiting approval (operator)"),
                        ("reject", "reject an operation awaiting approval (operator)"),
                        ("cancel", "cancel a pending operation (operator)"),
                        ("retry", "prepare and use a single-use retry plan (operator)"),
                        ("review", "record a review of an operation in needs_review, or list "
                                   "the review queue (operator)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--ledger-url", default=os.environ.get("EFFECTLEDGER_LEDGER_URL",
                                                              DEFAULT_LEDGER_URL))
        p.add_argument("--data-dir", help="where `effectledger up` keeps its tokens, used when "
                                          "EFFECTLEDGER_TOKEN is not set (env "
                                          "EFFECTLEDGER_DATA_DIR; default: effectledger-data)")
        if name == "submit":
            p.add_argument("tool")
            p.add_argument("--args", default="{}", help="arguments as a JSON object")
            p.add_argument("--key", help="idempotency key (same key + same args = same op)")
            p.add_argument("--task", help="task id scoping the key")
            p.add_argument("--tenant", default=None)
            p.add_argument("--wait", type=float, default=0.0,
                           help="seconds to wait for the operation to settle (at rest or "
                                "awaiting approval); exit code says how it ended")
        elif name == "show":
            p.add_argument("operation_id")
            p.add_argument("--journal", action="store_true")
            p.add_argument("--receipt", action="store_true")
            p.add_argument("--wait", type=float, default=0.0,
                           help="seconds to wait for the operation to settle")
        elif name == "review":
            p.add_argument("operation_id", nargs="?", help="omit to list the review queue")
            p.add_argument("--conclusion", choices=["not_executed", "completed", "uncertain"])
            p.add_argument("--evidence-ref", help="where the evidence is (ticket, call log, ...)")
            p.add_argument("--operator", help="who reviews (must match an operator token)")
            p.add_argument("--epoch", type=int, help="the epoch reviewed (default: current)")
            p.add_argument("--retry", action="store_true",
                           help="after a not_executed review, use one explicit retry plan")
        elif name in ("approve", "reject", "cancel", "retry"):
            p.add_argument("operation_id")
            p.add_argument("--operator", help="who is acting (journaled; default: the "
                                              "operator token's name)")
            p.add_argument("--epoch", type=int, help="the epoch you inspected (default: current)")
            if name == "approve":
                p.add_argument("--arguments-digest",
                               help="digest of the arguments you approve (default: current)")
            if name in ("reject", "cancel"):
                p.add_argument("--reason", default="")
            if name == "retry":
                p.add_argument("--review", choices=["not_executed", "completed", "uncertain"],
                               help="your verified conclusion about the last attempt")
                p.add_argument("--evidence-ref", help="where the evidence for --review is")
        else:
            p.add_argument("--state")
            p.add_argument("--limit", type=int, default=50)
            p.add_argument("--cursor")
    # The tools (bench, chaos) when installed (commands.py): loaded only when the command
    # asked for is not a built-in one, or none is named (`effectledger --help` lists them).
    if argv is not None and _requested(argv) in sub.choices:
        return parser
    for command in discover(reserved=frozenset(sub.choices)).values():
        tool = sub.add_parser(command.name, help=command.help)
        command.add_arguments(tool)
        tool.set_defaults(tool_run=command.run, tool_any_arguments=command.any_arguments)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "tool_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _dispatch(args)
    except EffectLedgerError as exc:
        print(f"effectledger: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from .startup_errors import startup_error_line

        line = startup_error_line(exc)
        if line is None:
            raise
        print(f"effectledger {args.command}: {line}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "up":
        from .up_plan import plan_or_refuse

        planned = plan_or_refuse(args)  # before the rest of `up` is imported: see there
        if isinstance(planned, int):
            return planned
        from .up import run_up

        return run_up(args, planned)
    tool_run = getattr(args, "tool_run", None)
    if tool_run is not None:
        return int(tool_run(args))
    if cmd == "unsafe-switches":
        from effectledger_core.unsafe import describe

        print(describe(os.environ))
        return 0
    if cmd == "mcp":
        from effectledger_mcp.cli import run as run_mcp

        return run_mcp(args)
    if cmd in ("submit", "show", "list", "approve", "reject", "cancel", "retry", "review"):
        from . import client

        return client.run(args)
    if cmd == "deploy-env":
        from .deploy_env import run as run_deploy_env

        return run_deploy_env(args)
    if cmd == "sandbox":
        from effectledger_core.config import Settings
        from effectledger_sandbox.app import create_app as sandbox_app
        from effectledger_sandbox.server import serve as serve_sandbox
        from effectledger_sandbox.server import webhook_options

        sandbox_settings = Settings()
        _logging_or_exit(sandbox_settings, "sandbox")
        try:
            hooks = webhook_options(args)
        except ValueError as exc:
            print(f"effectledger sandbox: {exc}", file=sys.stderr)
            return 2
        if args.max_keys is not None and args.max_keys < 1:
            print(f"effectledger sandbox: --max-keys must be at least 1, not {args.max_keys}",
                  file=sys.stderr)
            return 2
        app = sandbox_app(api_key=args.api_key or None, **hooks,
                          **({"max_keys": args.max_keys} if args.max_keys is not None else {}))

        async def sandbox() -> None:
            import asyncio

            from effectledger_core.heap import freeze_survivors_of_full_collections

            # It keeps every effect: see there.
            freeze_survivors_of_full_collections(asyncio.get_running_loop().call_soon_threadsafe)
            await serve_sandbox(args.host, args.port, app=app)

        run_loop(sandbox())
        return 0
    settings = _settings(args)
    _logging_or_exit(settings, cmd)
    if cmd == "streams":
        from .streams_cmd import run as run_streams

        return run_streams(args, settings)
    if cmd == "migrate":
        import asyncio

        from effectledger_ledger.db.store import Store
        from effectledger_ledger.migrate import upgrade

        async def _migrate() -> str | None:
            store = Store(settings.database_url)
            try:
                return await upgrade(store)
            finally:
                await store.close()

        print(json.dumps({"database": _redact(settings.database_url),
                          "revision": asyncio.run(_migrate())}))
        return 0
    if cmd == "ledger":
        from effectledger_ledger.app import serve
    elif cmd == "dispatcher":
        from effectledger_dispatcher.app import serve
    else:
        from effectledger_reconciler.app import serve
    run_loop(serve(settings))
    return 0


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a service on uvloop when it is installed (EFFECTLEDGER_EVENT_LOOP=asyncio opts out).

    What the imports made lives as long as the process: it is frozen out of the garbage
    collector's full passes first (`effectledger_core.heap`).
    """
    import asyncio

    from effectledger_core.heap import freeze_long_lived

    freeze_long_lived()
    if os.environ.get("EFFECTLEDGER_EVENT_LOOP", "uvloop").strip().lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def _redact(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)
