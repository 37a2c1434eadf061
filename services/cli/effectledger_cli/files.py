"""The data folder of `effectledger up`: its owner's only.

The SQLite ledger, its WAL, the logs and JetStream hold every tenant's arguments and results;
the credential files every secret. `up` runs with umask 077, so whatever it and its children
create is 0600 (folders 0700); `lock_down` fixes what an earlier run (or an older version of
`up`) left readable. It touches only what `up` itself puts in the folder, never anything else
a user may keep there (`--data-dir` may name a folder that holds other things).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# What `up` puts in its data folder: folders (walked) and files (by pattern).
OWN_FOLDERS = ("logs", "nats-auth", "jetstream", "jetstream-*")
OWN_FILES = ("ledger.db", "ledger.db-*", "nats*.conf", "demo_catalog.toml", "*.token")


def lock_down(data: Path) -> None:
    """The folder 0700; every file `up` owns in it 0600 and every folder 0700."""
    data.mkdir(parents=True, exist_ok=True)
    os.chmod(data, 0o700)
    for pattern in OWN_FILES:
        for path in data.glob(pattern):
            _chmod(path, 0o600)
    for pattern in OWN_FOLDERS:
        for top in data.glob(pattern):
            if not top.is_dir() or top.is_symlink():
                continue
            _chmod(top, 0o700)
            for root, dirs, names in os.walk(top):
                for d in dirs:
                    _chmod(Path(root, d), 0o700)
                for n in names:
                    _chmod(Path(root, n), 0o600)


def _chmod(path: Path, mode: int) -> None:
    # A file removed meanwhile, or a link (never followed: its target is not ours to change).
    with contextlib.suppress(FileNotFoundError):
        if not path.is_symlink():
            os.chmod(path, mode)


def write_private(path: Path, text: str) -> None:
    """Write `text` readable by its owner only, never briefly readable by others."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_TRUNC
