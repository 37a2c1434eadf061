"""The outbox relay and sweeper queries on both databases: leases, publication, republish."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from effectledger_core.messages import ClaimAttempt, ClaimStatus, DispatchAttempt, SubmitIntent
from effectledger_ledger.db.claims import claim_txn
from effectledger_ledger.db.intents import submit_intent_txn
from effectledger_ledger.db.outbox import (
    OutboxItem,
    any_due,
    any_unanswered,
    backlog_txn,
    lease_batch_txn,
    mark_published_txn,
    release_txn,
    sweep_unclaimed_txn,
)
from effectledger_ledger.db.schema import journal, operations, outbox
from effectledger_ledger.db.store import Store
from tests.support.ledger import DEMO as CATALOG
from tests.support.ledger import NOW as T0
from tests.support.ledger import SUBJECTS


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


async def submit(store: Store, op_id: str, *, now: datetime = T0) -> None:
    await store.run(submit_intent_txn, catalog=CATALOG,
                    intent=SubmitIntent(tool="create_ticket", arguments={"op": op_id}),
                    subjects=SUBJECTS, operation_id=op_id, outbox_id=f"ob_{op_id}", now=now)


async def lease(store: Store, now: datetime, *, limit: int = 100,
                lease_s: float = 30) -> list[OutboxItem]:
    return await store.run(lease_batch_txn, now=now, limit=limit, lease_s=lease_s)


async def outbox_rows(store: Store) -> dict[str, dict[str, Any]]:
    async with store.transaction() as conn:
        result = await conn.execute(sa.select(outbox))
        return {r["id"]: dict(r) for r in result.mappings().all()}


async def publish(store: Store, ids: list[str], now: datetime) -> int:
    return await store.run(mark_published_txn, ids, now=now)


async def set_op(store: Store, op_id: str, **values: Any) -> None:
    async with store.transaction() as conn:
        await conn.execute(operations.update().where(operations.c.id == op_id).values(**values))


async def test_any_due_says_what_a_lease_would_find(store: Store) -> None:
    """The relay's poll reads `any_due` before it leases: it must be true exactly when a
    lease at that moment would take a row, or the relay would sleep on a due row."""
    async def due(now: datetime) -> bool:
        async with store.read() as conn:
            return await any_due(conn, now=now)

    assert not await due(at(0))  # an empty outbox
    await submit(store, "op1")
    assert await due(at(0))  # pending
    [item] = await lease(store, at(0), lease_s=30)
    assert not await due(at(10)) and not await due(at(30))  # leased, the lease running
    assert await due(at(31))  # the lease ran out: a relay takes it over
    await store.run(release_txn, [item.id], now=at(10), error="no ack", retry_after_s=5)
    assert not await due(at(14))  # handed back, held by its retry delay
    assert await due(at(15))
    [item] = await lease(store, at(15))
    await publish(store, [item.id], at(16))
    assert not await due(at(10_000))  # published: the sweeper's, not the relay's
    for t in (0, 14, 15, 31, 10_000):  # and a lease agrees at every moment asked above
        assert await lease(store, at(t)) == []


async def test_an_idle_poll_begins_no_lease_transaction(store: Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's poll with nothing due ends on the lockless read; with a row due it leases
    and publishes it."""
    from effectledger_bus.testing import FakeJetStream
    from effectledger_ledger.relay import Relay

    ran: list[str] = []
    run = store.run

    async def recording_run(fn: Any, *args: Any, **kwargs: Any) -> Any:
        ran.append(fn.__name__)
        return await run(fn, *args, **kwargs)

    monkeypatch.setattr(store, "run", recording_run)
    js = FakeJetStream()
    relay = Relay(store, js, asyncio.Event(), clock=lambda: at(0))  # type: ignore[arg-type]
    assert await relay.pump_once() == 0
    assert ran == [] and js.published == []
    await submit(store, "op1")
    ran.clear()
    assert await relay.pump_once() == 1
    assert ran == ["lease_batch_txn", "mark_published_txn"]
    assert [h["Nats-Msg-Id"] for _, h in js.published] == ["ob_op1"]


async def test_lease_takes_pending_rows_once_until_the_lease_expires(store: Store) -> None:
    """Leased rows become 'publishing' with a lease; nobody re-leases them until it expires,
    and then the same command (same message id) is handed out again."""
    for op in ("op1", "op2", "op3"):
        await submit(store, op)
    items = await lease(store, at(0), lease_s=30)
    assert sorted(i.id for i in items) == ["ob_op1", "ob_op2", "ob_op3"]
    item = next(i for i in items if i.id == "ob_op1")
    assert item.kind == "dispatch" and item.subject == SUBJECTS.dispatch("create_ticket")
    assert DispatchAttempt.model_validate_json(item.payload).operation_id == "op1"
    assert item.message_id == "ob_op1" and item.publish_count == 0

    for row in (await outbox_rows(store)).values():
        assert row["status"] == "publishing" and row["lease_until"] == at(30)
    assert await lease(store, at(10)) == []
    assert await lease(store, at(30)) == []  # the lease runs until, not before, lease_until
    again = await lease(store, at(31))
    assert sorted(i.id for i in again) == ["ob_op1", "ob_op2", "ob_op3"]
    assert {i.message_id for i in again} == {i.message_id for i in items}


