"""The sandbox provider's in-memory state: effects, per-key records, ground truth, faults.

No HTTP here. Every method is synchronous, and the app runs on one event loop, so each call is
atomic with respect to concurrent requests; that is what makes "claim the key, then await"
a correct in-progress lock without any asyncio.Lock.

Two views of the world are kept apart on purpose:
- what a client can observe (effects, idempotency records, readback), which faults distort;
- the ground truth (`truth_json`), which counts every request that arrived and every effect
  that was applied, so tests can assert "applied exactly once" whatever the client saw.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .faults import FaultSet

REQUEST_LOG_LIMIT = 100_000
# Keys (and unkeyed effects) kept before the oldest are forgotten: a long `up` demo at 10
# operations/s grew by 1.2 MiB a minute with nothing forgotten. 100,000 keys is over four
# times the benchmark's longest run, whose effects check reads every key it used.
MAX_KEYS = 100_000
RouteKey = tuple[str, str]


@dataclass(slots=True)
class Effect:
    id: str
    route: str
    key: str | None
    body: Any
    fencing_token: int | None
    applied_at: float
    target: str | None = None  # the object a path-addressed request named (one segment)

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "idempotency_key": self.key, "status": "applied",
               "route": self.route, "body": self.body, "fencing_token": self.fencing_token}
        if self.target is not None:
            out["target"] = self.target
        return out


@dataclass(slots=True)
class KeyRecord:
    """An idempotent route's memory of one key: the request's digest and its effect."""

    digest: str
    created_at: float
    effect: Effect | None = None  # None while the first request is still in progress


@dataclass(slots=True)
class KeyTruth:
    applied: int = 0
    requests: int = 0
    routes: list[str] = field(default_factory=list)
    fencing_tokens: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "requests": self.requests, "routes": list(self.routes),
                "fencing_tokens": list(self.fencing_tokens)}


class Claim(StrEnum):
    NEW = "new"  # the caller now owns the key and must apply, or release it
    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    MISMATCH = "mismatch"


def body_digest(body: Any) -> str:
    # Canonical JSON, so key order and whitespace do not make "the same body" differ.
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)


class SandboxState:
    def __init__(self, *, retention_s: float = 86400.0,
                 clock: Callable[[], float] | None = None, max_keys: int = MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, not {max_keys}")
        self.retention_s = retention_s
        self.max_keys = max_keys
        self.clock: Callable[[], float] = clock or time.monotonic
        self.faults = FaultSet()
        self.reset()

    def reset(self) -> None:
        self.route_idempotent: dict[str, bool] = {}
        self.effects: dict[str, Effect] = {}
        self.by_key: dict[RouteKey, list[Effect]] = {}
        self.records: dict[RouteKey, KeyRecord] = {}
        self.fencing: dict[RouteKey, int] = {}
        self.truth: dict[str, KeyTruth] = {}
        # Every key seen, oldest first (dicts keep insertion order): what is forgotten first.
        self._keys: dict[str, None] = {}
        self._unkeyed: deque[str] = deque()
        self.forgotten_keys = 0
        self.total_applied = 0
        self.total_requests = 0
        self.log: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_LIMIT)
        self._next_effect = 0
        self._next_request = 0
        self.faults.clear()

    # -- routes -------------------------------------------------------------------------------

    def is_idempotent(self, route: str) -> bool:
        """Explicit config wins; else the name decides, and unknown names default to careful."""
        configured = self.route_idempotent.get(route)
        if configured is not None:
            return configured
        return not route.startswith("plain")

    @staticmethod
    def checks_fencing(route: str) -> bool:
        """Routes named `*nofence` ignore the Fencing-Token header, like the many providers
        that never look at it: what protects them is the dispatcher's send deadline."""
        return not route.endswith("nofence")

    def configure_route(self, route: str, *, idempotent: bool) -> None:
        self.route_idempotent[route] = idempotent

    # -- arrival and ground truth -------------------------------------------------------------

    def arrive(self, route: str, key: str | None, fencing_token: int | None) -> dict[str, Any]:
        """Count a POST that reached the provider; returns its log entry for the outcome."""
        self.total_requests += 1
        self._next_request += 1
        if key is not None:
            truth = self._truth_of(key)
            truth.requests += 1
            if route not in truth.routes:
                truth.routes.append(route)
            if fencing_token is not None:
                truth.fencing_tokens.append(fencing_token)
        entry: dict[str, Any] = {"seq": self._next_request, "at": self.clock(), "route": route,
                                 "key": key, "fencing_token": fencing_token,
                                 "outcome": "pending"}
        self.log.append(entry)
        return entry

    def _truth_of(self, key: str) -> KeyTruth:
        truth = self.truth.get(key)
        if truth is None:
            truth = self.truth[key] = KeyTruth()
            self._keys[key] = None
            while len(self._keys) > self.max_keys:
                self._forget(next(iter(self._keys)))
        return truth

    def _forget(self, key: str) -> None:
        """Drop everything kept for the oldest key, as a provider's retention would; the
        totals keep counting it, and `forgotten_keys` says how many went."""
        del self._keys[key]
        truth = self.truth.pop(key)
        for route in truth.routes:
            for effect in self.by_key.pop((route, key), []):
                self.effects.pop(effect.id, None)
            self.records.pop((route, key), None)
            self.fencing.pop((route, key), None)
        self.forgotten_keys += 1

    def truth_json(self) -> dict[str, Any]:
        return {"keys": {k: t.to_json() for k, t in self.truth.items()},
                "total_applied": self.total_applied, "total_requests": self.total_requests,
                "forgotten_keys": self.forgotten_keys}

    def key_truth_json(self, key: str) -> dict[str, Any]:
        truth = self.truth.get(key)
        return (truth or KeyTruth()).to_json()

    def requests_json(self, key: str | None = None) -> list[dict[str, Any]]:
        return [dict(e) for e in self.log if key is None or e["key"] == key]

    # -- fencing and idempotency --------------------------------------------------------------

    def check_fencing(self, route: str, key: str, token: int) -> bool:
        """Accept a token no lower than the highest seen for (route, key), remembering it."""
        highest = self.fencing.get((route, key))
        if highest is not None and token < highest:
            return False
        self.fencing[(route, key)] = token
        return True

    def claim(self, route: str, key: str, digest: str) -> tuple[Claim, Effect | None]:
        """Look the key up on an idempotent route; on NEW the caller holds it in progress."""
        now = self.clock()
        record = self.records.get((route, key))
        if record is not None and record.effect is not None \
                and now - record.created_at > self.retention_s:
            record = None  # past the retention window the key is forgotten, as providers do
        if record is None:
            self.records[(route, key)] = KeyRecord(digest=digest, created_at=now)
            return Claim.NEW, None
        if record.effect is None:
            return Claim.IN_PROGRESS, None
        if record.digest != digest:
            return Claim.MISMATCH, None
        return Claim.REPLAY, record.effect

    def key_untouched(self, route: str, key: str) -> bool:
        """Nothing applied and nothing in progress for the key: a refusal leaves it unapplied."""
        return not self.by_key.get((route, key)) and (route, key) not in self.records

    def release(self, route: str, key: str) -> None:
        """Forget an in-progress claim whose request ended without applying."""
        record = self.records.get((route, key))
        if record is not None and record.effect is None:
            del self.records[(route, key)]

    def apply(self, route: str, key: str | None, body: Any, fencing_token: int | None,
              target: str | None = None) -> Effect:
        """Apply one effect: the only place the ground truth's `applied` grows."""
        self._next_effect += 1
        effect = Effect(id=f"eff_{self._next_effect}", route=route, key=key, body=body,
                        fencing_token=fencing_token, applied_at=self.clock(), target=target)
        self.effects[effect.id] = effect
        self.total_applied += 1
        if key is None:
            # Unkeyed effects have no key to forget them by: the oldest go past the bound.
            self._unkeyed.append(effect.id)
            if len(self._unkeyed) > self.max_keys:
                self.effects.pop(self._unkeyed.popleft(), None)
        if key is not None:
            self.by_key.setdefault((route, key), []).append(effect)
            truth = self._truth_of(key)
            truth.applied += 1
            if route not in truth.routes:  # so that forgetting the key finds this effect
                truth.routes.append(route)
            record = self.records.get((route, key))
            if record is not None and record.effect is None:
                record.effect = effect
        return effect

    # -- reads --------------------------------------------------------------------------------

    def readback(self, route: str, key: str, lag_s: float = 0.0) -> Effect | None:
        """The latest effect for the key that is at least `lag_s` old (lag models replicas)."""
        effects = self.by_key.get((route, key))
        if not effects:
            return None
        if lag_s <= 0:
            return effects[-1]
        horizon = self.clock() - lag_s
        for effect in reversed(effects):
            if effect.applied_at <= horizon:
                return effect
        return None

    def listed(self, route: str, key: str) -> list[Effect]:
        """Every effect for the key, oldest first (a search endpoint's answer)."""
        return list(self.by_key.get((route, key), []))

    def get(self, route: str, effect_id: str) -> Effect | None:
        effect = self.effects.get(effect_id)
        return effect if effect is not None and effect.route == route else None
