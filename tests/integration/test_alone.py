"""A call alone in its transaction is one statement: a claim or a success
(`transitions.apply_alone`; db/claims.py `_claim_alone`, db/outcomes.py `_success_alone`) and
a new intent with a caller key or joining identical calls (db/intents.py `_created_alone`).

The statement only ever grants a claim, applies a success or creates an operation, and only
where the locked (or batch) path would do the same: every other case (a key already taken, a
redelivered claim or message, another attempt or sender, a stale epoch, a forged command, an
unknown operation, a failure, ambiguity) writes nothing and is decided as before. Checked
here the way it can go wrong: the same calls, one at a time, with the one-statement path on
and off, must answer the same and leave the same rows; concurrent claims of one operation are
granted once, concurrent copies of one outcome applied once; a row committed under the
statement's feet is caught by a unique key and answered by the locked path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from effectledger_core.messages import (
    AttemptSucceeded,
    ClaimAttempt,
    ClaimStatus,
    OutcomeAmbiguous,
    SubmitIntent,
)
from effectledger_core.results import ProviderResult
from effectledger_ledger.db import hot
from effectledger_ledger.db.claims import ClaimCall
from effectledger_ledger.db.intents import SubmitCall
from effectledger_ledger.db.outcomes import OutcomeCall
from effectledger_ledger.db.schema import attempts, inbox, operations
from effectledger_ledger.db.store import Store
from tests.integration.test_hot import _as_printed, _postgres_only, _statements
from tests.integration.test_set_based import (
    CATALOG,
    LATER,
    failed,
    reset,
    retry_when_asked,
    submit,
    submit_call,
)
from tests.support.ledger import NOW, SUBJECTS

T = TypeVar("T")
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


async def _both_ways(store: Store, monkeypatch: pytest.MonkeyPatch,
                     scenario: Callable[[Store], Awaitable[T]]) -> tuple[T, dict[str, list[str]]]:
    """`scenario` with the one-statement path on, then again on an empty database with it
    off: the answers and every row must be the same. Returns the first run's answers and
    rows."""
    alone = await scenario(store)
    alone_rows = await _as_printed(store)
    await reset(store)
    with monkeypatch.context() as m:
        m.setattr(hot, "direct", lambda conn: False)  # the one statement switched off
        other = await scenario(store)
    assert other == alone
    assert await _as_printed(store) == alone_rows
    return alone, alone_rows


async def _under_a_held_row(store: Store, insert: str, call: Awaitable[T]) -> T:
    """`call` run while another transaction holds `insert`'s row uncommitted: once the call's
    statement waits for that row (the unique key), the other transaction commits."""
    other = await asyncpg_connect(store)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute(insert)
        task = asyncio.ensure_future(call)
        # Matched by the statement's start: pg_stat_activity keeps only its first kilobyte.
        while not await other.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE 'WITH moved AS%' AND datname = current_database()"
                " AND pid <> pg_backend_pid()"):
            await asyncio.sleep(0.005)  # polling a condition, not a timing guess
            assert not task.done(), task
        await tx.commit()
        return await task
    finally:
        await other.close()


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
    alone, alone_rows = await _both_ways(store, monkeypatch, _one_at_a_time)
    assert [r["status"] for r in alone] == [
        "granted", "granted", "already_claimed", "stale_epoch", "command_mismatch",
        "command_mismatch", "not_claimable", "not_found", "granted", "granted"]
    assert len(alone_rows["attempts"]) == 3
    assert sum(1 for r in alone_rows["outbox"] if "consumed" in r) == 3
    assert sent, "the one-statement path never ran"


async def _sent_alone(store: Store, call: ClaimCall | OutcomeCall | SubmitCall) -> list[str]:
    """What `call` alone in its transaction sends, as asyncpg's query logger sees it."""
    return await _statements(store, [call], alone=True)


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
    reply = await _under_a_held_row(
        store, "INSERT INTO attempts (id, operation_id, epoch, dispatcher_id, status,"
        " claimed_at) VALUES ('intruder', 'op1', 1, 'dx', 'claimed', now())",
        store.run(_claim("op1", "a1", tool, digest).one))
    assert reply.status is ClaimStatus.ALREADY_CLAIMED and reply.attempt_id == "intruder"
    rows = await _as_printed(store)
    assert len(rows["attempts"]) == 1 and "pending" in rows["operations"][0]
    assert not any("attempt_claimed" in r for r in rows["journal"])


async def asyncpg_connect(store: Store) -> Any:
    import asyncpg

    url = store.url.set(drivername="postgresql")
    return await asyncpg.connect(url.render_as_string(hide_password=False))


