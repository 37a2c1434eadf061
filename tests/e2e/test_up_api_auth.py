"""`effectledger up` is secure on its HTTP API without configuration: it makes an operator
token and an agent token for its tenant (files 0600 beside the NATS credentials), gives them
to its ledger only, and the CLI and the Python client find them. A new user's `up` then
`submit` works with no token given; `curl` without one gets 401; another tenant's submission
and an approval without the operator token are refused. An open API is an explicit unsafe
switch that says so.

Each test runs its own `up` (its own nats-server) on free ports in its own folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from effectledger_cli.embedded import free_port
from effectledger_client import Client
from tests.support.upproc import lines_until, stop_and_check, up_ports

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "effectledger_cli"]
# Arguments that fit the demo catalog's `wire_funds` schema.
WIRE = {"currency": "EUR", "to_account": "DE89370400440532013000"}


def _clean_env(**extra: str) -> dict[str, str]:
    """A new user's shell: no effectledger setting, no token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    return {**env, **extra}


def _up(cwd: Path, ports: dict[str, int], *extra: str) -> list[str]:
    # No --data-dir: `up`'s default (./effectledger-data), as a new user runs it.
    return [*CLI, "up", "--nats-port", str(ports["nats"]), "--ledger-port",
            str(ports["ledger"]), "--sandbox-port", str(ports["sandbox"]),
            "--reconciler-port", str(ports["reconciler"]), *extra]


