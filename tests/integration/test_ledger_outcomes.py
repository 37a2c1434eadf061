"""The outcome inbox on both databases: dedup, fencing, journaling, the ambiguity hand-off."""

from __future__ import annotations

import asyncio
import itertools
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    ClaimAttempt,
    ClaimStatus,
    DeadLetter,
    FailureClass,
    Outcome,
    OutcomeAmbiguous,
    ReconcileOperation,
    SubmitIntent,
    parse,
)
from effectledger_ledger.db.claims import claim_txn
from effectledger_ledger.db.intents import submit_intent_txn
from effectledger_ledger.db.outcomes import record_dead_letter_txn, record_outcome_txn
from effectledger_ledger.db.resolution import Recorded
from effectledger_ledger.db.schema import (
    attempts,
    dead_letters,
    inbox,
    journal,
    operations,
    outbox,
)
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.support.ledger import DEMO as CATALOG
from tests.support.ledger import NOW, SUBJECTS

LATER = NOW + timedelta(seconds=7)
OUT = dict(operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1", at=LATER)


async def rows(store: Store, table: sa.Table, *where: Any) -> list[dict[str, Any]]:
    async with store.transaction() as conn:
        return [dict(r) for r in (await conn.execute(sa.select(table).where(*where)))
                .mappings().all()]


async def op_row(store: Store, op_id: str = "op1") -> dict[str, Any]:
    [op] = await rows(store, operations, operations.c.id == op_id)
    return op


async def journal_kinds(store: Store, op_id: str = "op1") -> list[str]:
    async with store.transaction() as conn:
        return list((await conn.execute(
            sa.select(journal.c.kind).where(journal.c.operation_id == op_id)
            .order_by(journal.c.id))).scalars())


async def in_flight(store: Store, op_id: str = "op1", attempt_id: str = "a1") -> None:
    """A submitted and claimed operation, ready for its outcome."""
    await store.run(submit_intent_txn, catalog=CATALOG,
                    intent=SubmitIntent(tool="create_ticket", arguments={"title": op_id}),
                    subjects=SUBJECTS, operation_id=op_id, outbox_id=f"ob_{op_id}", now=NOW)
    reply = await store.run(claim_txn, ClaimAttempt(operation_id=op_id, epoch=1,
                                                    attempt_id=attempt_id, dispatcher_id="d1"),
                            now=NOW)
    assert reply.status is ClaimStatus.GRANTED


async def record(store: Store, outcome: Outcome, message_id: str, *,
                 consumer: str = "ledger.outcomes", amb_id: str = "amb1") -> Recorded:
    return await store.run(record_outcome_txn, outcome, consumer=consumer,
                           message_id=message_id, subjects=SUBJECTS, now=LATER,
                           ambiguous_outbox_id=amb_id)


def succeeded(**kw: Any) -> AttemptSucceeded:
    return AttemptSucceeded(**{**OUT, **kw}, response_digest="sha256:beef", provider_ref="tk_42",
                            http_status=201)


def ambiguous(**kw: Any) -> OutcomeAmbiguous:
    return OutcomeAmbiguous(**{**OUT, **kw}, reason="timeout", message="no answer in 5s")


def failed(**kw: Any) -> AttemptFailed:
    return AttemptFailed(**{**OUT, **kw}, failure_class=FailureClass.INVALID_ARGUMENT,
                         code="bad_title", message="title too long", http_status=422)


async def test_succeeded_outcome_records_evidence(store: Store) -> None:
    """A success moves in_flight → succeeded with provider ref and response digest, and
    records the attempt's result, the inbox entry and the journal, in one commit."""
    await in_flight(store)
    result = await record(store, succeeded(), "m1")
    assert result == Recorded("applied", to_state="succeeded")

    op = await op_row(store)
    assert op["state"] == "succeeded" and op["epoch"] == 1 and op["updated_at"] == LATER
    assert op["provider_ref"] == "tk_42" and op["response_digest"] == "sha256:beef"
    assert op["last_outcome"]["type"] == "attempt_succeeded"
    [att] = await rows(store, attempts)
    assert att["status"] == "attempt_succeeded" and att["finished_at"] == LATER
    assert att["http_status"] == 201 and att["provider_ref"] == "tk_42"
    assert att["response_digest"] == "sha256:beef"
    assert [(r["consumer"], r["message_id"]) for r in await rows(store, inbox)] == [
        ("ledger.outcomes", "m1")]
    [entry] = await rows(store, journal, journal.c.kind == "outcome_recorded")
    assert (entry["from_state"], entry["to_state"], entry["epoch"]) == (
        "in_flight", "succeeded", 1)
    assert [r["kind"] for r in await rows(store, outbox)] == ["dispatch"]


async def test_failed_outcome_moves_to_failed(store: Store) -> None:
    """A definitive refusal moves in_flight → failed and keeps the failure on the attempt."""
    await in_flight(store)
    assert await record(store, failed(), "m1") == Recorded("applied", to_state="failed")
    assert (await op_row(store))["state"] == "failed"
    [att] = await rows(store, attempts)
    assert att["status"] == "attempt_failed"
    assert att["outcome"]["failure_class"] == "invalid_argument"


async def test_accepted_outcome_awaits_confirmation(store: Store) -> None:
    """An asynchronous acceptance moves to awaiting_confirmation with the provider ref."""
    await in_flight(store)
    accepted = AttemptAccepted(**OUT, response_digest="sha256:acc", provider_ref="job_9")
    assert (await record(store, accepted, "m1")).to_state == "awaiting_confirmation"
    op = await op_row(store)
    assert op["state"] == "awaiting_confirmation" and op["provider_ref"] == "job_9"


async def test_ambiguous_outcome_hands_off_to_the_reconciler(store: Store) -> None:
    """An ambiguous outcome moves to ambiguous and, in the same commit, writes an outbox row
    of kind 'reconcile' on the reconcile subject carrying a ReconcileOperation command."""
    await in_flight(store)
    outcome = ambiguous()
    assert await record(store, outcome, "m1", amb_id="amb_7") == Recorded(
        "applied", to_state="ambiguous")
    assert (await op_row(store))["state"] == "ambiguous"
    [row] = await rows(store, outbox, outbox.c.kind == "reconcile")
    assert row["id"] == "amb_7" and row["subject"] == SUBJECTS.ambiguous
    assert row["status"] == "pending" and row["epoch"] == 1 and row["operation_id"] == "op1"
    assert row["available_at"] == LATER and row["publish_count"] == 0
    cmd = parse(ReconcileOperation, row["payload"].encode())
    op = await op_row(store)
    assert (cmd.operation_id, cmd.epoch, cmd.attempt_id) == ("op1", 1, outcome.attempt_id)
    assert cmd.operation_key == op["operation_key"] and cmd.cause == "ambiguous"
    assert cmd.reason == outcome.reason and cmd.noticed_at == LATER
    # never back to dispatch: the only dispatch row is the original, already consumed
    [dispatch] = await rows(store, outbox, outbox.c.kind == "dispatch")
    assert dispatch["status"] == "consumed"


async def test_duplicate_message_id_is_ignored(store: Store) -> None:
    """A redelivered message id is 'duplicate': no second journal entry, no state change,
    even if the redelivered body differs."""
    await in_flight(store)
    await record(store, succeeded(), "m1")
    kinds = await journal_kinds(store)
    assert await record(store, succeeded(), "m1") == Recorded("duplicate")
    assert await record(store, failed(), "m1") == Recorded("duplicate")
    assert await journal_kinds(store) == kinds
    assert (await op_row(store))["state"] == "succeeded"
    assert len(await rows(store, inbox)) == 1


async def test_inbox_dedup_is_per_consumer(store: Store) -> None:
    """The same message id under another consumer is not a duplicate of the first."""
    await in_flight(store)
    await record(store, ambiguous(), "m1", consumer="c1")
    second = await record(store, succeeded(), "m1", consumer="c2")
    assert second.status == "applied" and second.to_state == "succeeded"


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (succeeded(epoch=2), "not_the_claimed_attempt"),
        (succeeded(attempt_id="a_other"), "not_the_claimed_attempt"),
        (succeeded(operation_id="ghost"), "unknown_operation"),
    ],
    ids=["wrong_epoch", "wrong_attempt", "unknown_operation"],
)
async def test_unfenced_outcome_is_rejected_and_journaled(store: Store, outcome: Outcome,
                                                          reason: str) -> None:
    """An outcome for another epoch, attempt or operation changes nothing and is journaled
    as outcome_rejected with the reason and the message id."""
    await in_flight(store)
    before = await op_row(store)
    result = await record(store, outcome, "m_bad")
    assert result.status == "rejected" and result.reason == reason
    assert await op_row(store) == before
    [att] = await rows(store, attempts)
    assert att["status"] == "claimed"
    [entry] = await rows(store, journal, journal.c.kind == "outcome_rejected")
    assert entry["operation_id"] == outcome.operation_id
    assert entry["detail"]["reason"] == reason and entry["detail"]["message_id"] == "m_bad"
    assert entry["epoch"] == outcome.epoch
    # the rejection is remembered: a redelivery does not journal it again
    assert await record(store, outcome, "m_bad") == Recorded("duplicate")
    assert len(await rows(store, journal, journal.c.kind == "outcome_rejected")) == 1


