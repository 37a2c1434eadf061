"""Direct publish of new intents' commands: leased at commit, published, marked or handed back."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from effectledger_bus.testing import FakeJetStream
from effectledger_core.messages import ClaimAttempt, ClaimStatus, SubmitIntent
from effectledger_ledger.db import hot
from effectledger_ledger.db.intents import submit_intent_txn
from effectledger_ledger.db.outbox import OutboxItem, lease_batch_txn
from effectledger_ledger.db.schema import operations, outbox
from effectledger_ledger.db.store import Store
from effectledger_ledger.relay import DirectPublisher
from effectledger_ledger.service import LedgerService
from tests.integration.test_hot import _postgres_only
from tests.support.ledger import DEMO as CATALOG
from tests.support.ledger import NOW, SUBJECTS


async def outbox_rows(store: Store) -> list[dict[str, Any]]:
    async with store.transaction() as conn:
        return [dict(r) for r in (await conn.execute(sa.select(outbox))).mappings()]


def service(store: Store, js: FakeJetStream, *, mark_linger_s: float = 0.0) -> LedgerService:
    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: NOW)
    svc.publisher = DirectPublisher(js, svc.writes, store, svc.outbox_wake,  # type: ignore[arg-type]
                                    mark_linger_s=mark_linger_s, clock=lambda: NOW)
    return svc


async def test_a_new_intent_is_published_at_once_and_marked(store: Store) -> None:
    js = FakeJetStream()
    svc = service(store, js)
    try:
        sub = await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": "t1"}))
        assert svc.publisher is not None
        await svc.publisher.drain()
    finally:
        await svc.close()
    [(subject, headers)] = js.published
    [row] = await outbox_rows(store)
    assert subject == SUBJECTS.dispatch("create_ticket")
    assert headers["Nats-Msg-Id"] == row["id"]
    assert (row["operation_id"], row["status"], row["stream_seq"]) == (
        sub.operation["id"], "published", 1)
    assert not svc.outbox_wake.is_set()  # the relay had nothing to do


async def test_while_leased_no_relay_takes_the_row(store: Store) -> None:
    js = FakeJetStream()
    svc = service(store, js)
    svc.publisher.submit = lambda item, **_: None  # type: ignore[method-assign, union-attr]
    try:
        await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": "t2"}))
    finally:
        await svc.close()
    assert await store.run(lease_batch_txn, now=NOW, limit=10, lease_s=30) == []
    # Once the lease has run out (the ledger died before publishing), the relay takes it.
    later = NOW + timedelta(seconds=svc.direct_lease_s + 1)
    [item] = await store.run(lease_batch_txn, now=later, limit=10, lease_s=30)
    assert item.publish_count == 0  # the same Nats-Msg-Id as the direct attempt


async def test_a_failed_publish_is_handed_to_the_relay_at_once(store: Store) -> None:
    js = FakeJetStream(fail=True)
    svc = service(store, js)
    try:
        await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": "t3"}))
        assert svc.publisher is not None
        await svc.publisher.drain()
    finally:
        await svc.close()
    [row] = await outbox_rows(store)
    assert (row["status"], row["last_error"]) == ("pending", "direct publish failed")
    assert svc.outbox_wake.is_set()
    [item] = await store.run(lease_batch_txn, now=NOW, limit=10, lease_s=30)
    assert item.id == row["id"]


async def test_a_claim_granted_before_the_mark_is_due_spares_the_mark(store: Store) -> None:
    """The claim consumed the row; marking it published would change nothing, so it is not
    written. The publisher's wait for the claim ends when the claim is in, not at its linger
    (an hour here: the drain below would time out)."""
    js = FakeJetStream()
    svc = service(store, js, mark_linger_s=3600)
    publisher = svc.publisher
    assert publisher is not None
    try:
        sub = await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": "t4"}))
        op = sub.operation
        reply = await svc.claim(ClaimAttempt(
            operation_id=op["id"], epoch=1, attempt_id="a1", dispatcher_id="d1",
            tool=op["tool"], arguments_digest=op["arguments_digest"]))
        assert reply.status is ClaimStatus.GRANTED
        async with asyncio.timeout(10):
            await publisher.drain()
    finally:
        await svc.close()
    [row] = await outbox_rows(store)
    assert (row["status"], row["stream_seq"]) == ("consumed", None)  # never marked
    assert (publisher.published, publisher.marks_skipped) == (1, 1)
    assert not publisher._commands and not publisher._claimed and not publisher._operation_of


async def test_a_command_nobody_claims_is_marked_once_the_linger_is_over(store: Store) -> None:
    js = FakeJetStream()
    svc = service(store, js, mark_linger_s=0.05)
    publisher = svc.publisher
    assert publisher is not None
    try:
        await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": "t5"}))
        await publisher.drain()
    finally:
        await svc.close()
    [row] = await outbox_rows(store)
    assert (row["status"], row["stream_seq"]) == ("published", 1)
    assert (publisher.published, publisher.marks_skipped) == (1, 0)
    assert not publisher._commands and not publisher._claimed and not publisher._operation_of


# ---- an intent alone: its command published with its commit -----------------------------------


class _Rollback(Exception):
    pass


async def _holding_the_key(store: Store, key: str, release: asyncio.Event, holding: asyncio.Event,
                           *, commit: bool) -> None:
    """An open transaction that inserted an operation under `key`: another INSERT of the same
    key waits for it, then writes (it rolled back) or writes nothing (it committed)."""
    with contextlib.suppress(_Rollback):
        async with store.transaction() as conn:
            await hot.begin(conn)
            await submit_intent_txn(conn, catalog=CATALOG, intent=SubmitIntent(
                tool="create_ticket", arguments={"title": "t"}, idempotency_key=key),
                subjects=SUBJECTS, operation_id="op-holder", outbox_id="ob-holder", now=NOW)
            holding.set()
            await release.wait()
            if not commit:
                raise _Rollback


async def _submit_while_held(store: Store, svc: LedgerService, js: FakeJetStream, key: str, *,
                             commit: bool) -> tuple[asyncio.Task[Any], asyncio.Task[None],
                                                    asyncio.Event]:
    """Submit `key` while a transaction holds it (`_holding_the_key`), once its command is out:
    the submit (in its statement), the holder, and the event that lets the holder end."""
    release, holding = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_holding_the_key(store, key, release, holding, commit=commit))
    async with asyncio.timeout(10):
        await holding.wait()
        submit = asyncio.create_task(svc.submit(SubmitIntent(
            tool="create_ticket", arguments={"title": "t"}, idempotency_key=key)))
        await js.arrived.wait()
    return submit, holder, release


async def _operation_ids(store: Store) -> set[str]:
    async with store.read() as conn:
        return set((await conn.execute(sa.select(operations.c.id))).scalars())


async def test_an_intent_alone_is_published_before_its_statement_answers(store: Store) -> None:
    """The command is out while the intent's one statement still waits (here for a lock the
    test holds on its key): the dispatcher's part of the way runs beside the commit. Its row
    is marked only once the statement wrote it."""
    _postgres_only(store)
    js = FakeJetStream()
    svc = service(store, js)
    assert svc.publisher is not None
    submit, holder, release = await _submit_while_held(store, svc, js, "k-early", commit=False)
    try:
        op_id = json.loads(js.payloads[0])["operation_id"]
        assert not submit.done()  # still in its statement...
        assert op_id not in await _operation_ids(store)  # ...which has written nothing yet
        release.set()  # the holder rolls back: the statement writes
        async with asyncio.timeout(10):
            sub = await submit
            await holder
            await svc.publisher.drain()
    finally:
        release.set()
        await svc.close()
    assert sub.created and sub.operation["id"] == op_id
    [row] = await outbox_rows(store)
    assert (row["operation_id"], row["status"], row["stream_seq"]) == (op_id, "published", 1)
    assert len(js.published) == 1  # once: not again after the commit
    assert not svc.publisher._written


async def test_a_command_whose_statement_wrote_nothing_is_refused_at_its_claim(
        store: Store) -> None:
    """Published with a statement that then found the key taken: the command names an
    operation that never existed. Nothing is marked or released for it, and its claim is not
    found, so no dispatcher calls anything for it; the caller gets the existing operation."""
    _postgres_only(store)
    js = FakeJetStream()
    svc = service(store, js)
    assert svc.publisher is not None
    submit, holder, release = await _submit_while_held(store, svc, js, "k-taken", commit=True)
    try:
        async with asyncio.timeout(10):
            release.set()  # the holder commits: the statement writes nothing
            sub = await submit
            await holder
            await svc.publisher.drain()
        stray = json.loads(js.payloads[0])
        reply = await svc.claim(ClaimAttempt(
            operation_id=stray["operation_id"], epoch=1, attempt_id="a1", dispatcher_id="d1",
            tool=stray["tool"], arguments_digest=stray["arguments_digest"]))
    finally:
        release.set()
        await svc.close()
    assert (sub.created, sub.operation["id"]) == (False, "op-holder")
    assert stray["operation_id"] not in await _operation_ids(store)
    assert reply.status is ClaimStatus.NOT_FOUND
    # Its id is young, but this ledger knows its statement wrote nothing: not asked again as
    # an intent another replica may be committing (service.py, `_committing_elsewhere`).
    assert svc.claims_asked_again == 0
    [row] = await outbox_rows(store)  # the holder's own row only, untouched by the publisher
    assert (row["id"], row["status"], row["stream_seq"]) == ("ob-holder", "pending", None)
    assert svc.publisher.published == 0 and not svc.publisher._written


async def _unpublished(svc: LedgerService, title: str) -> tuple[OutboxItem, tuple[str, int]]:
    """A new intent's command and operation, its row leased and nothing published yet (as when
    its statement has just been sent)."""
    publisher = svc.publisher
    assert publisher is not None
    real_submit = publisher.submit
    publisher.submit = lambda item, **_: None  # type: ignore[method-assign]
    try:
        sub = await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": title}))
    finally:
        publisher.submit = real_submit  # type: ignore[method-assign]
    assert sub.command is not None
    return sub.command, (sub.operation["id"], 1)


async def test_a_replay_after_a_statement_that_wrote_nothing_is_published_again_and_marked(
        store: Store) -> None:
    """A call's first statement failed after its command went out (nothing to mark), and the
    retried call writes the row: its command is published again (JetStream would drop the
    copy) and this time marked, rather than left to the lease's end."""
    js = FakeJetStream()
    svc = service(store, js)
    publisher = svc.publisher
    assert publisher is not None
    try:
        command, operation = await _unpublished(svc, "t6")
        # The first try's statement failed; the retry's wrote the row, before the first
        # publish was even settled.
        publisher.early(command, operation)(False)
        publisher.early(command, operation)(True)
        async with asyncio.timeout(10):
            await publisher.drain()
    finally:
        await svc.close()
    [row] = await outbox_rows(store)
    assert (row["status"], row["stream_seq"]) == ("published", 2)
    assert len(js.published) == 2 and publisher.published == 1 and not publisher._written


