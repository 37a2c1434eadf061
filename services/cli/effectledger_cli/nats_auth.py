"""The NATS credentials of a deployment on disk: the server's configuration and one file per
user, all mode 0600 in a folder of mode 0700.

`effectledger up` writes them into its data folder and starts nats-server with the
configuration (`-c`), so the embedded default has least-privilege users without anyone
configuring anything. Passwords are kept across restarts of `up` (an agent's credential file
stays valid); a user that is new gets a new password. Each child process receives only its own
user and password, in its environment (`EFFECTLEDGER_NATS_USER` / `_PASSWORD`), never on a
command line. The permissions themselves are `effectledger_bus.permissions`.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from effectledger_bus import permissions
from effectledger_bus.permissions import Credential, Plane, Principal, inbox_prefix, server_config
from effectledger_core.subjects import Subjects

from .embedded import nats_server_binary, wait_for_port
from .files import write_private

PASSWORDS = "passwords.json"


@dataclass(frozen=True)
class AuthFiles:
    folder: Path
    config: Path
    plane: Plane
    credentials: dict[str, Credential]
    url: str

    def credential_file(self, user: str) -> Path:
        return self.folder / f"{user}.json"

    def authorization(self) -> str:
        """The `authorization` block of every user with its password and permissions."""
        return permissions.render(self.plane, {u: c.password for u, c in self.credentials.items()})

    def child_env(self, user: str) -> dict[str, str]:
        """What one child process needs to connect as `user`, and nothing else."""
        cred = self.credentials[user]
        return {"EFFECTLEDGER_NATS_URL": self.url, "EFFECTLEDGER_NATS_USER": cred.user,
                "EFFECTLEDGER_NATS_PASSWORD": cred.password}


def _credential_doc(p: Principal, cred: Credential, url: str, subjects: Subjects) -> str:
    doc: dict[str, object] = {
        # `url` as EFFECTLEDGER_NATS_URL takes it (a cluster's nodes joined by commas);
        # `servers` as nats-py's connect takes it
        "url": url, "servers": url.split(","), "user": cred.user,
        "password": cred.password, "role": p.role.value,
        "inbox_prefix": inbox_prefix(cred.user)}
    if p.scope is not None:
        doc["scope"] = p.scope
    if p.role.value == "agent" and p.scope is not None:
        doc["intents_subject"] = subjects.rpc_intents_for(p.scope)
        doc["operation_subject"] = subjects.rpc_operation_for(p.scope)
    return json.dumps(doc, indent=2) + "\n"


def write(folder: Path, plane: Plane, subjects: Subjects, *, host: str, port: int,
          store_dir: Path, url: str | None = None, server: bool = True) -> AuthFiles:
    """The configuration and every user's credential file under `folder` (created 0700).
    `url`: what clients connect to, when not `host:port` (a cluster's node list).
    `server=False` writes no single-node configuration (a cluster's nodes render their own
    from `authorization()`)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    known: dict[str, str] = {}
    store = folder / PASSWORDS
    if store.exists():
        try:
            loaded = json.loads(store.read_text())
            known = {k: v for k, v in loaded.items() if isinstance(v, str)}
        except ValueError:
            known = {}  # unreadable: every user gets a new password
    creds = {u: Credential(u, known[u]) if u in known else Credential.generate(u)
             for u in plane.users}
    write_private(store, json.dumps({u: c.password for u, c in creds.items()}, indent=2))
    url = url or f"nats://{host}:{port}"
    config = folder / "nats.conf"
    if server:
        write_private(config, server_config(plane, {u: c.password for u, c in creds.items()},
                                            host=host, port=port, store_dir=str(store_dir)))
    for p in plane.principals:
        write_private(folder / f"{p.user}.json",
                      _credential_doc(p, creds[p.user], url, subjects))
    return AuthFiles(folder, config, plane, creds, url)


def start(files: AuthFiles, port: int, *, log_file: Path | None = None,
          host: str = "127.0.0.1", extra_args: list[str] | None = None
          ) -> subprocess.Popen[bytes]:
    """nats-server with this configuration (its users, permissions and JetStream folder)."""
    args = [nats_server_binary(), "-c", str(files.config), *(extra_args or [])]
    if log_file is None:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    else:
        # The child writes through its own copy of the descriptor; ours is closed at once
        # (left open, it leaked one file per broker until the garbage collector found it).
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    wait_for_port(host, port, 15.0, proc)
    return proc


def for_up(data: Path, subjects: Subjects, *, port: int, dispatchers: list[str],
           reconcilers: list[str], tenants: list[str], cluster_url: str | None = None
           ) -> AuthFiles:
    """`effectledger up`'s users under `<data>/nats-auth`, JetStream under `<data>/jetstream`.
    `cluster_url`: the nodes of a cluster, whose configurations (up_nats) carry the same
    users and permissions as one node's."""
    plane = permissions.plane(subjects, dispatchers=dispatchers, reconcilers=reconcilers,
                              tenants=tenants)
    return write(data / "nats-auth", plane, subjects, host="127.0.0.1", port=port,
                 store_dir=data / "jetstream", url=cluster_url, server=cluster_url is None)
