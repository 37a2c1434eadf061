"""Availability of the ledger's intake, from the callers' history and the fault log. Pure.

The rule under test: the ledger accepts intents whenever its database is up, whatever the
broker does. From the history (every submission attempt, with wall times) and the executed
faults (phase-relative times) a run reports:

- `stalled_s`: seconds during which some submission attempt had been in flight for at least
  `GRACE_S` and no intent at all was acknowledged in the last `GRACE_S` (sampled every
  `STEP_S`). A caller's backoff between attempts is its own, not counted;
- `refused_db_up`: attempts answered with an error or refused while the database was healthy
  and the ledger was not being restarted;
- `unavailable_db_up_s`: the stalled seconds while PostgreSQL was up and its link healthy (no
  `pg_restart`, and no black hole, reset or added latency on the database link: a slowed
  database slows intake, which is not what this measures; nor the `DB_RECOVERY_S` after such
  a fault) and the ledger process was not itself being faulted (killed, paused, restarted at
  a crash point, until it listened again, plus `LEDGER_RECOVERY_S` after it; a crash point's
  armed process counts as the ledger's from its listening to its crash: a ledger resumed
  from a pause answers the requests it held within tens of milliseconds, and every one of them
  has waited longer than `GRACE_S` by then). The goal is zero: nothing else may stop the
  ledger from acknowledging intents;
- `resumed_to_first_ack_s`: for every fault on a single ledger that held attempts, the seconds
  from its end (the process continued, or listening again) to the first of them acknowledged,
  so the recovery window above hides nothing: its max is reported beside it. With replicas,
  for every fault on one of them, the seconds from its end to that replica's first answer
  (a killed replica holds nothing when it is back: its callers moved on);
- `ledger_restarts`: for every fault that restarted the ledger, the seconds until the new
  process listened, and whether the broker was down then (the restart inside the long NATS
  outage is part of every schedule that has the outage);
- `ack_latency_during_broker_outage_s`: p50/p99/max of the attempts that were sent while the
  broker was down (`nats_restart`, `nats_long_outage`), from the attempt to its 2xx.
"""

from __future__ import annotations

from typing import Any

from .metrics import percentile

GRACE_S = 1.0
DB_RECOVERY_S = 1.0
LEDGER_RECOVERY_S = 0.5
STEP_S = 0.05
_LEDGER_FAULTS = ("kill", "pause", "crash_point")
# A replica killed while others serve is not excused: the callers move to another replica, so
# intake must not stall (the restart is still listed in `ledger_restarts`). Paused replicas
# are (see availability()).
_REPLICA_FAULTS = ("ledger_replica_kill",)
_BROKER_DOWN = ("nats_restart", "nats_long_outage")


Interval = tuple[float, float]


def _is_ledger(target: str) -> bool:
    return target == "ledger" or target.startswith("ledger-")


def _inside(t: float, intervals: list[Interval]) -> bool:
    return any(lo <= t < hi for lo, hi in intervals)


def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _windows(records: list[dict[str, Any]], pred: Any) -> list[Interval]:
    out = []
    for r in records:
        if "started_at" in r and pred(r):
            out.append((float(r["started_at"]), float(r.get("ended_at") or r["started_at"])))
    return out


def _down(r: dict[str, Any], end: float) -> list[Interval]:
    """When a ledger fault had the process down or restarting, up to `end`.

    A crash point re-arms by restarting the process, which then serves as usual until it
    reaches the point: that time is the ledger's, not the fault's, so with both moments
    recorded the window is the arming restart and the crash with its restart, not the whole
    span (an armed ledger can wait a minute for its point).
    """
    lo = float(r["started_at"])
    if "armed_listening_at" in r and "died_at" in r:
        return [(lo, float(r["armed_listening_at"])), (float(r["died_at"]), end)]
    return [(lo, end)]


def _down_by_ledger(records: list[dict[str, Any]], kinds: tuple[str, ...]
                    ) -> dict[str, list[Interval]]:
    """Per ledger process, each of its faults of `kinds` from its start until it listened
    again (see `_down`)."""
    per: dict[str, list[Interval]] = {}
    for r in records:
        if r["kind"] in kinds and _is_ledger(r["target"]) and "started_at" in r:
            end = r.get("listening_at") or r.get("ended_at") or r["started_at"]
            per.setdefault(r["target"], []).extend(_down(r, float(end)))
    return per


