"""Waits woken by another replica's commits: PostgreSQL `NOTIFY`, sent only when a peer listens.

A submit-and-wait sleeps on the replica that took the HTTP request (waiters.py), but the
commit that settles its operation can be another replica's: the dispatcher's outcome request
and the inbox are queue groups, so with two replicas about half of an agent's calls were
settled by the other one, and their waits ended only at the shared re-check, up to
`wait_recheck_s` (2 s) later (docs/benchmark.md, round twenty-one).

Each replica keeps one listening connection named after its deployment (`application_name`,
with the subject prefix: replicas of one deployment share it). Every `PEER_LOOK_S` that
connection counts the others in `pg_stat_activity`; while there are none, nothing is sent, so
a lone ledger (the embedded default, the benchmark) pays one look every few seconds and no
`NOTIFY` (whose commit takes a database-wide lock). While there are, a commit that moved an
operation to a state that ends a wait is announced after it, off the committing path: the
ids settled meanwhile go out in one `pg_notify` on the listening connection. A peer wakes
the waits it holds on those ids, which read the state themselves: the payload is a hint and
never a state, so a forged or stale one costs a read and changes nothing. A replica ignores
its own announcements. Whatever a lost connection or a late look misses, the re-check still
catches.

The same connection listens for new outbox rows, which wake the relay (the count every
`PEER_LOOK_S` doubles as its liveness check); a lost connection leaves the relay its poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Iterable
from typing import Any

from effectledger_core.waiting import SETTLED

from .db.rows import JournalRow
from .db.store import Store
from .waiters import Waiters

log = logging.getLogger(__name__)

CHANNEL = "effectledger_settled"
OUTBOX_CHANNEL = "effectledger_outbox"  # new outbox rows, any replica's (db/store.py's NOTIFY)
PEER_LOOK_S = 5.0  # how often the listening connection counts the deployment's other replicas
RETRY_S = 2.0  # after a lost connection
# PostgreSQL refuses a payload of 8000 bytes or more: ids (32 hex digits and a comma) go out in
# several notifications past this.
PAYLOAD_MAX = 7000
_SETTLED = frozenset(s.value for s in SETTLED)


def payload_of(tag: str, ids: list[str]) -> list[str]:
    """`tag:id,id,…` notifications, each under PAYLOAD_MAX bytes."""
    out: list[str] = []
    chunk: list[str] = []
    size = len(tag) + 1
    for op_id in ids:
        if chunk and size + len(op_id) + 1 > PAYLOAD_MAX:
            out.append(f"{tag}:{','.join(chunk)}")
            chunk, size = [], len(tag) + 1
        chunk.append(op_id)
        size += len(op_id) + 1
    if chunk:
        out.append(f"{tag}:{','.join(chunk)}")
    return out


def ids_of(payload: str, own_tag: str) -> list[str]:
    """The operation ids of a peer's notification; none for our own or a malformed one."""
    tag, sep, rest = payload.partition(":")
    if not sep or tag == own_tag or not rest:
        return []
    return [i for i in rest.split(",") if 0 < len(i) <= 64]


class Peers:
    """One replica's side: count the peers, announce settled operations, wake local waits."""

    def __init__(self, store: Store, waiters: Waiters, *, deployment: str,
                 look_s: float = PEER_LOOK_S, outbox_wake: asyncio.Event | None = None) -> None:
        self.store, self.waiters, self.look_s = store, waiters, look_s
        # The relay's wake-up, set on any replica's outbox NOTIFY: the same connection
        # listens for both, so a ledger holds one listening connection, not two.
        self.outbox_wake = outbox_wake
        # The listening connection's name: PostgreSQL keeps at most 63 bytes of it.
        self.app_name = f"effectledger-ledger {deployment}"[:63]
        self.tag = secrets.token_hex(8)  # this process: its own notifications come back too
        self.others = 0  # replicas of this deployment listening, besides this one
        self.looks = 0  # peer counts taken
        self.announced = 0  # notifications sent
        self.woken = 0  # local waits a peer's notification woke
        self._pending: dict[str, None] = {}  # ids settled here since the last send, in order
        self._due = asyncio.Event()

    def committed(self, rows: Iterable[JournalRow]) -> None:
        """The store's commit hook: note the operations a committed transaction settled."""
        if self.others <= 0:
            return
        for row in rows:
            if row["to_state"] in _SETTLED and row["operation_id"] is not None:
                self._pending[row["operation_id"]] = None
        if self._pending:
            self._due.set()

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        for op_id in ids_of(payload, self.tag):
            if self.waiters.watching(op_id):
                self.woken += 1
                self.waiters.changed(op_id)  # no state: each wait reads it

    def _on_outbox(self, *_: Any) -> None:
        assert self.outbox_wake is not None
        self.outbox_wake.set()

    async def run(self) -> None:
        """Listen and send until cancelled; reconnects after a lost connection."""
        if not self.store.is_postgres:
            return  # one process holds a SQLite ledger: there is no peer
        import asyncpg

        dsn = self.store.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while True:
            conn = None
            try:
                conn = await asyncpg.connect(dsn, server_settings={
                    "application_name": self.app_name})
                await conn.add_listener(CHANNEL, self._on_notify)
                if self.outbox_wake is not None:
                    await conn.add_listener(OUTBOX_CHANNEL, self._on_outbox)
                    self.outbox_wake.set()  # catch up on what was committed while not listening
                await self._serve(conn)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.others = 0  # unknown until the next look; the re-check covers meanwhile
                log.warning("peer notifications: connection lost (%s); retrying", exc)
                await asyncio.sleep(RETRY_S)
            finally:
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await conn.close()

    async def _serve(self, conn: Any) -> None:
        """One task does both on the one connection: count the peers every `look_s`, and
        send what has settled as soon as it has."""
        loop = asyncio.get_running_loop()
        next_look = loop.time()
        while not conn.is_closed():
            if loop.time() >= next_look:
                self.others = max(0, int(await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = $1",
                    self.app_name)) - 1)
                self.looks += 1
                next_look = loop.time() + self.look_s
                if self.others <= 0:
                    self._pending.clear()
            if self._pending:
                ids, self._pending = list(self._pending), {}
                for payload in payload_of(self.tag, ids):
                    await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, payload)
                    self.announced += 1
            self._due.clear()
            if self._pending:
                continue  # settled while we sent
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_look - loop.time())):
                    await self._due.wait()