async def test_outcome_for_a_superseded_epoch_is_rejected(store: Store) -> None:
    """Once the operation moved to epoch 2, a late epoch-1 outcome is refused as stale."""
    await in_flight(store)
    async with store.transaction() as conn:
        await conn.execute(operations.update().where(operations.c.id == "op1")
                           .values(epoch=2, state="pending"))
    result = await record(store, succeeded(), "m1")
    assert result.status == "rejected" and result.reason == "stale_epoch"
    op = await op_row(store)
    assert op["state"] == "pending" and op["provider_ref"] is None


async def test_late_success_after_ambiguous_settles_as_succeeded(store: Store) -> None:
    """A slow dispatcher's definitive success for the same attempt resolves the ambiguity."""
    await in_flight(store)
    await record(store, ambiguous(), "m_amb")
    result = await record(store, succeeded(), "m_ok")
    assert result == Recorded("applied", to_state="succeeded")
    op = await op_row(store)
    assert op["state"] == "succeeded" and op["provider_ref"] == "tk_42"
    [att] = await rows(store, attempts)
    assert att["status"] == "attempt_succeeded"
    recorded = await rows(store, journal, journal.c.kind == "outcome_recorded")
    assert [(e["from_state"], e["to_state"]) for e in recorded] == [
        ("in_flight", "ambiguous"), ("ambiguous", "succeeded")]