def _all_down(records: list[dict[str, Any]], replicas: set[str]) -> list[Interval]:
    """Moments when every ledger replica was being faulted at once."""
    per: dict[str, list[Interval]] = {name: [] for name in replicas} | _down_by_ledger(
        records, (*_LEDGER_FAULTS, *_REPLICA_FAULTS))
    if not per or not all(per.values()):
        return []  # a replica never faulted was always there
    merged = [_merge(v) for v in per.values()]
    out = merged[0]
    for other in merged[1:]:
        out = [(max(a, c), min(b, d)) for a, b in out for c, d in other
               if max(a, c) < min(b, d)]
    return out


def availability(history: list[dict[str, Any]], records: list[dict[str, Any]],
                 phase_start_wall: float) -> dict[str, Any]:
    # Each submission attempt from its send to its answer: the ledger holds it meanwhile. The
    # caller's own backoff between attempts is not the ledger's doing and is not counted.
    in_flight: list[Interval] = []
    acks: list[float] = []
    refused: list[tuple[float, str]] = []  # (when, ledger) of a refusal or an error
    attempts: dict[tuple[str, int], float] = {}  # (caller process, op) -> invoke time
    sent_to: dict[tuple[str, int], str] = {}  # ... -> the ledger replica it went to
    latencies: list[tuple[float, float]] = []  # (invoke time, seconds to its 2xx)
    answered_by: list[str] = []  # ... and the ledger replica that gave it, index for index
    for h in history:
        if h.get("f") != "submit":
            continue
        t = h["wall"] - phase_start_wall
        key = (h["process"], h["op"])
        if h["type"] == "invoke":
            attempts[key] = t
            sent_to[key] = str(h.get("ledger") or "ledger")
            continue
        sent = attempts.pop(key, None)
        if sent is None:
            continue
        in_flight.append((sent, t))
        if h["type"] == "ok":
            acks.append(t)
            latencies.append((sent, t - sent))
            answered_by.append(sent_to.get(key, "ledger"))
        else:
            refused.append((t, sent_to.get(key, "ledger")))
    for sent in attempts.values():  # never answered (the run ended first)
        in_flight.append((sent, sent))
    if not in_flight:
        return {"ran": False}

    # Any fault on the database or its link: down, unreachable, reset, or slowed (38 ms per
    # chunk on the link makes each of a transaction's round trips slow, and intake with it).
    # Plus DB_RECOVERY_S after each: the transactions the fault held commit then, and the
    # first answers leave a few tens of milliseconds after the link heals.
    db_down = [(lo, hi + DB_RECOVERY_S) for lo, hi in _windows(
        records, lambda r: r["kind"] == "pg_restart" or r["target"] == "pg")]
    # Several replicas when the callers sent to several (each attempt names its ledger).
    names = {str(h["ledger"]) for h in history if h.get("f") == "submit" and h.get("ledger")}
    replicas = len(names) > 1
    # With one ledger its own faults are excused; with replicas a fault on one is excused
    # only while it overlaps one on another (every replica down at once).
    own_windows = [w for ws in _down_by_ledger(records, _LEDGER_FAULTS).values() for w in ws]
    ledger_faulted = [(lo, hi + LEDGER_RECOVERY_S) for lo, hi in own_windows]
    own_fault: dict[str, list[Interval]] = {}
    if replicas:
        # A frozen replica holds its callers until their own timeout (only a balancer's
        # health check could take them away, and the harness's callers have none): its pause,
        # and the grace after it while it answers what it held, stays excused. A dead one
        # refuses at once and its callers move on, so a kill is not.
        ledger_faulted = _merge(_all_down(records, names) + [
            (lo, hi + GRACE_S) for lo, hi in _windows(
                records, lambda r: r["kind"] == "pause" and _is_ledger(r["target"]))])
        own_fault = {name: [(lo, hi + GRACE_S) for lo, hi in windows] for name, windows in
                     _down_by_ledger(records, (*_LEDGER_FAULTS, *_REPLICA_FAULTS)).items()}
    broker_down = _windows(records, lambda r: r["kind"] in _BROKER_DOWN)

    acks.sort()
    start = min(s for s, _ in in_flight)
    end = max(e for _, e in in_flight)
    # Moments when some attempt has been in flight for GRACE_S or more, as merged intervals.
    long_waits = _merge([(s + GRACE_S, e) for s, e in in_flight if e > s + GRACE_S])
    wi = 0
    stalled = unavailable = 0.0
    examples: list[dict[str, float]] = []
    run_start: float | None = None
    ai = 0
    t = start
    while t <= end:
        while ai < len(acks) and acks[ai] <= t:
            ai += 1
        recent_ack = ai > 0 and t - acks[ai - 1] < GRACE_S
        while wi < len(long_waits) and long_waits[wi][1] <= t:
            wi += 1
        long_wait = wi < len(long_waits) and long_waits[wi][0] <= t
        stall = long_wait and not recent_ack
        counted = stall and not _inside(t, db_down) and not _inside(t, ledger_faulted)
        if stall:
            stalled += STEP_S
        if counted:
            unavailable += STEP_S
            run_start = t if run_start is None else run_start
        elif run_start is not None:
            examples.append({"from_s": round(run_start, 2), "to_s": round(t, 2)})
            run_start = None
        t += STEP_S
    if run_start is not None:
        examples.append({"from_s": round(run_start, 2), "to_s": round(end, 2)})

    during = [d for s, d in latencies if _inside(s, broker_down)]
    # How long a ledger back from its own fault took to answer the intents it held: of the
    # attempts in flight when the fault ended and acknowledged after it, the first answer.
    first_acks: list[float] = []
    if not replicas:
        for _lo, hi in own_windows:
            held = [s + d for s, d in latencies if s < hi <= s + d]
            if held:
                first_acks.append(round(min(held) - hi, 3))
    else:
        # A killed replica's callers got an error and moved on, so it holds nothing when it
        # is back: what tells is its first answer at all once back (a held one or a new one).
        for name, windows in _down_by_ledger(records, (*_LEDGER_FAULTS,
                                                       *_REPLICA_FAULTS)).items():
            for _lo, hi in windows:
                after = [s + d for (s, d), by in zip(latencies, answered_by, strict=True)
                         if by == name and s + d >= hi]
                if after:
                    first_acks.append(round(min(after) - hi, 3))
    restarts = []
    for r in records:
        if (r["kind"] in (*_LEDGER_FAULTS, *_REPLICA_FAULTS) and _is_ledger(r["target"])
                and "listening_at" in r):
            restarts.append({
                "fault": r["kind"], "at_s": r["started_at"],
                "restarted_to_listening_s": round(r["listening_at"] - r["restarted_at"], 3)
                if r.get("restarted_at") is not None else None,
                "broker_down": _inside(float(r["started_at"]), broker_down)})
    return {
        "ran": True,
        "grace_s": GRACE_S,
        "stalled_s": round(stalled, 2),
        "unavailable_db_up_s": round(unavailable, 2),
        "unavailable_periods": examples[:8],
        # Refusals and errors answered while the database was healthy and the ledger was not
        # being restarted (a refused intent is as unavailable as an unanswered one).
        # With replicas, an attempt refused by the very replica a fault had taken down is the
        # caller's bad luck, not the service's: it retries on another.
        "refused_db_up": sum(1 for t, ledger in refused if not _inside(t, db_down)
                             and not _inside(t, ledger_faulted)
                             and not _inside(t, own_fault.get(ledger, []))),
        "ledger_restarts": restarts,
        "resumed_to_first_ack_s": {
            "n": len(first_acks), "p50": percentile(first_acks, 0.5),
            "max": max(first_acks) if first_acks else None},
        "ack_latency_during_broker_outage_s": {
            "n": len(during), "p50": percentile(during, 0.5), "p99": percentile(during, 0.99),
            "max": round(max(during), 3) if during else None},
        "ack_latency_s": {
            "n": len(latencies), "p50": percentile([d for _, d in latencies], 0.5),
            "p99": percentile([d for _, d in latencies], 0.99)},
    }
