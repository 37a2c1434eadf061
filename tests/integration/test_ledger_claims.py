"""Claims on both databases: claim before call, one claim per epoch, stale claims journaled."""

from __future__ import annotations

import asyncio
import itertools
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from effectledger_core.catalog import Catalog, Tool
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.digest import digest
from effectledger_core.messages import (
    AttemptSucceeded,
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    SubmitIntent,
)
from effectledger_ledger.db.claims import claim_txn
from effectledger_ledger.db.intents import submit_intent_txn
from effectledger_ledger.db.outcomes import record_outcome_txn
from effectledger_ledger.db.schema import attempts, journal, operations, outbox
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.support.ledger import NOW, SUBJECTS

LATER = NOW + timedelta(seconds=5)
CATALOG = Catalog({
    **Catalog.load(DEMO_CATALOG).tools,
    "wire_money": Tool.model_validate({
        "name": "wire_money", "endpoint": "https://bank.example/v1/wires",
        "contract_revision": "r1", "commit_policy": "approval"}),
})


async def rows(store: Store, table: sa.Table, *where: Any) -> list[dict[str, Any]]:
    async with store.transaction() as conn:
        return [dict(r) for r in (await conn.execute(sa.select(table).where(*where)))
                .mappings().all()]


async def journal_kinds(store: Store, op_id: str) -> list[str]:
    async with store.transaction() as conn:
        return list((await conn.execute(
            sa.select(journal.c.kind).where(journal.c.operation_id == op_id)
            .order_by(journal.c.id))).scalars())


async def submit(store: Store, op_id: str = "op1", tool: str = "create_ticket") -> None:
    await store.run(submit_intent_txn, catalog=CATALOG,
                    intent=SubmitIntent(tool=tool, arguments={"title": "x"}),
                    subjects=SUBJECTS, operation_id=op_id, outbox_id=f"ob_{op_id}", now=NOW)


async def set_op(store: Store, op_id: str, **values: Any) -> None:
    async with store.transaction() as conn:
        await conn.execute(operations.update().where(operations.c.id == op_id).values(**values))


async def claim(store: Store, attempt_id: str, *, op_id: str = "op1", epoch: int = 1,
                dispatcher: str = "d1") -> ClaimReply:
    return await store.run(claim_txn, ClaimAttempt(
        operation_id=op_id, epoch=epoch, attempt_id=attempt_id, dispatcher_id=dispatcher),
        now=LATER)


async def test_claim_is_granted_and_recorded_durably(store: Store) -> None:
    """A claim on a pending op grants, moves it in_flight, records the attempt and consumes
    the dispatch outbox row, all journaled."""
    await submit(store)
    reply = await claim(store, "a1")
    assert reply.status is ClaimStatus.GRANTED
    assert (reply.attempt_id, reply.current_epoch, reply.state) == ("a1", 1, "in_flight")

    [op] = await rows(store, operations)
    assert op["state"] == "in_flight" and op["epoch"] == 1 and op["updated_at"] == LATER
    [att] = await rows(store, attempts)
    assert att["id"] == "a1" and att["operation_id"] == "op1" and att["epoch"] == 1
    assert att["status"] == "claimed" and att["dispatcher_id"] == "d1"
    assert att["claimed_at"] == LATER and att["finished_at"] is None
    [row] = await rows(store, outbox)
    assert row["status"] == "consumed"
    assert await journal_kinds(store, "op1") == ["intent_accepted", "attempt_claimed"]
    [entry] = await rows(store, journal, journal.c.kind == "attempt_claimed")
    assert (entry["from_state"], entry["to_state"], entry["epoch"]) == ("pending", "in_flight", 1)
    assert entry["detail"] == {"attempt_id": "a1"} and entry["actor"] == "d1"


async def test_same_attempt_asking_again_is_granted_again_without_new_records(
        store: Store) -> None:
    """A lost reply is harmless: the same attempt id re-claiming gets GRANTED, nothing new."""
    await submit(store)
    await claim(store, "a1")
    again = await claim(store, "a1")
    assert again.status is ClaimStatus.GRANTED and again.attempt_id == "a1"
    assert len(await rows(store, attempts)) == 1
    assert await journal_kinds(store, "op1") == ["intent_accepted", "attempt_claimed"]


