"""The report's tail section: for each phase, its slowest 1 % beside what else happened then.

A p99 far above the p95 means a few operations waited for something rare. Per phase this puts
side by side: when the slowest 1 % were accepted (together, in one stall, or spread out), which
of their stages grew, the ledger's and the dispatchers' event-loop lag and garbage collections
(`pauses.py`), the COMMITs PostgreSQL logged as slow (a stalled WAL flush holds the one
writer and everything queued behind it), the PostgreSQL checkpoints begun, and the machine's
own share of stolen and disk-wait time (`procs.machine_shares`): enough to tell a stall of
the code from one of the machine."""

from __future__ import annotations

from typing import Any

from .tables import Phase, fmt, table


def clusters(times: list[float], gap_s: float = 0.1) -> list[tuple[float, int]]:
    """The acceptance times grouped where each lies within `gap_s` of the one before: (first
    time, count) per group, so "6 at 2.72" reads as one stall and six groups as six."""
    out: list[tuple[float, int]] = []
    last = None
    for t in sorted(times):
        if out and last is not None and t - last <= gap_s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((t, 1))
        last = t
    return out


def _row(p: Phase) -> list[str]:
    slow: dict[str, Any] = (p.get("stages_ms") or {}).get("slowest_1pct") or {}
    ledger: dict[str, Any] = p.get("ledger_stalls") or {}
    dispatchers: dict[str, Any] = p.get("dispatcher_stalls") or {}
    mach: dict[str, Any] = p.get("machine_cpu_share") or {}
    groups = clusters(list(slow.get("accepted_at_s") or []))
    when = ", ".join(f"{n} at {t:.2f}" for t, n in groups[:6]) + (" …" if len(groups) > 6 else "")
    lat: dict[str, Any] = p.get("latency_ms") or {}
    return [p.get("scenario", "?"), str(p.get("rep", 0) + 1), fmt(lat.get("p95")),
            fmt(lat.get("p99")), str(slow.get("n", "-")), when or "-",
            f"{fmt(slow.get('accepted_to_claimed_p50'))} / "
            f"{fmt(slow.get('claimed_to_outcome_p50'))} / "
            f"{fmt(slow.get('outcome_to_recorded_p50'))}",
            f"{_lag(ledger)} / {_lag(dispatchers)}", f"{_gc(ledger)} / {_gc(dispatchers)}",
            _slow((p.get("pg") or {}).get("slow")),
            str((p.get("pg") or {}).get("checkpoints", "-")),
            f"{fmt(100 * mach['steal'], 1)} / {fmt(100 * mach['iowait'], 1)}"
            if "steal" in mach and "iowait" in mach else "-"]


def _slow(slow: dict[str, Any] | None) -> str:
    """The phase's COMMITs the server logged as slow: how many, and the longest."""
    if not slow:
        return "-"
    if not slow.get("commits"):
        return "0"
    return f"{slow['commits']}, max {fmt(slow.get('commit_max_ms'))}"


def _lag(stalls: dict[str, Any]) -> str:
    """Loop-lag samples over 25 ms, of all samples ("-" when the process was not scraped)."""
    lag: dict[str, Any] = stalls.get("loop_lag") or {}
    return f"{lag['over_25ms']} of {lag['samples']}" if lag else "-"


def _gc(stalls: dict[str, Any]) -> str:
    """Garbage collections over 10 ms, all generations."""
    if not stalls:
        return "-"
    return str(sum((stalls.get(f"gc_gen{g}") or {}).get("over_10ms", 0) for g in "012"))


def section(phases: list[Phase]) -> list[str]:
    rows = [_row(p) for p in phases
            if p.get("scenario") in ("max", "half", "failure_mix")
            and (p.get("stages_ms") or {}).get("slowest_1pct")]
    if not rows:
        return []
    return ["The tail: each phase's slowest 1 % (by intent → succeeded) beside what else "
            "happened in the phase. *accepted at*: when they were accepted, grouped "
            "(count at seconds into the phase; one group is one stall that held them "
            "all); "
            "their stage medians (accepted → claimed / claimed → outcome / outcome → recorded); "
            "the event-loop lag samples over 25 ms and the garbage collections over 10 ms of "
            "the ledger / the dispatchers (summed); the COMMITs PostgreSQL logged as slower "
            "than 15 ms (each a WAL flush that held every call queued behind it), and the "
            "longest; PostgreSQL checkpoints begun; the "
            "machine's stolen / disk-wait share of CPU time (%).", "",
            table(rows, ["scenario", "rep", "p95 ms", "p99 ms", "slowest n", "accepted at",
                         "their stages p50 ms", "loop lag > 25 ms (ledger / dispatchers)",
                         "GC > 10 ms (ledger / dispatchers)", "slow COMMITs (ms)",
                         "checkpoints", "steal / iowait %"]), ""]
