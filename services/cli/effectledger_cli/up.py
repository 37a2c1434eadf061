"""`effectledger up`: the whole pipeline on the embedded default, in one command.

An embedded nats-server (JetStream under the data folder; or `--nats-cluster N` of them), the
ledger on SQLite (or `--database-url`), a dispatcher, the reconciler, the sandbox provider and
the demo catalog, each a child process in its own process group (`children`). Everything that
can be checked is checked before the first child starts (`up_plan`); the streams are applied
before the first service starts. Once everything runs, `up` supervises: a child that dies is
named and restarted with backoff while the others keep serving, and a crash loop stops
everything (`supervisor`). SIGINT, SIGTERM and SIGHUP stop the services first and the broker
last (`stop_signals`); `up` exits with no child left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from effectledger_bus.permissions import Role, user_name
from effectledger_bus.topology import topology
from effectledger_client import localtokens
from effectledger_core.states import AT_REST, State
from effectledger_core.unsafe import NATS_WITHOUT_PERMISSIONS, OPEN_API, check

from . import api_tokens, child_env, children, files, nats_auth, supervisor, up_nats
from .child_env import ChildRole
from .children import Child, StartFailed
from .stop_signals import Stopped, StopSignals
from .up_plan import Refused, UpPlan, refused

# Stop budget per stage, in order; together well under the 10 s a supervisor usually allows.
STOP_STAGES = ((("dispatcher", "reconciler"), 4.0), (("ledger", "sandbox"), 3.0),
               (("nats",), 2.0))
TENANT = localtokens.DEFAULT_TENANT
DEFAULT_LEDGER_PORT = 8600


def run_up(args: argparse.Namespace, planned: UpPlan) -> int:
    """Run what `up_plan.plan_or_refuse` planned (which also set the umask: everything `up`
    creates is its owner's only)."""
    sigs = StopSignals()
    sigs.install()
    procs: dict[str, Child] = {}
    try:
        return _run(planned, args, sigs, procs)
    except (Refused, OSError) as exc:  # OSError: no nats-server binary, ...
        return refused(exc)
    except (StartFailed, supervisor.CrashLoop) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (Stopped, KeyboardInterrupt):
        return 0
    finally:
        _stop_all(procs)


def _run(p: UpPlan, args: argparse.Namespace, sigs: StopSignals,
         procs: dict[str, Child]) -> int:
    p.logs.mkdir(parents=True, exist_ok=True)
    files.lock_down(p.data)
    env = _up_settings(p)
    references = child_env.catalog_references(p.catalog_path)
    # Secrets travel in the environment only (a command line is readable by every user of
    # the machine), and only to the children that use them: the ledger never sees provider
    # credentials; dispatchers call and reconcilers read back, so both hold the key; only
    # reconcilers verify webhooks, only the sandbox signs them.
    provider_env = {"EFFECTLEDGER_SANDBOX_API_KEY": p.api_key}

    def start(name: str, argv: list[str], extra: dict[str, str],
              role: ChildRole | None = None) -> Child:
        role = role or ChildRole(name.split("-")[0])
        # What the role uses, from the user's environment and this run's settings, then the
        # child's own secrets (child_env): never the whole environment.
        child = {**child_env.build(role, os.environ, env, references=references), **extra}
        with sigs.held():
            procs[name] = children.spawn(name, argv, child, p.logs)
        return procs[name]

    def start_nats(name: str, argv: list[str], extra: dict[str, str]) -> Child:
        return start(name, argv, extra, ChildRole.NATS)

    auth = _nats_auth(p, args)
    tokens = _api_tokens(p, args)
    try:
        ledger_tokens = tokens.ledger_env(os.environ) if tokens else {}
    except ValueError as exc:
        raise Refused(f"effectledger up: {exc}") from None
    up_nats.start(p.nats, p.data, start_nats,
                  config=auth.config if auth and not p.nats.clustered else None,
                  authorization=auth.authorization() if auth else "")

    def nats_env(role: Role, index: int = 0) -> dict[str, str]:
        """A child's NATS settings: its own least-privilege user
        (effectledger_bus.permissions), on one node as on a cluster."""
        if auth is None:
            return p.nats.client_env()
        user = {Role.LEDGER: "ledger", Role.STREAMS: "streams"}.get(role) or user_name(
            role, f"{role.value}-{index + 1}")
        return {**auth.child_env(user), "EFFECTLEDGER_STREAM_REPLICAS": str(p.nats.replicas)}

    streams = _apply_streams(p, env, nats_env(Role.STREAMS))
    if p.with_sandbox:
        sandbox = start("sandbox", children.cli("sandbox", "--port", str(p.sandbox_port)), {
            **provider_env, "EFFECTLEDGER_SANDBOX_WEBHOOK_URL": p.webhook_url("sandbox"),
            "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET": p.hook_secret,
            "EFFECTLEDGER_SANDBOX_WEBHOOK_ROUTES": "plainhooks"})
        children.wait_listening(sandbox, p.sandbox_port, 30)
    for i, port in enumerate(p.ledger_ports):
        ledger = start(_name("ledger", i), children.cli("ledger", "--port", str(port)),
                       {**nats_env(Role.LEDGER), **ledger_tokens})
        children.wait_listening(ledger, port, 60)
    for i, port in enumerate(p.dispatcher_metrics_ports):
        dispatcher = start(_name("dispatcher", i), children.cli(
            "dispatcher", "--id", f"dispatcher-{i + 1}"), {
            **nats_env(Role.DISPATCHER, i), **provider_env,
            "EFFECTLEDGER_DISPATCHER_HEALTH_PORT": str(port)})
        children.wait_listening(dispatcher, port, 60)
    for i, port in enumerate(p.reconciler_ports):
        reconciler = start(_name("reconciler", i), children.cli(
            "reconciler", "--id", f"reconciler-{i + 1}", "--port", str(port)), {
            **nats_env(Role.RECONCILER, i), **provider_env,
            "EFFECTLEDGER_WEBHOOK_SECRETS": p.hook_secrets})
        children.wait_listening(reconciler, port, 60)
    ledger_urls = [f"http://127.0.0.1:{port}" for port in p.ledger_ports]
    for url in ledger_urls:
        _wait_ready(url, procs)
    _announce(p, ledger_urls, streams, auth, tokens)
    if args.demo:
        code = _demo(ledger_urls[0], args.demo, tokens.agents[TENANT] if tokens else None)
        if args.exit_after_demo:
            return code
    def respawn(child: Child) -> Child:
        with sigs.held():
            return children.respawn(child)

    supervisor.run(supervisor.Supervisor(procs, respawn, supervisor.RestartPolicy(
        max_restarts=args.max_restarts, window_s=args.restart_window)))
    return 0


def _name(role: str, index: int) -> str:
    return role if index == 0 else f"{role}-{index + 1}"


def _announce(p: UpPlan, ledger_urls: list[str], streams: str,
              auth: nats_auth.AuthFiles | None, tokens: api_tokens.ApiTokens | None) -> None:
    print(f"ledger: {', '.join(ledger_urls)}")
    if tokens is not None:
        print(f"console: {ledger_urls[0]}/console (sign in with the operator token in "
              f"{tokens.operator_file})")
        print(f"operator token (API, operator {tokens.operator_name}): {tokens.operator_file}")
        print(f"agent token (API, tenant {TENANT}): {tokens.agent_file(TENANT)}")
    else:
        print(f"console: {ledger_urls[0]}/console")
        print(f"api: {OPEN_API_LINE}")
    if p.with_sandbox:
        print(f"sandbox: http://127.0.0.1:{p.sandbox_port}")
    if auth is not None:
        print(f"nats: {p.nats.url}")
        print(f"agent credentials (tenant {TENANT}, NATS): "
              f"{auth.credential_file(f'agent-{TENANT}')}")
        print(f"operator credentials (NATS): {auth.credential_file('operator')}")
    else:
        print(f"nats: {p.nats.url} (UNSAFE: no users or permissions)")
    print(f"streams: {streams}")
    for provider in p.webhook_providers:
        print(f"webhooks ({provider}): {p.webhook_url(provider)}")
    if not p.webhook_providers:
        print("webhooks: none (no provider in the catalog or EFFECTLEDGER_WEBHOOK_SECRETS)")
    for name, url in metrics_urls(p):
        print(f"metrics ({name}): {url}")
    print(f"logs: {p.logs}")
    example = "'{\"title\": \"hello\"}'" if p.demo_catalog else "'{...}'"
    # The flags a client needs to find this ledger and its tokens, when not the defaults.
    where = "" if p.ledger_ports[0] == DEFAULT_LEDGER_PORT else f" --ledger-url {ledger_urls[0]}"
    if tokens is not None and p.data != Path(localtokens.DEFAULT_DATA_DIR).resolve():
        where += f" --data-dir {p.data}"
    print(f"try: effectledger submit {p.first_tool} --args {example} --wait 5{where}")
    sys.stdout.flush()


def metrics_urls(p: UpPlan) -> list[tuple[str, str]]:
    """Every child's metrics endpoint: the HTTP services on their own port, each dispatcher
    on its metrics port, each nats-server on its monitoring port."""
    urls = [(_name("ledger", i), f"http://127.0.0.1:{port}/metrics")
            for i, port in enumerate(p.ledger_ports)]
    urls += [(_name("dispatcher", i), f"http://127.0.0.1:{port}/metrics")
             for i, port in enumerate(p.dispatcher_metrics_ports)]
    urls += [(_name("reconciler", i), f"http://127.0.0.1:{port}/metrics")
             for i, port in enumerate(p.reconciler_ports)]
    if p.with_sandbox:
        urls.append(("sandbox", f"http://127.0.0.1:{p.sandbox_port}/metrics"))
    urls += [(_name("nats", i), f"http://127.0.0.1:{port}/varz")
             for i, port in enumerate(p.nats.monitor_ports)]
    return urls


OPEN_API_LINE = ("UNSAFE (--unsafe-open-api): the API is open, with no tokens: any local "
                 "process may submit for any tenant and approve as anyone")


def _api_tokens(p: UpPlan, args: argparse.Namespace) -> api_tokens.ApiTokens | None:
    """An operator token and an agent token per tenant, for the ledger to require, unless
    the API is opened on purpose (--unsafe-open-api, or its environment switch)."""
    log = logging.getLogger("effectledger.up")
    if args.unsafe_open_api:
        os.environ[OPEN_API.env] = "1"  # the flag is the switch: `unsafe-switches` lists it
    if check(OPEN_API, os.environ, log):
        return None
    return api_tokens.for_up(p.data, [TENANT])


def _nats_auth(p: UpPlan, args: argparse.Namespace) -> nats_auth.AuthFiles | None:
    """A user per process with least-privilege permissions, on one node or every node of a
    cluster, unless the unsafe switch turns them off."""
    if check(NATS_WITHOUT_PERMISSIONS, os.environ,
                                 logging.getLogger("effectledger.up")):
        return None
    from effectledger_core.config import Settings

    subjects = Settings().subjects  # the prefixes the children will read from the env
    return nats_auth.for_up(
        p.data, subjects, port=p.nats.client_ports[0],
        dispatchers=[f"dispatcher-{i + 1}" for i in range(p.dispatchers)],
        reconcilers=[f"reconciler-{i + 1}" for i in range(len(p.reconciler_ports))],
        tenants=[TENANT], cluster_url=p.nats.url if p.nats.clustered else None)


def _apply_streams(p: UpPlan, env: dict[str, str], client: dict[str, str]) -> str:
    """The stream step runs before any service: services only check streams."""
    from effectledger_core.config import Settings

    from .streams_cmd import apply

    nats = p.nats
    settings = Settings(nats_url=client["EFFECTLEDGER_NATS_URL"],
                        nats_user=client.get("EFFECTLEDGER_NATS_USER"),
                        nats_password=client.get("EFFECTLEDGER_NATS_PASSWORD"),
                        stream_replicas=nats.replicas,
                        ack_wait_s=float(env["EFFECTLEDGER_ACK_WAIT_S"]))
    wanted = topology(settings)
    # A new cluster elects its JetStream leader first; apply waits for it. The client's own
    # connect/disconnect warnings would only be noise on the terminal here.
    logging.getLogger("effectledger_bus.connect").setLevel(logging.ERROR)
    if nats.clustered:
        print(f"nats: {len(nats.client_ports)} nodes started; applying the streams once "
              "JetStream has elected its leader...", flush=True)
    try:
        asyncio.run(asyncio.wait_for(apply(settings, wanted), 120))
    except TimeoutError:
        raise Refused("effectledger up: JetStream did not accept the streams within 120s; "
                      f"see the nats logs in {p.logs}",
                      code=1) from None
    return ", ".join(f"{s.name} ({s.num_replicas} replicas)" for s in wanted.streams)


def _up_settings(p: UpPlan) -> dict[str, str]:
    """This run's settings, over the user's; each child takes those its role reads."""
    return {
        "EFFECTLEDGER_DATABASE_URL": p.database_url,
        "EFFECTLEDGER_CATALOG_PATH": str(p.catalog_path),
        # Short enough that the embedded demo recovers from a killed dispatcher quickly.
        "EFFECTLEDGER_ACK_WAIT_S": os.environ.get("EFFECTLEDGER_ACK_WAIT_S", "30"),
        # The streams were applied before any service: as in a deployment, services only
        # check them (and wait, should one disappear, for the apply step to be run again).
        "EFFECTLEDGER_STREAMS_CREATE_MISSING": "false",
    }


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
    raise procs["ledger"].failure(f"did not become ready at {url} within 60s")


def _check_alive(procs: dict[str, Child]) -> None:
    for child in procs.values():
        code = child.proc.poll()
        if code is not None:
            raise child.failure(f"exited with {code}")


def _demo(url: str, n: int, token: str | None) -> int:
    tools = ["create_ticket", "send_email", "charge_card", "post_message", "page_oncall"]
    ids = []
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url, timeout=10, headers=headers) as http:
        for i in range(n):
            tool = tools[i % len(tools)]
            args = _demo_arguments(tool, i)
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
    return 0 if summary == {State.SUCCEEDED.value: n} else 1


def _demo_arguments(tool: str, i: int) -> dict[str, Any]:
    """Arguments that fit each demo tool's input schema (demo_catalog.toml)."""
    by_tool: dict[str, dict[str, Any]] = {
        "charge_card": {"amount": 100 + i, "currency": "EUR"},
        "send_email": {"to": "demo@example.com", "subject": f"demo {i}", "body": "hello"},
        "post_message": {"channel": "#demo", "text": f"demo {i}"},
        "page_oncall": {"summary": f"demo {i}", "severity": "high"},
    }
    return by_tool.get(tool, {"title": f"demo {i}"})


def _stop_all(procs: dict[str, Child]) -> None:
    """Services first (so they stop consuming and publish nothing half-way), the broker last
    (so their last log lines are not reconnect noise)."""
    StopSignals.ignore()
    for roles, timeout_s in STOP_STAGES:
        stage = [c for name, c in procs.items() if name.split("-")[0] in roles]
        if stage:
            children.stop(stage, timeout_s)
