"""Group commit: concurrent transaction functions share one transaction, one commit.

Every intent, claim and outcome used to be its own transaction, and with synchronous commit each
commit is a WAL flush: under load the ledger spent most of its time waiting for and paying for
commits, not doing work. `GroupCommit.run(fn, ...)` queues the call; a worker takes whatever has
queued up (at most `max_batch`) and runs the functions one after another on one connection, then
commits once. Nothing waits for a batch to fill: at low load a batch is one call, so latency is
unchanged; under load batches grow by themselves.

Each caller still gets its own result or exception, and only after the commit that made its
writes durable, so "ack after commit" holds per message. If anything in a batch raises, the
whole transaction is rolled back and every call in it is run again on its own (`Store.run`, with
its usual retries): one bad call can neither fail nor half-apply its neighbours. The functions
must therefore be pure transaction functions (all their effects are in the connection), which
the `*_txn` functions are.

A call may also be a typed value with a set-based form: a `BatchCall` (`calls.py`: a frozen
dataclass of the call's inputs) whose class implements `many(conn, calls)`. The calls of one
class in one batch are handed over together and get one result each, or an exception instance
for a call refused without writing anything. That turns N claims into a handful of statements
instead of N times as many. A call alone (or replayed after a rolled-back batch) is a batch of
one: one code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_obs import metrics

from .calls import BatchCall
from .pgtx import Pinned
from .store import Store

log = logging.getLogger(__name__)
T = TypeVar("T")
# Background calls a batch holding urgent calls takes at least (see `GroupCommit._take`).
URGENT_TOP_UP = 8
# A background-only batch this large lets urgent calls run beside it (`GroupCommit._express`).
EXPRESS_AFTER = 2 * URGENT_TOP_UP


async def _one(conn: AsyncConnection, call: BatchCall[T]) -> T:
    return await call.one(conn)


@dataclass
class _Call(Generic[T]):
    fn: Callable[..., Awaitable[T]]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    typed: BatchCall[T] | None = None  # a call with a set-based form
    future: asyncio.Future[T] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class BatchStats:
    batches: int = 0
    calls: int = 0
    fallbacks: int = 0  # batches rolled back and replayed call by call
    largest: int = 0
    idle_wakes: int = 0  # a writer or the express lane woken with nothing to do


class GroupCommit:
    """Coalesces concurrent `*_txn` calls into shared transactions (see module docstring)."""

    def __init__(self, store: Store, *, name: str, max_batch: int = 64, workers: int = 1) -> None:
        if max_batch < 1 or workers < 1:
            raise ValueError("max_batch and workers must be at least 1")
        self.store, self.name = store, name
        self.max_batch, self.workers = max_batch, workers
        self.stats = BatchStats()
        self._urgent: deque[_Call[Any]] = deque()
        self._background: deque[_Call[Any]] = deque()
        # The writers waiting for a call, each on a future of its own: a call wakes one of
        # them (an asyncio.Event would wake all, and the rest would find nothing to take).
        self._idle: deque[asyncio.Future[None]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        # The express lane (see `_express`): open while a worker runs a large batch of
        # background calls only, and woken by urgent calls only then (each wake-up that found
        # it closed was a task step for nothing, two per operation).
        self._urgent_ready: asyncio.Event | None = None
        self._express_open = 0
        self._express_task: asyncio.Task[None] | None = None

    async def call(self, typed: BatchCall[T]) -> T:
        """Run a typed call; calls of its class in the same batch are decided together."""
        return await self._submit(_Call(_one, (typed,), {}, typed))

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run a plain transaction function `fn(conn, *args, **kwargs)` in a shared batch."""
        return await self._submit(_Call(fn, args, kwargs))

    async def _submit(self, call: _Call[T]) -> T:
        if self.max_batch == 1:
            return await self.store.run(call.fn, *call.args, **call.kwargs)
        self._start()
        # Retrieve the outcome even when the caller is gone, so asyncio does not log it as lost.
        call.future.add_done_callback(_consume)
        urgent = _is_urgent(call)
        (self._urgent if urgent else self._background).append(call)
        self._wake_one()
        if urgent and self._express_open and self._urgent_ready is not None:
            self._urgent_ready.set()  # beside a large background batch only (`_express`)
        # The caller may be cancelled (a client went away); the call itself still runs and
        # commits or not as a unit with its batch, like a transaction whose reply was lost.
        return await asyncio.shield(call.future)

    def _wake_one(self) -> None:
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():  # else its writer was cancelled while it waited
                waiter.set_result(None)
                return

    def _start(self) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        while len(self._tasks) < self.workers:
            self._tasks.append(asyncio.create_task(self._work(), name=f"group-commit-{self.name}"))
        # SQLite has one connection: a second transaction would only wait for it.
        if self.store.is_postgres and (self._express_task is None or self._express_task.done()):
            self._urgent_ready = asyncio.Event()
            self._express_task = asyncio.create_task(
                self._express(self._urgent_ready), name=f"group-commit-{self.name}-express")

    def _take(self) -> list[_Call[Any]]:
        """Up to `max_batch` calls: every waiting urgent call first, then background ones.

        A batch that holds urgent calls is topped up with a few background calls only
        (`URGENT_TOP_UP`): someone waits for its commit, and a batch's transaction lasts as long
        as all its calls (after a restart the inbox hands over hundreds of outcomes, and an intent
        topped up with 56 of them waited 0.6-1.5 s). Background calls still keep pace: an
        operation brings two urgent calls (intent, claim) and about as many background ones
        (outcome, relay bookkeeping), and each urgent batch takes twice its urgent calls, at
        least eight; a batch with no urgent call takes `max_batch` of them.
        """
        batch: list[_Call[Any]] = []
        while self._urgent and len(batch) < self.max_batch:
            batch.append(self._urgent.popleft())
        room = self.max_batch - len(batch)
        if batch:
            room = min(room, max(URGENT_TOP_UP, 2 * len(batch)))
        while self._background and room > 0:
            batch.append(self._background.popleft())
            room -= 1
        return batch

    async def _work(self) -> None:
        woken = False
        # A worker runs one transaction at a time: it keeps its connection between them
        # (pgtx.Pinned) instead of a pool checkout and check-in for each.
        pinned = self.store.pinned()
        try:
            while True:
                batch = self._take()
                if not batch:
                    # Woken, and another writer took the call first (it was between batches).
                    self.stats.idle_wakes += woken
                    waiter = asyncio.get_running_loop().create_future()
                    self._idle.append(waiter)
                    await waiter
                    woken = True
                    continue
                woken = False
                # Urgent calls arriving now need not wait for this batch's commit (`_express`).
                express = len(batch) >= EXPRESS_AFTER and not any(_is_urgent(c) for c in batch)
                self._express_open += express
                try:
                    if express and self._urgent and self._urgent_ready is not None:
                        self._urgent_ready.set()
                    await self._run_guarded(batch, pinned)
                finally:
                    self._express_open -= express
        finally:
            if pinned is not None:
                await pinned.release()

    async def _express(self, urgent_ready: asyncio.Event) -> None:
        """Urgent calls beside a large batch of background calls, in a transaction of their own.

        After a restart or a broker outage the inbox hands over hundreds of outcomes, and a
        batch of 40 of them took 170 ms on a loaded machine; an intent arriving just after such
        a batch started waited for it, then for its own (a proving-ground seed measured 0.65 s
        from a ledger's resume to its first acknowledged intent). Only beside a large
        background-only batch: beside small ones (moderate load) a second transaction would
        cost a commit more than it saves, and a batch holding urgent calls is short already.
        """
        while True:
            await urgent_ready.wait()
            urgent_ready.clear()
            if not self._express_open:
                self.stats.idle_wakes += 1
                continue  # the workers take urgent calls first anyway
            batch: list[_Call[Any]] = []
            while self._urgent and len(batch) < self.max_batch:
                batch.append(self._urgent.popleft())
            if batch:
                await self._run_guarded(batch)

    async def _run_guarded(self, batch: list[_Call[Any]], pinned: Pinned | None = None
                           ) -> None:
        try:
            await self._run_batch(batch, pinned)
        except BaseException as exc:  # cancelled while running: nobody may wait forever
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(
                        exc if isinstance(exc, Exception) else RuntimeError("ledger stopping"))
            raise

    async def _run_batch(self, batch: list[_Call[Any]], pinned: Pinned | None) -> None:
        self.stats.batches += 1
        self.stats.calls += len(batch)
        self.stats.largest = max(self.stats.largest, len(batch))
        metrics.child(metrics.DB_BATCH_SIZE, self.name).observe(len(batch))
        started = time.perf_counter()
        if len(batch) == 1:
            await self._run_alone(batch[0], pinned)
            metrics.child(metrics.DB_TRANSACTION_DURATION, self.name).observe(
                time.perf_counter() - started)
            return
        try:
            async with self.store.transaction(pinned) as conn:
                results = await _run_in(conn, batch)
            metrics.child(metrics.DB_TRANSACTION_DURATION, self.name).observe(
                time.perf_counter() - started)
        except Exception as exc:
            self.stats.fallbacks += 1
            metrics.child(metrics.DB_BATCH_FALLBACKS, self.name).inc()
            log.debug("group commit %s: batch of %d rolled back (%s: %s); replaying one by one",
                      self.name, len(batch), type(exc).__name__, exc)
            await asyncio.gather(*(self._run_alone(call) for call in batch))
            return
        for call, result in zip(batch, results, strict=True):
            if call.future.done():
                continue
            if isinstance(result, BaseException):
                call.future.set_exception(result)  # refused by a set-based form, nothing written
            else:
                call.future.set_result(result)

    async def _run_alone(self, call: _Call[Any], pinned: Pinned | None = None) -> None:
        # A batch's fallback replays its calls at once, each on a checkout of its own (no pin).
        try:
            result = await self.store.run(call.fn, *call.args, pinned=pinned, **call.kwargs)
        except Exception as exc:
            if not call.future.done():
                call.future.set_exception(exc)
            return
        if not call.future.done():
            call.future.set_result(result)

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._express_task] if self._express_task else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks, self._express_task = [], None
        for queue in (self._urgent, self._background):
            while queue:
                call = queue.popleft()  # never started: it wrote nothing
                if not call.future.done():
                    call.future.set_exception(RuntimeError("ledger stopping"))


async def _run_in(conn: AsyncConnection, batch: list[_Call[Any]]) -> list[Any]:
    """Run a batch's calls on `conn`; typed calls of one class go to its `many` together."""
    groups: dict[Any, list[int]] = {}
    for i, call in enumerate(batch):
        key = type(call.typed) if call.typed is not None else call.fn
        groups.setdefault(key, []).append(i)
    results: list[Any] = [None] * len(batch)
    for key, idxs in groups.items():
        if isinstance(key, type) and issubclass(key, BatchCall):
            typed = [c for c in (batch[i].typed for i in idxs) if c is not None]
            out = await key.many(conn, typed)
            if len(out) != len(idxs):
                raise AssertionError(f"{key.__name__}.many returned {len(out)} results "
                                     f"for {len(idxs)} calls")
            for i, result in zip(idxs, out, strict=True):
                results[i] = result
        else:
            for i in idxs:
                results[i] = await batch[i].fn(conn, *batch[i].args, **batch[i].kwargs)
    return results


def _is_urgent(call: _Call[Any]) -> bool:
    return call.typed is not None and type(call.typed).urgent


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