async def test_lease_respects_limit_order_and_availability(store: Store) -> None:
    """Oldest available rows first, at most `limit`; rows not yet available are left alone."""
    await submit(store, "op_late", now=at(50))
    await submit(store, "op_mid", now=at(5))
    await submit(store, "op_old", now=at(1))
    first = await lease(store, at(10), limit=1, lease_s=300)
    assert [i.id for i in first] == ["ob_op_old"]
    second = await lease(store, at(10), limit=5, lease_s=300)
    assert [i.id for i in second] == ["ob_op_mid"]
    assert (await outbox_rows(store))["ob_op_late"]["status"] == "pending"
    assert [i.id for i in await lease(store, at(50))] == ["ob_op_late"]


async def test_mark_published_only_from_publishing(store: Store) -> None:
    """Only leased rows become published; a row nobody leased is not marked."""
    await submit(store, "op1")
    await submit(store, "op2", now=at(20))
    [item] = await lease(store, at(10))
    assert await publish(store, ["ob_op1", "ob_op2"], at(11)) == 1
    rows = await outbox_rows(store)
    assert rows["ob_op1"]["status"] == "published"
    assert rows["ob_op1"]["published_at"] == at(11) and rows["ob_op1"]["lease_until"] is None
    assert rows["ob_op2"]["status"] == "pending" and rows["ob_op2"]["published_at"] is None
    assert await publish(store, [item.id], at(12)) == 0  # already published: unchanged
    assert (await outbox_rows(store))["ob_op1"]["published_at"] == at(11)


async def test_row_consumed_while_publishing_is_not_marked_published(store: Store) -> None:
    """A fast dispatcher claims before the relay records the publish-ack: the row stays
    consumed, so the sweeper will never republish an already-claimed command."""
    await submit(store, "op1")
    await lease(store, at(0))
    reply = await store.run(claim_txn, ClaimAttempt(operation_id="op1", epoch=1, attempt_id="a1",
                                                    dispatcher_id="d1"), now=at(1))
    assert reply.status is ClaimStatus.GRANTED
    assert await publish(store, ["ob_op1"], at(2)) == 0
    assert (await outbox_rows(store))["ob_op1"]["status"] == "consumed"
    assert await store.run(sweep_unclaimed_txn, now=at(10_000), older_than_s=60) == 0
    assert (await outbox_rows(store))["ob_op1"]["status"] == "consumed"


async def test_release_gives_rows_back_after_a_pause(store: Store) -> None:
    """A failed publish returns the row to pending with the error, available only later."""
    await submit(store, "op1")
    await lease(store, at(0))
    await store.run(release_txn, ["ob_op1"], now=at(1), error="nats: timeout" + "x" * 2000,
                    retry_after_s=5)
    row = (await outbox_rows(store))["ob_op1"]
    assert row["status"] == "pending" and row["lease_until"] is None
    assert row["available_at"] == at(6)
    assert row["last_error"].startswith("nats: timeout") and len(row["last_error"]) == 1024
    assert await lease(store, at(5)) == []
    assert [i.id for i in await lease(store, at(6))] == ["ob_op1"]


async def test_release_does_not_touch_rows_no_longer_publishing(store: Store) -> None:
    """Releasing a row that was claimed meanwhile leaves it consumed."""
    await submit(store, "op1")
    await lease(store, at(0))
    await store.run(claim_txn, ClaimAttempt(operation_id="op1", epoch=1, attempt_id="a1",
                                            dispatcher_id="d1"), now=at(1))
    await store.run(release_txn, ["ob_op1"], now=at(2), error="e", retry_after_s=1)
    row = (await outbox_rows(store))["ob_op1"]
    assert row["status"] == "consumed" and row["last_error"] is None


async def _published(store: Store, op_id: str, published_at: datetime) -> None:
    await submit(store, op_id, now=published_at)
    leased = await lease(store, published_at)
    assert [i.id for i in leased] == [f"ob_{op_id}"]
    assert await publish(store, [f"ob_{op_id}"], published_at) == 1


