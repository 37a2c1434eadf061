"""`effectledger up`: the whole pipeline on the embedded default, in one command.

An embedded nats-server (JetStream under the data folder), the ledger on SQLite (or
`--database-url`), a dispatcher, the reconciler, the sandbox provider and the demo catalog, each a
child process. Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from effectledger_bus.permissions import Role, user_name
from effectledger_core.unsafe import NATS_WITHOUT_PERMISSIONS, check

from . import nats_auth
from .embedded import free_port, start_nats, wait_for_port

AT_REST = {"succeeded", "failed", "cancelled", "needs_review"}
DISPATCHER_ID, RECONCILER_ID, TENANT = "dispatcher-1", "reconciler-1", "default"
# Each child gets its own NATS user and password (nats_auth.child_env), never another's.
NATS_CREDENTIALS = ("EFFECTLEDGER_NATS_USER", "EFFECTLEDGER_NATS_PASSWORD",
                    "EFFECTLEDGER_NATS_TOKEN", "EFFECTLEDGER_NATS_CREDS_FILE")


def _spawn(name: str, args: list[str], env: dict[str, str], log_dir: Path
           ) -> subprocess.Popen[bytes]:
    log = open(log_dir / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "effectledger_cli", *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def run_up(args: argparse.Namespace) -> int:
    data = Path(args.data_dir).resolve()
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    nats_port = args.nats_port or free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    log = logging.getLogger("effectledger.up")
    open_nats = check(NATS_WITHOUT_PERMISSIONS, os.environ, log)
    try:
        from effectledger_core.config import Settings

        subjects = Settings().subjects  # the prefixes the children will read from the env
        auth = nats_auth.for_up(data, subjects, port=nats_port, dispatchers=[DISPATCHER_ID],
                                reconcilers=[RECONCILER_ID], tenants=[TENANT])
        if open_nats:
            procs["nats"] = start_nats(data / "jetstream", nats_port, log_file=logs / "nats.log")
        else:
            procs["nats"] = nats_auth.start(auth, nats_port, log_file=logs / "nats.log")
        env = {k: v for k, v in os.environ.items() if k not in NATS_CREDENTIALS}

        def creds(user: str) -> dict[str, str]:
            return {**env, **auth.child_env(user)}

        env.update({
            "EFFECTLEDGER_NATS_URL": f"nats://127.0.0.1:{nats_port}",
            "EFFECTLEDGER_DATABASE_URL": args.database_url or os.environ.get(
                "EFFECTLEDGER_DATABASE_URL", f"sqlite+aiosqlite:///{data / 'ledger.db'}"),
            "EFFECTLEDGER_LEDGER_PORT": str(args.ledger_port),
            # Only the dispatcher and the sandbox see the provider key; it is made per run.
            "EFFECTLEDGER_SANDBOX_API_KEY": env.get("EFFECTLEDGER_SANDBOX_API_KEY")
            or "sk_sandbox_" + secrets.token_hex(12),
            # Short enough that the embedded demo recovers from a killed dispatcher quickly.
            "EFFECTLEDGER_ACK_WAIT_S": env.get("EFFECTLEDGER_ACK_WAIT_S", "30"),
        })
        if args.catalog_path:
            env["EFFECTLEDGER_CATALOG_PATH"] = str(Path(args.catalog_path).resolve())
        # One webhook signing secret per run, shared by the sandbox (signs) and the
        # reconciler (verifies); the reconciler also reads back, so it holds the provider key.
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        webhook_url = f"http://127.0.0.1:{args.reconciler_port}/v1/webhooks/sandbox"
        env["EFFECTLEDGER_WEBHOOK_SECRETS"] = json.dumps({"sandbox": [secret]})
        env["EFFECTLEDGER_RECONCILER_PORT"] = str(args.reconciler_port)
        procs["sandbox"] = _spawn("sandbox", [
            "sandbox", "--port", str(args.sandbox_port), "--webhook-url", webhook_url,
            "--webhook-secret", secret, "--webhook-routes", "plainhooks"], env, logs)
        wait_for_port("127.0.0.1", args.sandbox_port, 30, procs["sandbox"])
        procs["ledger"] = _spawn("ledger", ["ledger"], creds("ledger"), logs)
        wait_for_port("127.0.0.1", args.ledger_port, 60, procs["ledger"])
        dispatcher_user = user_name(Role.DISPATCHER, DISPATCHER_ID)
        reconciler_user = user_name(Role.RECONCILER, RECONCILER_ID)
        procs["dispatcher"] = _spawn("dispatcher", ["dispatcher", "--id", DISPATCHER_ID],
                                     creds(dispatcher_user), logs)
        procs["reconciler"] = _spawn("reconciler", ["reconciler", "--id", RECONCILER_ID],
                                     creds(reconciler_user), logs)
        wait_for_port("127.0.0.1", args.reconciler_port, 60, procs["reconciler"])
        ledger_url = f"http://127.0.0.1:{args.ledger_port}"
        _wait_ready(ledger_url, procs)
        print(f"ledger: {ledger_url}")
        print(f"sandbox: http://127.0.0.1:{args.sandbox_port}")
        print(f"nats: nats://127.0.0.1:{nats_port}"
              + (" (UNSAFE: no users or permissions)" if open_nats else ""))
        print(f"agent credentials (tenant {TENANT}, NATS): "
              f"{auth.credential_file(f'agent-{TENANT}')}")
        print(f"operator credentials (NATS): {auth.credential_file('operator')}")
        print(f"webhooks: {webhook_url}")
        print(f"logs: {logs}")
        print("try: effectledger submit create_ticket --args '{\"title\": \"hello\"}' --wait 5")
        sys.stdout.flush()
        if args.demo:
            code = _demo(ledger_url, args.demo)
            if args.exit_after_demo:
                return code
        return _supervise(procs)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_all(procs)


def _wait_ready(url: str, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise SystemExit(f"effectledger up: {name} exited with {p.returncode}; "
                                 f"see its log")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # polling the readiness endpoint
    raise SystemExit("effectledger up: the ledger did not become ready within 60s")


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


def _supervise(procs: dict[str, subprocess.Popen[bytes]]) -> int:
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                print(f"effectledger up: {name} exited with {p.returncode}; stopping",
                      file=sys.stderr)
                return 1
        time.sleep(0.5)  # supervision period


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    # Services first (so they stop consuming), the broker last.
    order = [n for n in ("dispatcher", "reconciler", "ledger", "sandbox", "nats") if n in procs]
    for name in order:
        p = procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
