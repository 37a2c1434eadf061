"""What the chaos harness found in the ledger, pinned on both databases (no processes needed).

1. A claim whose reply was lost is re-granted to the same attempt id, but only while that
   attempt is still open, and the re-grant moves `claimed_at` forward: reconciliation counts the
   provider's processing horizon from `claimed_at`, and a dispatcher that only learns of its
   claim now only starts sending now. Before, a re-ask arriving after the attempt had been
   declared ambiguous (or after its epoch was retried) was granted and called the provider
   again, and a late re-grant left the horizon counted from the old claim: the reconciler read
   "not found" before the provider had applied the late request, and retried a non-idempotent
   call (seen as a `not_applied` verdict contradicting the provider, seed 3).
2. A claimed attempt whose outcome message the broker lost (a stream message deleted) stayed
   `in_flight` forever; the sweeper now hands it to reconciliation as ambiguous after
   `lost_outcome_after_s`.
3. A database that refuses connections (stopped, or a reset link) surfaced as the socket's own
   error: an HTTP 500 without the JSON error body, and no retry. It is `StoreUnavailable` now.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from effectledger_cli.embedded import free_port
from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.errors import StoreUnavailable
from effectledger_core.messages import (
    AttemptSucceeded,
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    OutcomeAmbiguous,
    ReconcileOperation,
    SubmitIntent,
)
from effectledger_core.subjects import Subjects
from effectledger_ledger.db.claims import claim_txn
from effectledger_ledger.db.intents import submit_intent_txn
from effectledger_ledger.db.lost import any_lost_outcomes, sweep_lost_outcomes_txn
from effectledger_ledger.db.outcomes import record_outcome_txn
from effectledger_ledger.db.schema import attempts, journal, operations, outbox
from effectledger_ledger.db.store import Store

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
SUBJECTS = Subjects(prefix="tst", stream_prefix="TST")
CATALOG = Catalog.load(DEMO_CATALOG)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


async def _submit(store: Store) -> None:
    await store.run(submit_intent_txn, catalog=CATALOG,
                    intent=SubmitIntent(tool="send_email", arguments={"title": "x"}),
                    subjects=SUBJECTS, operation_id="op1", outbox_id="ob1", now=T0)


async def _claim(store: Store, attempt: str, when: float, epoch: int = 1) -> ClaimReply:
    return await store.run(claim_txn, ClaimAttempt(
        operation_id="op1", epoch=epoch, attempt_id=attempt, dispatcher_id="d1"), now=at(when))


async def _one(store: Store, table: sa.Table, *where: Any) -> dict[str, Any]:
    async with store.transaction() as conn:
        return dict((await conn.execute(sa.select(table).where(*where))).mappings().one())


async def _kinds(store: Store) -> list[str]:
    async with store.transaction() as conn:
        return list((await conn.execute(sa.select(journal.c.kind).where(
            journal.c.operation_id == "op1").order_by(journal.c.id))).scalars())


async def test_a_reasked_open_claim_is_regranted_and_the_attempt_starts_again(
        store: Store) -> None:
    await _submit(store)
    assert (await _claim(store, "a1", 1)).status is ClaimStatus.GRANTED
    again = await _claim(store, "a1", 30)
    assert again.status is ClaimStatus.GRANTED and again.attempt_id == "a1"
    att = await _one(store, attempts, attempts.c.id == "a1")
    assert att["claimed_at"] == at(30)  # the horizon counts from the grant acted upon


async def test_a_reasked_claim_of_a_closed_attempt_is_refused_and_journaled(
        store: Store) -> None:
    await _submit(store)
    await _claim(store, "a1", 1)
    # Another dispatcher found the epoch claimed and declared it lost mid-attempt.
    lost = OutcomeAmbiguous(operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d2",
                            at=at(5), reason="dispatcher_lost_mid_attempt")
    await store.run(record_outcome_txn, lost, consumer="c", message_id="m1", subjects=SUBJECTS,
                    now=at(5), ambiguous_outbox_id="ob2")
    late = await _claim(store, "a1", 20)
    assert late.status is ClaimStatus.NOT_CLAIMABLE
    assert (await _one(store, operations, operations.c.id == "op1"))["state"] == "ambiguous"
    assert (await _one(store, attempts, attempts.c.id == "a1"))["claimed_at"] == at(1)
    assert (await _kinds(store))[-1] == "claim_rejected"


async def test_an_attempt_whose_outcome_was_lost_is_handed_to_reconciliation(
        store: Store) -> None:
    await _submit(store)
    await _claim(store, "a1", 1)
    ids = iter(["r1", "r2", "r3"])
    kw: dict[str, Any] = dict(older_than_s=60, subjects=SUBJECTS, new_id=lambda: next(ids))

    async def stuck(t: float) -> bool:
        """The sweeper's lockless question first: true exactly when the sweep finds one."""
        async with store.read() as conn:
            return await any_lost_outcomes(conn, now=at(t), older_than_s=60)

    assert not await stuck(30)
    assert await store.run(sweep_lost_outcomes_txn, now=at(30), **kw) == 0  # not yet
    assert await stuck(62)
    assert await store.run(sweep_lost_outcomes_txn, now=at(62), **kw) == 1
    assert not await stuck(90)
    op = await _one(store, operations, operations.c.id == "op1")
    assert (op["state"], op["epoch"]) == ("ambiguous", 1)
    assert (await _one(store, attempts, attempts.c.id == "a1"))["status"] == "outcome_lost"
    row = await _one(store, outbox, outbox.c.kind == "reconcile")
    cmd = ReconcileOperation.model_validate_json(row["payload"])
    assert (cmd.attempt_id, cmd.cause, cmd.claimed_at) == ("a1", "ambiguous", at(1))
    assert "outcome_presumed_lost" in await _kinds(store)
    assert await store.run(sweep_lost_outcomes_txn, now=at(90), **kw) == 0  # done once
    # The attempt is closed: its dispatcher asking again must not start a provider call ...
    assert (await _claim(store, "a1", 91)).status is ClaimStatus.NOT_CLAIMABLE
    # ... and if its success does arrive after all, it resolves the ambiguity.
    ok = AttemptSucceeded(operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1",
                          at=at(92), response_digest="sha256:x")
    await store.run(record_outcome_txn, ok, consumer="c", message_id="m2", subjects=SUBJECTS,
                    now=at(92), ambiguous_outbox_id="ob3")
    assert (await _one(store, operations, operations.c.id == "op1"))["state"] == "succeeded"


async def test_a_database_that_refuses_connections_is_unavailable_not_an_internal_error(
        ) -> None:
    dead = Store(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nothing")
    try:
        with pytest.raises(StoreUnavailable):
            await dead.run(_submit_txn_probe, attempts=2)
    finally:
        await dead.close()


async def _submit_txn_probe(conn: Any) -> None:
    await conn.execute(sa.text("SELECT 1"))
