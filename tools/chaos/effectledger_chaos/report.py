"""The report: JSON (config, schedule, results) and a readable summary table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checker import INVARIANTS
from .config import ChaosConfig
from .schedule import Schedule

TITLES = {
    "duplicate_effects": "1 duplicate effects",
    "lost_intents": "2 lost intents",
    "not_at_rest": "3 not at rest after quiet period",
    "verdicts_contradicting_truth": "4 verdicts contradicting provider truth",
    "duplicate_requests_per_epoch": "5 >1 provider request per epoch",
    "stale_epoch_writes_accepted": "6 stale-epoch writes accepted",
    "unneeded_reviews": "7 unneeded reviews (type a)",
    "bad_webhook_state_changes": "8 state changes by bad webhooks",
    "leftover_backlog": "9 leftover backlog / memory growth",
    "canary_leaks": "10 canary secrets leaked",
    "forged_messages_effective": "11 forged messages that took effect",
}


def build(cfg: ChaosConfig, schedule: Schedule, result: dict[str, Any],
          workdir: Path) -> dict[str, Any]:
    bad = result["bad_input"]
    exits = result["process_exits"]
    never = never_injected(result["faults_injected"])
    # A full run that never injected a planned kind proved nothing about it: it fails. A CI
    # run's short workload may leave a kind without a target; it reports, and passes.
    ok = (result["ok"] and (not bad.get("ran") or bad["ok"]) and not exits["unexpected"]
          and (cfg.ci or not never))
    # The result first: its own "ok" is the invariants' alone, and the verdict above must win
    # (after it, it overrode the verdict, so a failed bad-input batch or an unexpected exit
    # still exited 0).
    return {**result, "ok": ok, "invariants_ok": result["ok"], "seed": cfg.seed,
            "faults_never_injected": never,
            "faults_never_triggered": never_triggered(result["faults_injected"]),
            "config": cfg.to_json(), "workdir": str(workdir),
            "summary": summary_rows(result), "schedule": schedule.to_json()}


def never_injected(faults: dict[str, Any]) -> list[str]:
    """Fault kinds planned at least once and injected never."""
    return sorted(k for k, v in faults.items() if v["planned"] > 0 and v["injected"] == 0)


def never_triggered(faults: dict[str, Any]) -> list[str]:
    """Never-injected kinds whose every planned operation never reached the state the fault
    acts on (a webhook delivery fault whose operations' effects were never applied)."""
    return [k for k in never_injected(faults)
            if faults[k].get("untriggered", 0) == faults[k]["planned"]]


def summary_rows(result: dict[str, Any]) -> dict[str, Any]:
    inv = result["invariants"]
    return {"invariants": {name: inv[name]["count"] for name in INVARIANTS},
            "metrics": {k: result["metrics"][k] for k in (
                "operations_planned", "operations_acknowledged", "operations_in_ledger",
                "final_states", "throughput_ops_per_s", "time_to_rest_s")},
            "availability": _availability_summary(result["metrics"].get("availability", {})),
            "faults_injected": {k: v["injected"] for k, v in result["faults_injected"].items()},
            "time_to_rest_by_fault_s": {
                k: {"p50": v["p50"], "p99": v["p99"], "n": v["n"]}
                for k, v in result["metrics"].get("time_to_rest_by_fault_s", {}).items()},
            "bad_input_ok": result["bad_input"].get("ok"),
            "unexpected_exits": len(result["process_exits"]["unexpected"])}


def table(reports: list[dict[str, Any]]) -> str:
    """One column per seed: invariants, metrics, faults injected, review rates."""
    seeds = [f"seed {r['seed']}" for r in reports]
    width = max(42, *(len(t) for t in TITLES.values())) + 2
    col = max(10, *(len(s) for s in seeds)) + 2

    def row(label: str, values: list[Any]) -> str:
        return label.ljust(width) + "".join(str(v).rjust(col) for v in values)

    lines = [row("", seeds), "-" * (width + col * len(reports))]
    for name in INVARIANTS:
        lines.append(row(TITLES[name], [r["invariants"][name]["count"] for r in reports]))
    lines.append(row("bad-input batch ok", [_yn(r["bad_input"].get("ok")) for r in reports]))
    lines.append(row("unexpected process exits",
                     [len(r["process_exits"]["unexpected"]) for r in reports]))
    lines.append("-" * (width + col * len(reports)))
    m = [r["metrics"] for r in reports]
    lines.append(row("operations acknowledged / in ledger",
                     [f"{x['operations_acknowledged']}/{x['operations_in_ledger']}" for x in m]))
    for state in ("succeeded", "failed", "needs_review"):
        lines.append(row(f"  {state}", [x["final_states"].get(state, 0) for x in m]))
    lines.append(row("throughput (ops at rest / s)", [x["throughput_ops_per_s"] for x in m]))
    lines.append(row("time to rest p50 (s)", [x["time_to_rest_s"]["p50"] for x in m]))
    lines.append(row("time to rest p99 (s)", [x["time_to_rest_s"]["p99"] for x in m]))
    lines.append(row("run time (s)", [r.get("timing", {}).get("total_s") for r in reports]))
    a = [_availability_summary(x.get("availability", {})) for x in m]
    lines.append(row("intake unavailable, database up (s)",
                     [x.get("unavailable_db_up_s") for x in a]))
    lines.append(row("intake stalled, any cause (s)", [x.get("stalled_s") for x in a]))
    lines.append(row("intents refused, database up", [x.get("refused_db_up") for x in a]))
    lines.append(row("ack p50/p99 in broker outages (s)",
                     [f"{x.get('outage_ack_p50')}/{x.get('outage_ack_p99')}" for x in a]))
    lines.append(row("ledger restart to listening (s)",
                     [x.get("ledger_restart_to_listening") for x in a]))
    lines.append(row("ledger back to first held ack, max (s)",
                     [x.get("resumed_to_first_ack") for x in a]))
    lines.append("-" * (width + col * len(reports)))
    kinds = sorted({k for r in reports for k in r["faults_injected"]})
    lines.append(row("faults injected (review rate)", ["" for _ in reports]))
    for kind in kinds:
        vals = []
        for r in reports:
            n = r["faults_injected"].get(kind, {}).get("injected", 0)
            rate = r["metrics"]["review_rate_by_fault"].get(kind, {}).get("rate")
            vals.append(f"{n} ({_pct(rate)})")
        lines.append(row(f"  {kind}", vals))
    base = [r["metrics"]["review_rate_by_fault"].get("(none)", {}) for r in reports]
    lines.append(row("  no fault (review rate)",
                     [f"{b.get('operations', 0)} ({_pct(b.get('rate'))})" for b in base]))
    lines.append("-" * (width + col * len(reports)))
    lines.append(row("time to rest by fault, p50/p99 (s)", ["" for _ in reports]))
    for kind in [*kinds, "(none)"]:
        vals = []
        for r in reports:
            t = r["metrics"].get("time_to_rest_by_fault_s", {}).get(kind, {})
            vals.append(f"{_num(t.get('p50'))}/{_num(t.get('p99'))}")
        lines.append(row(f"  {'no fault' if kind == '(none)' else kind}", vals))
    lines.append(row("planned, never injected",
                     [", ".join(r.get("faults_never_injected", [])) or "none" for r in reports]))
    lines.append(row("  of which never triggered",
                     [", ".join(r.get("faults_never_triggered", [])) or "none"
                      for r in reports]))
    skipped = sorted({k for r in reports for k in r["config"].get("faults_skipped", [])})
    if skipped:
        lines.append(f"skipped (no cluster in this run): {', '.join(skipped)}")
    return "\n".join(lines)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _availability_summary(a: dict[str, Any]) -> dict[str, Any]:
    if not a.get("ran"):
        return {}
    outage = a["ack_latency_during_broker_outage_s"]
    restarts = [r["restarted_to_listening_s"] for r in a["ledger_restarts"]
                if r["restarted_to_listening_s"] is not None]
    return {"unavailable_db_up_s": a["unavailable_db_up_s"], "stalled_s": a["stalled_s"],
            "refused_db_up": a["refused_db_up"],
            "outage_ack_p50": outage["p50"], "outage_ack_p99": outage["p99"],
            "outage_acks": outage["n"],
            "ledger_restart_to_listening": max(restarts) if restarts else None,
            "resumed_to_first_ack": a.get("resumed_to_first_ack_s", {}).get("max")}


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.0f}%"


def _yn(v: Any) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")
