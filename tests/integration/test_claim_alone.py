"""A claim alone in its transaction is one statement (db/claims.py, `_claim_alone`).

The statement only ever grants, and only where the locked path would grant the same claim:
every other case (a redelivered claim, another attempt, a stale epoch, a forged command, an
unknown operation, one awaiting approval) writes nothing and is decided under the lock.
Checked here the way it can go wrong: the same claims, one at a time, with the one-statement
path on and off, must answer the same and leave the same rows; concurrent claims of one
operation are granted once; an attempt committed under the statement's feet is caught by
the unique key and answered by the locked path.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from effectledger_core.messages import ClaimAttempt, ClaimStatus, SubmitIntent
from effectledger_ledger.db import hot
from effectledger_ledger.db.claims import ClaimCall
from effectledger_ledger.db.schema import attempts, operations
from effectledger_ledger.db.store import Store
from tests.integration.test_hot import _as_printed, _postgres_only, _statements
from tests.integration.test_set_based import LATER, reset, submit, submit_call

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def _digest(store: Store, op: str) -> tuple[str, str]:
    async with store.transaction() as conn:
        row = (await conn.execute(sa.select(operations.c.tool, operations.c.arguments_digest)
                                  .where(operations.c.id == op))).one()
    return row.tool, row.arguments_digest


def _claim(op: str, attempt: str, tool: str, digest: str, *, epoch: int = 1,
           dispatcher: str = "d1") -> ClaimCall:
    return ClaimCall(ClaimAttempt(operation_id=op, epoch=epoch, attempt_id=attempt,
                                  dispatcher_id=dispatcher, tool=tool, arguments_digest=digest),
                     now=LATER, traceparent=TRACE)


async def _one_at_a_time(store: Store) -> list[Any]:
    """Claims of every kind, each alone in its transaction, as the service runs them."""
    for n in range(4):
        await submit(store, n, tool="wire_money" if n == 2 else "create_ticket")
    tool, digest = await _digest(store, "op0")
    tool1, digest1 = await _digest(store, "op1")
    tool2, digest2 = await _digest(store, "op2")
    calls = [
        _claim("op0", "a1", tool, digest),  # granted
        _claim("op0", "a1", tool, digest),  # the same attempt again (a lost reply): granted
        _claim("op0", "a2", tool, digest, dispatcher="d2"),  # another dispatcher: held
        _claim("op1", "b1", tool1, digest1, epoch=2),  # stale epoch
        _claim("op1", "b1", "wire_money", digest1),  # another tool: a forged command
        _claim("op1", "b1", tool1, "sha256:" + "0" * 64),  # other arguments: forged
        _claim("op2", "c1", tool2, digest2),  # awaiting approval: not claimable
        _claim("op9", "z1", tool, digest),  # unknown operation
        _claim("op1", "b1", tool1, digest1),  # granted after its forged copies
        _claim("op3", "d1", *await _digest(store, "op3")),  # granted
    ]
    replies = []
    for call in calls:
        reply = await store.run(call.one)
        replies.append(reply.model_dump(mode="json"))
    return replies


async def test_alone_and_locked_claims_answer_and_write_the_same(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _postgres_only(store)
    sent: list[int] = []
    real = hot.fetch

    async def counting(conn: Any, stmt: Any, params: Any, **kw: Any) -> Any:
        sent.append(1)
        return await real(conn, stmt, params, **kw)

    monkeypatch.setattr(hot, "fetch", counting)
    alone = await _one_at_a_time(store)
    alone_rows = await _as_printed(store)
    await reset(store)
    monkeypatch.setattr(hot, "direct", lambda conn: False)  # the one statement switched off
    locked = await _one_at_a_time(store)
    assert locked == alone
    assert await _as_printed(store) == alone_rows
    assert [r["status"] for r in alone] == [
        "granted", "granted", "already_claimed", "stale_epoch", "command_mismatch",
        "command_mismatch", "not_claimable", "not_found", "granted", "granted"]
    assert len(alone_rows["attempts"]) == 3
    assert sum(1 for r in alone_rows["outbox"] if "consumed" in r) == 3
    assert sent, "the one-statement path never ran"


async def _sent_alone(store: Store, call: ClaimCall) -> list[str]:
    """What `call` alone in its transaction sends, as asyncpg's query logger sees it."""
    seen: list[str] = []

    def log(query: Any) -> None:
        seen.append(query.query)

    async with store.transaction() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        driver.add_query_logger(log)
        await call.one(conn)
    driver.remove_query_logger(log)  # after the block: a COMMIT is logged too
    return [q for q in seen if "typeinfo_tree" not in q and "'jit'" not in q]


