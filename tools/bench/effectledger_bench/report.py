"""The report: results.json → report.md (tables, min / median / max over repetitions) + PNGs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .measure import summary
from .obscost import section as observability_section
from .sweep import TARGET_P99_MS
from .sweep import section as sweep_section
from .tables import Phase, fmt, med, mmm, table
from .tail import section as tail_section


def _get(p: Phase, path: str) -> Any:
    cur: Any = p
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def group(phases: list[Phase], scenario: str, key: str | None) -> dict[Any, list[Phase]]:
    out: dict[Any, list[Phase]] = {}
    for p in phases:
        if p["scenario"] != scenario:
            continue
        k = p["params"].get(key) if key else None
        out.setdefault(k, []).append(p)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0])))


METRICS: list[tuple[str, str, int]] = [
    ("ops/s", "ops_per_s", 1),
    ("p50 ms", "latency_ms.p50", 1),
    ("p95 ms", "latency_ms.p95", 1),
    ("p99 ms", "latency_ms.p99", 1),
    ("p99.9 ms", "latency_ms.p99_9", 1),
]
STAGES: list[tuple[str, str, int]] = [
    ("accepted → claimed p50 ms", "stages_ms.accepted_to_claimed.p50", 1),
    ("p99", "stages_ms.accepted_to_claimed.p99", 1),
    ("claimed → outcome p50", "stages_ms.claimed_to_outcome.p50", 1),
    ("p99", "stages_ms.claimed_to_outcome.p99", 1),
    ("outcome → recorded p50", "stages_ms.outcome_to_recorded.p50", 1),
    ("p99", "stages_ms.outcome_to_recorded.p99", 1),
]
# The processes measured one by one: column heading, key in a phase's per-process figures.
PROCESSES = [("ledger", "ledger"), ("dispatchers", "dispatcher"), ("postgres", "postgres"),
             ("nats", "nats"), ("sandbox", "sandbox"), ("loadgen", "loadgen")]


def per_process(figure: str, digits: int) -> list[tuple[str, str, int]]:
    """One column per process of the phase's `figure` (a dict by process kind)."""
    return [(heading, f"{figure}.{kind}", digits) for heading, kind in PROCESSES]


COST: list[tuple[str, str, int]] = [
    ("system CPU ms/op", "system_cpu_ms_per_op", 2),
    *per_process("cpu_ms_per_op", 2),
    ("WAL commits/op", "pg.wal_commits_per_op", 2),
    ("xact_commit/op", "pg.xact_commit_per_op", 2),
    ("WAL bytes/op", "pg.wal_bytes_per_op", 0),
]
WAKEUPS = per_process("wakeups_per_op", 1)
WRITES = per_process("writes_per_op", 1)
PREEMPTIONS = per_process("preemptions_per_op", 2)
RUNQ = per_process("runq_wait_ms_per_op", 2)


def scenario_table(phases: list[Phase], scenario: str, key: str | None, label: str,
                   metrics: list[tuple[str, str, int]]) -> str:
    rows = []
    for k, ps in group(phases, scenario, key).items():
        row = [str(k) if key else scenario, str(len(ps))]
        row += [mmm((_get(p, path) for p in ps), d) for _, path, d in metrics]
        rows.append(row)
    return table(rows, [label, "reps"] + [m[0] for m in metrics])


def multi_table(phases: list[Phase], scenarios: Iterable[str],
                metrics: list[tuple[str, str, int]]) -> str:
    rows = []
    for scen in scenarios:
        ps = [p for p in phases if p["scenario"] == scen]
        if ps:
            rows.append([scen, str(len(ps))]
                        + [mmm((_get(p, path) for p in ps), d) for _, path, d in metrics])
    return table(rows, ["scenario", "reps"] + [m[0] for m in metrics])


