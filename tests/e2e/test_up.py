"""`effectledger up` as a real process: stop signals, taken ports, bad catalogs.

Each test runs `up` on free ports with its own data folder; `up` starts its own nats-server
from the wheel, so nothing here touches the machine's shared servers.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from effectledger_cli.embedded import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> dict[str, int]:
    return {name: free_port() for name in ("nats", "ledger", "sandbox", "reconciler")}


def _up_args(tmp_path: Path, ports: dict[str, int], *extra: str) -> list[str]:
    return [sys.executable, "-m", "effectledger_cli", "up", "--data-dir", str(tmp_path / "data"),
            "--nats-port", str(ports["nats"]), "--ledger-port", str(ports["ledger"]),
            "--sandbox-port", str(ports["sandbox"]),
            "--reconciler-port", str(ports["reconciler"]), *extra]


def _lines_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    """stdout lines of `proc` up to the first that starts with `marker`."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            continue
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith(marker):
            return lines
    stderr = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
    raise AssertionError(f"`up` printed no {marker!r} line; got {lines}; stderr: {stderr}")


@pytest.fixture
def running_up(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:  # a failed test must not leave a stack behind
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def _stop_and_check(proc: subprocess.Popen[str], sig: signal.Signals, ports: list[int]) -> None:
    kids = psutil.Process(proc.pid).children(recursive=True)
    assert len(kids) >= 4, [k.cmdline() for k in kids]
    start = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=10)
    _, alive = psutil.wait_procs(kids, timeout=max(0.0, 10 - (time.monotonic() - start)))
    assert not alive, [p.pid for p in alive]
    while not all(_bindable(p) for p in ports):
        assert time.monotonic() - start < 10, [p for p in ports if not _bindable(p)]
        time.sleep(0.05)  # polling the ports until free, within the 10 s bound
    assert proc.returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_leaves_no_process_and_frees_every_port_within_10s(
        tmp_path: Path, running_up: list[subprocess.Popen[str]], sig: signal.Signals) -> None:
    ports = _ports()
    # --demo 2 on a sandbox port other than 8700 proves the demo catalog follows the sandbox.
    proc = subprocess.Popen(_up_args(tmp_path, ports, "--demo", "2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    running_up.append(proc)
    lines = _lines_until(proc, "demo:", 120)
    assert lines[-1] == 'demo: {"succeeded": 2}', lines
    cmdlines = [" ".join(k.cmdline()) for k in psutil.Process(proc.pid).children(recursive=True)]
    assert not [c for c in cmdlines if "whsec_" in c or "sk_sandbox" in c], cmdlines
    _stop_and_check(proc, sig, list(ports.values()))


def test_sigint_to_up_alone_stops_everything_and_a_custom_catalog_starts_no_sandbox(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    """A script without job control sends SIGINT to `up` only: its children, each in its own
    process group, must still all stop."""
    ports = _ports()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text((REPO / "tests/e2e/catalog.toml").read_text().replace(
        "@SANDBOX_URL@", f"http://127.0.0.1:{ports['sandbox']}"))
    proc = subprocess.Popen(_up_args(tmp_path, ports, "--catalog", str(catalog)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running_up.append(proc)
    lines = _lines_until(proc, "try:", 120)
    assert not [line for line in lines if line.startswith("sandbox:")], lines
    cmdlines = [" ".join(k.cmdline()) for k in psutil.Process(proc.pid).children(recursive=True)]
    assert not [c for c in cmdlines if " sandbox" in c], cmdlines
    assert _bindable(ports["sandbox"])
    _stop_and_check(proc, signal.SIGINT, list(ports.values()))


def test_a_second_up_on_a_taken_port_exits_non_zero_within_2s_naming_the_port(
        tmp_path: Path) -> None:
    ports = _ports()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports["ledger"]))
        holder.listen()
        start = time.monotonic()
        done = subprocess.run(_up_args(tmp_path, ports), capture_output=True, text=True,
                              timeout=30)
        elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert elapsed < 2.0, f"took {elapsed:.2f}s"
    line = done.stderr.strip()
    assert f"port {ports['ledger']} (ledger) is in use by pid {os.getpid()}" in line, line
    assert "--ledger-port" in line and "\n" not in line
    assert not (tmp_path / "data" / "logs").exists()  # nothing was started


def test_a_bad_catalog_exits_non_zero_naming_the_tool_and_the_field(tmp_path: Path) -> None:
    ports = _ports()
    catalog = tmp_path / "bad.toml"
    catalog.write_text('[tools.refund_order]\nendpoint = "ftp://example.com/refund"\n'
                       'contract_revision = "1"\n')
    done = subprocess.run(_up_args(tmp_path, ports, "--catalog", str(catalog)),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "tool 'refund_order', field 'endpoint'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert _bindable(ports["nats"])  # refused before anything started
