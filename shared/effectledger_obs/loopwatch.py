"""How long this process's event loop stood still: garbage-collection pauses and loop lag.

Every operation in flight in a service waits while its loop is held up, so a pause there is a
step in every latency figure of the moment: one 40 ms collection at 300 operations a second
is a dozen operations 40 ms late, which is the tail of a percentile (issue 30). Two metrics
show it:

- `effectledger_gc_pause_seconds{generation}`: each collection, timed by `gc.callbacks`;
- `effectledger_event_loop_lag_seconds`: how late a timer that asks to run every `PERIOD_S`
  actually runs (whatever held the loop: a collection, a long callback, CPU taken by others).

The timer is one `call_later` callback re-armed each time (no task), ten a second: next to the
hundreds of wake-ups a second of a loaded service, nothing.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from prometheus_client import Histogram

PERIOD_S = 0.1
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

GC_PAUSE = Histogram("effectledger_gc_pause_seconds",
                     "Garbage-collection pauses of this process, by generation",
                     ["generation"], buckets=PAUSE_BUCKETS)
LOOP_LAG = Histogram("effectledger_event_loop_lag_seconds",
                     f"How late a timer due every {PERIOD_S} s ran on the event loop",
                     buckets=PAUSE_BUCKETS)

_gc_started = 0.0
_installed = False


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
    elif _gc_started:
        GC_PAUSE.labels(str(info.get("generation", "?"))).observe(
            time.perf_counter() - _gc_started)


def start(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Time collections from now on and start the lag timer on `loop` (default: the running
    one). Idempotent for the collections; call once per loop."""
    global _installed
    if not _installed:
        gc.callbacks.append(_on_gc)
        _installed = True
    loop = loop or asyncio.get_running_loop()
    due = loop.time() + PERIOD_S

    def tick() -> None:
        nonlocal due
        now = loop.time()
        LOOP_LAG.observe(max(0.0, now - due))
        due = now + PERIOD_S
        loop.call_at(due, tick)

    loop.call_at(due, tick)
