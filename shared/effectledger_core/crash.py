"""Named crash points: no-ops unless armed, so every "crashed here" case can be tested.

Arm from the environment for real processes,
`EFFECTLEDGER_CRASH_POINTS="name[#scope][@n][:stop],..."` (the process SIGKILLs itself on the
n-th hit, default the first), or in-process with `arm()`, which raises `CrashPointHit` instead.

- `:stop` makes the process SIGSTOP itself instead of dying: a pause at exactly that point (a
  GC pause, an overloaded host), which whoever armed it ends with SIGCONT. The proving ground
  uses it to freeze a dispatcher between its claim and its send for longer than the horizon.
- `#scope` counts only hits in that scope (a crash point called with `scope=`; the dispatcher
  passes the tool's name), so a fault can be aimed at one kind of provider.
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
    "dispatcher.after_outcome_request",
    "dispatcher.after_outcome_publish",
    "ledger.after_intent_commit",
    "ledger.intent.after_early_publish",
    "ledger.relay.after_publish",
    "ledger.inbox.after_commit",
})


class CrashPointHit(BaseException):
    """Raised by an in-process armed crash point. BaseException so `except Exception` misses it."""


# Armed points by (name, scope); scope None counts every hit of the name.
_armed: dict[tuple[str, str | None], int] = {}
_mode_raise: set[str] = set()
_mode_stop: set[tuple[str, str | None]] = set()
_loaded = False


def parse(item: str) -> tuple[str, str | None, int, bool]:
    """`name[#scope][@n][:stop]` → (name, scope, n, stop); ValueError naming what is wrong."""
    spec, _, mode = item.partition(":")
    if mode not in ("", "stop"):
        raise ValueError(f"{ENV}: {item!r}: the only mode is ':stop'")
    spec, _, nth = spec.partition("@")
    name, _, scope = spec.partition("#")
    if name not in KNOWN:
        raise ValueError(f"{ENV}: unknown crash point {name!r}; known: {sorted(KNOWN)}")
    if nth and not (nth.isdigit() and int(nth) >= 1):
        raise ValueError(f"{ENV}: {item!r}: the hit count after '@' must be 1 or more")
    return name, scope or None, int(nth) if nth else 1, mode == "stop"


def _load_env() -> None:
    global _loaded
    _loaded = True
    for item in filter(None, (p.strip() for p in os.environ.get(ENV, "").split(","))):
        name, scope, nth, stop = parse(item)
        _armed[(name, scope)] = nth
        if stop:
            _mode_stop.add((name, scope))


def arm(name: str, nth: int = 1, scope: str | None = None) -> None:
    if name not in KNOWN:
        raise ValueError(f"unknown crash point {name!r}")
    _armed[(name, scope)] = nth
    _mode_raise.add(name)


def disarm_all() -> None:
    _armed.clear()
    _mode_raise.clear()
    _mode_stop.clear()


def crash_point(name: str, scope: str | None = None) -> None:
    if not _loaded:
        _load_env()
    if not _armed:
        return
    for key in ((name, None), (name, scope)) if scope is not None else ((name, None),):
        remaining = _armed.get(key)
        if remaining is None:
            continue
        if remaining > 1:
            _armed[key] = remaining - 1
            continue
        del _armed[key]
        if name in _mode_raise:
            raise CrashPointHit(name)
        if key in _mode_stop:
            _mode_stop.discard(key)
            os.kill(os.getpid(), signal.SIGSTOP)  # resumes here on SIGCONT
            return
        os.kill(os.getpid(), signal.SIGKILL)
