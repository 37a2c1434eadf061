"""The benchmark's cost-of-observability report: ratios against everything off and the
≤ 3 % verdicts, from phases as the runner records them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from effectledger_bench.obscost import SCENARIO, SETTINGS, round_order, section, setting_env


def _phase(setting: str, cpu: float, ops: float) -> dict[str, Any]:
    return {"scenario": SCENARIO, "params": {"setting": setting},
            "system_cpu_ms_per_op": cpu, "ops_per_s": ops}


def _row(lines: list[str], first_cell: str) -> list[str]:
    for line in "\n".join(lines).splitlines():  # a table is one multi-line entry
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in {lines}")


def test_report_has_no_section_when_the_scenario_did_not_run() -> None:
    assert section([{"scenario": "max", "params": {}, "ops_per_s": 1.0}]) == []


def test_ratios_are_medians_against_off_and_small_costs_meet_the_target() -> None:
    phases = [_phase("off", 2.0, 100.0), _phase("off", 2.2, 90.0),
              _phase("metrics", 2.1, 98.0), _phase("metrics", 2.1, 92.0),
              _phase("metrics+tracing-0.01", 2.14, 94.0),
              _phase("metrics+tracing-1.0", 2.52, 80.0)]
    lines = section(phases)
    # off: median 2.1 ms/op and 95 ops/s; metrics: 2.1 and 95 -> ratios 1.000
    assert _row(lines, "metrics")[3:7] == ["2.100", "95.0", "1.000", "1.000"]
    assert _row(lines, "metrics+tracing-1.0")[5] == "1.200"
    assert _row(lines, "metrics on vs off ≤ 3 % CPU/op")[1:] == ["+0.0 %", "met"]
    # tracing 0.01 is compared with metrics alone: 2.14 / 2.1 = +1.9 %
    assert _row(lines, "tracing 0.01 vs metrics only ≤ 3 % CPU/op")[1:] == ["+1.9 %", "met"]
    assert any("ranged 2.000 to 2.200" in line and "(10 %)" in line for line in lines)


def test_costs_over_three_percent_are_reported_as_not_met() -> None:
    phases = [_phase("off", 2.0, 100.0), _phase("metrics", 2.1, 95.0),
              _phase("metrics+tracing-0.01", 2.2, 90.0)]
    lines = section(phases)
    assert _row(lines, "metrics on vs off ≤ 3 % CPU/op")[1:] == ["+5.0 %", "NOT met"]
    assert _row(lines, "tracing 0.01 vs metrics only ≤ 3 % CPU/op")[2] == "NOT met"


def test_missing_off_setting_gives_no_ratio_rather_than_a_wrong_one() -> None:
    lines = section([_phase("metrics", 2.1, 95.0)])
    assert _row(lines, "metrics")[5:7] == ["n/a", "n/a"]
    assert _row(lines, "metrics on vs off ≤ 3 % CPU/op")[1:] == ["n/a", "n/a"]


def test_settings_switch_metrics_and_write_traces_inside_the_run_folder(tmp_path: Path) -> None:
    assert setting_env("off", tmp_path)["EFFECTLEDGER_METRICS"] == "off"
    assert setting_env("off", tmp_path)["OTEL_SDK_DISABLED"] == "true"
    traced = setting_env("metrics+tracing-0.01", tmp_path)
    assert traced["OTEL_TRACES_SAMPLER_ARG"] == "0.01"
    assert Path(traced["EFFECTLEDGER_TRACES_FILE"]).parent == tmp_path


def test_every_round_runs_every_setting_and_odd_rounds_run_them_in_reverse() -> None:
    names = [name for name, _ in SETTINGS]
    assert round_order(0) == names
    assert round_order(1) == names[::-1]
    assert round_order(2) == names
    # Over a pair of rounds each setting's mean position is the same: no setting always
    # runs first (coldest) or last (after the most rows were written).
    positions = {n: round_order(0).index(n) + round_order(1).index(n) for n in names}
    assert len(set(positions.values())) == 1
