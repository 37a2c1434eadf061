"""A read takes the writes that wait before it along in its own statement (db/hot.py, `Reads`).

In a mixed group-commit batch the claims' locking read carries the intents' writes, and the
outcomes' inbox-and-lock statement the claims' writes: two round trips fewer on the one writer.
Allowed only where no waiting write writes a row the read reads (they share one snapshot, and
the read would not see them); otherwise the writes go first, as before. Checked here on what
is sent, on what is decided, and on the rows, against SQLAlchemy's execution (no fusing).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

from effectledger_core.messages import SubmitIntent
from effectledger_core.states import Event
from effectledger_ledger.db import hot
from effectledger_ledger.db.claims import _INSERT_ATTEMPT
from effectledger_ledger.db.common import _INSERT_JOURNAL
from effectledger_ledger.db.outcomes import _FINISH_ATTEMPT, OutcomeCall
from effectledger_ledger.db.store import Store
from effectledger_ledger.db.transitions import _statement
from tests.integration.test_hot import _as_printed, _postgres_only
from tests.integration.test_set_based import (
    LATER,
    SUBJECTS,
    claim_call,
    reset,
    retry_when_asked,
    submit_call,
    success,
)


def _outcome(op: str, attempt: str, message_id: str) -> OutcomeCall:
    return OutcomeCall(success(op, attempt), consumer="c", message_id=message_id,
                       subjects=SUBJECTS, now=LATER, ambiguous_outbox_id=f"amb-{message_id}",
                       decide_retry=retry_when_asked)


async def _in_one_transaction(store: Store, groups: list[list[Any]]) -> tuple[list[str], list[Any]]:
    """Each group's `many` in turn in one transaction, as group commit runs a mixed batch:
    the statements sent (asyncpg's own type lookups left out) and each group's results."""
    seen: list[str] = []
    results: list[Any] = []

    def log(query: Any) -> None:
        seen.append(query.query)

    async with store.transaction() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        driver.add_query_logger(log)
        for calls in groups:
            results.append(await type(calls[0]).many(conn, calls))
    driver.remove_query_logger(log)  # after the block: its COMMIT is logged too
    return [q for q in seen if "typeinfo_tree" not in q and "'jit'" not in q], results


async def _setup(store: Store) -> None:
    """op1 claimed by a1 (its outcome can come), op2 pending (it can be claimed)."""
    for n in (1, 2):
        await store.run(submit_call(SubmitIntent(tool="create_ticket"), n).one)
    await store.run(claim_call("op1", "a1").one)


def _mixed() -> list[list[Any]]:
    return [[submit_call(SubmitIntent(tool="create_ticket"), 3)],
            [claim_call("op2", "a2")],
            [_outcome("op1", "a1", "m1")]]


async def _states(store: Store) -> dict[str, str]:
    async with store.transaction() as conn:
        return dict((await conn.execute(sa.text("SELECT id, state FROM operations"))).all())


async def test_a_mixed_batch_sends_each_groups_writes_with_the_next_read(store: Store) -> None:
    _postgres_only(store)
    await _setup(store)
    sent, results = await _in_one_transaction(store, _mixed())
    # BEGIN, the claims' read with the intent's writes, the outcomes' read with the claims'
    # writes, the outcomes' writes, COMMIT: seven statements before.
    assert len(sent) == 5 and sent[0].startswith("BEGIN") and sent[-1] == "COMMIT;", sent
    claims_read, outcomes_read = sent[1], sent[2]
    assert "INSERT INTO operations" in claims_read and "FOR UPDATE" in claims_read
    assert "UPDATE operations" in outcomes_read and "INSERT INTO attempts" in outcomes_read
    assert "INSERT INTO inbox" in outcomes_read
    assert results[1][0].status.value == "granted" and results[2][0].status == "applied"
    assert await _states(store) == {"op1": "succeeded", "op2": "in_flight", "op3": "pending"}


async def test_a_read_of_a_row_a_waiting_write_changes_sends_the_write_first(
        store: Store) -> None:
    """The claim of op2 and its outcome in one transaction: fused, the outcome's read would
    see op2 still `pending` and reject the outcome; sent first, the claim's writes are seen."""
    _postgres_only(store)
    await _setup(store)
    sent, results = await _in_one_transaction(
        store, [[claim_call("op2", "a2")], [_outcome("op2", "a2", "m2")]])
    assert results[1][0].status == "applied", results
    assert (await _states(store))["op2"] == "succeeded"
    outcomes_read = next(q for q in sent if "INSERT INTO inbox" in q)
    assert "UPDATE operations" not in outcomes_read
    assert any("UPDATE operations" in q and "INSERT INTO inbox" not in q for q in sent)


async def test_a_mixed_batch_writes_the_rows_sqlalchemys_execution_writes(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _postgres_only(store)
    await _setup(store)
    _, fused = await _in_one_transaction(store, _mixed())
    fused_rows = await _as_printed(store)
    await reset(store)
    monkeypatch.setattr(hot, "_direct", lambda conn: None)
    await _setup(store)
    _, plain = await _in_one_transaction(store, _mixed())
    assert [[repr(r) for r in group] for group in plain] == [
        [repr(r) for r in group] for group in fused]
    assert await _as_printed(store) == fused_rows


def _param(stmt: sa.Executable, keys: tuple[str, ...]) -> str | None:
    return hot._compiled(stmt, asyncpg_dialect(), keys).op_param


def test_each_write_knows_the_operation_of_its_rows_or_says_it_does_not() -> None:
    assert _param(_INSERT_JOURNAL, ("operation_id", "at", "kind")) == "operation_id"
    assert _param(_INSERT_ATTEMPT, ("id", "operation_id", "epoch")) == "operation_id"
    moved = _statement(Event.CLAIM, ())
    assert _param(moved, tuple(hot._compiled(moved, asyncpg_dialect(), ()).names)) == "b_id"
    # An attempt named by its own id: whose operation is not known, so it is never fused
    # with a read of attempts.
    finish = ("b_id", "b_status", "b_now", "b_http", "b_ref", "b_digest", "b_detail")
    assert _param(_FINISH_ATTEMPT, finish) is None


def test_a_write_of_unknown_operations_to_a_table_read_is_not_independent() -> None:
    reads = hot.Reads(frozenset({"operations", "attempts"}), frozenset({"op1"}))

    def write(table: str, ops: frozenset[str] | None) -> hot._Write:
        return hot._Write("", (), table, True, ops)

    assert hot._independent([write("journal", None), write("operations", frozenset({"op2"}))],
                            reads)
    assert not hot._independent([write("attempts", None)], reads)
    assert not hot._independent([write("operations", frozenset({"op1", "op2"}))], reads)


def test_a_read_with_ctes_of_its_own_gets_the_writes_first_in_its_with_list() -> None:
    write = ("INSERT INTO t (a) VALUES ($1)", 1)
    assert hot._fused((write, ("WITH x AS (SELECT $1) SELECT * FROM x", 1))) == (
        "WITH w0 AS (INSERT INTO t (a) VALUES ($1)), x AS (SELECT $2) SELECT * FROM x")
    # RECURSIVE qualifies the whole list; plain CTEs may stand in it.
    assert hot._fused((write, ("WITH RECURSIVE r(n) AS (SELECT $1) SELECT n FROM r", 1))) == (
        "WITH RECURSIVE w0 AS (INSERT INTO t (a) VALUES ($1)), r(n) AS (SELECT $2) "
        "SELECT n FROM r")