async def test_sweeper_republishes_unclaimed_rows_and_retires_obsolete_ones(store: Store) -> None:
    """Published-but-unclaimed commands older than the cutoff go back to pending with a new
    generation and a journal entry; commands whose operation moved on become obsolete;
    fresh ones are left alone."""
    await _published(store, "op_lost", at(0))
    await _published(store, "op_cancelled", at(0))
    await _published(store, "op_new_epoch", at(0))
    await _published(store, "op_fresh", at(90))
    await set_op(store, "op_cancelled", state="cancelled")
    await set_op(store, "op_new_epoch", epoch=2)

    n = await store.run(sweep_unclaimed_txn, now=at(100), older_than_s=60)
    assert n == 1
    rows = await outbox_rows(store)
    lost = rows["ob_op_lost"]
    assert lost["status"] == "pending" and lost["publish_count"] == 1
    assert lost["available_at"] == at(100)
    assert rows["ob_op_cancelled"]["status"] == "obsolete"
    assert rows["ob_op_new_epoch"]["status"] == "obsolete"
    assert rows["ob_op_fresh"]["status"] == "published"
    assert rows["ob_op_fresh"]["publish_count"] == 0

    async with store.transaction() as conn:
        entries = (await conn.execute(sa.select(journal).where(
            journal.c.kind == "dispatch_republished"))).mappings().all()
    assert len(entries) == 1
    assert entries[0]["operation_id"] == "op_lost" and entries[0]["at"] == at(100)
    assert entries[0]["detail"]["outbox_id"] == "ob_op_lost"
    assert entries[0]["detail"]["generation"] == 1

    [item] = await lease(store, at(100))
    assert item.id == "ob_op_lost" and item.publish_count == 1
    assert item.message_id == "ob_op_lost.r1" != "ob_op_lost"
    assert await store.run(sweep_unclaimed_txn, now=at(100), older_than_s=60) == 0


async def test_any_unanswered_says_what_a_sweep_would_select(store: Store) -> None:
    """The sweeper reads `any_unanswered` before it asks the broker and sweeps: it must be
    true whenever a sweep at that moment would act on a row (republish it or find it
    obsolete), or a lost command would never be sent again."""
    async def unanswered(t: float) -> bool:
        async with store.read() as conn:
            return await any_unanswered(conn, now=at(t), dispatch_after_s=60,
                                        reconcile_after_s=600)

    async def swept(t: float) -> int:
        """Rows both sweeps act on at `t` (republished or made obsolete)."""
        before = await outbox_rows(store)
        n = await store.run(sweep_unclaimed_txn, now=at(t), older_than_s=60)
        n += await store.run(sweep_unclaimed_txn, now=at(t), older_than_s=600,
                             kind="reconcile")
        after = await outbox_rows(store)
        return max(n, sum(after[i]["status"] != before[i]["status"] for i in before))

    assert not await unanswered(1000)  # an empty outbox
    await _published(store, "op2", at(0))
    await _published(store, "op3", at(0))
    async with store.transaction() as conn:  # op3's command as a reconcile command
        await conn.execute(outbox.update().where(outbox.c.id == "ob_op3")
                           .values(kind="reconcile"))
    await set_op(store, "op3", state="ambiguous")
    await _published(store, "op4", at(0))
    async with store.transaction() as conn:  # an audit row: done once published
        await conn.execute(outbox.update().where(outbox.c.id == "ob_op4").values(kind="audit"))

    assert not await unanswered(60)  # op2's dispatch command not yet older than 60 s
    assert await unanswered(61)
    assert await swept(61) == 1  # op2 republished; op3's reconcile command is not old enough
    assert not await unanswered(599)  # op2 pending again, op3 waits, the audit row ignored
    assert await swept(599) == 0
    assert await unanswered(601)
    assert await swept(601) == 1  # op3's reconcile command republished
    assert not await unanswered(10_000)
    assert await swept(10_000) == 0


