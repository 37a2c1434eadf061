"""`effectledger up` at start: ports checked distinct before anything starts, each catalog
provider's webhook URL and every child's metrics endpoint printed, and a data folder that
only its owner can read.

Each test runs its own `up` (its own nats-server from the wheel) on free ports; nothing here
touches the machine's shared servers.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from effectledger_cli.embedded import free_port
from tests.support.upproc import bindable, lines_until, stop_and_check, up_args, up_ports

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_one_port_given_to_two_roles_is_refused_naming_both_and_nothing_starts(
        tmp_path: Path) -> None:
    ports = up_ports()
    ports["reconciler"] = ports["ledger"]
    done = subprocess.run(up_args(tmp_path, ports), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done
    line = done.stderr.strip()
    assert line == (f"effectledger up: port {ports['ledger']} is given to both ledger "
                    f"(--ledger-port) and reconciler webhooks (--reconciler-port); give each "
                    "its own port"), line
    assert not (tmp_path / "data" / "logs").exists()
    assert all(bindable(p) for p in ports.values())


def test_a_dispatcher_metrics_port_on_a_ledger_port_is_refused(tmp_path: Path) -> None:
    ports = up_ports()
    done = subprocess.run(up_args(tmp_path, ports, "--ledgers", "2", "--database-url",
                                  "postgresql+asyncpg://127.0.0.1/test", "--metrics-port",
                                  str(ports["ledger"] + 1)),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "is given to both ledger 2 (--ledger-port) and dispatcher metrics" in done.stderr


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_up_prints_each_providers_webhook_url_and_every_childs_metrics_and_keeps_its_files_private(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    ports = up_ports()
    data = tmp_path / "data"
    # Left readable by an earlier run (or an older `up`): locked down at the next start.
    data.mkdir(mode=0o755)
    (data / "logs").mkdir(mode=0o755)
    (data / "logs" / "ledger.log").write_text("an old line\n")
    os.chmod(data / "logs" / "ledger.log", 0o644)
    (data / "notes.txt").write_text("the user's own file: not `up`'s to change\n")
    os.chmod(data / "notes.txt", 0o644)
    def whsec() -> str:
        return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()

    env = {**os.environ, "PROVIDER_BASE": "http://127.0.0.1:9", "STRIPE_WHSEC": whsec(),
           "STRIPE_WHSEC_OLD": whsec(), "GITHUB_WHSEC": "gh-secret", "SVIX_WHSEC": whsec(),
           "EFFECTLEDGER_WEBHOOK_SECRETS": json.dumps({"acme": [whsec()]})}
    catalog = tmp_path / "catalog.toml"
    catalog.write_text((REPO / "tests/e2e/catalog_providers.toml").read_text().replace(
        "@SANDBOX_URL@", "http://127.0.0.1:9"))
    proc = subprocess.Popen(
        up_args(tmp_path, ports, "--catalog", str(catalog)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=env)
    running_up.append(proc)
    lines = lines_until(proc, "try:", 120)
    reconciler = f"http://127.0.0.1:{ports['reconciler']}/v1/webhooks"
    hooks = [line for line in lines if line.startswith("webhooks")]
    # The catalog's providers and the one in EFFECTLEDGER_WEBHOOK_SECRETS; no sandbox runs,
    # so no sandbox URL (the old `up` printed only the sandbox's).
    assert hooks == [f"webhooks ({p}): {reconciler}/{p}"
                     for p in ("acme", "github", "stripe", "svix")], lines
    metrics = dict(line.removeprefix("metrics (").split("): ", 1) for line in lines
                   if line.startswith("metrics ("))
    assert set(metrics) == {"ledger", "dispatcher", "reconciler", "nats"}, lines
    for name, url in metrics.items():
        resp = httpx.get(url, timeout=5)
        assert resp.status_code == 200, (name, url, resp.status_code)
    assert "process_cpu_seconds_total" in httpx.get(metrics["dispatcher"], timeout=5).text

    assert _mode(data) == 0o700
    for path in [data / "ledger.db", *data.glob("ledger.db-*"), *(data / "logs").iterdir(),
                 *(data / "nats-auth").iterdir()]:
        assert _mode(path) == 0o600, path
    assert (data / "ledger.db-wal").exists()  # the WAL is checked, not assumed away
    for folder in [data / "logs", data / "nats-auth", data / "jetstream"]:
        assert _mode(folder) == 0o700, folder
    for root, dirs, names in os.walk(data / "jetstream"):
        assert all(_mode(Path(root, n)) == 0o600 for n in names), root
        assert all(_mode(Path(root, d)) == 0o700 for d in dirs), root
    assert _mode(data / "notes.txt") == 0o644
    stop_and_check(proc, signal.SIGINT, list(ports.values()))


def test_under_up_each_dispatcher_serves_metrics_on_consecutive_ports(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    ports = up_ports()
    first = free_port()
    while not bindable(first + 1):
        first = free_port()
    proc = subprocess.Popen(up_args(tmp_path, ports, "--dispatchers", "2", "--metrics-port",
                                    str(first)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running_up.append(proc)
    lines = lines_until(proc, "try:", 120)
    assert f"metrics (dispatcher): http://127.0.0.1:{first}/metrics" in lines, lines
    assert f"metrics (dispatcher-2): http://127.0.0.1:{first + 1}/metrics" in lines, lines
    assert f"metrics (sandbox): http://127.0.0.1:{ports['sandbox']}/metrics" in lines, lines
    for port in (first, first + 1, ports["sandbox"]):
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    stop_and_check(proc, signal.SIGTERM, [*ports.values(), first, first + 1])


if sys.platform != "linux":  # pragma: no cover - the modes above are POSIX's
    pytestmark = [pytestmark, pytest.mark.skip(reason="POSIX file modes")]
