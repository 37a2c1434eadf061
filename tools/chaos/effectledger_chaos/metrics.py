"""What a run measured besides the invariants: time to rest, throughput, review rate per fault
kind, faults injected per kind, process exits, and the writes fencing refused. Pure."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

from .config import TOOL_TYPE_OF, ChaosConfig
from .schedule import Schedule
from .stack import ExitRecord

AT_REST = frozenset({"succeeded", "failed", "cancelled", "needs_review"})
# After a timed fault ends, its effects (redeliveries after ack_wait, sweeps) can still land.
SETTLE_S = 10.0


def _ts(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return datetime.fromisoformat(str(value)).timestamp()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


def _rest_times(ops: list[dict[str, Any]], journal: dict[str, list[dict[str, Any]]]
                ) -> dict[str, float]:
    out = {}
    for o in ops:
        if o["state"] not in AT_REST:
            continue
        changes = [e for e in journal[o["id"]] if e["to_state"] is not None]
        if changes:
            ts = _ts(changes[-1]["at"])
            if ts is not None:
                out[o["id"]] = ts
    return out


def metrics(cfg: ChaosConfig, schedule: Schedule, ops: list[dict[str, Any]],
             journal: dict[str, list[dict[str, Any]]], first_invoke: dict[int, float],
             acked: dict[int, set[str]], by_key: dict[str, dict[str, Any]],
             fault_records: list[dict[str, Any]], phase_start_wall: float) -> dict[str, Any]:
    rest_at = _rest_times(ops, journal)
    to_rest: list[float] = []
    lifetimes: dict[int, tuple[float, float]] = {}
    for op in schedule.ops:
        row = by_key.get(op.caller_key)
        start = first_invoke.get(op.index)
        if row is None or start is None:
            continue
        end = rest_at.get(row["id"])
        lifetimes[op.index] = (start, end if end is not None else math.inf)
        if end is not None:
            to_rest.append(max(0.0, end - start))
    states = Counter(o["state"] for o in ops)
    by_type: dict[str, Counter[str]] = defaultdict(Counter)
    for o in ops:
        by_type[TOOL_TYPE_OF.get(o["tool"], "?")][o["state"]] += 1
    span = None
    if rest_at and first_invoke:
        span = max(rest_at.values()) - min(first_invoke.values())
    # Review rate per fault kind: operations a fault touched, and how many of them ended in
    # review. Per-operation faults touch their operation; timed faults touch every operation
    # alive during the fault (plus a settling margin).
    exposed: dict[str, set[int]] = defaultdict(set)
    for op in schedule.ops:
        for kind in op.fault_kinds:
            exposed[kind].add(op.index)
    for r in fault_records:
        if "started_at" not in r:
            continue
        lo = phase_start_wall + r["started_at"]
        hi = phase_start_wall + r.get("ended_at", r["started_at"]) + SETTLE_S
        for index, (start, end) in lifetimes.items():
            if start <= hi and end >= lo:
                exposed[r["kind"]].add(index)
    touched = set().union(*exposed.values()) if exposed else set()
    exposed["(none)"] = {i for i in lifetimes if i not in touched}
    # Time to rest per fault kind, over the same operations: from the first submission to
    # the last state change (those still restless are in invariant 3, not here).
    rest_by_fault = {}
    for kind, indices in sorted(exposed.items()):
        times = [lifetimes[i][1] - lifetimes[i][0] for i in indices
                 if i in lifetimes and lifetimes[i][1] != math.inf]
        times = [max(0.0, t) for t in times]
        rest_by_fault[kind] = {"n": len(times), "p50": percentile(times, 0.5),
                               "p99": percentile(times, 0.99)}
    review_rate = {}
    for kind, indices in sorted(exposed.items()):
        rows = [by_key[schedule.ops[i].caller_key] for i in indices
                if schedule.ops[i].caller_key in by_key]
        reviews = sum(1 for r in rows if r["state"] == "needs_review")
        review_rate[kind] = {"operations": len(rows), "needs_review": reviews,
                             "rate": round(reviews / len(rows), 3) if rows else None}
    return {
        "operations_planned": len(schedule.ops),
        "operations_acknowledged": len(acked),
        "operations_in_ledger": len(ops),
        "final_states": dict(sorted(states.items())),
        "final_states_by_tool_type": {t: dict(sorted(c.items()))
                                      for t, c in sorted(by_type.items())},
        "throughput_ops_per_s": round(len(rest_at) / span, 2) if span else None,
        "time_to_rest_s": {"p50": percentile(to_rest, 0.5), "p99": percentile(to_rest, 0.99),
                           "max": round(max(to_rest), 3) if to_rest else None,
                           "n": len(to_rest)},
        "review_rate_by_fault": review_rate,
        "time_to_rest_by_fault_s": rest_by_fault,
    }


# Webhook delivery faults act on the webhooks the provider sends for their operation's key;
# an applied effect always sends one ("effect.applied"), which every one of them matches.
DELIVERY_FAULTS = ("webhook_duplicate", "webhook_concurrent", "webhook_reorder",
                   "webhook_resign")


def injected(schedule: Schedule, records: list[dict[str, Any]],
             sandbox_faults: dict[str, Any], bad_webhooks: list[dict[str, Any]],
             bad_input: dict[str, Any],
             truth: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per fault kind: `planned`, `injected`, and for the webhook delivery kinds
    `untriggered`, the planned operations whose effect the provider never applied (`truth`,
    by key). Such an operation never got the webhook its fault waits for: other faults
    (a dispatcher stopped holding its claim, say) sent it to review before any request, so
    "armed, never fired" there says nothing against the injector. `pause_before_send` is
    `untriggered` when its armed dispatcher claimed fewer attempts of its tool than the
    point's hit count."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"planned": 0, "injected": 0})
    for kind, n in schedule.planned_counts().items():
        out[kind]["planned"] = n
    for r in records:
        res = r.get("result") or {}
        ok = "error" not in r and res.get("hit", True) is not False \
            and res.get("deleted", True) is not False and not res.get("skipped")
        if ok:
            out[r["kind"]]["injected"] += 1
        elif r["kind"] == "pause_before_send":
            # Armed, and fewer claims of its tool reached its dispatcher than its hit count
            # (a workload over by then): nothing could stop there, which says nothing
            # against the injector. Counted only with the database's word for it.
            out[r["kind"]].setdefault("untriggered", 0)
            seen = res.get("claims_while_armed")
            if seen is not None and seen < r["params"]["nth"]:
                out[r["kind"]]["untriggered"] += 1
    # Per-operation provider faults: how many fired in the sandbox (times consumed).
    kind_of = {}
    for op in schedule.ops:
        for f in op.faults:
            kind_of[(op.operation_key, _sandbox_kind(f.kind))] = f.kind
    for sf in sandbox_faults.get("provider", []) or []:
        fired_kind = kind_of.get((sf["match"].get("key"), sf["action"]["kind"]))
        if fired_kind is not None and sf["fired"]:
            out[fired_kind]["injected"] += 1
    # An operation carries at most one delivery fault (schedule._per_op_faults).
    webhook_kind = {op.operation_key: f.kind for op in schedule.ops for f in op.faults
                    if f.kind in DELIVERY_FAULTS}
    if truth is not None:
        for key, kind in webhook_kind.items():
            out[kind].setdefault("untriggered", 0)
            if truth.get(key, {}).get("applied", 0) == 0:
                out[kind]["untriggered"] += 1
    for wf in sandbox_faults.get("webhook", []) or []:
        hook_kind = webhook_kind.get(wf["match"].get("key"))
        if hook_kind is not None and wf["fired"] and wf["action"]["kind"] != "resign":
            out[hook_kind]["injected"] += 1
    for b in bad_webhooks:
        if b.get("status") is not None:
            out[b["kind"]]["injected"] += 1
    return dict(sorted(out.items()))


def _sandbox_kind(kind: str) -> str:
    return {"rate_limit_seconds": "rate_limit", "rate_limit_date": "rate_limit"}.get(kind, kind)


_UNREACHABLE = ("Connect call failed", "ConnectionRefusedError", "ConnectionResetError",
                "NoServersError", "connection refused", "Connection reset by peer")


def _outage(r: dict[str, Any]) -> bool:
    """A fault that makes the broker or the database unreachable for new connections."""
    return r["kind"] in ("nats_restart", "nats_long_outage", "pg_restart") or (
        r["kind"] == "net_blackhole" and r["target"] in ("nats", "pg"))


def exits(exits: list[ExitRecord], records: list[dict[str, Any]],
          phase_start_wall: float) -> dict[str, Any]:
    """Process exits: expected (a fault's signal, an armed crash point), during an outage of
    a dependency (a service that cannot start without its database or broker exits and is
    restarted, as any supervisor would), and unexpected (a crash: a failed check)."""
    outages = []
    for r in records:
        if _outage(r) and "started_at" in r:
            outages.append((phase_start_wall + r["started_at"],
                            phase_start_wall + r.get("ended_at", r["started_at"]) + 5))
    expected = Counter(e.reason.split(":")[0] + ":" + e.reason.split(":")[1]
                       if e.reason and ":" in e.reason else str(e.reason)
                       for e in exits if e.reason)
    unexpected, during_outage = [], []
    for e in exits:
        if e.reason:
            continue
        item = {"service": e.service, "incarnation": e.incarnation, "exit_code": e.code,
                "tail": e.tail[-1500:]}
        # Only a startup that died of the unreachable dependency itself, not any crash that
        # happened to fall inside the window.
        unreachable = any(m in e.tail for m in _UNREACHABLE)
        if unreachable and any(lo <= e.at <= hi for lo, hi in outages):
            during_outage.append(item)
        else:
            unexpected.append(item)
    return {"expected": dict(sorted(expected.items())), "unexpected": unexpected,
            "during_dependency_outage": during_outage}


def fencing(journal: list[dict[str, Any]], requests: list[dict[str, Any]]) -> dict[str, int]:
    """Writes that fencing refused (evidence that the guards were exercised, not a failure)."""
    c: Counter[str] = Counter()
    for e in journal:
        if e["kind"] in ("outcome_rejected", "verdict_rejected", "claim_rejected"):
            reason = (e["detail"] or {}).get("reason", "?")
            c[f"{e['kind']}:{reason}"] += 1
    c["provider_rejected_stale_token"] = sum(
        1 for r in requests if r["outcome"] == "rejected:stale_fencing_token")
    return dict(sorted(c.items()))
