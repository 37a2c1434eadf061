"""What metrics and tracing cost: the settings the `observability` scenario alternates, and
its report section (CPU ms/op and ops/s of each setting against everything off)."""

from __future__ import annotations

from pathlib import Path

from .tables import Phase, fmt, med, table

SCENARIO = "observability"
TARGET = 0.03  # the budget: metrics ≤ 3 %, tracing at 0.01 ≤ 3 %

# (name, what it is); the order is the order of each round.
SETTINGS: list[tuple[str, str]] = [
    ("off", "metrics and tracing off"),
    ("metrics", "metrics on, tracing off"),
    ("metrics+tracing-0.01", "metrics on, tracing sampled at 0.01"),
    ("metrics+tracing-1.0", "metrics on, tracing sampled at 1.0"),
]


def round_order(rnd: int) -> list[str]:
    """The settings in the order round `rnd` runs them: reversed every other round, so a load
    that rises or falls steadily over the run (other work on a shared machine, a table that
    grows) favours no setting over a pair of rounds."""
    names = [name for name, _ in SETTINGS]
    return names if rnd % 2 == 0 else names[::-1]


def setting_env(name: str, out_dir: Path) -> dict[str, str]:
    """The service environment of one setting. Traces go to a JSON-lines file in the run's
    folder, so nothing leaves the machine and export is part of the cost."""
    if name == "off":
        return {"EFFECTLEDGER_METRICS": "off", "OTEL_SDK_DISABLED": "true"}
    if name == "metrics":
        return {"EFFECTLEDGER_METRICS": "on", "OTEL_SDK_DISABLED": "true"}
    ratio = name.rsplit("-", 1)[1]
    return {"EFFECTLEDGER_METRICS": "on", "OTEL_SDK_DISABLED": "false",
            "EFFECTLEDGER_TRACES_FILE": str(out_dir / f"traces-{name}.jsonl"),
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": ratio}


def _medians(phases: list[Phase]) -> dict[str, tuple[float | None, float | None, int]]:
    out: dict[str, tuple[float | None, float | None, int]] = {}
    for name, _ in SETTINGS:
        ps = [p for p in phases
              if p.get("scenario") == SCENARIO and p["params"].get("setting") == name]
        if ps:
            out[name] = (med(p.get("system_cpu_ms_per_op") for p in ps),
                         med(p.get("ops_per_s") for p in ps), len(ps))
    return out


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def _verdict(cost: float | None) -> str:
    if cost is None:
        return "n/a"
    return "met" if cost <= TARGET else "NOT met"


def section(phases: list[Phase]) -> list[str]:
    """The report's lines; empty when the scenario did not run."""
    m = _medians(phases)
    if not m:
        return []
    off_cpu, off_ops, _ = m.get("off", (None, None, 0))
    rows = []
    for name, what in SETTINGS:
        if name not in m:
            continue
        cpu, ops, n = m[name]
        rc, ro = _ratio(cpu, off_cpu), _ratio(ops, off_ops)
        rows.append([name, what, str(n), fmt(cpu, 3), fmt(ops, 1),
                     fmt(rc, 3) if rc is not None else "n/a",
                     fmt(ro, 3) if ro is not None else "n/a"])
    lines = ["## Cost of observability", "",
             "The saturated closed loop, alternating the settings in each round (ledger and "
             "dispatchers restarted with each); traces are written to a JSON-lines file in the "
             "run's folder. Medians over rounds; the cost is the rise in system CPU ms/op.", "",
             table(rows, ["setting", "what", "rounds", "system CPU ms/op", "ops/s",
                          "CPU vs off", "ops/s vs off"]), ""]
    verdicts = []
    metrics_cpu = m.get("metrics", (None, None, 0))[0]
    t01_cpu = m.get("metrics+tracing-0.01", (None, None, 0))[0]
    cost_m = _ratio(metrics_cpu, off_cpu)
    cost_t = _ratio(t01_cpu, metrics_cpu)
    verdicts.append(["metrics on vs off ≤ 3 % CPU/op",
                     f"{(cost_m - 1) * 100:+.1f} %" if cost_m is not None else "n/a",
                     _verdict(cost_m - 1 if cost_m is not None else None)])
    verdicts.append(["tracing 0.01 vs metrics only ≤ 3 % CPU/op",
                     f"{(cost_t - 1) * 100:+.1f} %" if cost_t is not None else "n/a",
                     _verdict(cost_t - 1 if cost_t is not None else None)])
    lines += [table(verdicts, ["target", "measured", "verdict"]), ""]
    off_runs = [p.get("system_cpu_ms_per_op") for p in phases
                if p.get("scenario") == SCENARIO and p["params"].get("setting") == "off"]
    spread = [v for v in off_runs if v is not None]
    if len(spread) > 1:
        # A verdict means little when the same setting moves more than the target between rounds.
        lines += [f"Noise: `off` alone ranged {fmt(min(spread), 3)} to {fmt(max(spread), 3)} "
                  f"system CPU ms/op over {len(spread)} rounds "
                  f"({(max(spread) / min(spread) - 1) * 100:.0f} %); differences smaller than "
                  "that are not a measured cost.", ""]
    return lines
