"""The outbox relay and the sweeper.

The relay leases unpublished rows (committing the lease before any network call), publishes
each to JetStream with its Nats-Msg-Id, waits for the publish-ack, and only then marks it
published. It wakes on an in-process event, on PostgreSQL NOTIFY (other replicas' commits),
and on a poll timer, because notifications are hints that can be missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import JetStreamContext

from effectledger_core.crash import crash_point
from effectledger_core.errors import StoreUnavailable
from effectledger_core.ids import Clock, utcnow
from effectledger_core.states import OutboxKind
from effectledger_obs import metrics, tracing

from .db.batch import GroupCommit
from .db.outbox import (
    MarkPublished,
    OutboxItem,
    StreamPosition,
    any_due,
    any_unanswered,
    lease_batch_txn,
    mark_published_txn,
    release_txn,
    sweep_unclaimed_txn,
)
from .db.store import Store

log = logging.getLogger(__name__)

# How long a claim waits for its intent's statement to answer (`DirectPublisher.answered`):
# far longer than a commit (a WAL flush stalls for tens of milliseconds here), shorter than a
# dispatcher's claim request (`claim_timeout_s`, 5 s).
CLAIM_WAIT_S = 1.0
# How many operations handed over early `DirectPublisher.handed_over` remembers once answered:
# a claim comes within milliseconds of its command, so a few seconds' worth at any rate.
HANDED_OVER_KEPT = 4096


async def publish_item(js: JetStreamContext, item: OutboxItem, timeout_s: float) -> int:
    """Publish one outbox row under its Nats-Msg-Id; returns the stream sequence of the ack.

    With tracing on, the publish is a span in the trace of the request that wrote the row (its
    stored traceparent), and the message carries the publish span's context to the consumer.
    """
    headers = {"Nats-Msg-Id": item.message_id}
    if not tracing.ENABLED:
        ack = await js.publish(item.subject, item.payload, timeout=timeout_s, headers=headers)
        return int(ack.seq)
    with tracing.span(f"publish {item.kind}", kind=tracing.SpanKind.PRODUCER,
                      context=tracing.context_from_traceparent(item.traceparent),
                      attributes={"messaging.system": "nats",
                                  "messaging.destination.name": item.subject,
                                  "messaging.message.id": item.message_id}):
        tracing.inject(headers)
        ack = await js.publish(item.subject, item.payload, timeout=timeout_s, headers=headers)
        return int(ack.seq)


async def publish_all(js: JetStreamContext, items: list[OutboxItem],
                      timeout_s: float) -> list[int | BaseException]:
    """Publish `items` at once; each result is the ack's stream sequence or the exception.

    A single item (an agent's command, one at a time) is awaited in this task: through
    `asyncio.gather` it would be wrapped in a task of its own that starts only on the loop's
    next turn, one more scheduling step before the command's bytes leave."""
    if len(items) == 1:
        try:
            return [await publish_item(js, items[0], timeout_s)]
        except Exception as exc:  # as gather(return_exceptions=True) would hand it back
            return [exc]
    return list(await asyncio.gather(*(publish_item(js, i, timeout_s) for i in items),
                                     return_exceptions=True))


def _count_published(items: list[OutboxItem], published: set[str], via: str) -> None:
    for item in items:
        if item.id in published:
            metrics.child(metrics.RELAY_PUBLISHED, item.kind, via).inc()


class Relay:
    def __init__(self, store: Store, js: JetStreamContext, wake: asyncio.Event, *,
                 batch_size: int = 256, lease_s: float = 30.0, poll_interval_s: float = 0.5,
                 publish_timeout_s: float = 5.0, clock: Clock = utcnow) -> None:
        self.store, self.js, self.wake = store, js, wake
        self.batch_size, self.lease_s = batch_size, lease_s
        self.poll_interval_s, self.publish_timeout_s = poll_interval_s, publish_timeout_s
        self.clock = clock
        self.published = 0

    async def pump_once(self) -> int:
        """Publish one batch; returns how many rows were leased."""
        # Most polls find nothing (new intents' commands go out by direct publish): one
        # lockless read says so without the lease transaction's three round trips.
        async with self.store.read() as conn:
            if not await any_due(conn, now=self.clock()):
                return 0
        items = await self.store.run(lease_batch_txn, now=self.clock(), limit=self.batch_size,
                                     lease_s=self.lease_s)
        if not items:
            return 0
        results = await publish_all(self.js, items, self.publish_timeout_s)
        crash_point("ledger.relay.after_publish")
        seqs = {i.id: r for i, r in zip(items, results, strict=True) if isinstance(r, int)}
        ok = list(seqs)
        failed = [(i, r) for i, r in zip(items, results, strict=True)
                  if isinstance(r, BaseException)]
        if ok:
            await self.store.run(mark_published_txn, ok, now=self.clock(), seqs=seqs)
            self.published += len(ok)
            _count_published(items, set(ok), "relay")
        if failed:
            metrics.child(metrics.RELAY_PUBLISH_FAILURES, "relay").inc(len(failed))
            err = repr(failed[0][1])
            log.warning("relay: %d publishes failed (%s); retrying later", len(failed), err)
            await self.store.run(release_txn, [i.id for i, _ in failed], now=self.clock(),
                                 error=err, retry_after_s=1.0)
        return len(items)

    async def run(self) -> None:
        while True:
            try:
                n = await self.pump_once()
            except (StoreUnavailable, OSError) as exc:
                log.warning("relay: %s; retrying", exc)
                n = 0
                await asyncio.sleep(1.0)  # back off from a failing database, not a sync point
            except Exception:
                log.exception("relay: unexpected error; retrying")
                n = 0
                await asyncio.sleep(1.0)
            if n >= self.batch_size:
                continue  # more may be waiting
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.poll_interval_s)