async def test_a_call_taken_over_after_its_statement_wrote_nothing_is_marked_after_its_commit(
        store: Store) -> None:
    """The one statement wrote nothing (a call identity was held) and the batch path then
    wrote the row (it took the identity over), so the service hands the command over again
    after the commit: that publish is marked like any other."""
    js = FakeJetStream()
    svc = service(store, js)
    publisher = svc.publisher
    assert publisher is not None
    try:
        command, operation = await _unpublished(svc, "t7")
        publisher.early(command, operation)(False)  # the statement wrote nothing
        publisher.submit(command, operation=operation)  # written by the batch path
        async with asyncio.timeout(10):
            await publisher.drain()
    finally:
        await svc.close()
    [row] = await outbox_rows(store)
    assert (row["status"], row["stream_seq"]) == ("published", 2)
    assert len(js.published) == 2 and not publisher._written


def _claim_of(payload: bytes) -> ClaimAttempt:
    command = json.loads(payload)
    return ClaimAttempt(operation_id=command["operation_id"], epoch=command["epoch"],
                        attempt_id="a1", dispatcher_id="d1", tool=command["tool"],
                        arguments_digest=command["arguments_digest"])


async def _ended(svc: LedgerService, submit: asyncio.Task[Any], holder: asyncio.Task[None],
                 release: asyncio.Event) -> Any:
    """Let the holder of `_submit_while_held` end: the submit's answer, once its publishes are
    settled."""
    assert svc.publisher is not None
    release.set()
    async with asyncio.timeout(10):
        sub = await submit
        await holder
        await svc.publisher.drain()
    return sub


