"""Keep a service's long-lived objects out of the garbage collector's full passes.

A full collection (generation 2) walks every tracked object while the event loop stands still,
and most of what a service holds lives as long as the process: modules, classes, functions,
then the engine, pools, compiled statements and subscriptions made at start-up. Walking them
again and again was the latency tail: in the quick benchmark, before this, the ledger's full
collections took 66-146 ms and the dispatcher's 24-76 ms, several times a minute under load,
and every operation in flight waited for them. `gc.freeze` moves every object that exists into
a generation the collector never walks; a service calls `freeze_long_lived` before its event
loop starts and again once it is ready, and later full collections walk only what was made
since. Nothing is disabled: cycles made while serving are collected as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable


def freeze_long_lived(*, collect: bool = True) -> int:
    """Freeze every object that exists now; how many objects are frozen in all.

    `collect`: collect first, so no garbage is frozen (a pause of its own: only before the
    service serves). Without it, the few cycles already dead at that moment stay frozen.
    """
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_survivors_of_full_collections(schedule: Callable[[Callable[[], None]], object]
                                         ) -> None:
    """After every full collection, freeze what survived it (for a process whose state only
    grows: the sandbox keeps every effect it applied, for the effects check).

    Such a process's full collections walk its whole, ever larger state: the sandbox's grew from
    30 to 73 ms within one quick benchmark, and a provider that stalls is every client's latency
    tail. What survived a full collection is live, and the sandbox keeps it; frozen, it is not
    walked again. The freeze is handed to `schedule` (the event loop's `call_soon_threadsafe`),
    not done inside the collector's callback. Objects freed later by reference counting are
    freed as usual; only a cycle made of frozen objects would stay (the sandbox's state holds
    none).
    """
    def after(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info.get("generation") == 2:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to do
                schedule(gc.freeze)

    gc.callbacks.append(after)
