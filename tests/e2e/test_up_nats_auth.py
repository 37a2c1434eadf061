"""`effectledger up` is secure on NATS without any configuration: it generates a user per
process, starts nats-server with their permissions, gives each child only its own credentials
and prints where an agent's are; an agent submits with them, an anonymous client cannot
connect."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from effectledger_bus.permissions import inbox_prefix
from effectledger_cli.embedded import free_port
from tests.support.cluster import DEFAULT_CATALOG_TEMPLATE, SANDBOX_URL_TOKEN, wait_until


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    sandbox_port = free_port()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(DEFAULT_CATALOG_TEMPLATE.read_text().replace(
        SANDBOX_URL_TOKEN, f"http://127.0.0.1:{sandbox_port}"))
    out = tmp_path / "up.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env["EFFECTLEDGER_NATS_PASSWORD"] = "from-the-users-shell"  # must reach no child
    # `up --catalog` without `--demo` starts no sandbox: this test runs the catalog's own,
    # with the provider key `up` hands to its dispatcher and reconciler.
    env["EFFECTLEDGER_SANDBOX_API_KEY"] = "sk_sandbox_up_nats_auth"
    sandbox = subprocess.Popen(
        [sys.executable, "-m", "effectledger_cli", "sandbox", "--port", str(sandbox_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "effectledger_cli", "up", "--data-dir", str(tmp_path / "d"),
             "--catalog", str(catalog), "--sandbox-port", str(sandbox_port),
             "--ledger-port", str(free_port()), "--reconciler-port", str(free_port()),
             "--nats-port", str(free_port())],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        yield proc, out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        sandbox.terminate()
        sandbox.wait(30)


def _printed(out: Path, label: str) -> str | None:
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith(label):
            return line.split(": ", 1)[1]
    return None


async def test_up_runs_nats_with_a_user_per_process_and_prints_the_agents_credentials(
        up: tuple[subprocess.Popen[bytes], Path]) -> None:
    """Anonymous clients are refused; the printed agent credentials (mode 0600) submit an
    intent on the agent's tenant subject and it succeeds; the ledger's environment holds its
    own NATS user and none of the provider's or the user's secrets."""
    proc, out = up

    def ready() -> str | None:
        assert proc.poll() is None, out.read_text()
        return _printed(out, "try")

    await wait_until(ready, 120, interval=0.2, what="effectledger up to be ready")
    creds_path = Path(_printed(out, "agent credentials (tenant default, NATS)") or "")
    ledger_url = _printed(out, "ledger") or ""
    mode, creds = _read_private(creds_path)
    assert mode == 0o600

    with pytest.raises((nats.errors.NoServersError, nats.errors.Error)):
        await nats.connect(creds["url"], allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=5)
    nc = await nats.connect(creds["url"], user=creds["user"], password=creds["password"],
                            inbox_prefix=inbox_prefix(creds["user"]).encode(),
                            allow_reconnect=False)
    try:
        msg = await nc.request(creds["intents_subject"], json.dumps(
            {"tool": "create_ticket", "arguments": {"title": "up"}}).encode(), timeout=30)
    finally:
        await nc.close()
    reply = json.loads(msg.data)
    assert reply["ok"] is True, reply

    # The HTTP API needs a token too: the agent's, which `up` wrote beside its credentials.
    token = _read_token(Path(_printed(out, "agent token (API, tenant default)") or ""))
    async with httpx.AsyncClient(base_url=ledger_url, timeout=10,
                                 headers={"Authorization": f"Bearer {token}"}) as http:
        async def succeeded() -> bool:
            resp = await http.get(f"/v1/operations/{reply['operation']['id']}")
            return bool(resp.json()["state"] == "succeeded")

        await wait_until(succeeded, 60, interval=0.2, what="the agent's intent to succeed")

    environ = _environ(_child_pid(proc.pid, "ledger"))
    assert environ["EFFECTLEDGER_NATS_USER"] == "ledger"
    assert environ["EFFECTLEDGER_NATS_PASSWORD"] != "from-the-users-shell"


def _read_token(path: Path) -> str:
    return path.read_text().strip()


def _read_private(path: Path) -> tuple[int, dict[str, str]]:
    return path.stat().st_mode & 0o777, json.loads(path.read_text())


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_text().split("\0")
    return dict(item.split("=", 1) for item in raw if "=" in item)


def _child_pid(parent: int, service: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and service.encode() in cmd:
            return int(entry.name)
    raise AssertionError(f"no {service} child of {parent}")
