"""Set-based batches decide exactly as the same calls one transaction at a time would.

Each scenario runs twice on the same database: once call by call (each its own transaction,
the pre-batching behaviour) and once as one group-committed batch through the call type's
`many` form. The
replies, the errors and every row written must be the same, including the awkward cases a batch
makes possible: two calls for the same operation or the same key in one batch, refusals next to
grants, duplicates, and outcomes that leave the set-based path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from effectledger_core.catalog import Catalog, Tool
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.failures import Failure
from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    ClaimAttempt,
    FailureClass,
    OutcomeAmbiguous,
    SubmitIntent,
)
from effectledger_core.retry_policy import RetryDecision
from effectledger_ledger.db.calls import BatchCall
from effectledger_ledger.db.claims import ClaimCall
from effectledger_ledger.db.intents import SubmitCall
from effectledger_ledger.db.outcomes import OutcomeCall, record_outcome_txn
from effectledger_ledger.db.rows import OperationRow
from effectledger_ledger.db.schema import journal, metadata
from effectledger_ledger.db.store import Store
from tests.support.ledger import NOW, SUBJECTS

LATER = NOW + timedelta(seconds=5)
CATALOG = Catalog({
    **Catalog.load(DEMO_CATALOG).tools,
    "wire_money": Tool.model_validate({
        "name": "wire_money", "endpoint": "https://bank.example/v1/wires",
        "contract_revision": "r1", "commit_policy": "approval"}),
})


def normal(result: Any) -> Any:
    if isinstance(result, BaseException):
        return ("error", type(result).__name__, str(result))
    if hasattr(result, "model_dump"):
        return result.model_dump(mode="json")
    if hasattr(result, "operation"):  # Submitted
        return ("submitted", result.operation["id"], result.created)
    return repr(result)


async def snapshot(store: Store) -> dict[str, list[dict[str, Any]]]:
    out = {}
    async with store.transaction() as conn:
        for table in metadata.sorted_tables:
            cols = [c for c in table.c if not (table is journal and c.name == "id")]
            # Journal order matters per operation; across operations a batch may interleave
            # differently from the one-by-one run (both are valid serial orders).
            order = ([journal.c.operation_id, journal.c.id] if table is journal
                     else list(table.primary_key.columns))
            rows = (await conn.execute(sa.select(*cols).order_by(*order))).mappings().all()
            out[table.name] = [dict(r) for r in rows]
    return out


async def reset(store: Store) -> None:
    async with store.transaction() as conn:
        for table in reversed(metadata.sorted_tables):
            await conn.execute(table.delete())


async def both_ways(store: Store, setup: Callable[[], Awaitable[None]],
                    calls: Sequence[BatchCall[Any]]) -> list[Any]:
    """Run `calls` one by one, then (on a fresh database) as one batch; both must agree."""
    await setup()
    alone = []
    for call in calls:
        try:
            alone.append(normal(await store.run(call.one)))
        except Exception as exc:
            alone.append(normal(exc))
    after_alone = await snapshot(store)
    await reset(store)

    await setup()
    async with store.transaction() as conn:
        together = [normal(r) for r in await type(calls[0]).many(conn, calls)]
    assert together == alone
    assert await snapshot(store) == after_alone
    return alone


def submit_call(intent: SubmitIntent, n: int) -> SubmitCall:
    return SubmitCall(catalog=CATALOG, intent=intent, subjects=SUBJECTS, operation_id=f"op{n}",
                      outbox_id=f"ob{n}", now=NOW)


async def submit(store: Store, n: int, tool: str = "create_ticket") -> None:
    await store.run(submit_call(SubmitIntent(tool=tool, arguments={"n": n}), n).one)


async def test_intents_in_one_batch_match_intents_one_by_one(store: Store) -> None:
    async def nothing() -> None:
        return None

    a, b = {"title": "a"}, {"title": "b"}
    intents = [
        SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1"),
        SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1"),  # same again
        SubmitIntent(tool="create_ticket", arguments=b, idempotency_key="k1"),  # conflict
        SubmitIntent(tool="create_ticket", arguments=b),
        SubmitIntent(tool="no_such_tool", arguments=a),
        SubmitIntent(tool="create_ticket", arguments={"t": "nul\x00"}),
        SubmitIntent(tool="wire_money", arguments=a, idempotency_key="k2"),  # needs approval
        SubmitIntent(tool="create_ticket", arguments=a, idempotency_key="k1", tenant="other"),
    ]
    got = await both_ways(store, nothing, [submit_call(i, n) for n, i in enumerate(intents)])
    assert [g[0] if isinstance(g, tuple) else g for g in got] == [
        "submitted", "submitted", "error", "submitted", "error", "error", "submitted",
        "submitted"]
    assert got[1] == ("submitted", "op0", False)
    assert got[2][1] == "IdempotencyConflict"


def claim_call(op: str, attempt: str, epoch: int = 1) -> ClaimCall:
    return ClaimCall(ClaimAttempt(operation_id=op, epoch=epoch, attempt_id=attempt,
                                  dispatcher_id="d1"), now=LATER)


async def test_claims_in_one_batch_match_claims_one_by_one(store: Store) -> None:
    async def setup() -> None:
        for n in range(5):
            await submit(store, n, tool="wire_money" if n == 2 else "create_ticket")
        # op3's attempt is already over: asking again with its id must not re-grant it.
        await store.run(claim_call("op3", "x3").one)
        await store.run(record_outcome_txn, AttemptSucceeded(
            operation_id="op3", epoch=1, attempt_id="x3", dispatcher_id="d1", at=NOW,
            provider_ref="r", response_digest="sha256:00", http_status=200),
            consumer="c", message_id="m-x3", subjects=SUBJECTS, now=NOW,
            ambiguous_outbox_id="amb")

    got = await both_ways(store, setup, [
        claim_call("op0", "a1"),
        claim_call("op0", "a1"),  # the same attempt again (a lost reply): granted again
        claim_call("op0", "a2"),  # another dispatcher: already claimed
        claim_call("op1", "b1", epoch=2),  # stale
        claim_call("op2", "c1"),  # awaiting approval: not claimable
        claim_call("op9", "z1"),  # unknown
        claim_call("op3", "x3"),  # closed attempt
        claim_call("op4", "d1"),
    ])
    assert [g["status"] for g in got] == [
        "granted", "granted", "already_claimed", "stale_epoch", "not_claimable", "not_found",
        "not_claimable", "granted"]


def outcome_call(outcome: Any, message_id: str) -> OutcomeCall:
    return OutcomeCall(outcome, consumer="c", message_id=message_id, subjects=SUBJECTS,
                       now=LATER, ambiguous_outbox_id=f"amb-{message_id}")


def success(op: str, attempt: str) -> AttemptSucceeded:
    return AttemptSucceeded(operation_id=op, epoch=1, attempt_id=attempt, dispatcher_id="d1",
                            at=LATER, provider_ref=f"ref-{op}", response_digest="sha256:01",
                            http_status=201)


async def test_outcomes_in_one_batch_match_outcomes_one_by_one(store: Store) -> None:
    async def setup() -> None:
        for n in range(4):
            await submit(store, n)
            await store.run(claim_call(f"op{n}", f"a{n}").one)

    lost = OutcomeAmbiguous(operation_id="op2", epoch=1, attempt_id="a2", dispatcher_id="d2",
                            at=LATER, reason="dispatcher_lost_mid_attempt", message="lost")
    got = await both_ways(store, setup, [
        outcome_call(success("op0", "a0"), "m0"),
        outcome_call(success("op0", "a0"), "m0"),  # redelivered: duplicate
        outcome_call(success("op1", "zz"), "m1"),  # not the claimed attempt
        outcome_call(success("op1", "a1"), "m2"),
        outcome_call(success("op1", "a1"), "m3"),  # a second message: op1 already succeeded
        outcome_call(lost, "m4"),  # leaves the set-based path: handed to reconciliation
        outcome_call(success("op9", "a9"), "m5"),  # unknown operation
        outcome_call(success("op3", "a3"), "m6"),
    ])
    assert got == [
        "Recorded(status='applied', to_state='succeeded', reason=None)",
        "Recorded(status='duplicate', to_state=None, reason=None)",
        "Recorded(status='rejected', to_state=None, reason='not_the_claimed_attempt')",
        "Recorded(status='applied', to_state='succeeded', reason=None)",
        "Recorded(status='rejected', to_state=None, "
        "reason='state_succeeded_does_not_accept_outcome_succeeded')",
        "Recorded(status='applied', to_state='ambiguous', reason=None)",
        "Recorded(status='rejected', to_state=None, reason='unknown_operation')",
        "Recorded(status='applied', to_state='succeeded', reason=None)",
    ]


def retry_when_asked(op: OperationRow, failure: Failure) -> RetryDecision:
    """A fake retry policy: retries a failure whose code says so, after 2 s."""
    if failure.code == "retry_me":
        return RetryDecision(True, "asked", delay_s=2.0)
    return RetryDecision(False, "not_asked")


def failed(op: str, attempt: str, code: str) -> AttemptFailed:
    return AttemptFailed(operation_id=op, epoch=1, attempt_id=attempt, dispatcher_id="d1",
                         at=LATER, failure_class=FailureClass.TRANSIENT, code=code,
                         message="refused", http_status=503)


async def test_every_kind_of_outcome_in_one_batch_matches_one_by_one(store: Store) -> None:
    """One path for all outcomes: failures with and without a retry, an accepted attempt, an
    ambiguous one followed in the same batch by its late success, and outcomes that arrive
    after a retry opened a new epoch, decide and write exactly as one at a time."""
    async def setup() -> None:
        for n in range(5):
            await submit(store, n)
            await store.run(claim_call(f"op{n}", f"a{n}").one)

    def call(outcome: Any, message_id: str) -> OutcomeCall:
        return OutcomeCall(outcome, consumer="c", message_id=message_id, subjects=SUBJECTS,
                           now=LATER, ambiguous_outbox_id=f"amb-{message_id}",
                           decide_retry=retry_when_asked)

    accepted = AttemptAccepted(operation_id="op2", epoch=1, attempt_id="a2", dispatcher_id="d1",
                               at=LATER, provider_ref="ref-op2", response_digest="sha256:02")
    ambiguous = OutcomeAmbiguous(operation_id="op3", epoch=1, attempt_id="a3",
                                 dispatcher_id="d1", at=LATER, reason="timeout")
    got = await both_ways(store, setup, [
        call(failed("op0", "a0", "retry_me"), "m0"),  # retried: epoch 2, delayed dispatch row
        call(success("op0", "a0"), "m1"),  # epoch 1 is over: rejected
        call(failed("op1", "a1", "no"), "m2"),  # failed, retry declined and journaled
        call(accepted, "m3"),  # awaiting confirmation: handed to reconciliation
        call(success("op3", "zz"), "m9"),  # not the claimed attempt: rejected, journaled first
        call(ambiguous, "m4"),  # ambiguous: handed to reconciliation
        call(success("op3", "a3"), "m5"),  # its late success resolves the ambiguity
        call(success("op4", "a4"), "m6"),
        call(failed("op4", "a4", "retry_me"), "m7"),  # op4 already succeeded: rejected
    ])
    assert [g.split("reason=")[0] for g in got] == [
        "Recorded(status='applied', to_state='pending', ",
        "Recorded(status='rejected', to_state=None, ",
        "Recorded(status='applied', to_state='failed', ",
        "Recorded(status='applied', to_state='awaiting_confirmation', ",
        "Recorded(status='rejected', to_state=None, ",
        "Recorded(status='applied', to_state='ambiguous', ",
        "Recorded(status='applied', to_state='succeeded', ",
        "Recorded(status='applied', to_state='succeeded', ",
        "Recorded(status='rejected', to_state=None, ",
    ]


async def test_a_leased_intent_after_an_unleased_one_keeps_its_lease(store: Store) -> None:
    """A multi-row INSERT is compiled from its first row: every intent's outbox row carries
    lease_until, so a leased row after an unleased one is not written `publishing` without a
    lease (which no relay would ever take again)."""
    plain = submit_call(SubmitIntent(tool="create_ticket", arguments={"n": 0}), 0)
    leased = SubmitCall(catalog=CATALOG, intent=SubmitIntent(tool="create_ticket",
                                                             arguments={"n": 1}),
                        subjects=SUBJECTS, operation_id="op1", outbox_id="ob1", now=NOW,
                        lease_until=LATER)
    async with store.transaction() as conn:
        await SubmitCall.many(conn, [plain, leased])
    async with store.transaction() as conn:
        rows = (await conn.execute(sa.text(
            "SELECT id, status, lease_until FROM outbox ORDER BY id"))).all()
    assert [(r[0], r[1], r[2] is not None) for r in rows] == [
        ("ob0", "pending", False), ("ob1", "publishing", True)]
