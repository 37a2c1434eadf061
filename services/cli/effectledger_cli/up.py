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
import logging
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

from . import children, up_nats
from .children import Child, PortTaken, StartFailed

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
    database_url = args.database_url or os.environ.get("EFFECTLEDGER_DATABASE_URL") or (
        f"sqlite+aiosqlite:///{data / 'ledger.db'}")
    counts = {"--nats-cluster": args.nats_cluster, "--ledgers": args.ledgers,
              "--dispatchers": args.dispatchers, "--reconcilers": args.reconcilers}
    for flag, count in counts.items():
        if not 1 <= count <= 16:
            print(f"effectledger up: {flag} must be between 1 and 16, not {count}",
                  file=sys.stderr)
            return 2
    if args.ledgers > 1 and database_url.startswith("sqlite"):
        print(f"effectledger up: --ledgers {args.ledgers} needs PostgreSQL (--database-url "
              "postgresql+asyncpg://...): SQLite has a single writer", file=sys.stderr)
        return 2
    ledger_ports = [args.ledger_port + i for i in range(args.ledgers)]
    reconciler_ports = [args.reconciler_port + i for i in range(args.reconcilers)]
    nats = up_nats.plan(args.nats_cluster, args.nats_port)
    ports = {**_numbered("ledger", ledger_ports, "--ledger-port"),
             **_numbered("reconciler webhooks", reconciler_ports, "--reconciler-port")}
    if with_sandbox:
        ports["sandbox"] = (args.sandbox_port, "--sandbox-port")
    if args.nats_port:
        ports.update(_numbered("nats", nats.client_ports, "--nats-port"))
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
    env = _base_env(database_url, catalog_path)
    api_key = os.environ.get("EFFECTLEDGER_SANDBOX_API_KEY") or (
        "sk_sandbox_" + secrets.token_hex(12))
    # One webhook signing secret per run, shared by the sandbox (signs) and the reconcilers
    # (verify), added to the user's own secrets. Secrets travel in the environment only:
    # a command line is readable by every user of the machine.
    hook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    webhook_url = f"http://127.0.0.1:{reconciler_ports[0]}/v1/webhooks/sandbox"
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

    up_nats.start(nats, data, start)
    streams = _apply_streams(nats, env)
    if with_sandbox:
        sandbox = start("sandbox", children.cli("sandbox", "--port", str(args.sandbox_port)), {
            **provider_env, "EFFECTLEDGER_SANDBOX_WEBHOOK_URL": webhook_url,
            "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET": hook_secret,
            "EFFECTLEDGER_SANDBOX_WEBHOOK_ROUTES": "plainhooks"})
        children.wait_listening(sandbox, args.sandbox_port, 30)
    # The ledger never sees provider credentials; the dispatchers call and the reconcilers
    # read back, so both hold the key; only the reconcilers verify webhooks.
    for i, port in enumerate(ledger_ports):
        ledger = start(_name("ledger", i), children.cli("ledger", "--port", str(port)),
                       nats.client_env("ledger"))
        children.wait_listening(ledger, port, 60)
    for i in range(args.dispatchers):
        start(_name("dispatcher", i), children.cli("dispatcher", "--id", f"dispatcher-{i + 1}"),
              {**nats.client_env("dispatcher"), **provider_env})
    for i, port in enumerate(reconciler_ports):
        reconciler = start(_name("reconciler", i), children.cli(
            "reconciler", "--id", f"reconciler-{i + 1}", "--port", str(port)), {
            **nats.client_env("reconciler"), **provider_env,
            "EFFECTLEDGER_WEBHOOK_SECRETS": hook_secrets})
        children.wait_listening(reconciler, port, 60)
    ledger_urls = [f"http://127.0.0.1:{port}" for port in ledger_ports]
    for url in ledger_urls:
        _wait_ready(url, procs)
    print(f"ledger: {', '.join(ledger_urls)}")
    if with_sandbox:
        print(f"sandbox: http://127.0.0.1:{args.sandbox_port}")
    print(f"nats: {nats.url}" + (" (users: ledger, dispatcher, reconciler, streams)"
                                  if nats.clustered else ""))
    print(f"streams: {streams}")
    print(f"webhooks: {webhook_url}")
    print(f"logs: {logs}")
    tool = "create_ticket" if demo_catalog else sorted(catalog.tools)[0]
    example = "'{\"title\": \"hello\"}'" if demo_catalog else "'{...}'"
    print(f"try: effectledger submit {tool} --args {example} --wait 5")
    sys.stdout.flush()
    if args.demo:
        code = _demo(ledger_urls[0], args.demo)
        if args.exit_after_demo:
            return code
    return _supervise(procs)


def _name(role: str, index: int) -> str:
    return role if index == 0 else f"{role}-{index + 1}"


def _numbered(what: str, ports: list[int], flag: str) -> dict[str, tuple[int, str]]:
    if len(ports) == 1:
        return {what: (ports[0], flag)}
    return {f"{what} {i + 1}": (port, flag) for i, port in enumerate(ports)}


def _apply_streams(nats: up_nats.NatsPlan, env: dict[str, str]) -> str:
    """The stream step runs before any service: services only check streams."""
    from effectledger_core.config import Settings

    from .streams_cmd import apply

    client = nats.client_env("streams")
    settings = Settings(nats_url=client["EFFECTLEDGER_NATS_URL"],
                        nats_user=client.get("EFFECTLEDGER_NATS_USER"),
                        nats_password=client.get("EFFECTLEDGER_NATS_PASSWORD"),
                        stream_replicas=nats.replicas,
                        ack_wait_s=float(env["EFFECTLEDGER_ACK_WAIT_S"]))
    wanted = topology(settings)
    # A new cluster elects its JetStream leader first; apply waits for it. The client's own
    # connect/disconnect warnings would only be noise on the terminal here.
    logging.getLogger("effectledger_bus.connect").setLevel(logging.ERROR)
    print(f"streams: applying ({nats.replicas} replicas)...", flush=True)
    asyncio.run(asyncio.wait_for(apply(settings, wanted), 120))
    return ", ".join(f"{s.name} ({s.num_replicas} replicas)" for s in wanted.streams)


def _base_env(database_url: str, catalog: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           # set per child below, so that only the processes that need them see them
           if k not in ("EFFECTLEDGER_SANDBOX_API_KEY", "EFFECTLEDGER_WEBHOOK_SECRETS",
                        "EFFECTLEDGER_NATS_USER", "EFFECTLEDGER_NATS_PASSWORD")}
    env.update({
        "EFFECTLEDGER_DATABASE_URL": database_url,
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
    for roles, timeout_s in STOP_STAGES:
        stage = [c for name, c in procs.items() if name.split("-")[0] in roles]
        if stage:
            children.stop(stage, timeout_s)
