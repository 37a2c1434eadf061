"""In-process notifier for submit-and-wait: operation id → the waits watching it.

A waiter registers before it reads the operation's state (so no change can slip between its
read and its wait), then sleeps on an `asyncio.Event`. The service signals `changed(op_id)`
after the transaction that moved the operation has committed; only the waiters of that
operation wake, and each re-reads its state. Nothing polls the database per waiter: a waiter
costs one small object and a dict entry while it sleeps.

State reads are batched (`state`): waits that start or wake together share one
`SELECT id, state ... WHERE id IN (...)` on one connection, so ten thousand agents arriving
at once cost a handful of queries, not ten thousand, and never starve the connection pool
that every other request needs.

Changes this process did not make (another ledger replica's commit, a repair sweep that does
not name its operations) are caught by one shared re-check: every `recheck_s` a single query
per chunk of watched ids compares their states with what each waiter last saw, and wakes those
whose state moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ReadStates = Callable[[list[str]], Awaitable[dict[str, str]]]
CHUNK = 500  # ids per re-check query: well below every backend's bound-parameter limit


@dataclass(eq=False, slots=True)
class Watch:
    """One wait on one operation: woken by `Waiters.changed`."""

    operation_id: str
    seen: str | None = None  # the state this waiter last read
    # The state the waking commit produced, when the signaller knew it: saves a read.
    told: str | None = None
    # The operation's view as that commit left it, when its transaction returned one (a
    # success alone, `outcomes._success_alone`): the answer needs no read then.
    view: Any = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    # Which states end this wait (None: any change wakes it). A change to another state
    # (a claim's `in_flight` for a wait on the outcome) is noted in `seen` and wakes no one:
    # the wake-up would only go back to sleep, and it ran before the claim's reply was sent.
    ends_on: Callable[[str], bool] | None = None

    def take_told(self) -> str | None:
        told, self.told = self.told, None
        return told

    def take_view(self, state: str) -> Any:
        """The view told with `state` (None when none was, or it is of another state)."""
        view, self.view = self.view, None
        return view if view is not None and getattr(view, "state", None) == state else None

    async def sleep(self, timeout_s: float) -> bool:
        """Sleep until woken or `timeout_s`; True when woken. (`asyncio.timeout`, unlike
        `wait_for`, creates no extra task per sleeping waiter.)"""
        try:
            async with asyncio.timeout(timeout_s):
                await self.event.wait()
        except TimeoutError:
            return False
        self.event.clear()
        return True


class Waiters:
    """Registry of waits by operation id (see module docstring)."""

    def __init__(self, read_states: ReadStates | None = None, *, recheck_s: float = 2.0) -> None:
        self._by_op: dict[str, set[Watch]] = {}
        self._read_states = read_states
        self.recheck_s = recheck_s
        self._task: asyncio.Task[None] | None = None
        self.wakeups = 0
        # Batched state reads: ids asked for since the last read, and who waits for each.
        self._asked: dict[str, list[asyncio.Future[str | None]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.state_queries = 0

    def __len__(self) -> int:
        return sum(len(w) for w in self._by_op.values())

    def watching(self, operation_id: str) -> bool:
        """Whether anyone waits on the operation."""
        return operation_id in self._by_op

    @contextlib.contextmanager
    def watch(self, operation_id: str) -> Iterator[Watch]:
        w = Watch(operation_id)
        self._by_op.setdefault(operation_id, set()).add(w)
        self._start_recheck()
        try:
            yield w
        finally:
            group = self._by_op.get(operation_id)
            if group is not None:
                group.discard(w)
                if not group:
                    del self._by_op[operation_id]

    async def state(self, operation_id: str) -> str | None:
        """The operation's current state (None: no such operation), read together with every
        other state asked for meanwhile."""
        if self._read_states is None:
            raise RuntimeError("Waiters was built without a state reader")
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._asked.setdefault(operation_id, []).append(future)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_asked(), name="waiters-read")
        return await future

    async def _read_asked(self) -> None:
        assert self._read_states is not None
        while self._asked:
            asked, self._asked = self._asked, {}
            ids = list(asked)
            for i in range(0, len(ids), CHUNK):
                chunk = ids[i:i + CHUNK]
                try:
                    self.state_queries += 1
                    states = await self._read_states(chunk)
                except Exception as exc:
                    for op_id in chunk:
                        for f in asked[op_id]:
                            if not f.done():
                                f.set_exception(exc)
                    continue
                for op_id in chunk:
                    for f in asked[op_id]:
                        if not f.done():
                            f.set_result(states.get(op_id))

    def changed(self, operation_id: str | None, state: str | None = None,
                view: Any = None) -> None:
        """The operation's row changed and the change is committed: wake its waiters.
        `state`: the state that commit left it in, when known (the waiters need not read it;
        signals come in commit order, so the last one told is the latest). `view`: the
        operation as that commit left it, when its transaction returned it."""
        if operation_id is None:
            return
        for w in self._by_op.get(operation_id, ()):
            if state is not None and w.ends_on is not None and not w.ends_on(state):
                w.seen = state  # what the re-check compares with
                continue
            self.wakeups += 1
            w.told, w.view = state, view
            w.event.set()

    def _start_recheck(self) -> None:
        if self._read_states is None or self.recheck_s <= 0:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._recheck_loop(), name="waiters-recheck")

    async def _recheck_loop(self) -> None:
        while self._by_op:
            await asyncio.sleep(self.recheck_s)  # a period: the safety net's cadence
            try:
                await self.recheck()
            except Exception:  # the next round tries again; waits also end at their deadline
                log.exception("waiters: re-check failed")

    async def recheck(self) -> int:
        """One query per chunk of watched ids; wake waits whose operation's state moved."""
        assert self._read_states is not None
        ids = list(self._by_op)
        woken = 0
        for i in range(0, len(ids), CHUNK):
            states = await self._read_states(ids[i:i + CHUNK])
            for op_id, state in states.items():
                for w in self._by_op.get(op_id, ()):
                    if w.seen is not None and w.seen != state:
                        w.event.set()
                        woken += 1
        return woken

    async def close(self) -> None:
        for task in (self._task, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for group in self._by_op.values():
            for w in group:
                w.event.set()
