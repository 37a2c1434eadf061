"""Injected faults: what the sandbox does wrong on purpose, and to which requests.

A fault is `{"match": {"route": r, "key": k}, "action": {"kind": ...}, "times": n,
"probability": p}`. Each action belongs to one *phase* of a request; at each phase the first
active fault of that phase that matches (and wins its probability roll) fires. So one request
may meet at most one fault per phase, e.g. a `delay` and then a `drop_after_apply`.

`times` is decremented only when a fault fires, so `times: 1` means "exactly one request sees
it", which is what crash tests need to be reproducible. Probability rolls use one seeded RNG.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeGuard


class FaultError(ValueError):
    """A fault specification that cannot be used; the message names the offending field."""


class Phase(StrEnum):
    BEFORE = "before"  # on arrival, before idempotency: the provider's front door
    APPLY = "apply"  # instead of applying now
    AFTER = "after"  # between the apply (or replay) and the answer
    READBACK = "readback"  # on GET .../by-key/{key}


KIND_PHASE: dict[str, Phase] = {
    "delay": Phase.BEFORE,
    "status_before_apply": Phase.BEFORE,
    "rate_limit": Phase.BEFORE,
    # Bytes a database cannot hold (NUL, an unpaired surrogate) in the provider's answer: a
    # 400 refusal before applying, or the success answer with NUL in the effect's id.
    "hostile_refusal": Phase.BEFORE,
    "late_apply": Phase.APPLY,
    # The provider applies one request twice (its own internal retry, a key it ignored).
    "duplicate_apply": Phase.APPLY,
    "delay_after_apply": Phase.AFTER,
    "drop_after_apply": Phase.AFTER,
    "status_after_apply": Phase.AFTER,
    "slow_body": Phase.AFTER,
    "hostile_answer": Phase.AFTER,
    "readback_lag": Phase.READBACK,
}
_NEEDS_SECONDS = {"delay", "delay_after_apply", "late_apply", "readback_lag", "slow_body"}
_NEEDS_STATUS = {"status_before_apply", "status_after_apply"}


@dataclass(slots=True)
class Action:
    kind: str
    seconds: float = 0.0
    status: int = 0
    retry_after: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind in _NEEDS_SECONDS:
            out["seconds"] = self.seconds
        if self.kind in _NEEDS_STATUS:
            out["status"] = self.status
        if self.retry_after is not None:
            out["retry_after"] = self.retry_after
        return out


@dataclass(slots=True)
class Fault:
    action: Action
    route: str | None = None
    key: str | None = None
    times: int | None = None  # None: unlimited
    probability: float = 1.0
    fired: int = 0

    @property
    def phase(self) -> Phase:
        return KIND_PHASE[self.action.kind]

    def matches(self, route: str, key: str | None) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.route is not None and self.route != route:
            return False
        return self.key is None or self.key == key

    def to_json(self) -> dict[str, Any]:
        match = {k: v for k, v in (("route", self.route), ("key", self.key)) if v is not None}
        return {"match": match, "action": self.action.to_json(), "times": self.times,
                "probability": self.probability, "fired": self.fired}


def parse_fault(raw: Any) -> Fault:
    """Validate one fault object from the control API; raises FaultError with the field."""
    if not isinstance(raw, dict):
        raise FaultError("a fault must be a JSON object")
    unknown = set(raw) - {"match", "action", "times", "probability"}
    if unknown:
        raise FaultError(f"unknown fault fields {sorted(unknown)}")
    match = raw.get("match") or {}
    if not isinstance(match, dict) or set(match) - {"route", "key"}:
        raise FaultError("'match' must be an object with optional 'route' and 'key'")
    for name in ("route", "key"):
        if match.get(name) is not None and not isinstance(match[name], str):
            raise FaultError(f"'match.{name}' must be a string")
    times = raw.get("times")
    if times is not None and (not isinstance(times, int) or isinstance(times, bool) or times < 0):
        raise FaultError("'times' must be a non-negative integer")
    probability = raw.get("probability", 1.0)
    if not _is_number(probability) or not 0.0 <= float(probability) <= 1.0:
        raise FaultError("'probability' must be a number between 0 and 1")
    return Fault(action=_parse_action(raw.get("action")), route=match.get("route"),
                 key=match.get("key"), times=times, probability=float(probability))


def _parse_action(raw: Any) -> Action:
    if not isinstance(raw, dict):
        raise FaultError("'action' must be an object with a 'kind'")
    kind = raw.get("kind")
    if kind not in KIND_PHASE:
        raise FaultError(f"'action.kind' must be one of {sorted(KIND_PHASE)}")
    action = Action(kind=kind)
    if kind in _NEEDS_SECONDS:
        seconds = raw.get("seconds")
        if not _is_number(seconds) or float(seconds) < 0:
            raise FaultError(f"'action.seconds' (a non-negative number) is required for {kind}")
        action.seconds = float(seconds)
    if kind in _NEEDS_STATUS:
        status = raw.get("status")
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            raise FaultError(f"'action.status' (an error status 400..599) is required for {kind}")
        action.status = status
    retry_after = raw.get("retry_after", "1" if kind == "rate_limit" else None)
    if retry_after is not None:
        if not isinstance(retry_after, str | int) or isinstance(retry_after, bool):
            raise FaultError("'action.retry_after' must be a string (seconds or an HTTP-date)")
        action.retry_after = str(retry_after)
    return action


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class FaultSet:
    faults: list[Fault] = field(default_factory=list)
    seed: int | None = None
    rng: random.Random = field(default_factory=random.Random)

    def replace(self, faults: list[Fault], seed: int | None) -> None:
        self.faults = faults
        self.seed = seed
        # Re-seeding on every replace makes a scenario's probabilistic faults repeatable.
        self.rng = random.Random(seed)

    def append(self, fault: Fault) -> None:
        self.faults.append(fault)

    def clear(self) -> None:
        self.replace([], None)

    def pick(self, phase: Phase, route: str, key: str | None) -> Action | None:
        """The action of the first matching fault of `phase` that fires, consuming one `times`."""
        for fault in self.faults:
            if fault.phase is not phase or not fault.matches(route, key):
                continue
            if fault.probability < 1.0 and self.rng.random() >= fault.probability:
                continue
            if fault.times is not None:
                fault.times -= 1
            fault.fired += 1
            return fault.action
        return None

    def to_json(self) -> dict[str, Any]:
        return {"faults": [f.to_json() for f in self.faults], "seed": self.seed}