async def test_another_attempt_finds_the_epoch_already_claimed(store: Store) -> None:
    """A second attempt for a claimed epoch is refused and told who holds the claim and
    whether its outcome is in (false before the outcome, true after)."""
    await submit(store)
    await claim(store, "a1")
    other = await claim(store, "a2", dispatcher="d2")
    assert other.status is ClaimStatus.ALREADY_CLAIMED
    assert other.attempt_id == "a1" and other.outcome_recorded is False
    assert other.state == "in_flight"

    done = AttemptSucceeded(operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1",
                            at=LATER, response_digest="sha256:00")
    recorded = await store.run(record_outcome_txn, done, consumer="ledger", message_id="m1",
                               subjects=SUBJECTS, now=LATER, ambiguous_outbox_id="amb1")
    assert recorded.status == "applied"
    after = await claim(store, "a3", dispatcher="d3")
    assert after.status is ClaimStatus.ALREADY_CLAIMED
    assert after.attempt_id == "a1" and after.outcome_recorded is True
    assert after.state == "succeeded"
    assert [a["id"] for a in await rows(store, attempts)] == ["a1"]


async def test_claim_for_a_future_epoch_is_stale_and_journaled(store: Store) -> None:
    """A claim whose epoch is not the operation's is refused with the current epoch, journaled."""
    await submit(store)
    reply = await claim(store, "a1", epoch=2)
    assert reply.status is ClaimStatus.STALE_EPOCH
    assert reply.current_epoch == 1 and reply.state == "pending"
    [op] = await rows(store, operations)
    assert op["state"] == "pending"
    assert await rows(store, attempts) == []
    [entry] = await rows(store, journal, journal.c.kind == "claim_rejected")
    assert entry["epoch"] == 2 and entry["detail"]["attempt_id"] == "a1"
    assert entry["detail"]["current_epoch"] == 1
    [row] = await rows(store, outbox)
    assert row["status"] == "pending"


async def test_claim_for_a_superseded_epoch_is_stale(store: Store) -> None:
    """After a retry moved the operation to epoch 2, an unclaimed epoch-1 command is stale."""
    await submit(store)
    await set_op(store, "op1", epoch=2)
    reply = await claim(store, "a1", epoch=1)
    assert reply.status is ClaimStatus.STALE_EPOCH and reply.current_epoch == 2
    granted = await claim(store, "a2", epoch=2)
    assert granted.status is ClaimStatus.GRANTED
    assert [(a["id"], a["epoch"]) for a in await rows(store, attempts)] == [("a2", 2)]


async def test_claim_for_an_unknown_operation_is_not_found(store: Store) -> None:
    """A claim naming no operation answers not_found and writes nothing."""
    reply = await claim(store, "a1", op_id="ghost")
    assert reply.status is ClaimStatus.NOT_FOUND and reply.operation_id == "ghost"
    assert await rows(store, journal) == [] and await rows(store, attempts) == []


@pytest.mark.parametrize("state", ["cancelled", "awaiting_approval", "ambiguous",
                                   "succeeded", "needs_review"])
async def test_claim_on_an_unclaimable_state_is_refused(store: Store, state: str) -> None:
    """Only pending operations can be claimed; other states refuse and journal the attempt."""
    await submit(store)
    await set_op(store, "op1", state=state)
    reply = await claim(store, "a1")
    assert reply.status is not ClaimStatus.GRANTED
    assert reply.status is ClaimStatus.NOT_CLAIMABLE and reply.state == state
    [op] = await rows(store, operations)
    assert op["state"] == state
    assert await rows(store, attempts) == []
    assert "claim_rejected" in await journal_kinds(store, "op1")


async def test_approval_gated_operation_cannot_be_claimed(store: Store) -> None:
    """An operation awaiting approval from the start refuses claims (no dispatch before OK)."""
    await submit(store, tool="wire_money")
    reply = await claim(store, "a1")
    assert reply.status is ClaimStatus.NOT_CLAIMABLE and reply.state == "awaiting_approval"
    assert await rows(store, attempts) == []


async def test_claim_consumes_only_its_own_operations_dispatch_row(store: Store) -> None:
    """Claiming op1 marks op1's outbox row consumed and leaves op2's row pending."""
    await submit(store, "op1")
    await submit(store, "op2")
    await claim(store, "a1", op_id="op1")
    status = {r["id"]: r["status"] for r in await rows(store, outbox)}
    assert status == {"ob_op1": "consumed", "ob_op2": "pending"}


