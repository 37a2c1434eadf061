"""A private, throwaway PostgreSQL cluster: `initdb` and `pg_ctl` in a folder, on a free port.

The benchmark and the proving ground both start one (each with its own settings: the benchmark
keeps durability on, the proving ground turns fsync off because its faults are process crashes).
PostgreSQL refuses to run as root, so when we are root every server command runs as the
`postgres` system user (`runuser`), in a folder that user owns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from effectledger_cli.embedded import free_port


def pg_bindir() -> Path | None:
    """PostgreSQL's initdb/pg_ctl/pgbench folder: `pg_config --bindir`, else initdb on PATH,
    else the newest /usr/lib/postgresql/*/bin (Debian's layout)."""
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


def can_start() -> bool:
    """Whether a private cluster can be started here: PostgreSQL's binaries are installed and,
    when we are root, the `postgres` system user exists (Debian's packages create it)."""
    if pg_bindir() is None:
        return False
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return False
    return True


class PrivatePostgres:
    """A cluster in `root` (created if missing) with `settings` passed as `-c name=value`.

    `init()` once, then `start()`; `stop_immediate()` + `start()` is a crash and a restart on
    the same port. `url(db)` gives SQLAlchemy URLs, `dsn(db)` libpq ones. `root` must be
    reachable by the postgres user when we are root (a fresh folder under /tmp is).
    """

    def __init__(self, root: Path, settings: Mapping[str, str], *, port: int = 0,
                 bindir: Path | None = None) -> None:
        found = bindir or pg_bindir()
        if found is None:
            raise FileNotFoundError("PostgreSQL's initdb not found (pg_config --bindir); "
                                    "install PostgreSQL's server package")
        self.bindir = found
        self.root = root
        self.settings = dict(settings)
        self.port = port or free_port()
        self.data = root / "data"
        self.sock = root / "sock"
        self.log = root / "postgres.log"

    def bin(self, name: str) -> str:
        return str(self.bindir / name)

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(as_postgres([self.bin(argv[0]), *argv[1:]]), capture_output=True,
                             text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({out.returncode}): "
                               f"{(out.stderr or out.stdout).strip()[-2000:]}")
        return out

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            for folder in (self.root, self.sock):
                shutil.chown(folder, "postgres", "postgres")
            os.chmod(self.root, 0o755)
        # --no-sync: a throwaway cluster; the settings decide what the runs themselves sync.
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E",
                  "UTF8", "--no-sync")

    def start(self) -> None:
        opts = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        opts += f" -p {self.port} -k {self.sock}"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w",
                  "-t", "60", "start")

    def stop(self) -> None:
        """A clean shutdown; nothing to do when the cluster is not running."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop",
                      check=False)

    def stop_immediate(self) -> None:
        """A crash: no checkpoint, recovery from the WAL at the next start."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop",
                  check=False)

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def url(self, db: str, port: int | None = None) -> str:
        """SQLAlchemy URL; `port` reaches the cluster through a proxy in front of it."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{port or self.port}/{db}"

    def dsn(self, db: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def psql(self, sql: str, db: str = "postgres") -> str:
        out = subprocess.run([self.bin("psql"), "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                              "-d", self.dsn(db), "-c", sql],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"psql failed ({out.returncode}) on {sql[:200]!r}: "
                               f"{out.stderr.strip()[-2000:]}")
        return out.stdout.strip()

    def create_database(self, db: str) -> str:
        self.psql(f'CREATE DATABASE "{db}"')
        return self.url(db)

    def set_system(self, **settings: str) -> None:
        """ALTER SYSTEM + reload: applies to every session, including pooled ones."""
        for name, value in settings.items():
            self.psql(f"ALTER SYSTEM SET {name} = '{value}'")
        self.psql("SELECT pg_reload_conf()")
