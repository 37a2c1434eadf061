"""Run `effectledger up` as a real process in tests: free ports, its stdout lines, and the
check that a stop signal leaves no process and frees every port."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from effectledger_cli.embedded import free_port


def bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def up_ports() -> dict[str, int]:
    return {name: free_port() for name in ("nats", "ledger", "sandbox", "reconciler")}


def up_args(tmp_path: Path, ports: dict[str, int], *extra: str) -> list[str]:
    return [sys.executable, "-m", "effectledger_cli", "up", "--data-dir", str(tmp_path / "data"),
            "--nats-port", str(ports["nats"]), "--ledger-port", str(ports["ledger"]),
            "--sandbox-port", str(ports["sandbox"]),
            "--reconciler-port", str(ports["reconciler"]), *extra]


def lines_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    """stdout lines of `proc` up to the first that starts with `marker` (read by a thread:
    a select() on the pipe misses lines already taken into the reader's buffer)."""
    assert proc.stdout is not None
    stdout = proc.stdout
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stdout:
            lines.put(line.rstrip("\n"))
            if line.startswith(marker):
                return
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(marker):
            return seen
    stderr = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
    raise AssertionError(f"`up` printed no {marker!r} line; got {seen}; stderr: {stderr}")


@contextmanager
def reaped() -> Iterator[list[subprocess.Popen[str]]]:
    """A list to put `up` processes in; any still running at the end is killed with its
    children (a failed test must not leave a stack behind)."""
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait()


def stop_and_check(proc: subprocess.Popen[str], sig: signal.Signals, ports: list[int]) -> None:
    kids = psutil.Process(proc.pid).children(recursive=True)
    assert len(kids) >= 4, [k.cmdline() for k in kids]
    start = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=10)
    _, alive = psutil.wait_procs(kids, timeout=max(0.0, 10 - (time.monotonic() - start)))
    assert not alive, [p.pid for p in alive]
    while not all(bindable(p) for p in ports):
        assert time.monotonic() - start < 10, [p for p in ports if not bindable(p)]
        time.sleep(0.05)  # polling the ports until free, within the 10 s bound
    assert proc.returncode == 0


def free_ports_in_a_row(count: int) -> int:
    """The first of `count` consecutive free ports (for --ledgers/--reconcilers N)."""
    for _ in range(100):
        first = free_port()
        if all(bindable(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports found")


def up_children(proc: subprocess.Popen[str]) -> dict[str, psutil.Process]:
    """`up`'s children by the name `up` gives them: ledger, dispatcher, reconciler, sandbox,
    nats (a cluster's further nodes nats-2, nats-3, by their configuration file)."""
    found: dict[str, psutil.Process] = {}
    for child in psutil.Process(proc.pid).children():
        cmd = child.cmdline()
        if cmd and cmd[0].endswith("nats-server"):
            conf = next((Path(a).stem for a in cmd if a.endswith(".conf")), "nats")
            found[conf] = child  # nats-auth/nats.conf on one node, nats-<i>.conf on a cluster
        elif len(cmd) > 3 and cmd[1:3] == ["-m", "effectledger_cli"]:
            ident = cmd[cmd.index("--id") + 1] if "--id" in cmd else cmd[3]
            name = cmd[3] if ident.endswith("-1") or ident == cmd[3] else ident
            found[name] = child
    return found