@pytest.mark.parametrize("late", [ambiguous(), failed()], ids=["ambiguous", "failed"])
async def test_nothing_overrides_a_recorded_success(store: Store, late: Outcome) -> None:
    """After succeeded, a later ambiguous or failed outcome is rejected; state and evidence
    stay, and no reconciliation is requested."""
    await in_flight(store)
    await record(store, succeeded(), "m_ok")
    result = await record(store, late, "m_late")
    assert result.status == "rejected"
    assert result.reason is not None and "succeeded" in result.reason
    op = await op_row(store)
    assert op["state"] == "succeeded" and op["response_digest"] == "sha256:beef"
    assert await rows(store, outbox, outbox.c.kind == "ambiguous") == []
    [att] = await rows(store, attempts)
    assert att["status"] == "attempt_succeeded"


async def test_failed_after_ambiguous_is_rejected(store: Store) -> None:
    """Only a success may settle an ambiguity directly; a failure needs a verdict."""
    await in_flight(store)
    await record(store, ambiguous(), "m_amb")
    result = await record(store, failed(), "m_fail")
    assert result.status == "rejected"
    assert (await op_row(store))["state"] == "ambiguous"


def _service(store: Store) -> LedgerService:
    ids = itertools.count(1)
    return LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: LATER,
                         ids=lambda: f"id{next(ids):04d}")


