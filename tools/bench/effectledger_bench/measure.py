"""Figures from the ledger's own timestamps, and the effect check against the provider's truth.

Latency of an operation = journal `outcome_recorded` (to_state `succeeded`).at minus journal
`intent_accepted`.at: both written by the ledger in the transactions that made them true.
Throughput of a phase = succeeded operations / (last succeeded.at - first intent_accepted.at).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

AT_REST = ("succeeded", "failed", "cancelled", "needs_review", "ambiguous")
MOVING = ("pending", "in_flight", "awaiting_confirmation", "awaiting_approval")

OPS_SQL = """
SELECT o.id, o.state, o.operation_key, o.task_id,
       min(j.at) FILTER (WHERE j.kind = 'intent_accepted') AS accepted,
       min(j.at) FILTER (WHERE j.kind = 'outcome_recorded' AND j.to_state = 'succeeded')
           AS succeeded
FROM operations o JOIN journal j ON j.operation_id = o.id
WHERE o.task_id = ANY($1::text[])
GROUP BY o.id
"""


# Where an operation's time goes, from the ledger's own timestamps (epoch 1 only):
# accepted (journal, before the intent's transaction) -> claimed (the claim's transaction)
# -> outcome (the dispatcher's clock right after the provider answered) -> recorded (journal,
# the inbox's transaction). All clocks are this machine's.
STAGES_SQL = """
SELECT min(j.at) FILTER (WHERE j.kind = 'intent_accepted') AS accepted,
       min(a.claimed_at) AS claimed,
       min((a.outcome->>'at')::timestamptz) AS outcome,
       min(j.at) FILTER (WHERE j.kind = 'outcome_recorded' AND j.to_state = 'succeeded')
           AS recorded
FROM operations o
JOIN journal j ON j.operation_id = o.id
JOIN attempts a ON a.operation_id = o.id AND a.epoch = 1
WHERE o.task_id = ANY($1::text[]) AND o.state = 'succeeded'
GROUP BY o.id
"""
STAGES = (("accepted_to_claimed", "accepted", "claimed"),
          ("claimed_to_outcome", "claimed", "outcome"),
          ("outcome_to_recorded", "outcome", "recorded"))


async def stage_latencies(dsn: str, tags: Sequence[str]) -> dict[str, Any]:
    """p50/p99 (ms) of each stage of the operations of `tags` that succeeded in epoch 1, and
    where the slowest 1 % of them spent their time (`slowest_1pct`, see `slowest`)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(STAGES_SQL, list(tags))
    finally:
        await conn.close()
    out: dict[str, Any] = {}
    for name, start, end in STAGES:
        values = [(r[end] - r[start]).total_seconds() * 1000 for r in rows
                  if r[start] is not None and r[end] is not None]
        out[name] = {"p50": _round(percentile(values, 50)), "p99": _round(percentile(values, 99))}
    out["slowest_1pct"] = slowest([dict(r) for r in rows])
    return out


def slowest(rows: list[dict[str, datetime | None]], share: float = 0.01) -> dict[str, Any]:
    """The tail's evidence: of the slowest `share` of operations (accepted to recorded), the
    median of each stage (which stage the tail lives in) and when each was accepted, in
    seconds since the first operation (a periodic cause, a timer or a sweep, shows as a
    regular spacing), and when the first was accepted (`first_accepted`, UTC), so that the
    seconds can be laid beside a timeline kept outside the run (the services' logs)."""
    def ms(r: dict[str, datetime | None], start: str, end: str) -> float | None:
        a, b = r[start], r[end]
        return (b - a).total_seconds() * 1000 if a is not None and b is not None else None

    full = [r for r in rows if ms(r, "accepted", "recorded") is not None]
    if not full:
        return {"n": 0}
    full.sort(key=lambda r: ms(r, "accepted", "recorded") or 0.0, reverse=True)
    tail = full[:max(1, math.ceil(len(full) * share))]
    first = min(r["accepted"] for r in full if r["accepted"] is not None)
    out: dict[str, Any] = {"n": len(tail), "total_ms_min": _round(ms(tail[-1], "accepted",
                                                                      "recorded"))}
    for name, start, end in STAGES:
        values = [v for v in (ms(r, start, end) for r in tail) if v is not None]
        out[f"{name}_p50"] = _round(percentile(values, 50))
    out["first_accepted"] = first.isoformat() if isinstance(first, datetime) else None
    out["accepted_at_s"] = sorted(round((r["accepted"] - first).total_seconds(), 2)
                                  for r in tail if r["accepted"] is not None)
    return out


def _round(v: float | None) -> float | None:
    return round(v, 2) if v is not None else None


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (the smallest value with at least p % of values at or below it).

    With n values p99.9 is a real observation, never an interpolation beyond the data; for
    n < 1000 it is simply the maximum.
    """
    if not values:
        return None
    if not 0 < p <= 100:
        raise ValueError("p must be in (0, 100]")
    ordered = sorted(values)
    rank = math.ceil(p / 100 * len(ordered))
    return ordered[max(0, rank - 1)]


def summary(values: Iterable[float | None]) -> dict[str, float | None]:
    """min / median / max of repeated measurements (None values are skipped)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"min": None, "median": None, "max": None}
    n = len(vals)
    median = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return {"min": vals[0], "median": median, "max": vals[-1]}


@dataclass(frozen=True)
class OpRow:
    id: str
    state: str
    operation_key: str
    task_id: str
    accepted: datetime | None
    succeeded: datetime | None


