"""The hot path's two executors (db/hot.py) write the same rows, in the same transaction.

On PostgreSQL the set-based writes, the locking read and the inbox INSERT go straight to
asyncpg; SQLAlchemy's execute is the other implementation (SQLite's, and PostgreSQL's with the
direct path switched off). A whole scenario of intents, claims and every kind of outcome runs
both ways on one database, and every row must read the same as PostgreSQL prints it (so JSON
null and SQL NULL differ). A direct statement must also belong to the transaction it runs in,
and its errors must be the ones SQLAlchemy raises (the service retries on IntegrityError).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from effectledger_core.errors import StoreUnavailable
from effectledger_core.messages import AttemptAccepted, OutcomeAmbiguous, SubmitIntent
from effectledger_ledger.db import hot
from effectledger_ledger.db.common import journal_row
from effectledger_ledger.db.intents import SubmitCall
from effectledger_ledger.db.outcomes import OutcomeCall
from effectledger_ledger.db.reads import get_operation
from effectledger_ledger.db.schema import journal, metadata
from effectledger_ledger.db.store import Store
from effectledger_ledger.db.watch import states_of
from tests.integration.test_set_based import (
    CATALOG,
    LATER,
    NOW,
    SUBJECTS,
    claim_call,
    failed,
    reset,
    retry_when_asked,
    submit_call,
    success,
)


def _postgres_only(store: Store) -> None:
    if not store.is_postgres:
        pytest.skip("the direct path is PostgreSQL's; SQLite always takes SQLAlchemy's")


async def _as_printed(store: Store) -> dict[str, list[str]]:
    out = {}
    async with store.transaction() as conn:
        for table in metadata.sorted_tables:
            # A row's text form: an SQL NULL prints as nothing, a JSON null as `null`.
            doc = ("ROW(" + ", ".join(f"t.{c.name}" for c in table.c if c.name != "id") + ")"
                   if table is journal else "t")
            order = ("operation_id, id" if table is journal
                     else ", ".join(c.name for c in table.primary_key.columns))
            out[table.name] = list((await conn.execute(sa.text(
                f"SELECT {doc}::text FROM {table.name} t ORDER BY {order}"))).scalars())
    return out


async def _scenario(store: Store) -> list[Any]:
    """Intents, claims and outcomes of every kind, in batches as group commit makes them."""
    def outcome(o: Any, message_id: str) -> OutcomeCall:
        return OutcomeCall(o, consumer="c", message_id=message_id, subjects=SUBJECTS,
                           now=LATER, ambiguous_outbox_id=f"amb-{message_id}",
                           decide_retry=retry_when_asked)

    leased = SubmitCall(catalog=CATALOG, intent=SubmitIntent(
        tool="create_ticket", arguments={"n": 9, "none": None}, idempotency_key="k9"),
        subjects=SUBJECTS, operation_id="op9", outbox_id="ob9", now=NOW, lease_until=LATER,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    batches: list[list[Any]] = [
        [submit_call(SubmitIntent(tool="create_ticket", arguments={"n": n}), n)
         for n in range(6)] + [leased],
        [submit_call(SubmitIntent(tool="create_ticket", arguments={"n": 9, "none": None},
                                  idempotency_key="k9"), 10)],  # the same key: found
        [claim_call(f"op{n}", f"a{n}") for n in range(6)] + [claim_call("op0", "other")],
        [claim_call("op5", "a5")],  # asked again: a held claim gets a new claimed_at
        [outcome(success("op0", "a0"), "m0"), outcome(success("op0", "a0"), "m0"),
         outcome(failed("op1", "a1", "retry_me"), "m1"), outcome(failed("op2", "a2", "no"), "m2"),
         outcome(AttemptAccepted(operation_id="op3", epoch=1, attempt_id="a3",
                                 dispatcher_id="d1", at=LATER, provider_ref="ref-op3",
                                 response_digest="sha256:03"), "m3"),
         outcome(OutcomeAmbiguous(operation_id="op4", epoch=1, attempt_id="a4",
                                  dispatcher_id="d1", at=LATER, reason="timeout"), "m4")],
        [outcome(success("op5", "a5").model_copy(update={"result": None}), "m5")],
    ]
    replies = []
    for batch in batches:
        async with store.transaction() as conn:
            replies.append([repr(r) if not hasattr(r, "model_dump") else r.model_dump(mode="json")
                            for r in await type(batch[0]).many(conn, batch)])
    return replies


async def test_direct_and_sqlalchemy_execution_write_identical_rows(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _postgres_only(store)
    direct = await _scenario(store)
    direct_rows = await _as_printed(store)
    await reset(store)
    monkeypatch.setattr(hot, "_direct", lambda conn: None)
    through_sqlalchemy = await _scenario(store)
    assert through_sqlalchemy == direct
    assert await _as_printed(store) == direct_rows
    assert len(direct_rows["attempts"]) == 6 and len(direct_rows["inbox"]) == 6


async def test_a_direct_write_first_in_a_transaction_rolls_back_with_it(store: Store) -> None:
    """SQLAlchemy's adapter sends BEGIN with its first statement; a direct statement sent
    first must open that transaction, not run (and commit) on its own."""
    _postgres_only(store)
    row = journal_row(operation_id="op0", at=datetime.now(UTC), kind="note", actor="test")
    with pytest.raises(RuntimeError, match="abandon"):
        async with store.transaction() as conn:
            await hot.execute_rows(conn, journal.insert(), [row])
            raise RuntimeError("abandon")
    async with store.transaction() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(journal))).scalar() == 0


async def test_a_duplicate_operation_raises_integrity_error(store: Store) -> None:
    """The service retries an intent that lost a race on IntegrityError, on either path."""
    await store.run(submit_call(SubmitIntent(tool="create_ticket", arguments={"n": 1}), 1).one)
    again = SubmitCall(catalog=CATALOG, intent=SubmitIntent(tool="create_ticket",
                                                            arguments={"n": 2}),
                       subjects=SUBJECTS, operation_id="op1", outbox_id="ob2", now=NOW)
    with pytest.raises(IntegrityError):
        await store.run(again.one)



async def test_a_connection_lost_under_a_direct_statement_is_retried_on_a_new_one(
        store: Store) -> None:
    """A database restart closes the pool's connections. A direct statement that finds its
    connection gone must fail as retryable and take the connection out of the pool, as
    SQLAlchemy's own execute does; otherwise every transaction that drew it again failed."""
    _postgres_only(store)
    row = journal_row(operation_id="op0", at=datetime.now(UTC), kind="note", actor="test")
    async with store.engine.connect() as killer:
        victims = []
        async with store.engine.connect() as one, store.engine.connect() as two:
            for doomed in (one, two):  # two more connections, back to the pool after this
                victims.append((await doomed.execute(sa.text("SELECT pg_backend_pid()"))).scalar())
        # Killed while idle in the pool, as a database restart does; the pool cannot know.
        for victim in victims:
            await killer.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": victim})
    lost = 0
    for _ in range(4):  # the pool's connections, each drawn at least once
        try:
            async with store.transaction() as conn:
                await hot.execute_rows(conn, journal.insert(), [row])
        except StoreUnavailable:  # retryable: Store.run would try again on a fresh connection
            lost += 1
    # The first dead connection failed once and took the whole pool with it (as SQLAlchemy's
    # own path does on a disconnect), so the second dead one was never handed out.
    assert lost == 1
    async with store.transaction() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(journal))).scalar() == 3


