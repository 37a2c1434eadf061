"""A private nats-server with the deployment's users and permissions, and clients that record
what the server refused.

The server is the one `effectledger up` runs (`effectledger_cli.nats_auth`), on a free port in
the test's tmp folder; it is stopped afterwards. `Speaker` connects as one user (or as nobody)
and keeps every permissions violation the server reports, so a test can wait for the refusal
of exactly the subject it tried.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient

from effectledger_bus import permissions
from effectledger_cli import nats_auth
from effectledger_cli.embedded import free_port
from effectledger_core.subjects import Subjects
from tests.support.cluster import wait_until


@dataclass
class PrivateBroker:
    files: nats_auth.AuthFiles
    proc: subprocess.Popen[bytes]
    subjects: Subjects

    @property
    def url(self) -> str:
        return self.files.url

    def env(self, user: str) -> dict[str, str]:
        return self.files.child_env(user)


@contextlib.contextmanager
def private_broker(tmp: Path, subjects: Subjects, *, dispatchers: Iterable[str] = ("dispatcher",),
                   reconcilers: Iterable[str] = ("reconciler",),
                   tenants: Iterable[str] = ("acme", "globex"),
                   others: Iterable[permissions.Principal] = ()) -> Iterator[PrivateBroker]:
    """`others`: further users, such as an observer that may read every subject."""
    port = free_port()
    plane = permissions.plane(subjects, dispatchers=dispatchers, reconcilers=reconcilers,
                              tenants=tenants, others=others)
    files = nats_auth.write(tmp / "nats-auth", plane, subjects, host="127.0.0.1", port=port,
                            store_dir=tmp / "nats-js")
    proc = nats_auth.start(files, port, log_file=tmp / "nats.log")
    try:
        yield PrivateBroker(files, proc, subjects)
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass
class Speaker:
    """One connection, and the server's refusals it received."""

    nc: NatsClient
    errors: list[str] = field(default_factory=list)

    async def refused(self, subject: str, *, timeout_s: float = 10.0) -> None:
        """Wait until the server reported a permissions violation naming `subject`."""
        # nats-py lower-cases the server's message, subject included.
        wanted = f'"{subject.lower()}"'

        def seen() -> bool:
            return any("permissions violation" in e.lower() and wanted in e.lower()
                       for e in self.errors)

        await wait_until(seen, timeout_s, what=f"the server to refuse {subject}")

    async def publish(self, subject: str, message: Any) -> None:
        payload = message if isinstance(message, bytes) else json.dumps(message).encode()
        await self.nc.publish(subject, payload)
        await self.nc.flush()

    async def request(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        msg = await self.nc.request(subject, json.dumps(body).encode(), timeout=15)
        return json.loads(msg.data)  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def speaker(broker: PrivateBroker, user: str) -> AsyncIterator[Speaker]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    cred = broker.files.credentials[user]
    nc = await nats.connect(broker.url, user=cred.user, password=cred.password,
                            inbox_prefix=permissions.inbox_prefix(cred.user).encode(),
                            error_cb=on_error, allow_reconnect=False)
    try:
        yield Speaker(nc, errors)
    finally:
        await nc.close()
