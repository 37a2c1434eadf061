"""The rate sweep's section of the report: latency against the offered rate, beside its floor.

The half-rate target is measured at one point, half of the run's own max rate, so a faster
maximum moves the point to a busier machine. The sweep (`bench --rates 0.2,0.35,0.5,0.65`)
shows the whole curve: at each share of the max rate an open loop's p50 and p99, pgbench
replaying one operation's SQL at the same rate on the same disk right after it (the floor),
the CPU per operation and how busy the machine was. Where the p99 leaves its floor is where
queueing for the CPU starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .measure import summary
from .tables import Phase, fmt, mmm, table

SCENARIO = "rate"
TARGET_P99_MS = 25.0  # the half-rate target's bound (report.targets)


def _by_share(phases: list[Phase]) -> dict[float, list[Phase]]:
    out: dict[float, list[Phase]] = {}
    for p in phases:
        if p["scenario"] == SCENARIO:
            out.setdefault(float(p["params"]["share"]), []).append(p)
    return dict(sorted(out.items()))


def _floor(p: Phase, key: str) -> float | None:
    value = (p.get("floor_ms") or {}).get(key)
    return value if isinstance(value, (int, float)) else None


def _busy(p: Phase) -> float | None:
    idle = (p.get("machine_cpu_share") or {}).get("idle")
    return None if idle is None else 100 * (1 - idle)


def rows(phases: list[Phase]) -> list[list[str]]:
    out = []
    for share, ps in _by_share(phases).items():
        out.append([f"{share:g}", mmm(p["params"].get("rate") for p in ps),
                    mmm(p.get("ops_per_s") for p in ps),
                    mmm((p.get("latency_ms") or {}).get("p50") for p in ps),
                    mmm((p.get("latency_ms") or {}).get("p99") for p in ps),
                    mmm(_floor(p, "p50") for p in ps), mmm(_floor(p, "p99") for p in ps),
                    mmm((p.get("system_cpu_ms_per_op") for p in ps), 2),
                    mmm(_busy(p) for p in ps), str(len(ps))])
    return out


def plot(phases: list[Phase], out: Path) -> str | None:
    """p50, p99 and the floor's p99 (ms) against the offered rate, the target's bound dashed;
    beside it the system CPU per operation. Medians over repetitions."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = _by_share(phases)
    if not groups:
        return None

    def medians(get: Any) -> list[float]:
        values = [summary(get(p) for p in ps)["median"] for ps in groups.values()]
        return [v if v is not None else float("nan") for v in values]

    rates = medians(lambda p: p["params"].get("rate"))
    fig, (lat, cpu) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    lat.plot(rates, medians(lambda p: (p.get("latency_ms") or {}).get("p99")), "o-",
             label="p99")
    lat.plot(rates, medians(lambda p: (p.get("latency_ms") or {}).get("p50")), "o-",
             label="p50")
    if any(_floor(p, "p99") is not None for ps in groups.values() for p in ps):
        lat.plot(rates, medians(lambda p: _floor(p, "p99")), "s--",
                 label="floor p99 (pgbench paced)")
    lat.axhline(TARGET_P99_MS, color="grey", linestyle=":", label=f"{TARGET_P99_MS:g} ms")
    lat.set_xlabel("offered ops/s")
    lat.set_ylabel("ms, intent → succeeded")
    lat.set_ylim(bottom=0)
    lat.grid(alpha=0.3)
    lat.legend(fontsize=8)
    cpu.plot(rates, medians(lambda p: p.get("system_cpu_ms_per_op")), "o-")
    cpu.set_xlabel("offered ops/s")
    cpu.set_title("system CPU ms per operation", fontsize=10)
    cpu.set_ylim(bottom=0)
    cpu.grid(alpha=0.3)
    fig.suptitle("effectledger: latency against the offered rate (median of repetitions)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out.name


def section(phases: list[Phase], out_dir: Path) -> list[str]:
    found = rows(phases)
    if not found:
        return []
    parts = ["## The rate sweep", "",
             "Open loops at shares of each repetition's max rate (`--rates`), each followed by "
             "pgbench replaying one operation's SQL at the same rate on the same cluster and "
             "disk (the floor: what the database alone takes at that rate). Latency is the "
             f"ledger's intent → succeeded; the half-rate target's bound is {fmt(TARGET_P99_MS)} "
             "ms; busy is the machine's CPU share not idle.", "",
             table(found, ["share", "offered ops/s", "ops/s", "p50 ms", "p99 ms",
                           "floor p50 ms", "floor p99 ms", "system CPU ms/op", "busy %",
                           "reps"]), ""]
    png = plot(phases, out_dir / "curve-rate.png")
    if png:
        parts += [f"![rate sweep]({png})", ""]
    return parts