async def test_a_claim_that_comes_before_its_intent_has_answered_waits_for_it(
        store: Store) -> None:
    """With two writers, a claim need not queue behind its intent's transaction: a free writer
    would decide it while the intent's statement still runs (held here on a lock), find no
    operation and answer `not_found`, a 20 ms nak for the dispatcher. It waits for the
    statement's answer instead, and is granted."""
    _postgres_only(store)
    js = FakeJetStream()
    svc = service(store, js)
    publisher = svc.publisher
    assert publisher is not None and svc.writes.workers == 2  # PostgreSQL's default
    submit, holder, release = await _submit_while_held(store, svc, js, "k-claim", commit=False)
    try:
        claim = asyncio.create_task(svc.claim(_claim_of(js.payloads[0])))
        await asyncio.sleep(0)  # one turn of the loop: the new task runs to its first wait
        assert publisher.claims_waiting == 1 and not submit.done()  # both wait for it
        release.set()  # the holder rolls back: the statement writes, then the claim goes
        async with asyncio.timeout(10):
            reply = await claim
        sub = await _ended(svc, submit, holder, release)
    finally:
        release.set()
        await svc.close()
    assert sub.created and reply.status is ClaimStatus.GRANTED
    assert (publisher.claims_waited, publisher.claims_waiting) == (1, 0)
    assert not publisher._unanswered


async def test_a_claim_waits_for_its_intent_only_so_long(store: Store) -> None:
    """A statement still unanswered after `claim_wait_s` waits on a lock and may write
    nothing: the claim is decided meanwhile, not found, and the dispatcher asks again."""
    _postgres_only(store)
    js = FakeJetStream()
    svc = service(store, js)
    publisher = svc.publisher
    assert publisher is not None
    publisher.claim_wait_s = 0.05
    submit, holder, release = await _submit_while_held(store, svc, js, "k-slow", commit=True)
    try:
        async with asyncio.timeout(10):
            reply = await svc.claim(_claim_of(js.payloads[0]))  # the statement still waits
        assert not submit.done()
        sub = await _ended(svc, submit, holder, release)
    finally:
        release.set()
        await svc.close()
    assert reply.status is ClaimStatus.NOT_FOUND and publisher.claims_waited == 1
    assert (sub.created, sub.operation["id"]) == (False, "op-holder")
    assert not publisher._unanswered