# ---- outcomes ---------------------------------------------------------------------------------

def _outcome(o: Any, message_id: str, consumer: str = "c") -> OutcomeCall:
    return OutcomeCall(o, consumer=consumer, message_id=message_id, subjects=SUBJECTS,
                       now=LATER, ambiguous_outbox_id=f"amb-{message_id}",
                       decide_retry=retry_when_asked, traceparent=TRACE)


def _success(op: str, attempt: str, *, epoch: int = 1, dispatcher: str = "d1",
             result: bool = True) -> AttemptSucceeded:
    return AttemptSucceeded(
        operation_id=op, epoch=epoch, attempt_id=attempt, dispatcher_id=dispatcher, at=LATER,
        provider_ref=f"ref-{op}", response_digest="sha256:01", http_status=201,
        result=ProviderResult(kind="json", value={"id": op, "none": None}, bytes=30)
        if result else None)


async def _outcomes_one_at_a_time(store: Store) -> list[Any]:
    for n in range(7):
        await submit(store, n)
        tool, digest = await _digest(store, f"op{n}")
        await store.run(_claim(f"op{n}", f"a{n}", tool, digest).one)
    await store.run(_outcome(OutcomeAmbiguous(operation_id="op5", epoch=1, attempt_id="a5",
                                              dispatcher_id="d1", at=LATER,
                                              reason="timeout"), "amb5").one)
    calls = [
        _outcome(_success("op0", "a0"), "m0"),  # applied
        _outcome(_success("op0", "a0"), "m0"),  # the same message again: duplicate
        _outcome(_success("op0", "a0"), "m0", consumer="other"),  # applied already: rejected
        _outcome(_success("op1", "x1"), "m1"),  # not the claimed attempt
        _outcome(_success("op1", "a1", dispatcher="d2"), "m1b"),  # not the claim's holder
        _outcome(_success("op1", "a1", epoch=2), "m1c"),  # stale epoch
        _outcome(_success("op9", "a9"), "m9"),  # unknown operation
        _outcome(_success("op1", "a1", result=False), "m1d"),  # applied, with no result
        _outcome(failed("op2", "a2", "retry_me"), "m2"),  # a failure: the locked path
        _outcome(failed("op3", "a3", "no"), "m3"),
        _outcome(_success("op5", "a5"), "m5"),  # a late success after ambiguity
        _outcome(_success("op4", "a4"), "m4"),
        _outcome(_success("op6", "a6"), "m6"),
        _outcome(_success("op6", "a6"), "m6"),
    ]
    return [(await store.run(call.one)).__repr__() for call in calls]


