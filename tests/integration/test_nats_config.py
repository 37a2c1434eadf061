"""`effectledger nats-config`: the shipped `infra/nats/permissions.conf` is its output for the
defaults, and a nats-server started from it (passwords from its environment) admits each user
with its own password and nobody else."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import nats
import pytest

from effectledger_cli.embedded import free_port, nats_server_binary, wait_for_port
from effectledger_cli.main import build_parser
from effectledger_cli.nats_config import render

SHIPPED = Path(__file__).resolve().parents[2] / "infra" / "nats" / "permissions.conf"


def _render(*argv: str) -> str:
    return render(build_parser().parse_args(["nats-config", *argv]))


def test_the_shipped_permissions_are_the_generators_output() -> None:
    assert SHIPPED.read_text() == _render(), (
        "infra/nats/permissions.conf is stale: effectledger nats-config > "
        "infra/nats/permissions.conf")


async def test_nats_server_admits_each_user_with_the_password_from_its_environment(
        tmp_path: Path) -> None:
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(_render("--listen", f"127.0.0.1:{port}", "--store-dir",
                            str(tmp_path / "js"), "--tenant", "acme"))
    env = {**os.environ, "NATS_LEDGER_PASSWORD": "pw-ledger",
           "NATS_DISPATCHER_PASSWORD": "pw-d", "NATS_RECONCILER_PASSWORD": "pw-r",
           "NATS_AGENT_ACME_PASSWORD": "pw-acme", "NATS_OPERATOR_PASSWORD": "pw-op",
           "NATS_STREAMS_PASSWORD": "pw-s"}
    proc = _start(conf, env)
    try:
        wait_for_port("127.0.0.1", port, 15, proc)
        url = f"nats://127.0.0.1:{port}"
        nc = await nats.connect(url, user="agent-acme", password="pw-acme",
                                allow_reconnect=False)
        await nc.close()
        for user, password in (("agent-acme", "pw-ledger"), (None, None)):
            with pytest.raises((nats.errors.NoServersError, nats.errors.Error)):
                await nats.connect(url, user=user, password=password, allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=3)
    finally:
        proc.terminate()
        proc.wait(10)


def _start(conf: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([nats_server_binary(), "-c", str(conf)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_tls_options_are_checked_and_rendered() -> None:
    text = _render("--listen", "0.0.0.0:4222", "--tls-cert", "/tls/c.pem", "--tls-key",
                   "/tls/k.pem", "--tls-ca", "/tls/ca.pem", "--tls-verify")
    assert 'cert_file: "/tls/c.pem"' in text and "verify: true" in text
    with pytest.raises(SystemExit, match="needs --tls-ca"):
        _render("--listen", "0.0.0.0:4222", "--tls-cert", "c", "--tls-key", "k",
                "--tls-verify")
    with pytest.raises(SystemExit, match="needs --listen"):
        _render("--tls-cert", "c", "--tls-key", "k")