def latency_stats(rows: Sequence[OpRow]) -> dict[str, Any]:
    ok = [r for r in rows if r.succeeded is not None and r.accepted is not None]
    lat = [(r.succeeded - r.accepted).total_seconds() * 1000 for r in ok]  # type: ignore[operator]
    states: dict[str, int] = {}
    for r in rows:
        states[r.state] = states.get(r.state, 0) + 1
    out: dict[str, Any] = {"operations": len(rows), "succeeded": len(ok), "states": states}
    if ok:
        first = min(r.accepted for r in ok)  # type: ignore[type-var]
        last = max(r.succeeded for r in ok)  # type: ignore[type-var]
        span = (last - first).total_seconds()  # type: ignore[operator]
        out["span_s"] = round(span, 3)
        out["ops_per_s"] = round(len(ok) / span, 1) if span > 0 else None
        out["latency_ms"] = latency_ms(lat)
    return out


def latency_ms(lat: Sequence[float]) -> dict[str, float | None]:
    """The report's latency figures of non-empty `lat` (ms): p50, p95, p99, p99.9 (nearest
    rank), max and mean, rounded to 0.01 ms."""
    return {name: _round(v) for name, v in (
        ("p50", percentile(lat, 50)), ("p95", percentile(lat, 95)),
        ("p99", percentile(lat, 99)), ("p99_9", percentile(lat, 99.9)),
        ("max", max(lat)), ("mean", sum(lat) / len(lat)))}


async def fetch_ops(dsn: str, tags: Sequence[str]) -> list[OpRow]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(OPS_SQL, list(tags))
    finally:
        await conn.close()
    return [OpRow(r["id"], r["state"], r["operation_key"], r["task_id"], r["accepted"],
                  r["succeeded"]) for r in rows]


async def count_moving(conn: asyncpg.Connection, tags: Sequence[str]) -> int:
    return int(await conn.fetchval(
        "SELECT count(*) FROM operations WHERE state = ANY($1::text[]) "
        "AND task_id = ANY($2::text[])", list(MOVING), list(tags)))


async def all_ops(dsn: str) -> list[tuple[str, str, str, str | None]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, state, operation_key, task_id FROM operations")
    finally:
        await conn.close()
    return [(r["id"], r["state"], r["operation_key"], r["task_id"]) for r in rows]


def check_effects(ops: Sequence[tuple[str, str, str, str | None]], truth: dict[str, Any],
                  submitted_ids: Iterable[str], *, peer_prefixes: Sequence[str] = ()
                  ) -> dict[str, Any]:
    """Zero lost and zero duplicated effects, from the provider's ground truth.

    - duplicated: a key the provider applied more than once;
    - lost: an intent the ledger acknowledged with no operation row; an operation the ledger
      calls `succeeded` that the provider never applied; an operation still moving at the end;
    - lied: an operation the ledger calls `failed` that the provider applied;
    - unknown: `ambiguous` operations (honestly unknown; no reconciler in this run), by what
      the provider really did;
    - provider_forgot_keys: keys past the sandbox's memory (`--max-keys`); their effects cannot
      be checked, so the check fails (they also show as `succeeded_not_applied`).
    """
    keys = truth.get("keys", {})
    # Keys the sandbox forgot (past its `--max-keys`) cannot be checked: said as such, and the
    # check fails, rather than each one being counted as a lost effect.
    forgotten = int(truth.get("forgotten_keys", 0) or 0)
    applied = {k: int(v.get("applied", 0)) for k, v in keys.items()}
    by_id = {o[0]: o for o in ops}
    ledger_keys = {o[2] for o in ops}
    missing = [i for i in submitted_ids if i not in by_id]
    succeeded_not_applied = [o[0] for o in ops if o[1] == "succeeded" and applied.get(o[2], 0) < 1]
    moving = [o[0] for o in ops if o[1] in MOVING]
    failed_applied = [o[0] for o in ops if o[1] == "failed" and applied.get(o[2], 0) > 0]
    ambiguous = [o for o in ops if o[1] in ("ambiguous", "needs_review")]
    dup_ledger = [k for k in ledger_keys if applied.get(k, 0) > 1]
    peers = {p: {"keys": 0, "applied": 0, "duplicated": 0} for p in peer_prefixes}
    stray = 0
    for k, n in applied.items():
        if k in ledger_keys:
            continue
        for p in peer_prefixes:
            if k.startswith(p):
                peers[p]["keys"] += 1
                peers[p]["applied"] += n
                peers[p]["duplicated"] += int(n > 1)
                break
        else:
            stray += int(n > 0)
    lost = len(missing) + len(succeeded_not_applied) + len(moving)
    return {
        "operations": len(ops), "lost": lost, "duplicated": len(dup_ledger),
        "failed_but_applied": len(failed_applied),
        "lost_detail": {"acknowledged_without_row": len(missing),
                        "succeeded_not_applied": len(succeeded_not_applied),
                        "still_moving": len(moving)},
        "ambiguous": {"count": len(ambiguous),
                      "applied": sum(1 for o in ambiguous if applied.get(o[2], 0) == 1),
                      "not_applied": sum(1 for o in ambiguous if applied.get(o[2], 0) == 0)},
        "unknown_provider_keys_applied": stray, "peers": peers,
        "provider_forgot_keys": forgotten,
        "examples": {"missing": missing[:3], "succeeded_not_applied": succeeded_not_applied[:3],
                     "moving": moving[:3], "duplicated": dup_ledger[:3]},
        "ok": (lost == 0 and not dup_ledger and not failed_applied and stray == 0
               and not forgotten),
    }