async def test_a_transaction_cancelled_inside_a_statement_is_rolled_back_at_once(
        store: Store) -> None:
    """The ledger owns the transaction on the asyncpg connection (db/pgtx.py), so nothing else
    would roll it back: a cancelled caller must leave no open transaction behind."""
    _postgres_only(store)
    row = journal_row(operation_id="op0", at=datetime.now(UTC), kind="note", actor="test")
    inside = asyncio.Event()

    async def cancelled() -> None:
        async with store.transaction() as conn:
            await hot.execute_rows(conn, journal.insert(), [row])
            await hot.flush(conn)  # BEGIN and the INSERT are sent
            inside.set()
            await hot.fetch(conn, sa.select(sa.func.pg_sleep(60)), {})  # cancelled here

    # Watching from a connection checked out before: a checkout after the cancel would not
    # hand out a connection left inside a transaction (the pool guard), hiding one.
    async with store.engine.connect() as watcher:
        task = asyncio.create_task(cancelled())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        open_ones = (await watcher.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state <> 'idle' AND pid <> pg_backend_pid()"))).scalar()
        rows = (await watcher.execute(sa.select(sa.func.count()).select_from(journal))).scalar()
    assert (open_ones, rows) == (0, 0)


# ---- deferred writes (hot.execute_rows) -------------------------------------------------------

async def _statements(store: Store, calls: list[Any], *, alone: bool = False) -> list[str]:
    """What one transaction running `calls` as a batch (or its one call `alone`, as
    `BatchCall.one`) sends to PostgreSQL, statement by statement, as asyncpg's query logger
    sees them (BEGIN and COMMIT included)."""
    seen: list[str] = []

    def log(query: Any) -> None:
        seen.append(query.query)

    async with store.transaction() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        driver.add_query_logger(log)
        if alone:
            [call] = calls
            await call.one(conn)
        else:
            await type(calls[0]).many(conn, calls)
    driver.remove_query_logger(log)  # after the block: its COMMIT is logged too
    # Not ours: asyncpg's one-off introspection of a type it meets first (the id arrays).
    return [q for q in seen if "typeinfo_tree" not in q and "'jit'" not in q]


async def test_an_intent_alone_is_one_statement_without_begin_or_commit(store: Store) -> None:
    """Its three INSERTs are fused, and a transaction of one statement needs no BEGIN."""
    _postgres_only(store)
    [sent] = await _statements(store, [submit_call(SubmitIntent(tool="create_ticket"), 1)])
    assert [t for t in ("operations", "journal", "outbox") if f"INSERT INTO {t} " in sent] == [
        "operations", "journal", "outbox"]
    # Committed by itself: another connection sees all three rows.
    rows = await _as_printed(store)
    assert (len(rows["operations"]), len(rows["journal"]), len(rows["outbox"])) == (1, 1, 1)


async def test_an_intent_with_a_caller_key_reads_then_writes_without_begin_or_commit(
        store: Store) -> None:
    """The key's read is lockless (the unique key re-checks it at the INSERT), so it needs no
    transaction around it either: two statements, each its own transaction."""
    _postgres_only(store)
    keyed = SubmitIntent(tool="create_ticket", idempotency_key="k1")
    read, write = await _statements(store, [submit_call(keyed, 1)])
    assert read.startswith("SELECT") and "FOR UPDATE" not in read
    assert "INSERT INTO operations " in write
    # The same key again is found by that read and writes nothing.
    [again] = await _statements(store, [submit_call(keyed, 2)])
    assert again.startswith("SELECT")
    assert len((await _as_printed(store))["operations"]) == 1


async def test_a_claim_sends_its_writes_as_one_statement_after_its_read(store: Store) -> None:
    _postgres_only(store)
    await store.run(submit_call(SubmitIntent(tool="create_ticket"), 1).one)
    sent = await _statements(store, [claim_call("op1", "a1")])
    # BEGIN, the locking read, every write at once, COMMIT (the logger sees BEGIN, so the
    # intent's test above would see one too if it were sent).
    assert sent[0] == "BEGIN;" and sent[-1] == "COMMIT;" and len(sent) == 4, sent
    assert "FOR UPDATE" in sent[1]
    assert "UPDATE operations" in sent[2] and "INSERT INTO attempts" in sent[2]
    async with store.transaction() as conn:
        state = (await conn.execute(sa.text("SELECT state FROM operations"))).scalar()
    assert state == "in_flight"


async def test_a_statement_through_sqlalchemy_sees_the_writes_deferred_before_it(
        store: Store) -> None:
    _postgres_only(store)
    row = journal_row(operation_id=None, at=NOW, kind="note", actor="test")
    async with store.transaction() as conn:
        await hot.execute_rows(conn, journal.insert(), [row])
        count = sa.select(sa.func.count()).select_from(journal)
        assert (await conn.execute(count)).scalar() == 1


async def test_a_second_write_to_a_table_runs_after_the_first_not_beside_it(
        store: Store) -> None:
    """Fused writes share one snapshot: an UPDATE beside an INSERT into the same table would
    not see the inserted row. It must be sent after it, as written."""
    _postgres_only(store)
    row = journal_row(operation_id=None, at=NOW, kind="note", actor="test")
    async with store.transaction() as conn:
        await hot.execute_rows(conn, journal.insert(), [row, row])
        await hot.execute_rows(conn, journal.update().where(journal.c.kind == "note")
                               .values(actor="changed"), [{}])
    async with store.transaction() as conn:
        actors = (await conn.execute(sa.select(journal.c.actor))).scalars().all()
    assert actors == ["changed", "changed"]


async def test_two_claims_send_their_writes_as_one_statement(store: Store) -> None:
    """Each claim's UPDATEs name their own operation and dispatch command (`row_key`), so a
    batch of two sends them with the attempts' INSERT, not as executemany of their own: each
    table's rows as one statement over arrays (`hot._unnested`)."""
    _postgres_only(store)
    for n in (1, 2):
        await store.run(submit_call(SubmitIntent(tool="create_ticket"), n).one)
    sent = await _statements(store, [claim_call("op1", "a1"), claim_call("op2", "a2")])
    assert sent[0] == "BEGIN;" and sent[-1] == "COMMIT;" and len(sent) == 4, sent
    assert sent[2].count("UPDATE operations") == 1 and sent[2].count("UPDATE outbox") == 1
    assert sent[2].count("FROM unnest(") == 4, sent[2]  # and the journal's, the attempts'

    async with store.transaction() as conn:
        states = (await conn.execute(sa.text("SELECT state FROM operations"))).scalars().all()
    assert states == ["in_flight", "in_flight"]


async def _notes(store: Store, actors: list[str]) -> None:
    async with store.transaction() as conn:
        for i, actor in enumerate(actors):
            await hot.execute_rows(conn, journal.insert(), [journal_row(
                operation_id=None, at=NOW, kind=f"note{i}", actor=actor)])


_RENAME = (journal.update().where(journal.c.kind == sa.bindparam("b_kind"),
                                  journal.c.actor == sa.bindparam("b_from"))
           .values(actor=sa.bindparam("b_to")))


async def test_rows_of_one_update_naming_different_rows_are_fused_and_all_applied(
        store: Store) -> None:
    _postgres_only(store)
    await _notes(store, ["a", "a"])
    rows = [{"b_kind": "note0", "b_from": "a", "b_to": "x"},
            {"b_kind": "note1", "b_from": "a", "b_to": "y"}]
    seen: list[str] = []
    async with store.transaction() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        driver.add_query_logger(lambda q: seen.append(q.query))
        await hot.execute_rows(conn, _RENAME, rows, row_key=("b_kind",))
    # One statement for both rows (asyncpg may first look up the array types, once per
    # connection: that is a read of pg_type, not a write).
    updates = [q for q in seen if "UPDATE journal" in q]
    assert len(updates) == 1 and "FROM unnest(" in updates[0], seen
    assert all("pg_catalog" in q or "jit" in q for q in seen if q not in updates), seen
    async with store.transaction() as conn:
        actors = (await conn.execute(sa.select(journal.c.actor).order_by(journal.c.kind))
                  ).scalars().all()
    assert actors == ["x", "y"]


async def test_rows_of_one_update_naming_the_same_row_run_one_after_another(
        store: Store) -> None:
    """Fused, both would see the snapshot from before either, and the second (which needs the
    first's write) would change nothing: rows with equal keys keep executemany's order."""
    _postgres_only(store)
    await _notes(store, ["a"])
    rows = [{"b_kind": "note0", "b_from": "a", "b_to": "b"},
            {"b_kind": "note0", "b_from": "b", "b_to": "c"}]
    async with store.transaction() as conn:
        await hot.execute_rows(conn, _RENAME, rows, row_key=("b_kind",))
    async with store.transaction() as conn:
        assert (await conn.execute(sa.select(journal.c.actor))).scalar() == "c"


async def test_a_failing_part_of_a_fused_statement_writes_nothing(store: Store) -> None:
    """An intent whose outbox row collides: its operation and journal rows, fused into the same
    statement (and transaction) as the outbox row, are not written either."""
    _postgres_only(store)
    await store.run(submit_call(SubmitIntent(tool="create_ticket"), 1).one)
    clash = SubmitCall(catalog=CATALOG, intent=SubmitIntent(tool="create_ticket"),
                       subjects=SUBJECTS, operation_id="op2", outbox_id="ob1", now=NOW)
    with pytest.raises(IntegrityError):
        await store.run(clash.one)
    rows = await _as_printed(store)
    assert (len(rows["operations"]), len(rows["journal"]), len(rows["outbox"])) == (1, 1, 1)


async def test_an_outcome_dedups_and_locks_in_one_statement(store: Store) -> None:
    """BEGIN, the inbox INSERT fused with the locking read, the writes, COMMIT; a redelivered
    message is found a duplicate by that same statement and changes nothing."""
    _postgres_only(store)
    await store.run(submit_call(SubmitIntent(tool="create_ticket"), 1).one)
    await store.run(claim_call("op1", "a1").one)
    call = OutcomeCall(success("op1", "a1"), consumer="c", message_id="m1", subjects=SUBJECTS,
                       now=LATER, ambiguous_outbox_id="amb-m1")
    sent = await _statements(store, [call])
    assert sent[0] == "BEGIN;" and sent[-1] == "COMMIT;" and len(sent) == 4, sent
    assert "INSERT INTO inbox" in sent[1] and "FOR UPDATE" in sent[1]
    assert "UPDATE operations" in sent[2]
    again = await _statements(store, [call])
    assert again[0] == "BEGIN;" and len(again) == 3, again  # read, nothing to write, COMMIT
    async with store.transaction() as conn:
        state = (await conn.execute(sa.text("SELECT state FROM operations"))).scalar()
    assert state == "succeeded"
    [duplicate] = await store.run(OutcomeCall.many, [call])
    assert duplicate.status == "duplicate"


async def test_an_outcome_for_an_unknown_operation_is_rejected_not_dropped(store: Store) -> None:
    """The fused statement finds no operation to lock: its one row still says the message was
    new, so the outcome is rejected (and journaled) rather than taken for a duplicate."""
    _postgres_only(store)
    call = OutcomeCall(success("nope", "a1"), consumer="c", message_id="m9", subjects=SUBJECTS,
                       now=LATER, ambiguous_outbox_id="amb-m9")
    [result] = await store.run(OutcomeCall.many, [call])
    assert (result.status, result.reason) == ("rejected", "unknown_operation")
    [again] = await store.run(OutcomeCall.many, [call])
    assert again.status == "duplicate"


async def test_reads_direct_and_through_sqlalchemy_give_identical_views(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operation's view (read after every submit-and-wait) and the waiters' state reads go
    straight to asyncpg on a `Store.read()` connection (`hot.read_rows`); they must give what
    SQLAlchemy's execute gives, for every kind of operation the scenario leaves behind
    (attempts, evidence, JSON arguments with nulls, results)."""
    _postgres_only(store)
    await _scenario(store)
    ids = [f"op{n}" for n in (*range(6), 9)]

    async def views() -> tuple[list[dict[str, Any]], dict[str, str]]:
        async with store.read() as conn:
            out = [(await get_operation(conn, op_id)).model_dump(mode="json") for op_id in ids]
            return out, await states_of(conn, ids)

    direct = await views()
    sent: list[str] = []
    monkeypatch.setattr(hot.PgTransaction, "fetch", _spy(hot.PgTransaction.fetch, sent))
    assert await views() == direct and len(sent) == len(ids) + 1  # a view is one statement
    monkeypatch.setattr(hot, "READ_KEY", "not-there")  # every read through SQLAlchemy
    sent.clear()
    assert await views() == direct and sent == []
    assert {v["state"] for v in direct[0]} >= {"succeeded", "failed", "ambiguous"}
    assert any(v["attempts"] for v in direct[0]) and direct[1]["op0"] == "succeeded"


def _spy(fetch: Any, sent: list[str]) -> Any:
    async def spied(self: Any, sql: str, args: Any, *, begin: bool = True) -> Any:
        sent.append(sql)
        assert not begin  # a read on a read connection never opens a transaction
        return await fetch(self, sql, args, begin=begin)
    return spied


async def test_a_read_leaves_no_transaction_behind_and_a_lost_one_is_retryable(
        store: Store) -> None:
    """A direct read is a statement of its own (the connection is AUTOCOMMIT): nothing stays
    open on the connection; and one that finds its connection gone fails as StoreUnavailable
    and replaces the pool, as a direct statement in a transaction does."""
    _postgres_only(store)
    await store.run(submit_call(SubmitIntent(tool="create_ticket"), 1).one)
    async with store.engine.connect() as killer:  # checked out first: not the victim
        async with store.read() as conn:
            await get_operation(conn, "op1")
            driver: Any = (await conn.get_raw_connection()).driver_connection
            assert not driver.is_in_transaction()
            pid = (await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar()
        await killer.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    with pytest.raises(StoreUnavailable):
        for _ in range(store.engine.pool.size() + 1):  # until the dead one is drawn
            async with store.read() as conn:
                await get_operation(conn, "op1")
    async with store.read() as conn:  # the pool was replaced: the next read succeeds
        assert (await get_operation(conn, "op1")).id == "op1"
