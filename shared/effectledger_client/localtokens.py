"""The HTTP API tokens `effectledger up` generates, found where it keeps them.

`up` writes an operator token and one agent token per tenant beside its NATS credentials
(`<data>/nats-auth/api-operator.token`, `api-agent-<tenant>.token`, mode 0600 in a 0700
folder) and gives them to its ledger. A client that is given no token (no `token=` and no
EFFECTLEDGER_TOKEN) reads the agent token from there, so `effectledger up` then
`effectledger submit ...` works with no flags on the machine and as the user that ran `up`.

Only for a ledger on loopback: a token found on disk is never sent to another host. The data
folder is EFFECTLEDGER_DATA_DIR, else `./effectledger-data` (`up`'s default).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

DATA_DIR_ENV = "EFFECTLEDGER_DATA_DIR"
DEFAULT_DATA_DIR = "effectledger-data"
FOLDER = "nats-auth"  # beside the NATS credential files
DEFAULT_TENANT = "default"
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def data_dir(given: str | os.PathLike[str] | None = None) -> Path:
    return Path(given or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def operator_file(data: Path) -> Path:
    return data / FOLDER / "api-operator.token"


def agent_file(data: Path, tenant: str) -> Path:
    if not _TENANT.match(tenant):  # the tenant becomes part of a file name
        raise ValueError(f"tenant {tenant!r} cannot name a token file")
    return data / FOLDER / f"api-agent-{tenant}.token"


def read(path: Path) -> str | None:
    """The token in `path`, or None when there is none (missing, unreadable or empty)."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return token or None


def is_loopback(url: str) -> bool:
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host is not None and host in LOOPBACK


def find(url: str, *, operator: bool = False, tenant: str = DEFAULT_TENANT,
         data: str | os.PathLike[str] | None = None) -> str | None:
    """The token `up` made for this role, when the ledger at `url` is on this machine."""
    if not is_loopback(url):
        return None
    folder = data_dir(data)
    if operator:
        return read(operator_file(folder))
    try:
        return read(agent_file(folder, tenant))
    except ValueError:
        return None