def test_a_new_user_submits_with_no_token_given_and_a_tokenless_request_gets_401(
        tmp_path: Path, running_up: list[subprocess.Popen[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ports = up_ports()
    url = f"http://127.0.0.1:{ports['ledger']}"
    proc = subprocess.Popen(_up(tmp_path, ports), cwd=tmp_path, env=_clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running_up.append(proc)
    lines = lines_until(proc, "try:", 120)
    data = tmp_path / "effectledger-data"
    operator_file = data / "nats-auth" / "api-operator.token"
    agent_file = data / "nats-auth" / "api-agent-default.token"
    assert f"agent token (API, tenant default): {agent_file}" in lines, lines
    assert any(line.startswith("operator token (API") and line.endswith(str(operator_file))
               for line in lines), lines
    for f in (operator_file, agent_file):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert lines[-1].endswith(f"--ledger-url {url}"), lines  # no --data-dir: the default

    # The CLI, run where `up` was run, with no token anywhere: it finds the agent token.
    submitted = subprocess.run(
        [*CLI, "submit", "create_ticket", "--args", '{"title": "hello"}', "--wait", "20",
         "--ledger-url", url], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
        timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    assert json.loads(submitted.stdout)["state"] == "succeeded"

    # Without a token: 401, with curl as a user would try it.
    if shutil.which("curl"):
        curl = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                               f"{url}/v1/operations"], capture_output=True, text=True,
                              timeout=30)
        assert curl.stdout == "401", curl
    assert httpx.post(f"{url}/v1/intents", json={"tool": "create_ticket", "arguments": {}},
                      timeout=10).status_code == 401
    ready = httpx.get(f"{url}/readyz", timeout=10).json()
    assert ready["auth"] == "enabled" and ready["warnings"] == []

    # The Python client, told only where the data folder is.
    monkeypatch.setenv("EFFECTLEDGER_DATA_DIR", str(data))
    monkeypatch.delenv("EFFECTLEDGER_TOKEN", raising=False)
    with Client(url) as client:
        assert client.submit("create_ticket", {"title": "py"}, wait_s=20).operation.state == \
            "succeeded"
    stop_and_check(proc, signal.SIGTERM, list(ports.values()))


def test_under_up_defaults_another_tenants_submission_and_a_tokenless_approval_are_refused(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    """The issue's attack: `wire_funds` for tenant "victim", approved as "alice", over HTTP.
    On the old `up` the API was open and both went through (applied at the provider)."""
    ports = up_ports()
    url = f"http://127.0.0.1:{ports['ledger']}"
    proc = subprocess.Popen(_up(tmp_path, ports), cwd=tmp_path, env=_clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running_up.append(proc)
    lines_until(proc, "try:", 120)
    wire = {"tool": "wire_funds", "arguments": {**WIRE, "amount": 5000, "reference": "attack"},
            "tenant": "victim", "idempotency_key": "attack-1"}
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/intents", json=wire).status_code == 401  # 201 on the old `up`
        auth = tmp_path / "effectledger-data" / "nats-auth"
        agent = {"Authorization":
                 f"Bearer {(auth / 'api-agent-default.token').read_text().strip()}"}
        assert http.post("/v1/intents", json=wire, headers=agent).status_code == 403
        assert http.post("/v1/intents", json={**wire, "tenant": "victim", "operator": "alice"}
                         ).status_code == 401
        # The agent's own wire waits for an operator; neither no token nor the agent's may
        # approve it.
        own = http.post("/v1/intents", headers=agent, json={
            "tool": "wire_funds", "arguments": {**WIRE, "amount": 7, "reference": "own"},
            "idempotency_key": "own-1"})
        assert own.status_code == 201, own.text
        op_id = own.json()["id"]
        assert own.json()["state"] == "awaiting_approval"
        approve = {"operator": "alice", "epoch": own.json()["epoch"],
                   "arguments_digest": own.json()["arguments_digest"]}
        assert http.post(f"/v1/operations/{op_id}/approve", json=approve).status_code == 401
        assert http.post(f"/v1/operations/{op_id}/approve", json=approve,
                         headers=agent).status_code == 403
        assert http.get(f"/v1/operations/{op_id}", headers=agent).json()["state"] == \
            "awaiting_approval"
        operator = {"Authorization":
                    f"Bearer {(auth / 'api-operator.token').read_text().strip()}"}
        everything = http.get("/v1/operations", headers=operator).json()["items"]
    assert [op["id"] for op in everything] == [op_id], everything  # nothing for "victim"
    # The operator, with no token given, from where `up` runs: the CLI finds the operator's.
    approved = subprocess.run([*CLI, "approve", op_id, "--ledger-url", url], cwd=tmp_path,
                              env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert approved.returncode == 0, approved.stderr
    assert json.loads(approved.stdout)["state"] != "awaiting_approval"
    stop_and_check(proc, signal.SIGTERM, list(ports.values()))


def test_an_open_api_is_an_explicit_unsafe_switch_that_says_so(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    ports = up_ports()
    url = f"http://127.0.0.1:{ports['ledger']}"
    proc = subprocess.Popen(_up(tmp_path, ports, "--unsafe-open-api"), cwd=tmp_path,
                            env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    running_up.append(proc)
    lines = lines_until(proc, "try:", 120)
    assert any(line.startswith("api: UNSAFE (--unsafe-open-api)") for line in lines), lines
    assert not (tmp_path / "effectledger-data" / "nats-auth" / "api-operator.token").exists()
    ready = httpx.get(f"{url}/readyz", timeout=10).json()
    assert ready["auth"] == "disabled"
    assert ready["warnings"] and ready["warnings"][0].startswith("UNSAFE: the API is open")
    assert httpx.post(f"{url}/v1/intents",
                      json={"tool": "create_ticket", "arguments": {"title": "open"}},
                      timeout=10).status_code == 201
    stop_and_check(proc, signal.SIGTERM, list(ports.values()))
    assert "UNSAFE: EFFECTLEDGER_UNSAFE_OPEN_API" in (proc.stderr.read() if proc.stderr else "")


def test_the_mcp_http_transport_needs_a_token_on_loopback_too(tmp_path: Path) -> None:
    """In front of a ledger that runs without tokens, `mcp --http` refuses to serve even on
    loopback (whoever reaches it would act for the ledger) unless switched open on purpose."""
    import http.server
    import threading

    class OpenLedger(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # an open ledger answers /v1/tools without a token
            body = b'{"tools": []}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            return None

    ledger = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OpenLedger)
    threading.Thread(target=ledger.serve_forever, daemon=True).start()
    try:
        port = free_port()
        done = subprocess.run([*CLI, "mcp", "--http", f"127.0.0.1:{port}", "--ledger-url",
                               f"http://127.0.0.1:{ledger.server_address[1]}"],
                              env=_clean_env(), capture_output=True, text=True, timeout=60)
    finally:
        ledger.shutdown()
    assert done.returncode == 2, done.stderr
    assert "runs without tokens" in done.stderr and "--unsafe-open-http" in done.stderr


