"""The load generator: intents over NATS request-reply (`<prefix>.rpc.v1.intents`).

Why NATS and not `POST /v1/intents`: the HTTP handler runs the submit transaction *and* a second
read transaction to render the operation view, and goes through FastAPI; the NATS handler runs
only the submit transaction. The agent-facing cost per operation is therefore lower on NATS,
which is the path an agent in the same deployment would use.

Completion is observed cheaply and without touching the database: core-NATS subscriptions to
the subjects a dispatcher reports outcomes on, its requests to the ledger
(`<prefix>.rpc.v1.outcome.>`) and their JetStream copies, sent only without the ledger's answer
(`<prefix>.ledger.v1.outcome.>`). That only drives the closed loop and the progress line; every
reported figure comes from the ledger's own timestamps, read from the database after the run
(see `measure.py`).

- open loop: intent i is sent at t0 + i/rate whatever happened to the earlier ones (bounded by
  `max_in_flight` outstanding *requests*; a send that finds the bound reached is counted late);
- closed loop: at most `window` operations outstanding end to end (submitted, no outcome yet);
  its completion rate is the maximum sustainable rate at that window.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client as NatsClient

from .measure import percentile
from .stack import TOOL


@dataclass
class LoadResult:
    tag: str
    mode: str
    submitted: int = 0
    rejected: int = 0
    errors: int = 0
    late: int = 0
    outcomes: int = 0
    wall_s: float = 0.0
    op_ids: list[str] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    # Open loop: how far behind its schedule each intent was sent (ms), and the generator's
    # own full collections meanwhile (ms). A generator behind schedule sends what is due at
    # once: a burst the system did not cause, which the tail would blame on it.
    send_lag_ms: list[float] = field(default_factory=list)
    gc_pauses_ms: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = {"tag": self.tag, "mode": self.mode, "submitted": self.submitted,
               "rejected": self.rejected, "errors": self.errors, "late": self.late,
               "outcomes_seen": self.outcomes, "wall_s": round(self.wall_s, 3),
               "submit_rate": round(self.submitted / self.wall_s, 1) if self.wall_s else None,
               "error_samples": self.error_samples[:5]}
        if self.send_lag_ms:
            # The report's one percentile definition (nearest rank), as for every latency.
            lags = self.send_lag_ms
            out["send_lag_ms"] = {
                "p50": round(percentile(lags, 50) or 0.0, 2),
                "p99": round(percentile(lags, 99) or 0.0, 2),
                "max": round(max(lags), 2), "over_5ms": sum(1 for x in lags if x > 5.0)}
            out["generator_gc_ms"] = {"count": len(self.gc_pauses_ms),
                                      "max": round(max(self.gc_pauses_ms, default=0.0), 2)}
        return out


@contextmanager
def _collections(pauses_ms: list[float]) -> Iterator[None]:
    """Append the length of every full collection (generation 2) of this process, in ms."""
    started: list[float] = []

    def timed(phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses_ms.append((time.perf_counter() - started.pop()) * 1000)

    gc.callbacks.append(timed)
    try:
        yield
    finally:
        gc.callbacks.remove(timed)


class Progress:
    """One status line a second on stderr (rewritten in place on a terminal)."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label, self.enabled = label, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._last = 0.0

    def show(self, text: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < (1.0 if self.tty else 5.0):
            return
        self._last = now
        line = f"  [{self.label}] {now - self.t0:6.1f}s {text}"
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


class LoadGenerator:
    def __init__(self, nats_url: str, subject_prefix: str, *, progress: bool = True) -> None:
        self.nats_url = nats_url
        self.rpc = f"{subject_prefix}.rpc.v1.intents"
        # An operation seen on both (a request whose answer was lost, then its copy) counts
        # once: `_on_outcome` only counts what is still waiting.
        self.outcomes_subjects = (f"{subject_prefix}.rpc.v1.outcome.>",
                                  f"{subject_prefix}.ledger.v1.outcome.>")
        self.progress = progress
        self.nc: NatsClient | None = None
        self.waiting: set[str] = set()  # operation ids submitted, no outcome seen yet
        self.seen = 0
        self._changed = asyncio.Event()

    async def __aenter__(self) -> LoadGenerator:
        self.nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1,
                                     pending_size=64 * 1024 * 1024)
        for subject in self.outcomes_subjects:
            await self.nc.subscribe(subject, cb=self._on_outcome, pending_msgs_limit=1_000_000)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.nc is not None:
            await self.nc.close()

    async def _on_outcome(self, msg: Any) -> None:
        try:
            op_id = json.loads(msg.data)["operation_id"]
        except (ValueError, KeyError, TypeError):
            return
        if op_id in self.waiting:
            self.waiting.discard(op_id)
            self.seen += 1
            self._changed.set()

    async def submit(self, tag: str, i: int, result: LoadResult, *, track: bool) -> None:
        assert self.nc is not None
        body = {"tool": TOOL, "arguments": {"title": f"{tag} #{i}"},
                "idempotency_key": f"{tag}-{i}", "task_id": tag}
        try:
            msg = await self.nc.request(self.rpc, json.dumps(body).encode(), timeout=60)
            reply = json.loads(msg.data)
        except Exception as exc:  # counted and reported; the run goes on
            result.errors += 1
            result.error_samples.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        if not reply.get("ok"):
            result.rejected += 1
            result.error_samples.append(json.dumps(reply)[:200])
            return
        op_id = reply["operation"]["id"]
        result.submitted += 1
        result.op_ids.append(op_id)
        if track:
            self.waiting.add(op_id)

    async def open_loop(self, tag: str, rate: float, duration_s: float, *,
                        max_in_flight: int = 2000) -> LoadResult:
        result = LoadResult(tag, f"open@{rate:g}/s")
        total = max(1, int(rate * duration_s))
        prog = Progress(tag, self.progress)
        t0 = time.monotonic()
        seen0 = self.seen
        with _collections(result.gc_pauses_ms):
            await self._open_loop(tag, rate, total, t0, result, prog, max_in_flight)
        result.wall_s = time.monotonic() - t0
        result.outcomes = self.seen - seen0
        prog.show(f"sent {total} in {result.wall_s:.1f}s", force=True)
        prog.done()
        return result

    async def _open_loop(self, tag: str, rate: float, total: int, t0: float,
                         result: LoadResult, prog: Progress, max_in_flight: int) -> None:
        in_flight: set[asyncio.Task[None]] = set()
        seen0 = self.seen
        for i in range(total):
            due = t0 + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the schedule of an open-loop generator
            result.send_lag_ms.append(max(0.0, (time.monotonic() - due) * 1000))
            if len(in_flight) >= max_in_flight:
                result.late += 1
                await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.create_task(self.submit(tag, i, result, track=True))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            prog.show(f"offered {rate:g}/s  sent {i + 1}/{total}  accepted {result.submitted}"
                      f"  outcomes {self.seen - seen0}  outstanding {len(self.waiting)}")
        if in_flight:
            await asyncio.wait(in_flight)

    async def closed_loop(self, tag: str, window: int, duration_s: float, *,
                          submitters: int = 32) -> LoadResult:
        """Keep `window` operations outstanding end to end for `duration_s`."""
        result = LoadResult(tag, f"closed@window={window}")
        prog = Progress(tag, self.progress)
        t0 = time.monotonic()
        seen0 = self.seen
        counter = iter(range(10**9))
        stop = t0 + duration_s
        sending = 0

        async def submitter() -> None:
            nonlocal sending
            while time.monotonic() < stop:
                while len(self.waiting) + sending >= window and time.monotonic() < stop:
                    self._changed.clear()
                    try:
                        await asyncio.wait_for(self._changed.wait(), 0.2)
                    except TimeoutError:
                        pass
                if time.monotonic() >= stop:
                    return
                sending += 1
                try:
                    await self.submit(tag, next(counter), result, track=True)
                finally:
                    sending -= 1

        async def show() -> None:
            while True:
                done = self.seen - seen0
                el = time.monotonic() - t0
                prog.show(f"window {window}  accepted {result.submitted}  outcomes {done}"
                          f" ({done / max(el, 1e-9):.0f}/s)  outstanding {len(self.waiting)}")
                await asyncio.sleep(0.5)  # refresh period of the progress line

        shower = asyncio.create_task(show())
        try:
            await asyncio.gather(*(submitter() for _ in range(submitters)))
        finally:
            shower.cancel()
        result.wall_s = time.monotonic() - t0
        result.outcomes = self.seen - seen0
        prog.show(f"accepted {result.submitted} in {result.wall_s:.1f}s", force=True)
        prog.done()
        return result

    async def burst(self, tag: str, n: int, *, concurrency: int = 64) -> LoadResult:
        """Submit `n` intents as fast as `concurrency` requests allow (to queue a backlog)."""
        result = LoadResult(tag, f"burst@{concurrency}")
        prog = Progress(tag, self.progress)
        t0 = time.monotonic()
        counter = iter(range(n))

        async def worker() -> None:
            for i in counter:
                await self.submit(tag, i, result, track=False)
                prog.show(f"queued {result.submitted}/{n}"
                          f" ({result.submitted / (time.monotonic() - t0):.0f}/s)")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.wall_s = time.monotonic() - t0
        prog.show(f"queued {result.submitted} in {result.wall_s:.1f}s", force=True)
        prog.done()
        return result
