"""Warm a new ledger's connections and hot statements before it listens.

A ledger process starts cold: its pool holds no connection, SQLAlchemy has compiled none of
the hot statements (`hot.py` compiles each once per process) and no connection has prepared
them (asyncpg prepares once per connection). The first group-commit batches after a start
paid all of that while agents and dispatchers waited: in the proving ground a ledger restarted
and then paused committed its first batch of 26 held claims 0.6 s after it resumed, and the
availability figure counted it.

So before it listens, the ledger runs the hot path once per connection it is about to use:
an intent, its claim and its outcome, in a transaction that is rolled back. Nothing persists
(no operation, journal entry, outbox row, or NOTIFY, which PostgreSQL sends only on commit);
the statements stay compiled in the process and prepared on each connection the pool keeps.
A warm-up that fails (the database went away meanwhile, a catalog with only approval tools)
is logged and skipped: it only makes the first batches faster, and must never keep the ledger
from serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.catalog import Catalog
from effectledger_core.ids import new_id, utcnow
from effectledger_core.messages import AttemptSucceeded, ClaimAttempt, SubmitIntent
from effectledger_core.subjects import Subjects

from . import hot
from .calls import BatchCall
from .claims import ClaimCall
from .intents import SubmitCall
from .outcomes import OutcomeCall
from .store import Store

T = TypeVar("T")
log = logging.getLogger(__name__)

# An operation of this tenant lives only inside the warm-up's rolled-back transaction.
WARMUP_TENANT = "effectledger-warmup"


async def warm(store: Store, catalog: Catalog, subjects: Subjects, *, connections: int,
               timeout_s: float = 5.0) -> int:
    """Run the hot path on `connections` pooled connections at once; how many were warmed."""
    tool = next((t for t in catalog.tools.values() if t.commit_policy == "auto"), None)
    if tool is None:
        return 0  # every tool needs an approval: there is no hot path to warm
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            done = await asyncio.gather(
                *(_dry_run(store, catalog, subjects, tool.name) for _ in range(connections)),
                return_exceptions=True)
    except TimeoutError:
        log.warning("ledger warm-up took over %.0f s; serving without it", timeout_s)
        return 0
    warmed = sum(1 for d in done if d is True)
    for failure in (d for d in done if isinstance(d, BaseException)):
        log.warning("ledger warm-up failed on one connection: %r", failure)
    log.info("ledger warm-up: %d connection(s) in %.0f ms", warmed,
             (time.monotonic() - started) * 1000)
    return warmed


class _Rehearsed(Exception):
    """Ends the warm-up's transaction: raised inside it, it is rolled back."""


async def _dry_run(store: Store, catalog: Catalog, subjects: Subjects, tool: str) -> bool:
    now = utcnow()
    try:
        async with store.transaction() as conn:
            # Begun first: a call alone would otherwise be one statement committing by
            # itself (`transitions.apply_alone`), and a rehearsal must leave nothing behind.
            await hot.begin(conn)
            # The shapes the service sends: an intent with a caller key and a lease (the
            # direct path), its claim, and a success outcome (which also writes the inbox row),
            # each as a call alone (one statement) and as a batch of two (the locked path).
            for alone in (True, False):
                await _operation(conn, catalog, subjects, tool, now, alone=alone)
            await hot.flush(conn)  # so the fused writes are prepared too
            raise _Rehearsed  # nothing of it persists
    except _Rehearsed:
        pass
    return True


async def _operation(conn: AsyncConnection, catalog: Catalog, subjects: Subjects, tool: str,
                     now: datetime, *, alone: bool) -> None:
    """An intent, its claim and its success: as calls alone, or as batches of two (a batch's
    rows are written over arrays, `hot._unnested`, whose types asyncpg looks up once per
    connection: here, not in the first real batch)."""
    async def run(calls: list[BatchCall[T]]) -> list[T]:
        if alone:
            return [await calls[0].one(conn)]
        results = []
        for result in await type(calls[0]).many(conn, calls):
            if isinstance(result, Exception):
                raise result
            results.append(result)
        return results

    n = 1 if alone else 2
    ops = [r.operation for r in await run([SubmitCall(
        catalog, SubmitIntent(tool=tool, idempotency_key=new_id(), tenant=WARMUP_TENANT),
        subjects, new_id(), new_id(), now, lease_until=now) for _ in range(n)])]
    attempts = [new_id() for _ in ops]
    await run([ClaimCall(ClaimAttempt(
        operation_id=op["id"], epoch=1, attempt_id=attempt, dispatcher_id="warmup",
        tool=op["tool"], arguments_digest=op["arguments_digest"]), now)
        for op, attempt in zip(ops, attempts, strict=True)])
    await run([OutcomeCall(AttemptSucceeded(
        operation_id=op["id"], epoch=1, attempt_id=attempt, dispatcher_id="warmup",
        at=now, response_digest="warmup"), consumer="warmup", message_id=new_id(),
        subjects=subjects, now=now, ambiguous_outbox_id=new_id())
        for op, attempt in zip(ops, attempts, strict=True)])