class DirectPublisher:
    """Publishes new intents' dispatch commands with their commit, skipping the relay.

    The intent's transaction wrote the outbox row already leased (`direct_publish_lease_s`),
    so no relay takes it meanwhile; this saves the relay's lease transaction and its wake-up
    on every operation. Marks go through the ledger's group commit and share a transaction
    with the intents and claims of the moment. Whatever cannot be published is released to
    the relay at once; if the ledger dies first, the lease runs out and the relay publishes it
    (the same Nats-Msg-Id, so JetStream drops a copy that did get through).

    An intent alone in its transaction (an agent's call) hands its command over *before* its
    one statement is sent (`early`), so the publish, the delivery and the dispatcher's claim
    request travel while the commit's WAL flush does; the claim is decided only on a committed
    operation (docs/design.md, "A command published with its commit"). Its marks, or its
    release, wait until the statement has answered, and are skipped when it wrote nothing. A
    claim for it that reaches this ledger first waits for that answer too (`answered`).
    """

    def __init__(self, js: JetStreamContext, writes: GroupCommit, store: Store, wake: asyncio.Event,
                 *, publish_timeout_s: float = 5.0, max_batch: int = 256,
                 mark_linger_s: float = 0.0, clock: Clock = utcnow) -> None:
        self.js, self.writes, self.store, self.wake = js, writes, store, wake
        self.publish_timeout_s, self.max_batch, self.clock = publish_timeout_s, max_batch, clock
        self.mark_linger_s = mark_linger_s
        self.published = 0
        self.marks_skipped = 0  # rows a granted claim had consumed before their mark was due
        # A submitted command's (operation id, epoch) -> its outbox id, the reverse, and per
        # outbox id a future a claim granted here completes (see `consumed`); all three kept
        # only until the command's settle.
        self._commands: dict[tuple[str, int], str] = {}
        self._operation_of: dict[str, tuple[str, int]] = {}
        self._claimed: dict[str, asyncio.Future[None]] = {}
        # Per outbox id handed over `early`: whether its statement wrote the row (see `early`).
        self._written: dict[str, asyncio.Future[bool]] = {}
        # The same futures by operation (id, epoch), only until they are done (see `answered`).
        self._unanswered: dict[tuple[str, int], asyncio.Future[bool]] = {}
        # The same operations once answered, the latest HANDED_OVER_KEPT (see `handed_over`).
        self._answered_ops: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.claim_wait_s = CLAIM_WAIT_S
        self.claims_waiting = 0  # claims in `answered` now
        self.claims_waited = 0  # claims that found their intent's statement unanswered
        self._queue: asyncio.Queue[OutboxItem] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._worker: asyncio.Task[None] | None = None
        self._outstanding = 0  # submitted, not yet marked or handed back
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, item: OutboxItem, *, operation: tuple[str, int] | None = None) -> None:
        """Publish `item`; `operation` (its operation id and epoch) lets a claim granted for
        it spare its mark (see `consumed`)."""
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name="direct-publisher")
        early = self._written.get(item.id)
        if early is not None and early.done() and not early.result():
            # Handed over early by a statement that wrote nothing, and now written after its
            # commit (the batch path took the call over): this publish is marked as any other.
            del self._written[item.id]
        self._outstanding += 1
        self._idle.clear()
        if operation is not None and self.mark_linger_s > 0:
            self._commands[operation] = item.id
            self._operation_of[item.id] = operation
            self._claimed[item.id] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(item)

    def early(self, item: OutboxItem, operation: tuple[str, int]) -> Callable[[bool], None]:
        """Publish `item` now, before the statement that writes its row has answered; returns
        the function to call with whether that statement wrote the row (True: committed with
        it). Until then nothing is marked or released for it, and nothing at all when it did
        not write: there is no row (the key was taken, or the statement failed). A replay of
        the same call publishes again only if the earlier try wrote nothing."""
        known = self._written.get(item.id)
        if known is None or (known.done() and not known.result()):
            # New, or a replay of a call whose earlier statement wrote nothing (it failed and
            # is retried): published again, JetStream drops the copy, and this one is marked.
            known = self._written[item.id] = asyncio.get_running_loop().create_future()
            self._unanswered[operation] = known
            known.add_done_callback(lambda done: self._answered(operation, done))
            self.submit(item, operation=operation)

        def settle(written: bool) -> None:
            if not known.done():
                known.set_result(written)
        return settle

    def _answered(self, operation: tuple[str, int], done: asyncio.Future[bool]) -> None:
        if self._unanswered.get(operation) is done:  # not a replay's, handed over since
            del self._unanswered[operation]
        self._answered_ops[operation] = None
        self._answered_ops.move_to_end(operation)
        if len(self._answered_ops) > HANDED_OVER_KEPT:
            self._answered_ops.popitem(last=False)

    def handed_over(self, operation_id: str, epoch: int) -> bool:
        """Whether this ledger handed over that operation's command `early` (lately: the
        last HANDED_OVER_KEPT answered, and any not answered yet). Its claim has then waited
        for the statement in `answered`, and a `not_found` after that is final: the statement
        wrote nothing (a retried key)."""
        operation = (operation_id, epoch)
        return operation in self._unanswered or operation in self._answered_ops

    async def answered(self, operation_id: str, epoch: int) -> None:
        """Return once the statement writing this operation, if its command was handed over
        `early` and it has not answered yet, has answered (or after `claim_wait_s`).

        A claim waits here before it is queued for a writer. With one writer it always came
        after the intent's transaction anyway; with two (PostgreSQL's default) a free writer
        would decide it while the other still runs the intent's statement, find no committed
        operation, and answer `not_found`, which costs the dispatcher a 20 ms nak. A statement
        that has not answered within `claim_wait_s` is waiting on a lock (its key held by
        another transaction) and may write nothing: the claim is decided then as before, and a
        `not_found` is asked again (docs/design.md, "A command published with its commit").
        """
        pending = self._unanswered.get((operation_id, epoch))
        if pending is None or pending.done():
            return
        self.claims_waited += 1
        self.claims_waiting += 1
        try:
            await asyncio.wait((pending,), timeout=self.claim_wait_s)  # never cancels it
        finally:
            self.claims_waiting -= 1

    def consumed(self, operation_id: str, epoch: int) -> None:
        """A claim for this operation and epoch was granted and committed: it marked the
        epoch's dispatch command consumed, so marking it published would change nothing."""
        outbox_id = self._commands.pop((operation_id, epoch), None)
        waiter = self._claimed.get(outbox_id) if outbox_id is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        """Wait until everything submitted so far is published and marked (or handed back)."""
        await self._idle.wait()

    async def _work(self) -> None:
        while True:
            items = [await self._queue.get()]
            while len(items) < self.max_batch and not self._queue.empty():
                items.append(self._queue.get_nowait())
            results = await publish_all(self.js, items, self.publish_timeout_s)
            crash_point("ledger.relay.after_publish")
            # Marking must not hold up the next round of publishes.
            task = asyncio.create_task(self._settle(items, results))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _settle(self, items: list[OutboxItem], results: list[Any]) -> None:
        # Rows published early exist only once their statement wrote them: wait for it (it
        # answers within one round trip of the publish), and leave out those it did not.
        written = {i.id: w for i in items if (w := self._written.get(i.id)) is not None}
        try:
            if written:
                await asyncio.wait(written.values())
            kept = [(i, r) for i, r in zip(items, results, strict=True)
                    if i.id not in written or written[i.id].result()]
            seqs = {i.id: r for i, r in kept if isinstance(r, int)}
            failed = [i.id for i, r in kept if isinstance(r, BaseException)]
            if failed:  # first: the relay should not wait for the marks' linger
                metrics.child(metrics.RELAY_PUBLISH_FAILURES, "direct").inc(len(failed))
                log.warning("direct publish: %d failed (%r); handed to the relay", len(failed),
                            next(r for r in results if isinstance(r, BaseException)))
                await self.store.run(release_txn, failed, now=self.clock(),
                                     error="direct publish failed", retry_after_s=0.0)
                self.wake.set()
            if seqs:
                self.published += len(seqs)
                _count_published(items, set(seqs), "direct")
                unclaimed = await self._unclaimed(seqs)
                if unclaimed:
                    await self.writes.call(MarkPublished(list(unclaimed), now=self.clock(),
                                                         seqs=unclaimed))
        except Exception:
            # Unmarked rows keep their lease; the relay takes them over when it runs out.
            log.exception("direct publish: could not record %d publishes", len(items))
        finally:
            for item in items:
                self._claimed.pop(item.id, None)
                if item.id in written and self._written.get(item.id) is written[item.id]:
                    del self._written[item.id]  # not a replay's, published since
                operation = self._operation_of.pop(item.id, None)
                if operation is not None and self._commands.get(operation) == item.id:
                    del self._commands[operation]
            self._outstanding -= len(items)
            if self._outstanding == 0:
                self._idle.set()

    async def _unclaimed(self, seqs: dict[str, int]) -> dict[str, int]:
        """The published rows still to mark: waits up to `mark_linger_s` for their claims and
        leaves out the rows a granted claim consumed meanwhile. Not a pause: the wait ends as
        soon as every claim is in, and rows without a waiter are marked at once."""
        waiters = [w for w in (self._claimed.get(i) for i in seqs) if w is not None]
        if waiters and not all(w.done() for w in waiters):
            await asyncio.wait(waiters, timeout=self.mark_linger_s)
        out = {}
        for outbox_id, seq in seqs.items():
            waiter = self._claimed.get(outbox_id)
            if waiter is not None and waiter.done():
                self.marks_skipped += 1
            else:
                out[outbox_id] = seq
        return out

    async def close(self, grace_s: float = 5.0) -> None:
        # Finish what is in hand; anything left keeps its lease and goes to the relay later.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), grace_s)
        tasks = [t for t in (self._worker, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


class Sweeper:
    """Republishes dispatch rows published but never claimed: JetStream may lose messages."""

    def __init__(self, store: Store, wake: asyncio.Event, *, older_than_s: float,
                 interval_s: float, reconcile_after_s: float = 900.0,
                 positions: Callable[[], Awaitable[dict[str, StreamPosition | None]]]
                 | None = None,
                 clock: Clock = utcnow,
                 repair_lost_outcomes: Callable[[], Awaitable[int]] | None = None) -> None:
        self.store, self.wake = store, wake
        # Where the dispatch and reconcile streams stand, so queued rows are not resent.
        self.positions = positions
        # Claimed attempts whose outcome message the broker lost (db/lost.py).
        self.repair_lost_outcomes = repair_lost_outcomes
        self.older_than_s, self.interval_s, self.clock = older_than_s, interval_s, clock
        # Reconciliation legitimately waits (provider horizons, webhook windows): resend a
        # reconcile command only after much longer than a dispatch command.
        self.reconcile_after_s = max(reconcile_after_s, older_than_s)
        self.republished = 0
        # Both series exist at 0 from the start: an idle sweep no longer reaches the increment
        # (it ends on its lockless read), and a dashboard should show 0, not "no data".
        for kind in (OutboxKind.DISPATCH.value, OutboxKind.RECONCILE.value):
            metrics.child(metrics.SWEEPER_REPUBLISHED, kind)

    async def sweep_once(self) -> int:
        n = await self._sweep_unanswered()
        if n:
            log.warning("sweeper: republishing %d unclaimed dispatch commands", n)
            self.republished += n
            self.wake.set()
        if self.repair_lost_outcomes is not None:
            lost = await self.repair_lost_outcomes()
            if lost:
                log.warning("sweeper: %d claimed attempts never reported an outcome; "
                            "handed to reconciliation as ambiguous", lost)
                self.wake.set()
            n += lost
        return n

    async def _sweep_unanswered(self) -> int:
        """Republish what the broker may have lost; 0 at once when no row is old enough: an
        idle ledger's sweep asks the broker nothing and begins no transaction."""
        async with self.store.read() as conn:
            if not await any_unanswered(conn, now=self.clock(),
                                        dispatch_after_s=self.older_than_s,
                                        reconcile_after_s=self.reconcile_after_s):
                return 0
        pos: dict[str, StreamPosition | None] = {}
        if self.positions is not None:
            pos = await self.positions()
        dispatch = await self.store.run(sweep_unclaimed_txn, now=self.clock(),
                                        older_than_s=self.older_than_s,
                                        position=pos.get("dispatch"))
        reconcile = await self.store.run(sweep_unclaimed_txn, now=self.clock(),
                                         older_than_s=self.reconcile_after_s,
                                         kind=OutboxKind.RECONCILE.value,
                                         position=pos.get("reconcile"))
        metrics.child(metrics.SWEEPER_REPUBLISHED, "dispatch").inc(dispatch)
        metrics.child(metrics.SWEEPER_REPUBLISHED, "reconcile").inc(reconcile)
        return dispatch + reconcile

    async def run(self) -> None:
        while True:
            try:
                await self.sweep_once()
            except Exception:
                log.exception("sweeper: error; will retry")
            await asyncio.sleep(self.interval_s)  # a period, not synchronisation


async def stream_position(js: JetStreamContext, stream: str,
                          consumer: str) -> StreamPosition | None:
    """The stream's bounds and the consumer's ack floor; None when JetStream cannot say."""
    from nats.js.errors import NotFoundError

    try:
        info = await js.stream_info(stream)
    except Exception as exc:  # an unreachable broker: no position, age rules alone apply
        log.debug("sweeper: no stream info for %s: %s", stream, exc)
        return None
    state = info.state
    ack_floor = 0
    try:
        cinfo = await js.consumer_info(stream, consumer)
        ack_floor = int(cinfo.ack_floor.stream_seq) if cinfo.ack_floor else 0
    except NotFoundError:
        pass  # nobody has consumed yet: nothing is acknowledged
    except Exception as exc:
        log.debug("sweeper: no consumer info for %s/%s: %s", stream, consumer, exc)
        return None
    return StreamPosition(first_seq=int(state.first_seq), last_seq=int(state.last_seq),
                          ack_floor=ack_floor)
