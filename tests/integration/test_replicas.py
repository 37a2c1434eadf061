"""Two ledger replicas on one PostgreSQL database: a wait on one ends on the other's commit
(peers.py), and a claim that reaches one before the other's intent has committed is asked
again rather than answered `not_found` (service.py, `LedgerService.claim`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from effectledger_core.ids import new_id
from effectledger_core.messages import AttemptSucceeded, ClaimAttempt, ClaimStatus
from effectledger_ledger.db.store import Store
from effectledger_ledger.peers import CHANNEL, Peers
from effectledger_ledger.service import NOT_FOUND_AGAIN_S
from tests.support.cluster import wait_until
from tests.support.ledger import DEMO, LedgerDriver

pytestmark = pytest.mark.timeout(120)


class Ledger(LedgerDriver):
    default_catalog, tool = DEMO, "create_ticket"


@pytest.fixture
async def pg_store(store: Store) -> Store:
    if not store.is_postgres:
        pytest.skip("replicas share a PostgreSQL database; SQLite has one process")
    return store


async def _replica(store: Store, deployment: str, first_id: int
                   ) -> tuple[Ledger, Peers, asyncio.Task[None]]:
    led = Ledger(store)
    led._ids = itertools.count(first_id)  # ids of its own, as replicas' are
    led.svc.waiters.recheck_s = 0  # only a notification can wake a wait here
    peers = Peers(store, led.svc.waiters, deployment=deployment, look_s=0.1)
    led.svc.commit_hooks.append(peers.committed)
    return led, peers, asyncio.create_task(peers.run())


@pytest.fixture
async def pair(pg_store: Store) -> AsyncIterator[list[tuple[Ledger, Peers]]]:
    deployment = f"t{secrets.token_hex(4)}"
    other = Store(str(pg_store.url.render_as_string(hide_password=False)))
    made = [await _replica(pg_store, deployment, 1), await _replica(other, deployment, 50_000)]
    try:
        yield [(led, peers) for led, peers, _task in made]
    finally:
        for led, _peers, task in made:
            await _stop(task)
            await led.svc.close()
        await other.close()


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _succeed(led: Ledger, op_id: str) -> None:
    attempt = await led.claim(op_id)
    recorded = await led.svc.record_outcome(AttemptSucceeded(
        operation_id=op_id, epoch=1, attempt_id=attempt, dispatcher_id="d1", at=led.now,
        http_status=201, provider_ref="tk_1", response_digest="sha256:x"),
        consumer="ledger", message_id=led.mid())
    assert recorded.status == "applied", recorded


async def test_a_wait_on_one_replica_ends_on_the_others_commit(
        pair: list[tuple[Ledger, Peers]]) -> None:
    """The outcome recorded by replica B ends the wait held by replica A at once. Without the
    notification (A's re-check is off) the wait would run its whole 60 s."""
    (a, a_peers), (b, b_peers) = pair
    await wait_until(lambda: a_peers.others == 1 and b_peers.others == 1, 30,
                     what="each replica counts the other")
    op_id = await a.submit(title="t")
    waiting = asyncio.create_task(a.svc.wait_operation(op_id, 60, created_as="pending"))
    await wait_until(lambda: a.svc.waiters.watching(op_id), 10, what="the wait registered")
    await _succeed(b, op_id)
    view = await asyncio.wait_for(waiting, 30)
    assert view.state == "succeeded"
    assert a_peers.woken == 1 and b_peers.announced >= 1


async def test_a_lone_replica_sends_nothing(pg_store: Store) -> None:
    """Alone in its deployment a ledger sends no NOTIFY (its commit would take a database-wide
    lock for nobody): it only counts, every `look_s`."""
    led, peers, task = await _replica(pg_store, f"t{secrets.token_hex(4)}", 1)
    try:
        await wait_until(lambda: peers.looks >= 2, 30, what="two looks")
        assert peers.others == 0
        await _succeed(led, await led.submit(title="t"))
        await wait_until(lambda: peers.looks >= 4, 30, what="two more looks")
        assert peers.announced == 0
    finally:
        await _stop(task)
        await led.svc.close()


async def test_a_forged_notification_changes_nothing(
        pair: list[tuple[Ledger, Peers]]) -> None:
    """Whoever can NOTIFY on the ledger's database (only its own role can connect) names an
    operation as settled when it is not: the wait wakes, reads the state itself, and sleeps
    on. The payload is a hint, never a state; a malformed one is dropped."""
    (a, a_peers), _ = pair
    op_id = await a.submit(title="t")
    waiting = asyncio.create_task(a.svc.wait_operation(op_id, 60, created_as="pending"))
    await wait_until(lambda: a.svc.waiters.watching(op_id), 10, what="the wait registered")
    queries = a.svc.waiters.state_queries
    conn: Any = await _raw(a.store)
    try:
        for payload in ("garbage", "x:", f"forger:{op_id}", f"forger:{'z' * 100}"):
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, payload)
        await wait_until(lambda: a_peers.woken == 1, 10, what="the forged hint arrived")
        await wait_until(lambda: a.svc.waiters.state_queries > queries, 10,
                         what="the woken wait read the state")
        assert not waiting.done() and (await a.op(op_id))["state"] == "pending"
    finally:
        await conn.close()
        await _stop(waiting)