def plot_curve(phases: list[Phase], scenario: str, key: str, xlabel: str, out: Path,
               series: list[tuple[str, str]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = group(phases, scenario, key)
    if not groups:
        return None
    xs = list(groups)
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.4))
    if len(series) == 1:
        axes = [axes]
    for ax, (title, path) in zip(axes, series, strict=True):
        meds, lows, highs = [], [], []
        for x in xs:
            s = summary(_get(p, path) for p in groups[x])
            meds.append(s["median"])
            lows.append(s["min"])
            highs.append(s["max"])
        pos = list(range(len(xs)))
        ys = [m if m is not None else float("nan") for m in meds]
        err = [[(m - lo) if m is not None and lo is not None else 0 for m, lo in
                zip(meds, lows, strict=True)],
               [(hi - m) if m is not None and hi is not None else 0 for m, hi in
                zip(meds, highs, strict=True)]]
        ax.errorbar(pos, ys, yerr=err, marker="o", capsize=4)
        ax.set_xticks(pos, [str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(f"effectledger: {scenario} (median, min-max)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out.name


def _best_runs(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """A peer's fastest run in each repetition (the setting it is compared at)."""
    best: dict[int, dict[str, Any]] = {}
    for p in results.get("peers", []):
        if p["peer"] == name and p.get("ops_per_s") is not None:
            rep = p.get("rep", 0)
            if rep not in best or p["ops_per_s"] > best[rep]["ops_per_s"]:
                best[rep] = p
    return [best[r] for r in sorted(best)]


def _peer_values(results: dict[str, Any], name: str) -> list[float]:
    """A peer's ops/s per repetition, at the best setting it ran with in that repetition."""
    return [p["ops_per_s"] for p in _best_runs(results, name)]


PEER_MODES = {"dbos": ("direct", "queue"), "temporal": ("activity", "local")}


def _best_setting(results: dict[str, Any], name: str) -> str:
    """The setting (processes, concurrency) of a peer's fastest run: how it was at its best."""
    runs = [p for p in results.get("peers", [])
            if p["peer"] == name and p.get("ops_per_s") is not None]
    if not runs:
        return "?"
    top = max(runs, key=lambda p: p["ops_per_s"])
    return str(top.get("processes", top.get("concurrency", "?")))


def best_peer(results: dict[str, Any], family: str) -> tuple[str, float] | None:
    """(mode, median ops/s) of a peer's best mode, over the repetitions' best settings."""
    found = [(med(_peer_values(results, f"{family}_{mode}")) or 0.0, mode)
             for mode in PEER_MODES[family]]
    value, mode = max(found)
    return (mode, value) if value else None


def _paced(results: dict[str, Any]) -> list[dict[str, Any]]:
    """pgbench's paced runs (peers.pgbench_paced), one per repetition, that measured."""
    return [p for p in results.get("peers", [])
            if p["peer"] == "pgbench_paced" and _get(p, "latency_ms.p99") is not None]


def pgbench_best(results: dict[str, Any]) -> tuple[int | None, list[float]]:
    by_clients: dict[int, list[float]] = {}
    for p in results.get("peers", []):
        if p["peer"] == "pgbench_limit" and p.get("ops_per_s") is not None:
            by_clients.setdefault(p["clients"], []).append(p["ops_per_s"])
    if not by_clients:
        return None, []
    best = max(by_clients, key=lambda c: max(by_clients[c]))
    return best, by_clients[best]


def targets(results: dict[str, Any]) -> list[list[str]]:
    phases = results.get("phases", [])
    rows: list[list[str]] = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "**missed**")

    def gap(value: float | None, target: float, higher: bool = True) -> str:
        if value is None:
            return ""
        if (value >= target) if higher else (value <= target):
            return ""
        # Ratios can miss by less than the first decimal shows: say by how much.
        digits = 1 if abs(target - value) >= 0.05 else 3
        return (f" (short by {target - value:.{digits}f}, "
                f"{100 * (target - value) / target:.{0 if digits == 1 else 1}f} %)"
                if higher else f" (over by {value - target:.1f}, "
                               f"{100 * (value - target) / target:.0f} %)")

    top = [p.get("ops_per_s") for p in phases if p["scenario"] == "max"]
    m = med(top)
    rows.append(["≥ 1,000 ops/s end to end (latency 0)", mmm(top) + gap(m, 1000),
                 verdict(None if m is None else m >= 1000)])
    clients, pgb = pgbench_best(results)
    if pgb and m:
        ratio = m / (med(pgb) or 1)
        shown = f"{ratio:.2f}" if abs(ratio - 1.0) >= 0.005 else f"{ratio:.3f}"
        rows.append([f"≥ 1.0 x pgbench limit ({mmm(pgb)} ops/s at {clients} clients)",
                     f"{shown} x" + gap(ratio, 1.0), verdict(ratio >= 1.0)])
    for family, label, target in (("dbos", "DBOS", 8.0), ("temporal", "Temporal", 3.0)):
        best = best_peer(results, family)
        if best and m:
            ratio = m / best[1]
            rows.append([f"≥ {target:g} x {label} (best mode: {best[0]}, {best[1]:.1f} ops/s)",
                         f"{ratio:.2f} x" + gap(ratio, target), verdict(ratio >= target)])
    ceiling = med(_peer_values(results, "no_durability"))
    if ceiling and m:
        rows.append([f"share of the no-durability ceiling ({ceiling:.1f} ops/s), shown",
                     f"{m / ceiling:.2f} x", "n/a"])
    half = [_get(p, "latency_ms.p99") for p in phases if p["scenario"] == "half"]
    hm = med(half)
    rows.append([f"p99 intent→succeeded ≤ {TARGET_P99_MS:g} ms at half the max rate",
                 mmm(half) + " ms" + gap(hm, TARGET_P99_MS, higher=False),
                 verdict(None if hm is None else hm <= TARGET_P99_MS)])
    paced = _paced(results)
    if paced:
        rows.append(["the floor under it: pgbench replaying one operation's SQL at the same rate,"
                     " p99 (p50), shown", mmm(_get(p, "latency_ms.p99") for p in paced)
                     + f" ms ({mmm(_get(p, 'latency_ms.p50') for p in paced)} ms)", "n/a"])
    cpu_max = med(p.get("system_cpu_ms_per_op") for p in phases if p["scenario"] == "max")
    cpu_half = med(p.get("system_cpu_ms_per_op") for p in phases if p["scenario"] == "half")
    if cpu_max:
        rows.append(["system CPU ≤ 1.3 ms/op at saturation (`max`)", f"{cpu_max:.2f} ms/op"
                     + gap(cpu_max, 1.3, higher=False), verdict(cpu_max <= 1.3)])
    if cpu_max and cpu_half:
        flat = cpu_half / cpu_max
        rows.append(["system CPU/op at half rate ÷ at saturation ≤ 1.3",
                     f"{cpu_half:.2f} ÷ {cpu_max:.2f} = {flat:.2f} x"
                     + gap(flat, 1.3, higher=False), verdict(flat <= 1.3)])
    bl = group(phases, "backlog", "backlog")
    if len(bl) >= 2:
        xs = list(bl)
        c0 = med(p["system_cpu_ms_per_op"] for p in bl[xs[0]])
        cn = med(p["system_cpu_ms_per_op"] for p in bl[xs[-1]])
        if c0 and cn:
            change = 100 * (cn - c0) / c0
            # Growth is the failure mode; a drop is fixed per-second costs (relay polls,
            # sweeper) spread over more operations while the backlog drains.
            rows.append([f"flat cost {xs[0]} → {xs[-1]:,} backlog (no more than +20 %)",
                         f"{fmt(c0, 2)} → {fmt(cn, 2)} system CPU ms/op ({change:+.0f} %)",
                         verdict(change <= 20)])
            # The same comparison against the saturated `max` phase, where fixed per-second
            # costs are spread the same way as during a drain.
            cmax = med(p["system_cpu_ms_per_op"] for p in phases if p["scenario"] == "max")
            if cmax:
                vs_max = 100 * (cn - cmax) / cmax
                rows.append([f"... {xs[-1]:,} backlog vs the saturated `max` phase",
                             f"{fmt(cmax, 2)} → {fmt(cn, 2)} system CPU ms/op "
                             f"({vs_max:+.0f} %)", verdict(vs_max <= 20)])
    rp = group(phases, "replicas", "dispatchers")
    if 1 in rp and 2 in rp:
        r1 = med(p.get("ops_per_s") for p in rp[1])
        r2 = med(p.get("ops_per_s") for p in rp[2])
        if r1 and r2:
            rows.append(["near-linear gain 1 → 2 dispatchers (while CPU remains)",
                         f"{r1:.1f} → {r2:.1f} ops/s ({r2 / r1:.2f} x)",
                         verdict(r2 / r1 >= 1.8)])
    peak = results.get("peak_rss_mib", {})
    svc = {k: v for k, v in peak.items() if k.split("-")[0] in ("ledger", "dispatcher",
                                                                "reconciler")}
    if svc:
        worst = max(svc, key=lambda k: svc[k])
        rows.append(["peak RSS ≤ 150 MiB per service process",
                     f"max {svc[worst]:.0f} MiB ({worst})" + gap(svc[worst], 150, higher=False),
                     verdict(svc[worst] <= 150)])
    eff = results.get("effects", {})
    if eff:
        rows.append(["zero lost, zero duplicated effects",
                     f"lost {eff.get('lost')}, duplicated {eff.get('duplicated')}, "
                     f"failed-but-applied {eff.get('failed_but_applied')}",
                     verdict(bool(eff.get("ok")))])
    return rows


# What the services' processes were counted doing, per operation: (the phase's figure, what it
# means, its columns). A run from before a count existed shows no table for it.
_COUNTED: list[tuple[str, str, list[tuple[str, str, int]]]] = [
    ("wakeups_per_op",
     "Wake-ups per operation by process (voluntary context switches, all threads; for "
     "PostgreSQL its live processes): how often a process went to sleep waiting and had to be "
     "woken. A busy process finds its next message waiting; one that handles messages as they "
     "come sleeps and wakes for each.", WAKEUPS),
    ("writes_per_op",
     "Write syscalls per operation by process (`syscw` of `/proc/<pid>/io`, all threads): each "
     "socket write to NATS, PostgreSQL or the provider is one unless several messages share "
     "it. On loopback a write also runs the receiver's side of TCP and wakes it, so fewer "
     "writes per operation is CPU saved on both sides. PostgreSQL answers with send(2), which "
     "this counter leaves out: its figure is its WAL and data file writes.", WRITES),
    ("preemptions_per_op",
     "Preemptions per operation by process (involuntary context switches, all threads): how "
     "often a process that could have run on lost its CPU to another. The same work cut up "
     "and interleaved more finely on two shared cores costs more CPU.", PREEMPTIONS),
    ("runq_wait_ms_per_op",
     "Run-queue wait per operation by process, ms (`/proc/<pid>/task/*/schedstat`, all "
     "threads): the time a process was ready to run but waited for a CPU. Beside the "
     "latency it says how much of an operation's time was spent waiting for a core rather "
     "than for the database, the broker or the provider.", RUNQ),
]


WRITER: list[tuple[str, str, int]] = [
    ("transactions/op", "writer_per_op", 2),
    ("mean transaction ms", "ledger_stalls.writer.mean_ms", 2),
    ("writers busy (s per s of load)", "ledger_stalls.writer.busy_share", 2),
]


def writer_section(phases: list[Phase]) -> list[str]:
    """The ledger's group-commit writers in each phase (`pauses.summarise`): how many
    transactions an operation took, how long one took, and how busy the writers were."""
    shown = [{**p, "writer_per_op": round(p["ledger_stalls"]["writer"]["transactions"]
                                          / max(1, p.get("operations") or 0), 2)}
             for p in phases if _get(p, "ledger_stalls.writer.transactions") is not None]
    if not shown:
        return []
    return ["The ledger's group-commit writers (its transaction-duration histogram): "
            "transactions per operation, the mean transaction (commit included), and the "
            "seconds the writers were in a transaction per second of offered load. At the "
            "number of writers (`DB_BATCH_WORKERS`) every call queued for a commit.", "",
            multi_table(shown, ("max", "half", "failure_mix"), WRITER), ""]


def wakeup_section(phases: list[Phase], probe: dict[str, Any] | None) -> list[str]:
    """Wake-ups per operation by process, beside what one wake-up costs on this machine."""
    if not any("wakeups_per_op" in p for p in phases):
        return []
    parts: list[str] = []
    for figure, text, columns in _COUNTED:
        if any(figure in p for p in phases):
            parts += [text, "", multi_table(phases, ("max", "half", "failure_mix"), columns), ""]
    probe = probe or {}
    rates = probe.get("rates")
    if rates:
        hot = probe.get("work_us_hot")
        rows = [[f"{int(r):,}", fmt(v.get("cpu_us_per_message"), 1),
                 fmt(v.get("wakeups_per_message"), 2),
                 fmt(v["cpu_us_per_message"] / hot, 1) if hot else "n/a"]
                for r, v in sorted(rates.items(), key=lambda kv: -int(kv[0]))]
        parts += [f"What a wake-up costs on this machine (`python -m effectledger_bench.wakeprobe`"
                  f", before the run): an event loop handling one-byte messages another process "
                  f"writes at a fixed rate, each with the same {fmt(hot, 1)} µs of work (its cost "
                  f"in a tight loop). The work does not change with the rate; what it costs "
                  f"does.", "",
                  table(rows, ["messages/s", "CPU µs/message", "wake-ups/message",
                               "÷ tight loop"]), ""]
    elif probe.get("error"):
        parts += [f"Wake-up probe failed: {probe['error']}", ""]
    return parts


def render(results: dict[str, Any], out_dir: Path) -> str:
    phases = results.get("phases", [])
    mach = results.get("machine", {})
    cfg = results.get("config", {})
    git = results.get("git", {})
    parts = [
        f"# effectledger benchmark — {'quick' if cfg.get('quick') else 'full'} run",
        "",
        f"- date: {results.get('started_at')} → {results.get('finished_at')} "
        f"({results.get('duration_s')} s of scenarios)",
        f"- machine: {mach.get('nproc')} CPUs ({mach.get('cpu_model')}), "
        f"{mach.get('ram_gib')} GiB RAM, kernel {mach.get('kernel')}, Python "
        f"{mach.get('python')}; load average at start {mach.get('load_avg_at_start')}",
        f"- code: commit {git.get('commit')}"
        + (" (product code modified in the work tree)" if git.get(
            "product_code_modified_in_worktree") else ""),
        f"- durability: PostgreSQL {results.get('postgres', {}).get('version', '')} "
        f"{results.get('postgres', {}).get('settings', '')}; JetStream file storage",
        "- load: intents over NATS request-reply; closed loop window "
        f"{results.get('window_probe', {}).get('chosen') or cfg.get('window')} "
        f"(probe: {results.get('window_probe', {}).get('outcomes_per_s', 'fixed')}), "
        f"{cfg.get('duration_s')} s per phase; dispatchers {cfg.get('dispatchers')} x "
        f"concurrency {cfg.get('dispatcher_concurrency')}; repetitions {cfg.get('reps')}",
        "- figures: median (min-max) over repetitions; latency = ledger journal "
        "`intent_accepted` → `outcome_recorded`(succeeded)",
        "",
        "## Targets",
        "",
        table(targets(results), ["target", "measured", "verdict"]),
        "",
        "## Throughput and latency",
        "",
        "`max`: closed loop (the maximum sustainable rate); `half`: open loop at half of that "
        "repetition's max; `failure_mix`: open loop at half rate with 1 % transient 503s and "
        "1 % provider timeouts.",
        "",
    ]
    parts += [multi_table(phases, ("max", "half", "failure_mix"), METRICS), ""]
    if any("stages_ms" in p for p in phases):
        parts += ["Where an operation's time goes, from the ledger's own timestamps "
                  "(operations that succeeded in epoch 1): *accepted → claimed* is the intent's "
                  "transaction, the publish of its command, the dispatcher's pull and the claim's "
                  "transaction; *claimed → outcome* is the claim's reply and the provider call; "
                  "*outcome → recorded* is the outcome's publish, the inbox's pull and its "
                  "transaction.", "", multi_table(phases, ("max", "half", "failure_mix"), STAGES),
                  ""]
    parts += ["## Cost per operation", "",
              "CPU milliseconds per operation by process (all processes of a kind summed; "
              "`system` = ledger + dispatchers + PostgreSQL + NATS); WAL commit records and "
              "bytes per operation (pg_waldump / pg_current_wal_lsn); `xact_commit` from "
              "pg_stat_database (flushed lazily, indicative).", ""]
    parts += [multi_table(phases, ("max", "half", "failure_mix"), COST), ""]
    parts += wakeup_section(phases, results.get("wakeup_cost"))
    parts += tail_section(phases)
    parts += writer_section(phases)
    parts += observability_section(phases)
    parts += sweep_section(phases, out_dir)
    curves = [
        ("backlog", "backlog", "operations queued first",
         [("system CPU ms/op", "system_cpu_ms_per_op"), ("ops/s", "ops_per_s"),
          ("WAL bytes/op", "pg.wal_bytes_per_op")]),
        ("replicas", "dispatchers", "dispatcher processes",
         [("ops/s", "ops_per_s"), ("p99 ms", "latency_ms.p99"),
          ("system CPU ms/op", "system_cpu_ms_per_op")]),
        ("latency", "latency_ms", "provider latency (ms)",
         [("ops/s", "ops_per_s"), ("p50 ms", "latency_ms.p50"), ("p99 ms", "latency_ms.p99")]),
    ]
    for scen, key, xlabel, series in curves:
        if not any(p["scenario"] == scen for p in phases):
            continue
        parts += [f"## Scale curve: {scen}", ""]
        if scen == "backlog":
            parts += ["Dispatchers stopped while the backlog is queued (over NATS), then started "
                      "while intents keep arriving at the half rate; cost covers every operation "
                      "of the phase (queued + offered), ops/s is the drain rate from ledger "
                      "timestamps. Latency of the offered operations (they wait behind the "
                      "backlog):", ""]
            rows = []
            for k, ps in group(phases, "backlog", "backlog").items():
                rows.append([str(k), mmm(_get(p, "load_ops.latency_ms.p50") for p in ps),
                             mmm(_get(p, "load_ops.latency_ms.p99") for p in ps)])
            parts += [table(rows, ["backlog", "offered p50 ms", "offered p99 ms"]), ""]
        parts += [scenario_table(phases, scen, key, key, METRICS[:1] + METRICS[3:4] + COST[:3]
                                 + COST[7:8] + COST[9:]), ""]
        png = plot_curve(phases, scen, key, xlabel, out_dir / f"curve-{scen}.png", series)
        if png:
            parts += [f"![{scen}]({png})", ""]
    parts += ["## Side by side: the limit and the peers", "",
              "Same run, same sandbox provider (latency 0, no faults), same call "
              "(`POST /v1/idempotent/effects` with `Idempotency-Key`, `Fencing-Token`).", ""]
    rows = []
    m = med(p.get("ops_per_s") for p in phases if p["scenario"] == "max")
    clients, pgb = pgbench_best(results)
    for name, label in (("pgbench_limit", f"pgbench: one operation's SQL ({clients} clients)"),
                        ("dbos_direct", "DBOS Transact, direct workflows"),
                        ("dbos_queue", "DBOS Transact, queue"),
                        ("temporal_activity", "Temporal (dev server), activity"),
                        ("temporal_local", "Temporal (dev server), local activity"),
                        ("no_durability", "no durability: the dispatcher's calls, "
                                          f"{_best_setting(results, 'no_durability')} "
                                          "process(es)"),
                        ("no_durability_httpx", "no durability: httpx from one process")):
        vals = pgb if name == "pgbench_limit" else _peer_values(results, name)
        if not vals:
            continue
        pm = med(vals)
        lat = [_get(p, "latency_ms.p99") for p in (
            _best_runs(results, name) if name != "pgbench_limit" else [])]
        if name.startswith(("dbos_", "temporal_")):
            label += f", concurrency {_best_setting(results, name)}"
        rows.append([label, mmm(vals), mmm(lat),
                     f"{m / pm:.2f}" if m and pm else "n/a"])
    for p in _paced(results):
        rows.append([f"pgbench: one operation's SQL paced at the half rate ({p['rate']}/s, "
                     f"rep {p.get('rep', 0) + 1})", fmt(p.get("ops_per_s")),
                     fmt(_get(p, "latency_ms.p99")), "n/a"])
    if m:
        rows.insert(0, ["effectledger (max, closed loop)", mmm(
            p.get("ops_per_s") for p in phases if p["scenario"] == "max"),
            mmm(_get(p, "latency_ms.p99") for p in phases if p["scenario"] == "max"), "1.00"])
    parts += [table(rows, ["system", "ops/s", "p99 ms", "effectledger ÷ this"]), ""]
    missing = sorted({f"{p['peer']}: {p.get('skipped') or str(p.get('error'))[:200]}"
                      for p in results.get("peers", []) if p.get("skipped") or p.get("error")})
    if missing:
        parts += ["Not measured: " + "; ".join(missing), ""]
    if any(p["peer"].startswith("temporal_") for p in results.get("peers", [])):
        parts += ["Temporal runs as `temporal server start-dev`: one process holding all of "
                  "Temporal's services, persisting to one SQLite file. A production cluster "
                  "runs frontend, history, matching and worker services apart on PostgreSQL, "
                  "MySQL or Cassandra; that adds network hops per step and scales out, so "
                  "these figures describe the dev server on this machine, not a cluster.", ""]
    cap = results.get("sql_capture")
    if cap:
        parts += [f"The pgbench script (`{Path(cap['script']).name}`) replays the "
                  f"{cap['transactions_per_op']} transactions / {cap['statements_per_op']} "
                  f"statements one operation costs, captured with `log_statement=all` "
                  f"(shape identical across {cap['operations_captured']} captured operations: "
                  f"{cap['consistent_shape']}): " + "; ".join(f"`{s}`" for s in cap["shape"]),
                  ""]
    eff = results.get("effects")
    if eff:
        parts += ["## Effects check (sandbox ground truth vs ledger)", "",
                  "```json", _short_json(eff), "```", ""]
    peak = results.get("peak_rss_mib")
    if peak:
        parts += ["## Peak RSS (VmHWM) per process, MiB", "",
                  table([[k, fmt(v)] for k, v in peak.items()], ["process", "peak RSS MiB"]),
                  ""]
    profile = results.get("profile")
    if profile:
        load = results.get("profile_load", "closed-loop load")
        parts += [f"## Where the time goes (py-spy, {load})", ""]
        for name, s in profile.items() if isinstance(profile, dict) else []:
            if not isinstance(s, dict) or "samples" not in s:
                parts += [f"- {name}: {s}"]
                continue
            parts += [f"**{name}**: busy {s.get('busy_pct')} % of the sampled time; "
                      "self time by package: " + ", ".join(
                          f"{k} {v} %" for k, v in s["self_by_package_pct"][:8]),
                      "",
                      "inclusive: " + ", ".join(f"{k} {v} %" for k, v in s["inclusive_pct"]),
                      "", "top self functions: " + ", ".join(
                          f"`{k}` {v} %" for k, v in s["self_top_functions_pct"][:6]), ""]
    if results.get("errors"):
        parts += ["## Errors during the run", ""] + [f"- {e}" for e in results["errors"]] + [""]
    return "\n".join(parts) + "\n"


def summary_section(results: dict[str, Any]) -> str:
    """The short form for the README: machine, date, targets, side by side, curves."""
    phases = results.get("phases", [])
    mach = results.get("machine", {})
    lines = [
        f"Latest full run: {results.get('started_at')}, {mach.get('nproc')} CPUs "
        f"({mach.get('cpu_model')}), {mach.get('ram_gib')} GiB RAM, load average at start "
        f"{mach.get('load_avg_at_start')} (the machine was shared). Durability on: "
        "`synchronous_commit=on`, `fsync=on`, JetStream file storage. Median (min-max) over "
        f"{results.get('config', {}).get('reps')} repetitions.",
        "",
        table(targets(results), ["target", "measured", "verdict"]),
        "",
    ]
    rows = []
    m = med(p.get("ops_per_s") for p in phases if p["scenario"] == "max")
    _clients, pgb = pgbench_best(results)
    for name, label in (("pgbench_limit", "pgbench, one operation's SQL"),
                        ("dbos_direct", "DBOS Transact, direct"),
                        ("dbos_queue", "DBOS Transact, queue"),
                        ("temporal_activity", "Temporal dev server, activity"),
                        ("temporal_local", "Temporal dev server, local activity"),
                        ("no_durability", "no durability (the ceiling)"),
                        ("no_durability_httpx", "no durability (httpx, one process)")):
        vals = pgb if name == "pgbench_limit" else _peer_values(results, name)
        if vals:
            pm = med(vals)
            rows.append([label, mmm(vals), f"{m / pm:.2f}" if m and pm else "n/a"])
    if m:
        rows.insert(0, ["effectledger (max)", mmm(p.get("ops_per_s") for p in phases
                                                  if p["scenario"] == "max"), "1.00"])
    lines += [table(rows, ["same run, same provider", "ops/s", "effectledger / this"]), ""]
    for scen, key in (("replicas", "dispatchers"), ("latency", "latency_ms"),
                      ("backlog", "backlog")):
        g = group(phases, scen, key)
        if g:
            lines.append(f"- {scen}: " + "; ".join(
                f"{k}: {mmm(p.get('ops_per_s') for p in ps)} ops/s, "
                f"{mmm((p.get('system_cpu_ms_per_op') for p in ps), 2)} CPU ms/op"
                for k, ps in g.items()))
    return "\n".join(lines) + "\n"


def _short_json(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=1, default=str)


def write(results: dict[str, Any], out_dir: Path,
          renderer: Callable[[dict[str, Any], Path], str] = render) -> Path:
    path = out_dir / "report.md"
    path.write_text(renderer(results, out_dir))
    (out_dir / "summary.md").write_text(summary_section(results))
    return path


def rerender(out_dir: Path) -> Path:
    """Render report.md again from an existing results.json."""
    import json

    return write(json.loads((out_dir / "results.json").read_text()), out_dir)
