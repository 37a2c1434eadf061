"""The child processes of `effectledger up`: spawned in process groups of their own, checked
for free ports before anything starts, named with their log's last lines when they fail, and
stopped in order (services first, the broker last) with nothing left behind.

Each child gets its own session (so its own process group): a Ctrl-C in a terminal, or a
SIGINT sent to a script's process group, reaches `up` alone, and `up` decides the order of
the stop. Were the children in `up`'s group, the broker could die together with the services
and every service's last log lines would be reconnect noise.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

_PR_SET_PDEATHSIG = 1


class StartFailed(Exception):
    """A child did not come up; the message names it and carries its log's last lines."""


class PortTaken(Exception):
    """A port `up` needs is in use; the message is one line naming the port and its holder."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    # How it was started, so that a supervisor can start it again the same way.
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"

    def failure(self, what: str) -> StartFailed:
        return StartFailed(f"effectledger up: {self.name} {what}; last lines of {self.log}:\n"
                           + "\n".join("  " + line for line in self.tail().splitlines()))


def _die_with_parent() -> None:
    """In the child before exec: receive SIGTERM if `up` itself is killed (Linux only), so a
    SIGKILLed `up` does not leave its services holding their ports."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path) -> Child:
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return Child(name, proc, log, list(argv), env)


def respawn(child: Child) -> Child:
    """The same child again: its command line, environment and log (appended to)."""
    return spawn(child.name, child.argv, child.env, child.log.parent)


def cli(*args: str) -> list[str]:
    """The command line of an `effectledger` subcommand run by this interpreter."""
    return [sys.executable, "-m", "effectledger_cli", *args]


def wait_listening(child: Child, port: int, timeout_s: float, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise child.failure(f"exited with {child.proc.returncode} before listening on "
                                f"{host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)  # polling a port: the child offers no readiness signal
    raise child.failure(f"did not listen on {host}:{port} within {timeout_s:.0f}s")


def port_holder(port: int) -> str:
    """Who listens on `port`, as far as this user may see: 'pid 123 (nats-server -p 4222)'."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return "another process"
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return "a process of another user"
            try:
                cmd = " ".join(psutil.Process(conn.pid).cmdline()) or "?"
            except psutil.Error:
                cmd = "?"
            return f"pid {conn.pid} ({cmd[:120]})"
    return "another process"


def check_ports(ports: dict[str, tuple[int, str]], host: str = "127.0.0.1") -> None:
    """Raise PortTaken for the first port of `ports` ({what: (port, flag)}) that cannot be
    bound. Checked before anything starts: an old `up` still answering on these ports would
    otherwise make the new one print every endpoint as ready and fail a moment later."""
    for what, (port, flag) in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                raise PortTaken(f"effectledger up: port {port} ({what}) is in use by "
                                f"{port_holder(port)}; stop it or choose another with {flag}"
                                ) from None


def stop(children: Sequence[Child], timeout_s: float) -> None:
    """SIGTERM each child's process group, wait up to `timeout_s` for all of them, then
    SIGKILL what is left. Always returns with every group gone."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        _signal_group(child, signal.SIGKILL)  # stragglers, and anything the child started
        child.proc.wait()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)
