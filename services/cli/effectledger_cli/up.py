"""`effectledger up`: the whole pipeline on the embedded default, in one command.

An embedded nats-server (JetStream under the data folder), the ledger on SQLite (or
`--database-url`), a dispatcher, the reconciler, the sandbox provider and the demo catalog, each a
child process in its own process group. SIGINT, SIGTERM and SIGHUP stop the services first and
the broker last; `up` exits with no child left.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import httpx

from effectledger_bus.topology import topology
from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.errors import EffectLedgerError

from . import children
from .children import Child, PortTaken, StartFailed
from .embedded import free_port, nats_server_binary

AT_REST = {"succeeded", "failed", "cancelled", "needs_review"}
DEMO_SANDBOX = "127.0.0.1:8700"  # where the bundled demo catalog expects its sandbox
# Stop budget per stage, in order; together well under the 10 s a supervisor usually allows.
STOP_STAGES = ((("dispatcher", "reconciler"), 4.0), (("ledger", "sandbox"), 3.0),
               (("nats",), 2.0))
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """Raised in the main flow by the first stop signal (a BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """Turns the first SIGINT/SIGTERM/SIGHUP into `Stopped`, except inside `held()` (while a
    child is being spawned, so that no child can start without being recorded); a signal
    arriving there is raised when the section ends. Later signals are ignored: the stop is
    under way."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._held = 0

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signum
        if not self._held:
            raise Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if self.received is not None and not self._held:
            raise Stopped(self.received)


def demo_catalog_text(sandbox_port: int, host: str = "127.0.0.1") -> str:
    """The bundled demo catalog, pointed at the sandbox on `host:sandbox_port`."""
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


def run_up(args: argparse.Namespace) -> int:
    sigs = _Signals()
    sigs.install()
    procs: dict[str, Child] = {}
    try:
        return _run(args, sigs, procs)
    except (PortTaken, StartFailed) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (Stopped, KeyboardInterrupt):
        return 0
    finally:
        _stop_all(procs)


def _run(args: argparse.Namespace, sigs: _Signals, procs: dict[str, Child]) -> int:
    data = Path(args.data_dir).resolve()
    demo_catalog = not args.catalog_path
    with_sandbox = demo_catalog or bool(args.demo)
    ports = {"ledger": (args.ledger_port, "--ledger-port"),
             "reconciler webhooks": (args.reconciler_port, "--reconciler-port")}
    if with_sandbox:
        ports["sandbox"] = (args.sandbox_port, "--sandbox-port")
    if args.nats_port:
        ports["nats"] = (args.nats_port, "--nats-port")
    children.check_ports(ports)
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if demo_catalog:
        catalog_path = data / "demo_catalog.toml"
        catalog_path.write_text(demo_catalog_text(args.sandbox_port))
    else:
        catalog_path = Path(args.catalog_path).resolve()
    try:  # an invalid catalog is named (tool and field) before anything starts
        catalog = Catalog.load(catalog_path)
    except EffectLedgerError as exc:
        print(f"effectledger up: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    nats_port = args.nats_port or free_port()
    env = _base_env(args, data, nats_port, catalog_path)
    api_key = os.environ.get("EFFECTLEDGER_SANDBOX_API_KEY") or (
        "sk_sandbox_" + secrets.token_hex(12))
    # One webhook signing secret per run, shared by the sandbox (signs) and the reconciler
    # (verifies), added to the user's own secrets. Secrets travel in the environment only:
    # a command line is readable by every user of the machine.
    hook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    webhook_url = f"http://127.0.0.1:{args.reconciler_port}/v1/webhooks/sandbox"
    try:
        hook_secrets = merged_webhook_secrets(os.environ.get("EFFECTLEDGER_WEBHOOK_SECRETS"),
                                              "sandbox", hook_secret)
    except ValueError as exc:
        print(f"effectledger up: {exc}", file=sys.stderr)
        return 2
    provider_env = {"EFFECTLEDGER_SANDBOX_API_KEY": api_key}

    def start(name: str, argv: list[str], extra: dict[str, str]) -> Child:
        with sigs.held():
            procs[name] = children.spawn(name, argv, {**env, **extra}, logs)
        return procs[name]

    nats = start("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(nats_port),
                          "-js", "-sd", str(data / "jetstream")], {})
    children.wait_listening(nats, nats_port, 15)
    _apply_streams(env)
    if with_sandbox:
        sandbox = start("sandbox", children.cli("sandbox", "--port", str(args.sandbox_port)), {
            **provider_env, "EFFECTLEDGER_SANDBOX_WEBHOOK_URL": webhook_url,
            "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET": hook_secret,
            "EFFECTLEDGER_SANDBOX_WEBHOOK_ROUTES": "plainhooks"})
        children.wait_listening(sandbox, args.sandbox_port, 30)
    # The ledger never sees provider credentials; the dispatcher calls and the reconciler
    # reads back, so both hold the key; only the reconciler verifies webhooks.
    ledger = start("ledger", children.cli("ledger"), {})
    children.wait_listening(ledger, args.ledger_port, 60)
    start("dispatcher", children.cli("dispatcher", "--id", "dispatcher-1"), provider_env)
    reconciler = start("reconciler", children.cli("reconciler", "--id", "reconciler-1"),
                       {**provider_env, "EFFECTLEDGER_WEBHOOK_SECRETS": hook_secrets})
    children.wait_listening(reconciler, args.reconciler_port, 60)
    ledger_url = f"http://127.0.0.1:{args.ledger_port}"
    _wait_ready(ledger_url, procs)
    print(f"ledger: {ledger_url}")
    if with_sandbox:
        print(f"sandbox: http://127.0.0.1:{args.sandbox_port}")
    print(f"nats: nats://127.0.0.1:{nats_port}")
    print(f"webhooks: {webhook_url}")
    print(f"logs: {logs}")
    tool = "create_ticket" if demo_catalog else sorted(catalog.tools)[0]
    example = "'{\"title\": \"hello\"}'" if demo_catalog else "'{...}'"
    print(f"try: effectledger submit {tool} --args {example} --wait 5")
    sys.stdout.flush()
    if args.demo:
        code = _demo(ledger_url, args.demo)
        if args.exit_after_demo:
            return code
    return _supervise(procs)


def _apply_streams(env: dict[str, str]) -> None:
    """The stream step runs before any service: services only check streams."""
    from effectledger_core.config import Settings

    from .streams_cmd import apply

    settings = Settings(nats_url=env["EFFECTLEDGER_NATS_URL"],
                        ack_wait_s=float(env["EFFECTLEDGER_ACK_WAIT_S"]))
    asyncio.run(asyncio.wait_for(apply(settings, topology(settings)), 30))


def _base_env(args: argparse.Namespace, data: Path, nats_port: int, catalog: Path
              ) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           # set per child below, so that only the processes that need them see them
           if k not in ("EFFECTLEDGER_SANDBOX_API_KEY", "EFFECTLEDGER_WEBHOOK_SECRETS")}
    env.update({
        "EFFECTLEDGER_NATS_URL": f"nats://127.0.0.1:{nats_port}",
        "EFFECTLEDGER_DATABASE_URL": args.database_url or os.environ.get(
            "EFFECTLEDGER_DATABASE_URL", f"sqlite+aiosqlite:///{data / 'ledger.db'}"),
        "EFFECTLEDGER_LEDGER_PORT": str(args.ledger_port),
        "EFFECTLEDGER_RECONCILER_PORT": str(args.reconciler_port),
        "EFFECTLEDGER_CATALOG_PATH": str(catalog),
        # Short enough that the embedded demo recovers from a killed dispatcher quickly.
        "EFFECTLEDGER_ACK_WAIT_S": os.environ.get("EFFECTLEDGER_ACK_WAIT_S", "30"),
    })
    return env


def _wait_ready(url: str, procs: dict[str, Child]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _check_alive(procs)
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # polling the readiness endpoint
    raise procs["ledger"].failure("did not become ready within 60s")


def _check_alive(procs: dict[str, Child]) -> None:
    for child in procs.values():
        code = child.proc.poll()
        if code is not None:
            raise child.failure(f"exited with {code}")


def _demo(url: str, n: int) -> int:
    tools = ["create_ticket", "send_email", "charge_card", "post_message", "page_oncall"]
    ids = []
    with httpx.Client(base_url=url, timeout=10) as http:
        for i in range(n):
            tool = tools[i % len(tools)]
            args = ({"amount": 100 + i, "currency": "EUR"} if tool == "charge_card"
                    else {"title": f"demo {i}"})
            resp = http.post("/v1/intents", json={"tool": tool, "arguments": args,
                                                  "idempotency_key": f"demo-{time.time()}-{i}"})
            resp.raise_for_status()
            ids.append(resp.json()["id"])
        deadline = time.monotonic() + 60
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {i: http.get(f"/v1/operations/{i}").json()["state"] for i in ids}
            if all(s in AT_REST for s in states.values()):
                break
            time.sleep(0.2)  # polling the API for the demo's summary
    summary: dict[str, int] = {}
    for s in states.values():
        summary[s] = summary.get(s, 0) + 1
    print("demo: " + json.dumps(summary, sort_keys=True))
    sys.stdout.flush()
    return 0 if summary == {"succeeded": n} else 1


def _supervise(procs: dict[str, Child]) -> int:
    while True:
        _check_alive(procs)  # a child that died is named with its log, and all stop
        time.sleep(0.5)  # supervision period


def _stop_all(procs: dict[str, Child]) -> None:
    """Services first (so they stop consuming and publish nothing half-way), the broker last
    (so their last log lines are not reconnect noise). Signals are ignored meanwhile."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    for names, timeout_s in STOP_STAGES:
        stage = [procs[n] for n in names if n in procs]
        if stage:
            children.stop(stage, timeout_s)