async def test_fifty_concurrent_claims_grant_exactly_one(store: Store) -> None:
    """50 dispatchers race for one epoch through LedgerService: exactly one is granted and
    every other reply names the winner."""
    await submit(store)
    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: LATER,
                        ids=lambda: "unused")
    claims = [ClaimAttempt(operation_id="op1", epoch=1, attempt_id=f"a{i:02d}",
                           dispatcher_id=f"d{i:02d}") for i in range(50)]
    replies = await asyncio.gather(*(svc.claim(c) for c in claims))
    granted = [r for r in replies if r.status is ClaimStatus.GRANTED]
    assert len(granted) == 1
    winner = granted[0].attempt_id
    assert all(r.status is ClaimStatus.ALREADY_CLAIMED and r.attempt_id == winner
               for r in replies if r is not granted[0])
    [att] = await rows(store, attempts)
    assert att["id"] == winner
    assert (await journal_kinds(store, "op1")).count("attempt_claimed") == 1


async def test_concurrent_claims_across_operations_all_succeed(store: Store) -> None:
    """Claims for different operations do not block or refuse each other."""
    for i in range(10):
        await submit(store, f"op{i}")
    counter = itertools.count()
    replies = await asyncio.gather(*(
        claim(store, f"a{next(counter)}", op_id=f"op{i}") for i in range(10)))
    assert all(r.status is ClaimStatus.GRANTED for r in replies)
    assert {r["state"] for r in await rows(store, operations)} == {"in_flight"}


async def test_claim_for_another_tool_is_refused_and_journaled(store: Store) -> None:
    """A claim naming another tool under this operation's id and epoch (a forged dispatch
    command) is refused before anything is recorded, and the refusal is journaled."""
    await submit(store)
    reply = await store.run(claim_txn, ClaimAttempt(
        operation_id="op1", epoch=1, attempt_id="forged", dispatcher_id="d1",
        tool="wire_money", arguments_digest=digest({"title": "x"})), now=LATER)
    assert reply.status is ClaimStatus.COMMAND_MISMATCH
    assert reply.reason is not None and "wire_money" in reply.reason
    assert await rows(store, attempts) == []
    [op] = await rows(store, operations)
    assert op["state"] == "pending"
    [rejected] = [j for j in await rows(store, journal) if j["kind"] == "claim_rejected"]
    assert rejected["detail"]["reason"] == "command_mismatch"


async def test_claim_with_other_arguments_is_refused_even_while_the_claim_is_held(
        store: Store) -> None:
    """Other arguments under a held claim are refused too: the mismatch is decided before the
    "already claimed" path that could declare the real attempt lost."""
    await submit(store)
    good = await store.run(claim_txn, ClaimAttempt(
        operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1",
        tool="create_ticket", arguments_digest=digest({"title": "x"})), now=LATER)
    assert good.status is ClaimStatus.GRANTED
    assert (good.tool, good.arguments_digest) == ("create_ticket", digest({"title": "x"}))
    forged = await store.run(claim_txn, ClaimAttempt(
        operation_id="op1", epoch=1, attempt_id="a2", dispatcher_id="d2",
        tool="create_ticket", arguments_digest=digest({"title": "y"})), now=LATER)
    assert forged.status is ClaimStatus.COMMAND_MISMATCH
    [op] = await rows(store, operations)
    assert op["state"] == "in_flight"
    assert [a["id"] for a in await rows(store, attempts)] == ["a1"]


async def test_a_retry_rendered_from_stored_arguments_still_matches_its_operation(
        store: Store) -> None:
    """A large number may come back from the database in another form (jsonb writes 1e16 as an
    integer); a claim carrying the digest of the arguments as stored is the operation's own."""
    await store.run(submit_intent_txn, catalog=CATALOG,
                    intent=SubmitIntent(tool="create_ticket", arguments={"n": 1e16}),
                    subjects=SUBJECTS, operation_id="op1", outbox_id="ob_op1", now=NOW)
    await set_op(store, "op1", arguments={"n": 10**16})
    reply = await store.run(claim_txn, ClaimAttempt(
        operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1",
        tool="create_ticket", arguments_digest=digest({"n": 10**16})), now=LATER)
    assert reply.status is ClaimStatus.GRANTED
    assert reply.arguments_digest == digest({"n": 10**16})
