"""What `effectledger up` will run, decided and checked before anything starts.

Every refusal is one line on the terminal and an exit code, and happens before the first
child process: one port given to two roles (naming both), taken ports (named with their
holder), an invalid catalog (named by tool and field), several ledgers on SQLite, malformed
webhook secrets.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from effectledger_core.errors import EffectLedgerError

from . import children, up_nats
from .embedded import free_port, reserve

if TYPE_CHECKING:
    from effectledger_core.catalog import Catalog

DEMO_SANDBOX = "127.0.0.1:8700"  # where the bundled demo catalog expects its sandbox
MAX_COUNT = 16


class Refused(Exception):
    """`up` will not start: the message is the one line to print; `code` the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class UpPlan:
    data: Path
    logs: Path
    database_url: str
    catalog_path: Path
    demo_catalog: bool
    first_tool: str
    with_sandbox: bool
    sandbox_port: int
    ledger_ports: list[int]
    reconciler_ports: list[int]
    dispatchers: int
    dispatcher_metrics_ports: list[int]  # each dispatcher's /metrics, /healthz, /readyz
    nats: up_nats.NatsPlan
    api_key: str
    hook_secret: str  # signs the sandbox's webhooks (the sandbox's environment only)
    hook_secrets: str  # the reconcilers' EFFECTLEDGER_WEBHOOK_SECRETS: the user's + this one
    webhook_providers: list[str]  # the providers whose webhooks the reconcilers take

    def webhook_url(self, provider: str) -> str:
        return f"http://127.0.0.1:{self.reconciler_ports[0]}/v1/webhooks/{provider}"


def demo_catalog_text(sandbox_port: int, host: str = "127.0.0.1") -> str:
    """The bundled demo catalog, pointed at the sandbox on `host:sandbox_port`."""
    # Here, not at the top: the config module brings pydantic-settings (see `plan`).
    from effectledger_core.config import DEMO_CATALOG

    return DEMO_CATALOG.read_text().replace(DEMO_SANDBOX, f"{host}:{sandbox_port}")


def merged_webhook_secrets(user_json: str | None, provider: str, secret: str) -> str:
    """The user's EFFECTLEDGER_WEBHOOK_SECRETS with `secret` added for `provider`, never
    replacing theirs. ValueError (one line) when theirs is not a JSON object of lists."""
    current: dict[str, list[str]] = {}
    if user_json and user_json.strip():
        try:
            parsed = json.loads(user_json)
        except ValueError as exc:
            raise ValueError(f"EFFECTLEDGER_WEBHOOK_SECRETS is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict) or not all(
                isinstance(v, list) and all(isinstance(s, str) for s in v)
                for v in parsed.values()):
            raise ValueError('EFFECTLEDGER_WEBHOOK_SECRETS must look like '
                             '{"<provider>": ["whsec_..."]}')
        current = parsed
    merged = {p: list(v) for p, v in current.items()}
    merged.setdefault(provider, [])
    if secret not in merged[provider]:
        merged[provider].append(secret)
    return json.dumps(merged)


def plan_or_refuse(args: argparse.Namespace) -> UpPlan | int:
    """The plan, or the exit code of a refusal already printed (one line on stderr).

    `effectledger` runs this before it imports the rest of `up` (the broker's and the HTTP
    clients, the permissions: most of a second on a busy 2-core machine), so that a refusal
    answers at once (`tests/e2e/test_up.py`: a taken port within 2 s)."""
    # Everything `up` and its children create (the SQLite ledger and its WAL, logs, JetStream,
    # credentials, the demo catalog written here) is its owner's only: they hold every
    # tenant's arguments and results.
    os.umask(0o077)
    try:
        return plan(args)
    except (Refused, OSError) as exc:  # OSError: a data folder we may not write, ...
        return refused(exc)


def refused(exc: Refused | OSError) -> int:
    """Say why `up` will not run or go on (one line on stderr); its exit code."""
    if isinstance(exc, Refused):
        print(str(exc), file=sys.stderr)
        return exc.code
    print(f"effectledger up: {exc}", file=sys.stderr)
    return 1


