"""Named crash points: no-ops unless armed, so every "crashed here" case can be tested.

Arm from the environment for real processes, `EFFECTLEDGER_CRASH_POINTS="name[@n],..."` (the
process SIGKILLs itself on the n-th hit, default the first), or in-process with `arm()`, which
raises `CrashPointHit` instead.
"""

from __future__ import annotations

import os
import signal

ENV = "EFFECTLEDGER_CRASH_POINTS"
# Every crash point in production code, so tests and the chaos harness can enumerate them.
KNOWN = frozenset({
    "dispatcher.after_claim",
    "dispatcher.before_call",
    "dispatcher.after_response",
    "dispatcher.after_outcome_publish",
    "ledger.after_intent_commit",
    "ledger.relay.after_publish",
    "ledger.inbox.after_commit",
})


class CrashPointHit(BaseException):
    """Raised by an in-process armed crash point. BaseException so `except Exception` misses it."""


_armed: dict[str, int] = {}
_mode_raise: set[str] = set()
_loaded = False


def _load_env() -> None:
    global _loaded
    _loaded = True
    for item in filter(None, (p.strip() for p in os.environ.get(ENV, "").split(","))):
        name, _, nth = item.partition("@")
        if name not in KNOWN:
            raise ValueError(f"{ENV}: unknown crash point {name!r}; known: {sorted(KNOWN)}")
        _armed[name] = int(nth) if nth else 1


def arm(name: str, nth: int = 1) -> None:
    if name not in KNOWN:
        raise ValueError(f"unknown crash point {name!r}")
    _armed[name] = nth
    _mode_raise.add(name)


def disarm_all() -> None:
    _armed.clear()
    _mode_raise.clear()


def crash_point(name: str) -> None:
    if not _loaded:
        _load_env()
    remaining = _armed.get(name)
    if remaining is None:
        return
    if remaining > 1:
        _armed[name] = remaining - 1
        return
    del _armed[name]
    if name in _mode_raise:
        raise CrashPointHit(name)
    os.kill(os.getpid(), signal.SIGKILL)