async def test_service_records_ambiguity_and_wakes_the_relay(store: Store) -> None:
    """LedgerService.record_outcome commits the ambiguous hand-off and wakes the relay."""
    await in_flight(store)
    svc = _service(store)
    result = await svc.record_outcome(ambiguous(), consumer="ledger", message_id="m1")
    assert result.to_state == "ambiguous"
    assert svc.outbox_wake.is_set()
    [row] = await rows(store, outbox, outbox.c.kind == "reconcile")
    assert row["id"] == "id0001"


async def test_concurrent_redeliveries_apply_exactly_once(store: Store) -> None:
    """Ten simultaneous deliveries of one message: one applied, nine duplicates, one entry."""
    await in_flight(store)
    svc = _service(store)
    results = await asyncio.gather(*(
        svc.record_outcome(ambiguous(), consumer="ledger", message_id="m1") for _ in range(10)))
    assert sorted(r.status for r in results) == ["applied"] + ["duplicate"] * 9
    assert len(await rows(store, outbox, outbox.c.kind == "reconcile")) == 1
    assert (await journal_kinds(store)).count("outcome_recorded") == 1


async def test_dead_letter_is_recorded_and_journaled(store: Store) -> None:
    """A poison message leaves a dead-letter row and a journal entry, without its payload."""
    letter = DeadLetter(consumer="ledger", subject="tst.ledger.v1.outcome.x", message_id="m9",
                        error="schema_version: Input should be 1", payload_excerpt="{...}",
                        deliveries=3)
    await store.run(record_dead_letter_txn, letter, now=LATER)
    [row] = await rows(store, dead_letters)
    assert row["message_id"] == "m9" and row["deliveries"] == 3 and row["at"] == LATER
    [entry] = await rows(store, journal)
    assert entry["kind"] == "dead_lettered" and entry["operation_id"] is None
    assert "payload_excerpt" not in entry["detail"]


async def _wait_until_a_backend_waits_for_a_lock(store: Store) -> None:
    """Condition-based: poll pg_stat_activity until some session is blocked on a lock."""
    async with asyncio.timeout(20), store.engine.connect() as probe:
        while True:
            waiting = (await probe.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"))).scalar_one()
            await probe.rollback()
            if waiting:
                return


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_success_racing_an_ambiguous_outcome_is_not_lost(store: Store) -> None:
    """A late success that races a 'dispatcher lost' ambiguity for the same attempt still
    settles the operation as succeeded once the ambiguity commits (not rejected as a
    concurrent change, which would throw the evidence away)."""
    await in_flight(store)
    async with store.engine.connect() as conn:
        tx = await conn.begin()
        first = await record_outcome_txn(
            conn, ambiguous(dispatcher_id="d2"), consumer="ledger.outcomes",
            message_id="m_amb", subjects=SUBJECTS, now=LATER, ambiguous_outbox_id="amb1")
        assert first.to_state == "ambiguous"
        late = asyncio.create_task(record(store, succeeded(), "m_ok"))
        await _wait_until_a_backend_waits_for_a_lock(store)
        assert not late.done()
        await tx.commit()
    result = await late
    assert result == Recorded("applied", to_state="succeeded")
    assert (await op_row(store))["state"] == "succeeded"


async def test_only_the_claims_holder_may_report_what_its_call_did(store: Store) -> None:
    """d1 holds the claim: a success or a failure for its attempt id sent by d2 is rejected and
    journaled (not_the_claim_holder) and the operation stays in flight; d2 may still report
    d1 lost mid-attempt (ambiguous), which only sends the operation to reconciliation."""
    await in_flight(store)
    for i, forged in enumerate([succeeded(dispatcher_id="d2"), failed(dispatcher_id="d2")]):
        result = await record(store, forged, f"m_forged{i}")
        assert (result.status, result.reason) == ("rejected", "not_the_claim_holder")
    [op] = await rows(store, operations, operations.c.id == "op1")
    assert op["state"] == "in_flight"
    lost = await record(store, ambiguous(dispatcher_id="d2"), "m_lost")
    assert lost.to_state == "ambiguous"
