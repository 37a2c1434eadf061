"""The fused form (one statement per set-based step on PostgreSQL) writes exactly what the
statement-by-statement form writes.

Each scenario runs twice on the same PostgreSQL database, once with the writes fused and once
one statement each (`fused.statement_by_statement`), and every row is compared as PostgreSQL
prints it (`t::text`), so that a JSON null stored where SQL NULL was (or the reverse), a
timestamp shifted or a string cut would show.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from effectledger_core.messages import (
    AttemptAccepted,
    OutcomeAmbiguous,
    SubmitIntent,
)
from effectledger_core.states import Event, State
from effectledger_ledger.db import fused
from effectledger_ledger.db.batch import BatchCall
from effectledger_ledger.db.outcomes import OutcomeCall
from effectledger_ledger.db.schema import journal, metadata
from effectledger_ledger.db.store import Store
from effectledger_ledger.db.transitions import Change, apply_many
from tests.integration.test_set_based import (
    LATER,
    NOW,
    SUBJECTS,
    claim_call,
    failed,
    normal,
    reset,
    retry_when_asked,
    submit,
    submit_call,
    success,
)


async def raw(store: Store) -> dict[str, list[str]]:
    """Every row as PostgreSQL prints it (the journal without its serial id)."""
    out = {}
    async with store.transaction() as conn:
        for table in metadata.sorted_tables:
            if table is journal:
                cols = ", ".join(c.name for c in journal.c if c.name != "id")
                sql = f"SELECT ROW({cols})::text FROM journal ORDER BY operation_id, id"
            else:
                pk = ", ".join(c.name for c in table.primary_key.columns)
                sql = f"SELECT t::text FROM {table.name} t ORDER BY {pk}"
            out[table.name] = list((await conn.execute(sa.text(sql))).scalars())
    return out


def count_statements(store: Store) -> list[str]:
    seen: list[str] = []

    @event.listens_for(store.engine.sync_engine, "before_cursor_execute")
    def _seen(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        seen.append(statement.split()[0])

    return seen


async def both_forms(store: Store, setup: Callable[[], Awaitable[None]],
                     calls: Sequence[BatchCall[Any]]) -> list[str]:
    """Run `calls` as one batch with and without fusing; replies and rows must agree.

    Returns the first words of the statements the fused batch sent."""
    seen = count_statements(store)
    await reset(store)
    await setup()
    with fused.statement_by_statement():
        async with store.transaction() as conn:
            apart = [normal(r) for r in await type(calls[0]).many(conn, calls)]
    rows_apart = await raw(store)
    await reset(store)

    await setup()
    seen.clear()
    async with store.transaction() as conn:
        together = [normal(r) for r in await type(calls[0]).many(conn, calls)]
    sent = list(seen)
    assert together == apart
    assert await raw(store) == rows_apart
    return sent


@pytest.fixture
def pg_store(store: Store) -> Store:
    if not store.is_postgres:
        pytest.skip("fused statements are PostgreSQL's (SQLite keeps one statement each)")
    return store


async def test_intents_fused_write_what_they_wrote_apart(pg_store: Store) -> None:
    async def nothing() -> None:
        return None

    a = {"title": "a", "none": None, "n": 1e16}
    intents = [
        SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1",
                     task_id="t", tenant="x" * 1024),
        SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1"),  # same again
        SubmitIntent(tool="create_ticket", arguments={"title": "b"}),
        SubmitIntent(tool="wire_money", arguments=a, idempotency_key="k2"),  # needs approval
    ]
    calls = [submit_call(i, n) for n, i in enumerate(intents)]
    leased = submit_call(SubmitIntent(tool="create_ticket", arguments={"l": 1}), 9)
    calls.append(type(leased)(**{**{f: getattr(leased, f) for f in leased.__slots__},
                                 "lease_until": NOW + timedelta(seconds=30),
                                 "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}))
    sent = await both_forms(pg_store, nothing, calls)
    assert sent.count("WITH") == 1 and "INSERT" not in sent  # the read by key, then one write


async def test_claims_fused_write_what_they_wrote_apart(pg_store: Store) -> None:
    async def setup() -> None:
        for n in range(4):
            await submit(pg_store, n, tool="wire_money" if n == 2 else "create_ticket")

    sent = await both_forms(pg_store, setup, [
        claim_call("op0", "a1"),
        claim_call("op0", "a1"),  # the same attempt again
        claim_call("op0", "a2"),  # already claimed
        claim_call("op1", "b1", epoch=2),  # stale: journaled only
        claim_call("op2", "c1"),  # not claimable
        claim_call("op3", "d1"),
    ])
    assert sent == ["SELECT", "WITH"]  # the locking read, then one write


async def test_outcomes_fused_write_what_they_wrote_apart(pg_store: Store) -> None:
    async def setup() -> None:
        for n in range(5):
            await submit(pg_store, n)
            await pg_store.run(claim_call(f"op{n}", f"a{n}").one)

    def call(outcome: Any, message_id: str) -> OutcomeCall:
        return OutcomeCall(outcome, consumer="c", message_id=message_id, subjects=SUBJECTS,
                           now=LATER, ambiguous_outbox_id=f"amb-{message_id}",
                           decide_retry=retry_when_asked)

    accepted = AttemptAccepted(operation_id="op2", epoch=1, attempt_id="a2", dispatcher_id="d1",
                               at=LATER, provider_ref="ref-op2", response_digest="sha256:02")
    ambiguous = OutcomeAmbiguous(operation_id="op3", epoch=1, attempt_id="a3",
                                 dispatcher_id="d1", at=LATER, reason="timeout")
    await both_forms(pg_store, setup, [
        call(failed("op0", "a0", "retry_me"), "m0"),
        call(success("op0", "a0"), "m1"),
        call(failed("op1", "a1", "no"), "m2"),
        call(accepted, "m3"),
        call(ambiguous, "m4"),
        call(success("op3", "a3"), "m5"),
        call(success("op4", "a4"), "m6"),
    ])
    sent = await both_forms(pg_store, setup, [call(success(f"op{n}", f"a{n}"), f"s{n}")
                                              for n in range(5)])
    assert sent == ["INSERT", "SELECT", "WITH"]  # inbox, locking read, one write


async def test_two_changes_of_one_operation_keep_their_order(pg_store: Store) -> None:
    """Parts of one statement see the same snapshot: a second change of the same operation
    in one batch would miss the first, so such a batch is written one statement at a time."""
    await submit(pg_store, 0)
    claim = Change(operation_id="op0", epoch=1, from_state=State.PENDING, event=Event.CLAIM,
                   at=LATER, actor="d1", detail={})
    done = Change(operation_id="op0", epoch=1, from_state=State.IN_FLIGHT,
                  event=Event.OUTCOME_SUCCEEDED, at=LATER, actor="d1", detail={})
    async with pg_store.transaction() as conn:
        await apply_many(conn, [claim, done])
    async with pg_store.transaction() as conn:
        state = (await conn.execute(sa.text("SELECT state FROM operations"))).scalar()
        kinds = list((await conn.execute(sa.text(
            "SELECT to_state FROM journal WHERE operation_id = 'op0' ORDER BY id"))).scalars())
    assert state == "succeeded"
    assert kinds == ["pending", "in_flight", "succeeded"]


async def test_fused_updates_find_their_rows_by_index(pg_store: Store) -> None:
    """The planner takes a jsonb recordset for 100 rows; joined to outbox on its non-unique
    index it chose a sequential scan of the whole table for every claim batch. The updates
    look their rows up by an array condition, which is an index scan however large the table."""
    calls = [submit_call(SubmitIntent(tool="create_ticket", arguments={"n": n}), n)
             for n in range(3000)]
    async with pg_store.transaction() as conn:
        await type(calls[0]).many(conn, calls)
        await type(claim_call("op0", "a0")).many(
            conn, [claim_call(f"op{n}", f"a{n}") for n in range(10, 3000)])
        await conn.execute(sa.text("ANALYZE"))
    fused_sent: list[tuple[str, Any]] = []

    @event.listens_for(pg_store.engine.sync_engine, "before_cursor_execute")
    def _seen(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.startswith("WITH"):
            fused_sent.append((statement, parameters))

    async with pg_store.transaction() as conn:
        await type(claim_call("op1", "a1")).many(conn, [claim_call("op1", "a1"),
                                                        claim_call("op2", "a2")])
    async with pg_store.transaction() as conn:
        await OutcomeCall.many(conn, [OutcomeCall(success("op1", "a1"), consumer="c",
                                                  message_id="m1", subjects=SUBJECTS, now=LATER,
                                                  ambiguous_outbox_id="x")])
    assert len(fused_sent) == 2
    for statement, parameters in fused_sent:
        async with pg_store.transaction() as conn:
            plan = "\n".join(r[0] for r in (await conn.exec_driver_sql(
                "EXPLAIN " + statement, parameters)).all())
        assert "Seq Scan" not in plan, plan