def plan(args: argparse.Namespace) -> UpPlan:
    """Check everything `up` can check without starting a process; Refused otherwise."""
    data = Path(args.data_dir).resolve()
    database_url = args.database_url or os.environ.get("EFFECTLEDGER_DATABASE_URL") or (
        f"sqlite+aiosqlite:///{data / 'ledger.db'}")
    counts = {"--nats-cluster": args.nats_cluster, "--ledgers": args.ledgers,
              "--dispatchers": args.dispatchers, "--reconcilers": args.reconcilers}
    for flag, count in counts.items():
        if not 1 <= count <= MAX_COUNT:
            raise Refused(f"effectledger up: {flag} must be between 1 and {MAX_COUNT}, "
                          f"not {count}")
    if args.max_restarts < 0 or not args.restart_window > 0:
        raise Refused("effectledger up: --max-restarts must be 0 or more and "
                      "--restart-window more than 0 seconds")
    if args.ledgers > 1 and database_url.startswith("sqlite"):
        raise Refused(f"effectledger up: --ledgers {args.ledgers} needs PostgreSQL "
                      "(--database-url postgresql+asyncpg://...): SQLite has a single writer")
    demo_catalog = not args.catalog_path
    with_sandbox = demo_catalog or bool(args.demo)
    ledger_ports = [args.ledger_port + i for i in range(args.ledgers)]
    reconciler_ports = [args.reconciler_port + i for i in range(args.reconcilers)]
    # The ports `up` picks itself (NATS, monitoring, metrics) never land on one given by flag.
    reserve([*ledger_ports, *reconciler_ports, args.sandbox_port,
             *([args.metrics_port + i for i in range(args.dispatchers)] if args.metrics_port
               else []),
             *([args.nats_port + i for i in range(args.nats_cluster)] if args.nats_port
               else [])])
    metrics_ports = [args.metrics_port + i if args.metrics_port else free_port()
                     for i in range(args.dispatchers)]
    nats = up_nats.plan(args.nats_cluster, args.nats_port)
    ports = {**_numbered("ledger", ledger_ports, "--ledger-port"),
             **_numbered("reconciler webhooks", reconciler_ports, "--reconciler-port"),
             **_numbered("dispatcher metrics", metrics_ports, "--metrics-port")}
    if with_sandbox:
        ports["sandbox"] = (args.sandbox_port, "--sandbox-port")
    if args.nats_port:
        ports.update(_numbered("nats", nats.client_ports, "--nats-port"))
    over = [f"{what} {port}" for what, (port, _) in ports.items() if port > 65535]
    if over:
        raise Refused(f"effectledger up: no such port: {', '.join(over)}")
    _distinct(ports)
    try:
        children.check_ports(ports)
    except children.PortTaken as exc:
        raise Refused(str(exc), code=1) from None
    hook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    try:
        hook_secrets = merged_webhook_secrets(os.environ.get("EFFECTLEDGER_WEBHOOK_SECRETS"),
                                              "sandbox", hook_secret)
    except ValueError as exc:
        raise Refused(f"effectledger up: {exc}") from None
    if demo_catalog:
        data.mkdir(parents=True, exist_ok=True)
        catalog_path = data / "demo_catalog.toml"
        catalog_path.write_text(demo_catalog_text(args.sandbox_port))
    else:
        catalog_path = Path(args.catalog_path).resolve()
    # Imported only now: the catalog's validation (pydantic, jsonschema) is most of what
    # `plan` imports, and a taken port or a bad flag is refused without it.
    from effectledger_core.catalog import Catalog

    try:
        catalog = Catalog.load(catalog_path)
    except EffectLedgerError as exc:
        raise Refused(f"effectledger up: {exc.code}: {exc.message}") from None
    return UpPlan(
        data=data, logs=data / "logs", database_url=database_url, catalog_path=catalog_path,
        demo_catalog=demo_catalog,
        first_tool="create_ticket" if demo_catalog else sorted(catalog.tools)[0],
        with_sandbox=with_sandbox, sandbox_port=args.sandbox_port, ledger_ports=ledger_ports,
        reconciler_ports=reconciler_ports, dispatchers=args.dispatchers,
        dispatcher_metrics_ports=metrics_ports, nats=nats,
        api_key=os.environ.get("EFFECTLEDGER_SANDBOX_API_KEY") or (
            "sk_sandbox_" + secrets.token_hex(12)),
        hook_secret=hook_secret, hook_secrets=hook_secrets,
        webhook_providers=webhook_providers(
            catalog, os.environ.get("EFFECTLEDGER_WEBHOOK_SECRETS"), with_sandbox))


def webhook_providers(catalog: Catalog, user_json: str | None,
                      with_sandbox: bool) -> list[str]:
    """Every provider the reconcilers take webhooks from: the catalog's `[webhooks.<p>]`, the
    providers its tools name (`webhook_provider`), those with secrets in
    EFFECTLEDGER_WEBHOOK_SECRETS, and the sandbox when it runs (its secret is `up`'s own)."""
    found = set(catalog.webhooks)
    found.update(t.webhook_provider for t in catalog.tools.values() if t.webhook_provider)
    # the user's EFFECTLEDGER_WEBHOOK_SECRETS, already checked by merged_webhook_secrets
    found.update(json.loads(user_json) if user_json and user_json.strip() else {})
    if with_sandbox:
        found.add("sandbox")
    return sorted(found)


def _distinct(ports: dict[str, tuple[int, str]]) -> None:
    """One port given to two roles is refused here, before anything starts: the second
    child would only fail to listen after `up` had announced every endpoint."""
    holder: dict[int, tuple[str, str]] = {}
    for what, (port, flag) in ports.items():
        if port in holder:
            first, first_flag = holder[port]
            raise Refused(f"effectledger up: port {port} is given to both {first} "
                          f"({first_flag}) and {what} ({flag}); give each its own port")
        holder[port] = (what, flag)


def _numbered(what: str, ports: list[int], flag: str) -> dict[str, tuple[int, str]]:
    if len(ports) == 1:
        return {what: (ports[0], flag)}
    return {f"{what} {i + 1}": (port, flag) for i, port in enumerate(ports)}
