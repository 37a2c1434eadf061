"""`effectledger up` as a real process: stop signals, taken ports, bad catalogs.

Each test runs `up` on free ports with its own data folder; `up` starts its own nats-server
from the wheel, so nothing here touches the machine's shared servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.upproc import bindable, lines_until, stop_and_check, up_args, up_ports

# Stop signals must free every port within seconds: not beside a chaos run or a benchmark.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("heavy")]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_leaves_no_process_and_frees_every_port_within_10s(
        tmp_path: Path, running_up: list[subprocess.Popen[str]], sig: signal.Signals) -> None:
    ports = up_ports()
    # --demo 2 on a sandbox port other than 8700 proves the demo catalog follows the sandbox.
    proc = subprocess.Popen(up_args(tmp_path, ports, "--demo", "2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    running_up.append(proc)
    lines = lines_until(proc, "demo:", 120)
    assert lines[-1] == 'demo: {"succeeded": 2}', lines
    cmdlines = [" ".join(k.cmdline()) for k in psutil.Process(proc.pid).children(recursive=True)]
    assert not [c for c in cmdlines if "whsec_" in c or "sk_sandbox" in c], cmdlines
    stop_and_check(proc, sig, list(ports.values()))


def test_sigint_to_up_alone_stops_everything_and_a_custom_catalog_starts_no_sandbox(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    """A script without job control sends SIGINT to `up` only: its children, each in its own
    process group, must still all stop."""
    ports = up_ports()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text((REPO / "tests/e2e/catalog.toml").read_text().replace(
        "@SANDBOX_URL@", f"http://127.0.0.1:{ports['sandbox']}"))
    proc = subprocess.Popen(up_args(tmp_path, ports, "--catalog", str(catalog)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running_up.append(proc)
    lines = lines_until(proc, "try:", 120)
    assert not [line for line in lines if line.startswith("sandbox:")], lines
    cmdlines = [" ".join(k.cmdline()) for k in psutil.Process(proc.pid).children(recursive=True)]
    assert not [c for c in cmdlines if " sandbox" in c], cmdlines
    assert bindable(ports["sandbox"])
    stop_and_check(proc, signal.SIGINT, list(ports.values()))


def test_a_second_up_on_a_taken_port_exits_non_zero_within_2s_naming_the_port(
        tmp_path: Path) -> None:
    ports = up_ports()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports["ledger"]))
        holder.listen()
        start = time.monotonic()
        done = subprocess.run(up_args(tmp_path, ports), capture_output=True, text=True,
                              timeout=30)
        elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert elapsed < 2.0, f"took {elapsed:.2f}s"
    line = done.stderr.strip()
    assert f"port {ports['ledger']} (ledger) is in use by pid {os.getpid()}" in line, line
    assert "--ledger-port" in line and "\n" not in line
    assert not (tmp_path / "data" / "logs").exists()  # nothing was started


def test_a_bad_catalog_exits_non_zero_naming_the_tool_and_the_field(tmp_path: Path) -> None:
    ports = up_ports()
    catalog = tmp_path / "bad.toml"
    catalog.write_text('[tools.refund_order]\nendpoint = "ftp://example.com/refund"\n'
                       'contract_revision = "1"\n')
    done = subprocess.run(up_args(tmp_path, ports, "--catalog", str(catalog)),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "tool 'refund_order', field 'endpoint'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert bindable(ports["nats"])  # refused before anything started


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_killed_up_takes_its_children_with_it(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    """SIGKILL cannot be handled: the children are told by the kernel (parent-death signal)."""
    ports = up_ports()
    proc = subprocess.Popen(up_args(tmp_path, ports), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    running_up.append(proc)
    lines_until(proc, "try:", 120)
    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, [" ".join(p.cmdline()) for p in alive]
