"""Behind a backlog, every statement that moves an operation finds it by a key.

The guards on `state` (a claim wants `pending`, an outcome `in_flight`) are indexable, and the
planner weighs them by statistics that lag: a table with a history has few `pending` rows at
its last ANALYZE. It then chose to scan every `pending` entry of a state index and filter them
by id, so behind a backlog each claim read every queued row and the drain grew with the square
of the backlog (`transitions.on_the_row`, docs/design.md). Checked here on what PostgreSQL would
actually do: every statement that claims and outcomes send, alone and in a batch, is EXPLAINed
with its own arguments behind 3,000 queued operations the statistics do not know of, and no
plan may reach `operations` except through its primary key or a unique key.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.messages import OutcomeAmbiguous, SubmitIntent
from effectledger_ledger.db import pgtx
from effectledger_ledger.db.calls import BatchCall
from effectledger_ledger.db.intents import SubmitCall
from effectledger_ledger.db.outbox import MarkPublished, mark_published_txn, release_txn
from effectledger_ledger.db.schema import operations, outbox
from effectledger_ledger.db.store import Store
from tests.integration.test_alone import _claim, _digest, _outcome, _success
from tests.integration.test_set_based import claim_call, failed, submit, submit_call
from tests.support.ledger import NOW

QUEUED = 3_000
HISTORY = 300
TABLES = ("operations", "outbox")
# The ways into them that find a row, or an operation's rows, whatever its state or status.
KEYS = {"pk_operations", "uq_operations_operation_key", "uq_operations_call_key", "pk_outbox",
        "ix_outbox_operation"}


@pytest.fixture
async def backlog(store: Store) -> AsyncIterator[Store]:
    """A settled history the statistics know (ANALYZE found nothing pending), then op1..op6
    submitted and a queue of `pending` operations behind them that the statistics do not
    know of (autovacuum off for the test, so no ANALYZE runs in between)."""
    if not store.is_postgres:
        pytest.skip("these are PostgreSQL's plans; SQLite's one writer has no such statistics")
    await submit(store, 0)
    async with store.transaction() as conn:
        for table in ("operations", "outbox"):
            await conn.execute(sa.text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
        seed = dict((await conn.execute(
            sa.select(operations).where(operations.c.id == "op0"))).mappings().one())

        def clones(prefix: str, n: int, state: str) -> list[dict[str, Any]]:
            return [{**seed, "id": f"{prefix}{i}", "state": state,
                     "operation_key": f"{prefix}-key-{i}", "call_key": None}
                    for i in range(n)]

        await conn.execute(operations.insert(), clones("settled", HISTORY, "succeeded"))
        await conn.execute(operations.update().where(operations.c.id == "op0")
                           .values(state="succeeded"))
        command = dict((await conn.execute(
            sa.select(outbox).where(outbox.c.operation_id == "op0"))).mappings().one())
        await conn.execute(outbox.insert(), [
            {**command, "id": f"settled-ob{i}", "operation_id": f"settled{i}",
             "status": "consumed"} for i in range(HISTORY)])
        await conn.execute(outbox.update().where(outbox.c.operation_id == "op0")
                           .values(status="consumed"))
    async with store.transaction() as conn:  # nothing pending or publishing, as usual
        await conn.execute(sa.text("ANALYZE operations"))
        await conn.execute(sa.text("ANALYZE outbox"))
    for n in range(1, 7):
        await submit(store, n)
    async with store.transaction() as conn:
        await conn.execute(operations.insert(), clones("queued", QUEUED, "pending"))
        await conn.execute(outbox.insert(), [
            {**command, "id": f"queued-ob{i}", "operation_id": f"queued{i}",
             "status": "publishing"} for i in range(QUEUED)])
    try:
        yield store
    finally:
        async with store.transaction() as conn:
            for table in ("operations", "outbox"):
                await conn.execute(sa.text(f"ALTER TABLE {table} RESET (autovacuum_enabled)"))


async def _sent(store: Store, calls: list[BatchCall[Any]]) -> list[tuple[str, tuple[Any, ...]]]:
    """Each statement one transaction running `calls` sends (one call: alone, as
    `BatchCall.one`; several: as a batch), with its arguments; BEGIN and COMMIT left out."""
    if len(calls) == 1:
        return await _sent_by(store, calls[0].one)
    return await _sent_by(store, lambda conn: type(calls[0]).many(conn, calls))


async def _sent_by(store: Store, work: Callable[[AsyncConnection], Awaitable[Any]]
                   ) -> list[tuple[str, tuple[Any, ...]]]:
    """Each statement `work` sends in one transaction, with its arguments: what goes straight
    to asyncpg (`db/hot.py`, seen by asyncpg's query logger) and what goes through
    SQLAlchemy's execution layer (seen by its `before_cursor_execute`)."""
    seen: list[tuple[str, tuple[Any, ...]]] = []

    def direct(query: Any) -> None:
        if query.args and "typeinfo_tree" not in query.query and "'jit'" not in query.query:
            seen.append((query.query, tuple(query.args)))

    def through_sqlalchemy(conn: Any, cursor: Any, statement: str, parameters: Any,
                           context: Any, executemany: bool) -> None:
        for args in (parameters if executemany else [parameters]):
            if args:
                seen.append((statement, tuple(args)))

    sync_engine = store.engine.sync_engine
    sa.event.listen(sync_engine, "before_cursor_execute", through_sqlalchemy)
    try:
        async with store.transaction() as conn:
            driver: Any = (await conn.get_raw_connection()).driver_connection
            driver.add_query_logger(direct)
            await work(conn)
        # asyncpg hands each query to its loggers with `call_soon`; the loop runs callbacks in
        # the order they were scheduled, so once this one has run, all of theirs have.
        loop = asyncio.get_running_loop()
        logged = loop.create_future()
        loop.call_soon(logged.set_result, None)
        await logged
        driver.remove_query_logger(direct)
    finally:
        sa.event.remove(sync_engine, "before_cursor_execute", through_sqlalchemy)
    return seen


def _indexes(plan: dict[str, Any]) -> list[str]:
    """The indexes a bitmap heap scan reads: those of the bitmap index scans below it."""
    found = [plan["Index Name"]] if "Index Name" in plan else []
    for child in plan.get("Plans", ()):
        found += _indexes(child)
    return found


def _scans(plan: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(node type, index name or '') of every way `plan` reads `operations` or `outbox`."""
    if plan.get("Relation Name") in TABLES and "Scan" in plan["Node Type"]:
        if plan["Node Type"] == "Bitmap Heap Scan":
            for index in _indexes(plan):
                yield plan["Node Type"], index
        else:
            yield plan["Node Type"], plan.get("Index Name", "")
    for child in plan.get("Plans", ()):
        yield from _scans(child)


async def _ways_in(store: Store, sent: list[tuple[str, tuple[Any, ...]]], *,
                   generic: bool = False) -> list[tuple[str, str, str]]:
    """How PostgreSQL would reach `operations` and `outbox` in each statement: (statement,
    node, index). The plan for its own arguments (a custom plan, as the store's connections
    make); with `generic`, the plan made once for any arguments, as the writer's connection
    makes for what it sends outside a BEGIN (`pgtx.Pinned`)."""
    assert sent, "nothing was sent"
    found = []
    async with store.read() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        for query, args in sent:
            if generic:
                await driver.execute(f"PREPARE probe AS {query}")
                try:
                    await driver.execute("SET plan_cache_mode = force_generic_plan")
                    # A generic plan sees no values: NULLs for all.
                    nulls = f"({', '.join(['NULL'] * len(args))})" if args else ""
                    [row] = await driver.fetch(f"EXPLAIN (FORMAT JSON) EXECUTE probe{nulls}")
                finally:
                    await driver.execute("DEALLOCATE probe; RESET plan_cache_mode")
            else:
                [row] = await driver.fetch(f"EXPLAIN (FORMAT JSON) {query}", *args)
            # Decoded already where the connection has a JSON codec (SQLAlchemy's pool sets one).
            [doc] = json.loads(row[0]) if isinstance(row[0], str) else row[0]
            found += [(query[:60], node, index) for node, index in _scans(doc["Plan"])]
    return found


def _not_by_key(ways: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return [w for w in ways if w[2] not in KEYS]


async def test_claims_find_the_operation_by_its_key_behind_a_backlog(backlog: Store) -> None:
    store = backlog
    (t1, d1), (t2, d2), (t3, d3) = [await _digest(store, f"op{n}") for n in (1, 2, 3)]
    alone = await _sent(store, [_claim("op1", "a1", t1, d1)])
    batch = await _sent(store, [_claim("op2", "a2", t2, d2), _claim("op3", "a3", t3, d3)])
    ways = await _ways_in(store, alone + batch)
    assert any(index == "pk_operations" for _, _, index in ways)  # the claim's UPDATE
    assert _not_by_key(ways) == []


async def test_outcomes_find_the_operation_by_its_key_behind_a_backlog(backlog: Store) -> None:
    store = backlog
    for n in range(1, 7):
        await store.run(claim_call(f"op{n}", f"a{n}").one)
    lost = OutcomeAmbiguous(operation_id="op6", epoch=1, attempt_id="a6", dispatcher_id="d1",
                            at=NOW, reason="timeout")
    sent = [
        *await _sent(store, [_outcome(_success("op1", "a1"), "m1")]),  # alone: one statement
        *await _sent(store, [_outcome(_success("op2", "a2"), "m2"),
                             _outcome(_success("op3", "a3"), "m3")]),
        *await _sent(store, [_outcome(failed("op4", "a4", "retry_me"), "m4")]),  # retried
        *await _sent(store, [_outcome(failed("op5", "a5", "no"), "m5"),
                             _outcome(lost, "m6")]),
    ]
    ways = await _ways_in(store, sent)
    assert any(index == "pk_operations" for _, _, index in ways)
    assert _not_by_key(ways) == []


async def test_a_large_batch_writes_its_rows_by_key_behind_a_backlog(backlog: Store) -> None:
    """A batch larger than a VALUES list takes (`hot.FUSE_ROWS`): its rows are written over
    arrays, one statement per table (`hot._unnested`), joined to the table by the same WHERE;
    the join must still reach each row by its key. (At 64 calls against this test's 3,300
    rows, a scan is the cheaper plan, for the batch's locking read too; a production table
    holds the retention period's history.)"""
    store = backlog
    tool, digest = await _digest(store, "queued0")
    ops = [f"queued{i}" for i in range(16)]
    claims = await _sent(store, [_claim(op, f"qa{i}", tool, digest) for i, op in enumerate(ops)])
    outcomes = await _sent(store, [_outcome(_success(op, f"qa{i}"), f"qm{i}")
                                   for i, op in enumerate(ops)])
    assert sum("FROM unnest(" in q for q, _ in claims + outcomes) >= 2
    ways = await _ways_in(store, claims + outcomes)
    assert any(index == "pk_operations" for _, _, index in ways)
    assert _not_by_key(ways) == []


async def test_the_check_sees_a_plan_that_scans_the_backlog(backlog: Store) -> None:
    """The check itself can fail: the guard written plainly, as it was, is planned as a scan
    of the state index behind this backlog."""
    store = backlog
    plain = ("UPDATE operations SET updated_at = $1 WHERE operations.id = $2 AND "
             "operations.epoch = $3 AND operations.state = $4 AND operations.state IN "
             "('pending')")
    ways = await _ways_in(store, [(plain, (NOW, "op1", 1, "pending"))])
    assert _not_by_key(ways), ways


async def test_the_relays_marks_find_their_rows_by_key_behind_a_backlog(backlog: Store) -> None:
    """The relay marks what it published, or hands it back, by outbox id; behind 3,000 rows
    being published that the statistics do not know of, neither may scan them."""
    store = backlog
    async with store.transaction() as conn:
        ids = list((await conn.execute(
            outbox.update().where(outbox.c.operation_id.in_(["op1", "op2", "op3"]))
            .values(status="publishing").returning(outbox.c.id))).scalars())
    sent = [
        *await _sent_by(store, lambda conn: mark_published_txn(
            conn, ids[:1], now=NOW, seqs={ids[0]: 7})),
        *await _sent(store, [MarkPublished(ids=ids[1:2], now=NOW),
                             MarkPublished(ids=ids[2:], now=NOW)]),
        *await _sent_by(store, lambda conn: release_txn(conn, ids, now=NOW, error="down",
                                                      retry_after_s=1.0)),
    ]
    ways = await _ways_in(store, sent)
    assert any(index == "pk_outbox" for _, _, index in ways)
    assert _not_by_key(ways) == []


async def _calls_alone(store: Store, n: int) -> list[tuple[str, tuple[Any, ...]]]:
    """What an agent's call sends when it is alone in its transactions (the writer's idle
    path): a new intent with a caller key, one joining identical calls, the first one's claim
    and its success. `n`: a number no operation of the test uses yet."""
    keyed = submit_call(SubmitIntent(tool="create_ticket", arguments={"n": n},
                                     idempotency_key=f"key-{n}"), n)
    joined = submit_call(SubmitIntent(tool="create_ticket", arguments={"n": n + 1},
                                      join_identical=True), n + 1)
    sent = [*await _sent(store, [keyed]), *await _sent(store, [joined])]
    tool, digest = await _digest(store, f"op{n}")
    sent += await _sent(store, [_claim(f"op{n}", f"a{n}", tool, digest)])
    sent += await _sent(store, [_outcome(_success(f"op{n}", f"a{n}"), f"m{n}")])
    return sent


async def test_what_the_writer_plans_once_finds_rows_by_key_on_an_empty_database(
        store: Store) -> None:
    """A generic plan is made at a statement's first execution on the writer's connection and
    kept; after a deploy that is on empty tables, whose statistics say nothing."""
    if not store.is_postgres:
        pytest.skip("these are PostgreSQL's plans")
    ways = await _ways_in(store, await _calls_alone(store, 100), generic=True)
    assert any(index == "pk_operations" for _, _, index in ways)
    assert _not_by_key(ways) == []


async def test_what_the_writer_plans_once_finds_rows_by_key_behind_a_backlog(
        backlog: Store) -> None:
    ways = await _ways_in(backlog, await _calls_alone(backlog, 100), generic=True)
    assert any(index == "pk_operations" for _, _, index in ways)
    assert _not_by_key(ways) == []


async def _sent_outside_a_begin(store: Store, monkeypatch: pytest.MonkeyPatch,
                                batches: list[list[BatchCall[Any]]]
                                ) -> list[tuple[str, tuple[Any, ...]]]:
    """What the writer's held connection (`pgtx.Pinned`) sends outside a BEGIN, where it
    plans once, while it runs `batches` (one call: alone; several: as a batch)."""
    outside: list[tuple[str, tuple[Any, ...]]] = []
    real_execute, real_fetch = pgtx.PgTransaction.execute, pgtx.PgTransaction.fetch

    async def execute(tx: pgtx.PgTransaction, sql: str, args: Any, *,
                      begin: bool = True) -> None:
        if not (begin or tx.began):
            outside.append((sql, tuple(args)))
        await real_execute(tx, sql, args, begin=begin)

    async def fetch(tx: pgtx.PgTransaction, sql: str, args: Any, *, begin: bool = True) -> Any:
        if not (begin or tx.began):
            outside.append((sql, tuple(args)))
        return await real_fetch(tx, sql, args, begin=begin)

    monkeypatch.setattr(pgtx.PgTransaction, "execute", execute)
    monkeypatch.setattr(pgtx.PgTransaction, "fetch", fetch)
    pinned = store.pinned()
    assert pinned is not None
    try:
        for calls in batches:
            async with store.transaction(pinned) as conn:
                if len(calls) == 1:
                    await calls[0].one(conn)
                else:
                    await type(calls[0]).many(conn, calls)
    finally:
        await pinned.release()
    return outside


async def test_the_writer_plans_once_only_what_finds_rows_by_key(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an empty database, where the writer's first plans are made after a deploy: an
    intent with a key alone, keyed intents in a batch (whose key read, `= ANY($1)`, a generic
    plan made on a small table would scan), a plain intent (its lone write), a claim and a
    success alone. Everything the writer sends outside a BEGIN finds its rows by keys in a
    plan made once, and the key read is not among them."""
    if not store.is_postgres:
        pytest.skip("these are PostgreSQL's plans")

    def keyed(n: int) -> SubmitCall:
        return submit_call(SubmitIntent(tool="create_ticket", arguments={"n": n},
                                        idempotency_key=f"key-{n}"), n)

    outside = await _sent_outside_a_begin(store, monkeypatch, [
        [keyed(1)], [keyed(2), keyed(3)],
        [submit_call(SubmitIntent(tool="create_ticket", arguments={"n": 4}), 4)]])
    tool, digest = await _digest(store, "op1")
    outside += await _sent_outside_a_begin(store, monkeypatch, [
        [_claim("op1", "a1", tool, digest)], [_outcome(_success("op1", "a1"), "m1")]])
    reads = [q for q, _ in outside if q.lstrip().upper().startswith("SELECT")]
    assert all(q.startswith("SELECT pg_notify(") for q in reads), reads  # reads no table
    ways = await _ways_in(store, outside, generic=True)
    assert any(index == "pk_operations" for _, _, index in ways)
    assert _not_by_key(ways) == []