async def _raw(store: Store) -> Any:
    import asyncpg

    return await asyncpg.connect(
        store.url.set(drivername="postgresql").render_as_string(hide_password=False))


async def test_a_claim_ahead_of_the_other_replicas_commit_is_asked_again(
        pair: list[tuple[Ledger, Peers]]) -> None:
    """The dispatcher's claim reaches replica B while replica A's intent, whose command went
    out with its statement, has not committed yet: B finds nothing, and asks again a few
    milliseconds later (the pause is where A commits here) instead of answering `not_found`,
    which costs the dispatcher a 20 ms nak."""
    (a, _), (b, _) = pair
    op_id = new_id()
    made = iter([op_id])
    a.svc.ids = lambda: next(made, None) or new_id()
    pauses: list[float] = []

    async def a_commits_meanwhile(delay_s: float) -> None:
        pauses.append(delay_s)
        if len(pauses) == 1:
            assert await a.submit(title="t") == op_id

    b.svc.sleep = a_commits_meanwhile
    reply = await b.svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id="at1",
                                           dispatcher_id="d1"))
    assert reply.status is ClaimStatus.GRANTED, reply
    assert b.svc.claims_asked_again == 1 and len(pauses) == 1


async def test_a_claim_for_an_old_or_foreign_id_is_answered_at_once(
        pair: list[tuple[Ledger, Peers]]) -> None:
    """Only a young id (made within YOUNG_ID_MS) may still be committing: an older one, or an
    id not made by `new_id`, is `not_found` at once, and a young one that never appears is
    `not_found` after the pauses, no later."""
    (_, _), (b, _) = pair
    pauses: list[float] = []

    async def note(delay_s: float) -> None:
        pauses.append(delay_s)

    b.svc.sleep = note
    young = new_id()
    old = f"{int(young[:12], 16) - 60_000:012x}{young[12:]}"
    for op_id, asked in ((old, 0), ("counted-id-7", 0), (young, 1)):
        reply = await b.svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id="at1",
                                               dispatcher_id="d1"))
        assert reply.status is ClaimStatus.NOT_FOUND, (op_id, reply)
        assert b.svc.claims_asked_again == asked, op_id
    assert pauses == list(NOT_FOUND_AGAIN_S)


async def test_the_listening_connection_wakes_the_relay_on_any_replicas_outbox_notify(
        pg_store: Store) -> None:
    """The one listening connection also serves the relay: an outbox NOTIFY (another
    replica's new rows) sets its wake-up, as the relay's own listener did."""
    led = Ledger(pg_store)
    wake = asyncio.Event()
    peers = Peers(pg_store, led.svc.waiters, deployment=f"t{secrets.token_hex(4)}",
                  look_s=0.1, outbox_wake=wake)
    task = asyncio.create_task(peers.run())
    conn: Any = await _raw(pg_store)
    try:
        await wait_until(lambda: peers.looks >= 1, 30, what="listening")
        wake.clear()  # set once on connecting (catch-up)
        await conn.execute("SELECT pg_notify('effectledger_outbox', '')")
        await asyncio.wait_for(wake.wait(), 10)
    finally:
        await conn.close()
        await _stop(task)
        await led.svc.close()