async def test_a_claim_alone_is_one_statement_committed_by_itself(store: Store) -> None:
    _postgres_only(store)
    await submit(store, 1)
    tool, digest = await _digest(store, "op1")
    [sent] = await _sent_alone(store, _claim("op1", "a1", tool, digest))
    assert "UPDATE operations" in sent and "INSERT INTO attempts" in sent
    assert "INSERT INTO journal" in sent and "UPDATE outbox" in sent
    rows = await _as_printed(store)  # another connection sees it: it committed
    assert len(rows["attempts"]) == 1 and "in_flight" in rows["operations"][0]
    # Asked again (its reply lost): the statement writes nothing (an attempt holds the
    # epoch), and the claim is decided under the lock: granted, nothing doubled.
    again = await _sent_alone(store, _claim("op1", "a1", tool, digest))
    assert again[0].startswith("WITH moved") and again[1] == "BEGIN;"
    assert "FOR UPDATE" in again[2] and again[-1] == "COMMIT;"
    assert len((await _as_printed(store))["attempts"]) == 1


async def test_a_claim_with_the_locked_batch_takes_the_locked_path(store: Store) -> None:
    """Beside other calls (a batch), the claims are decided together under the lock."""
    _postgres_only(store)
    await submit(store, 1)
    await submit(store, 2)
    t1, d1 = await _digest(store, "op1")
    t2, d2 = await _digest(store, "op2")
    sent = await _statements(store, [_claim("op1", "a1", t1, d1), _claim("op2", "a2", t2, d2)])
    assert sent[0] == "BEGIN;" and "FOR UPDATE" in sent[1]


async def test_concurrent_claims_of_one_operation_are_granted_once(store: Store) -> None:
    _postgres_only(store)
    for n in range(5):
        await submit(store, n)
    for n in range(5):
        tool, digest = await _digest(store, f"op{n}")
        replies = await asyncio.gather(*(
            store.run(_claim(f"op{n}", f"a{n}-{k}", tool, digest, dispatcher=f"d{k}").one)
            for k in range(4)))
        assert sorted(r.status.value for r in replies) == [
            "already_claimed", "already_claimed", "already_claimed", "granted"], replies
    async with store.transaction() as conn:
        held = (await conn.execute(sa.select(attempts.c.operation_id, sa.func.count())
                                   .group_by(attempts.c.operation_id))).all()
    assert sorted(held) == [(f"op{n}", 1) for n in range(5)]


async def test_an_attempt_committed_meanwhile_is_stopped_by_the_unique_key(
        store: Store) -> None:
    """The NOT EXISTS reads the statement's snapshot; an attempt inserted after it (by a
    writer that did not lock the operation, which no writer of the ledger is) fails the
    INSERT, the statement leaves nothing behind, and the locked path answers."""
    _postgres_only(store)
    await store.run(submit_call(SubmitIntent(tool="create_ticket"), 1).one)
    tool, digest = await _digest(store, "op1")
    other = await asyncpg_connect(store)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute(
            "INSERT INTO attempts (id, operation_id, epoch, dispatcher_id, status, claimed_at)"
            " VALUES ('intruder', 'op1', 1, 'dx', 'claimed', now())")
        claim = asyncio.create_task(store.run(_claim("op1", "a1", tool, digest).one))
        # Wait until the claim's INSERT waits for the intruder's row lock (the unique key).
        while not await other.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE '%INSERT INTO attempts%' AND pid <> pg_backend_pid()"):
            await asyncio.sleep(0.005)  # polling a condition, not a timing guess
            assert not claim.done(), claim
        await tx.commit()
        reply = await claim
    finally:
        await other.close()
    assert reply.status is ClaimStatus.ALREADY_CLAIMED and reply.attempt_id == "intruder"
    rows = await _as_printed(store)
    assert len(rows["attempts"]) == 1 and "pending" in rows["operations"][0]
    assert not any("attempt_claimed" in r for r in rows["journal"])


async def asyncpg_connect(store: Store) -> Any:
    import asyncpg

    url = store.url.set(drivername="postgresql")
    return await asyncpg.connect(url.render_as_string(hide_password=False))
