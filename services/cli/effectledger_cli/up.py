"""`effectledger up`: the whole pipeline on the embedded default, in one command.

An embedded nats-server (JetStream under the data folder), the ledger on SQLite (or
`--database-url`), a dispatcher, the reconciler, the sandbox provider and the demo catalog, each a
child process. Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .embedded import free_port, start_nats, wait_for_port

AT_REST = {"succeeded", "failed", "cancelled", "needs_review"}


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
    try:
        procs["nats"] = start_nats(data / "jetstream", nats_port, log_file=logs / "nats.log")
        env = dict(os.environ)
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
        procs["ledger"] = _spawn("ledger", ["ledger"], env, logs)
        wait_for_port("127.0.0.1", args.ledger_port, 60, procs["ledger"])
        procs["dispatcher"] = _spawn("dispatcher", ["dispatcher", "--id", "dispatcher-1"], env,
                                     logs)
        procs["reconciler"] = _spawn("reconciler", ["reconciler", "--id", "reconciler-1"], env,
                                     logs)
        wait_for_port("127.0.0.1", args.reconciler_port, 60, procs["reconciler"])
        ledger_url = f"http://127.0.0.1:{args.ledger_port}"
        _wait_ready(ledger_url, procs)
        print(f"ledger: {ledger_url}")
        print(f"sandbox: http://127.0.0.1:{args.sandbox_port}")
        print(f"nats: nats://127.0.0.1:{nats_port}")
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