async def test_an_idle_sweep_asks_the_broker_nothing_and_begins_no_transaction(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing old enough the sweep ends on the lockless read: no stream position asked,
    no sweep transaction; with a lost command it asks and republishes it."""
    from effectledger_ledger.db.outbox import StreamPosition
    from effectledger_ledger.relay import Sweeper

    ran: list[str] = []
    asked: list[str] = []
    run = store.run

    async def recording_run(fn: Any, *args: Any, **kwargs: Any) -> Any:
        ran.append(fn.__name__)
        return await run(fn, *args, **kwargs)

    async def positions() -> dict[str, StreamPosition | None]:
        asked.append("positions")
        return {}

    monkeypatch.setattr(store, "run", recording_run)
    sweeper = Sweeper(store, asyncio.Event(), older_than_s=60, interval_s=5,
                      reconcile_after_s=600, positions=positions, clock=lambda: at(100))
    assert await sweeper.sweep_once() == 0
    assert ran == [] and asked == []
    from prometheus_client import REGISTRY

    for kind in ("dispatch", "reconcile"):  # shown at 0, not missing, though never reached
        assert REGISTRY.get_sample_value("effectledger_sweeper_republished_total",
                                         {"kind": kind}) is not None
    monkeypatch.setattr(store, "run", run)
    await _published(store, "op1", at(0))
    monkeypatch.setattr(store, "run", recording_run)
    assert await sweeper.sweep_once() == 1
    assert ran == ["sweep_unclaimed_txn", "sweep_unclaimed_txn"] and asked == ["positions"]
    assert (await outbox_rows(store))["ob_op1"]["status"] == "pending"


async def test_sweeper_generations_keep_counting(store: Store) -> None:
    """Each sweep of a still-unclaimed row is a new generation with a new message id."""
    await _published(store, "op1", at(0))
    ids = []
    for round_ in range(1, 4):
        now = at(1000 * round_)
        assert await store.run(sweep_unclaimed_txn, now=now, older_than_s=60) == 1
        [item] = await lease(store, now)
        assert item.publish_count == round_
        ids.append(item.message_id)
        assert await publish(store, [item.id], now) == 1
    assert ids == ["ob_op1.r1", "ob_op1.r2", "ob_op1.r3"]


async def test_sweeper_ignores_ambiguous_rows(store: Store) -> None:
    """Only dispatch commands are swept; a published ambiguity hand-off is not re-dispatched."""
    await _published(store, "op1", at(0))
    async with store.transaction() as conn:
        await conn.execute(outbox.update().where(outbox.c.id == "ob_op1").values(kind="ambiguous"))
    assert await store.run(sweep_unclaimed_txn, now=at(1000), older_than_s=60) == 0
    assert (await outbox_rows(store))["ob_op1"]["status"] == "published"


async def test_backlog_counts_rows_by_status(store: Store) -> None:
    """backlog_txn reports how many rows sit in each status."""
    await submit(store, "op1")
    await submit(store, "op2")
    await lease(store, at(0), limit=1)
    assert await store.run(backlog_txn) == {"pending": 1, "publishing": 1}


async def test_concurrent_relays_never_lease_the_same_row(store: Store) -> None:
    """Ten relays leasing at once split the rows between them without any overlap."""
    for i in range(30):
        await submit(store, f"op{i:02d}")
    batches = await asyncio.gather(*(lease(store, at(0), limit=4) for _ in range(10)))
    leased = [i.id for batch in batches for i in batch]
    assert len(leased) == len(set(leased)) == 30


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_skip_locked_lets_a_second_relay_pass_an_open_lease_transaction(
        store: Store) -> None:
    """While one relay's lease transaction is still open, a second one skips its locked rows
    (instead of waiting or taking them) and leases only the others."""
    for i in range(4):
        await submit(store, f"op{i}", now=at(i))
    async with store.engine.connect() as first, store.engine.connect() as second:
        tx1 = await first.begin()
        mine = await lease_batch_txn(first, now=at(10), limit=2, lease_s=30)
        assert [i.id for i in mine] == ["ob_op0", "ob_op1"]
        tx2 = await second.begin()
        # Without SKIP LOCKED this would block on the first relay's locks: fail fast instead.
        await second.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
        theirs = await lease_batch_txn(second, now=at(10), limit=10, lease_s=30)
        assert [i.id for i in theirs] == ["ob_op2", "ob_op3"]
        await tx2.commit()
        await tx1.commit()
    rows = await outbox_rows(store)
    assert {r["status"] for r in rows.values()} == {"publishing"}


def test_stream_position_tells_queued_from_gone() -> None:
    """Between the ack floor and the stream's end a message is queued or in hand; below the
    first sequence, at or below the ack floor, or past the end it is gone."""
    from effectledger_ledger.db.outbox import StreamPosition

    pos = StreamPosition(first_seq=10, last_seq=20, ack_floor=12)
    assert [s for s in range(5, 25) if pos.still_queued(s)] == list(range(13, 21))
    assert not pos.still_queued(None)


async def test_sweeper_leaves_rows_queued_behind_a_backlog(store: Store) -> None:
    """An old, unclaimed row whose message is still in the stream is not republished; the
    same row is republished once the stream says the message is gone."""
    from effectledger_ledger.db.outbox import StreamPosition

    await submit(store, "op1")
    [item] = await store.run(lease_batch_txn, now=T0, limit=10, lease_s=30)
    await store.run(mark_published_txn, [item.id], now=T0, seqs={item.id: 7})
    later = T0 + timedelta(seconds=3600)
    queued = StreamPosition(first_seq=5, last_seq=9, ack_floor=6)
    assert await store.run(sweep_unclaimed_txn, now=later, older_than_s=60,
                           position=queued) == 0
    gone = StreamPosition(first_seq=8, last_seq=9, ack_floor=6)  # seq 7 deleted
    assert await store.run(sweep_unclaimed_txn, now=later, older_than_s=60,
                           position=gone) == 1