async def test_alone_and_locked_outcomes_answer_and_write_the_same(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _postgres_only(store)
    alone, _rows = await _both_ways(store, monkeypatch, _outcomes_one_at_a_time)
    assert [a.split("(")[1].split(",")[0] for a in alone] == [
        "status='applied'", "status='duplicate'", "status='rejected'", "status='rejected'",
        "status='rejected'", "status='rejected'", "status='rejected'", "status='applied'",
        "status='applied'", "status='applied'", "status='applied'", "status='applied'",
        "status='applied'", "status='duplicate'"], alone


async def test_a_success_alone_is_one_statement_committed_by_itself(store: Store) -> None:
    _postgres_only(store)
    await submit(store, 1)
    tool, digest = await _digest(store, "op1")
    await store.run(_claim("op1", "a1", tool, digest).one)
    [sent] = await _sent_alone(store, _outcome(_success("op1", "a1"), "m1"))
    assert "UPDATE operations" in sent and "INSERT INTO inbox" in sent
    rows = await _as_printed(store)
    assert "succeeded" in rows["operations"][0] and len(rows["inbox"]) == 1
    assert any('""id"": ""op1""' in r for r in rows["operations"])  # the provider's answer
    # The same message again: nothing written, the locked path finds it in the inbox.
    again = await _sent_alone(store, _outcome(_success("op1", "a1"), "m1"))
    assert again[0].startswith("WITH moved") and again[1] == "BEGIN;"
    assert (await _as_printed(store)) == rows


async def test_concurrent_copies_of_one_outcome_are_applied_once(store: Store) -> None:
    _postgres_only(store)
    await submit(store, 1)
    tool, digest = await _digest(store, "op1")
    await store.run(_claim("op1", "a1", tool, digest).one)
    results = await asyncio.gather(*(
        store.run(_outcome(_success("op1", "a1"), "m1").one) for _ in range(4)))
    assert sorted(r.status for r in results) == [
        "applied", "duplicate", "duplicate", "duplicate"], results
    rows = await _as_printed(store)
    assert sum("outcome_recorded" in r for r in rows["journal"]) == 1


async def test_a_message_recorded_meanwhile_is_stopped_by_the_inbox_key(store: Store) -> None:
    """The inbox's NOT EXISTS reads the statement's snapshot; a copy of the message recorded
    after it fails the inbox INSERT, and the whole statement with it (the operation stays
    where it was); the locked path then finds the copy: a duplicate."""
    _postgres_only(store)
    await submit(store, 1)
    tool, digest = await _digest(store, "op1")
    await store.run(_claim("op1", "a1", tool, digest).one)
    result = await _under_a_held_row(
        store, "INSERT INTO inbox (consumer, message_id, received_at) VALUES ('c', 'm1', now())",
        store.run(_outcome(_success("op1", "a1"), "m1").one))
    assert result.status == "duplicate"
    async with store.transaction() as conn:
        state = (await conn.execute(sa.select(operations.c.state))).scalar()
        n = (await conn.execute(sa.select(sa.func.count()).select_from(inbox))).scalar()
    assert state == "in_flight" and n == 1


# ---- intents ----------------------------------------------------------------------------------

async def _intents_one_at_a_time(store: Store) -> list[Any]:
    a, b = {"title": "a"}, {"title": "b", "none": None}
    leased = SubmitCall(catalog=CATALOG, intent=SubmitIntent(
        tool="create_ticket", arguments=b, idempotency_key="k5"), subjects=SUBJECTS,
        operation_id="op5", outbox_id="ob5", now=NOW, lease_until=LATER, traceparent=TRACE)
    calls = [
        submit_call(SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1"), 1),
        submit_call(SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1"), 2),
        submit_call(SubmitIntent(tool="create_ticket", arguments=b, idempotency_key="k1"), 3),
        submit_call(SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1",
                                 tenant="other"), 4),
        leased,
        submit_call(SubmitIntent(tool="wire_money", arguments=a, idempotency_key="k6"), 6),
        submit_call(SubmitIntent(tool="no_such_tool", arguments=a, idempotency_key="k7"), 7),
        submit_call(SubmitIntent(tool="create_ticket", arguments=a), 8),
        submit_call(SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k9",
                                 join_identical=True), 9),
    ]
    return [await _submitted(store, call) for call in calls]


async def _submitted(store: Store, call: SubmitCall) -> Any:
    """An intent alone in its transaction, as the service runs it: its answer, or the kind of
    its refusal."""
    try:
        got = await store.run(call.one)
    except Exception as exc:  # a refusal, compared by kind
        return type(exc).__name__
    return (got.created, got.operation, got.command)


async def test_alone_and_batched_intents_answer_and_write_the_same(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _postgres_only(store)
    alone, _rows = await _both_ways(store, monkeypatch, _intents_one_at_a_time)
    assert [x if isinstance(x, str) else x[0] for x in alone] == [
        True, False, "IdempotencyConflict", True, True, True, "UnknownTool", True, True]
    assert alone[4][2] is not None  # the leased command, for the direct publisher


def _join(n: int | str, arguments: dict[str, Any], *, tool: str = "create_ticket",
          now: datetime = NOW, leased: bool = True, **intent: Any) -> SubmitCall:
    """An intent that joins identical calls (what the MCP server sends), as operation `op<n>`."""
    return SubmitCall(catalog=CATALOG, intent=SubmitIntent(
        tool=tool, arguments=arguments, join_identical=True, **intent), subjects=SUBJECTS,
        operation_id=f"op{n}", outbox_id=f"ob{n}", now=now,
        lease_until=LATER if leased else None)


async def _joins_one_at_a_time(store: Store) -> list[Any]:
    """Intents that join identical calls (every MCP call), of every kind, one at a time."""
    a, b = {"title": "a"}, {"title": "b"}
    out: list[Any] = []

    async def run(call: SubmitCall) -> None:
        out.append(await _submitted(store, call))

    def join(n: int, arguments: dict[str, Any] = a, **kw: Any) -> SubmitCall:
        return _join(n, arguments, **kw)

    await run(join(1))  # a new identity
    await run(join(2))  # the same call again: joins op1
    await run(join(3, b, leased=False))  # other arguments; its command left to the relays
    await run(join(4, repeat="again"))  # a deliberate repeat
    await run(join(5, tenant="other"))  # another tenant
    await run(join(6, idempotency_key="k6"))  # a key: new, and takes op1's identity over
    await run(join(7))  # joins op6, the identity's holder now
    await run(join(8, idempotency_key="k6"))  # the key again: op6
    await run(join(9, tool="wire_money"))  # awaiting approval
    await run(join(10, tool="no_such_tool"))  # refused
    # A holder that succeeded longer ago than the tool's window is not joined: a new operation
    # takes its identity over.
    await store.run(_claim("op3", "c3", *await _digest(store, "op3")).one)
    await store.run(_outcome(_success("op3", "c3"), "m3").one)
    await run(join(11, b, now=NOW + timedelta(hours=2)))
    await run(join(12, b, now=NOW + timedelta(hours=2)))  # joins op11
    return out


async def test_alone_and_batched_joining_intents_answer_and_write_the_same(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _postgres_only(store)
    alone, _rows = await _both_ways(store, monkeypatch, _joins_one_at_a_time)
    created = [x if isinstance(x, str) else x[0] for x in alone]
    assert created == [True, False, True, True, True, True, False, False, True,
                       "UnknownTool", True, False]
    ids = [None if isinstance(x, str) else x[1]["id"] for x in alone]
    assert (ids[1], ids[6], ids[7], ids[11]) == ("op1", "op6", "op6", "op11")


async def test_concurrent_identical_calls_make_one_operation(store: Store) -> None:
    """An agent's host sending the same key-less call four times at once: one operation, the
    others joined to it (the call identity's unique key stops each later INSERT)."""
    _postgres_only(store)
    for n in range(3):
        answers = await asyncio.gather(*(store.run(_join(f"{n}-{k}", {"n": n}).one)
                                         for k in range(4)))
        assert sorted(a.created for a in answers) == [False, False, False, True], answers
        assert len({a.operation["id"] for a in answers}) == 1
    async with store.transaction() as conn:
        n_ops = (await conn.execute(sa.select(sa.func.count()).select_from(operations))).scalar()
    assert n_ops == 3


async def test_a_new_joining_intent_alone_is_one_statement(store: Store) -> None:
    """An MCP call's intent: one statement when its call identity is new; the same call
    again writes nothing by it, then reads the holder and joins it."""
    _postgres_only(store)
    [sent] = await _sent_alone(store, _join(1, {"t": 1}))
    assert "INSERT INTO operations" in sent and "ON CONFLICT DO NOTHING" in sent
    rows = await _as_printed(store)
    assert (len(rows["operations"]), len(rows["journal"]), len(rows["outbox"])) == (1, 1, 1)
    again = await _sent_alone(store, _join(2, {"t": 1}))
    assert again[0].startswith("WITH new_op") and again[1].startswith("SELECT")
    assert await _as_printed(store) == rows


async def test_a_new_intent_with_a_key_alone_is_one_statement(store: Store) -> None:
    """As the service sends it: leased to the ledger's direct publisher (a command left to
    the relays adds the NOTIFY that wakes them, as a statement of its own)."""
    _postgres_only(store)
    keyed = SubmitCall(catalog=CATALOG, intent=SubmitIntent(
        tool="create_ticket", idempotency_key="k1"), subjects=SUBJECTS, operation_id="op1",
        outbox_id="ob1", now=NOW, lease_until=LATER)
    [sent] = await _sent_alone(store, keyed)
    assert "INSERT INTO operations" in sent and "ON CONFLICT" in sent
    rows = await _as_printed(store)
    assert (len(rows["operations"]), len(rows["journal"]), len(rows["outbox"])) == (1, 1, 1)
    # The key again: nothing written, then read and found (the same call).
    again = await _sent_alone(store, submit_call(
        SubmitIntent(tool="create_ticket", idempotency_key="k1"), 2))
    assert again[0].startswith("WITH new_op") and again[1].startswith("SELECT")
    assert await _as_printed(store) == rows



async def test_a_success_alone_returns_the_view_a_read_gives(store: Store) -> None:
    """With an earlier attempt (a failure retried): the closed attempt as written, the other
    as it was, the operation as moved, exactly as `reads.get_operation` reads them after."""
    _postgres_only(store)
    from effectledger_ledger.db.reads import get_operation, view_of

    await submit(store, 1)
    tool, digest = await _digest(store, "op1")
    await store.run(_claim("op1", "a1", tool, digest).one)
    await store.run(_outcome(failed("op1", "a1", "retry_me"), "m1").one)
    await store.run(_claim("op1", "a2", tool, digest, epoch=2).one)
    recorded = await store.run(_outcome(_success("op1", "a2", epoch=2), "m2").one)
    assert recorded.status == "applied" and recorded.view_rows is not None
    async with store.read() as conn:
        read = await get_operation(conn, "op1")
    assert view_of(recorded.view_rows) == read
    assert [a.epoch for a in read.attempts] == [1, 2] and read.state == "succeeded"
