"""CI hook for the benchmark: `effectledger bench --quick --check` runs and finds no lost or
duplicated effect. It asserts nothing about speed (the benchmark is not a test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from effectledger_testkit.postgres import pg_bindir

TIME_LIMIT_S = 240  # the quick run takes about 1.5 minutes on the 2-core CI machine
# Smaller than `--quick` itself (5 s phases, 300 workflows per peer, 4 s of pgbench): this
# checks the harness and the effects, not figures, so every scenario and peer still runs, each
# for less time. `effectledger bench --quick` as documented (docs/benchmark.md) is unchanged.
CI_SIZES = ["--duration", "2", "--peer-n", "100", "--pgbench-seconds", "2"]


def _why_no_private_postgres() -> str | None:
    if pg_bindir() is None:
        return "PostgreSQL's initdb is not installed (pg_config --bindir)"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a `postgres` user to run initdb as"
    return None


@pytest.mark.slow
@pytest.mark.xdist_group("heavy")
@pytest.mark.timeout(TIME_LIMIT_S + 120)
def test_bench_quick_check_finds_no_lost_or_duplicated_effect(tmp_path: Path) -> None:
    """The harness starts its private servers and services, runs every scenario small, and the
    sandbox's ground truth agrees with the ledger: zero lost, zero duplicated."""
    reason = _why_no_private_postgres()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "effectledger_cli", "bench", "--quick", "--check",
         "--no-progress", *CI_SIZES, "--rates", "0.3", "--out", str(out)],
        capture_output=True, text=True, timeout=TIME_LIMIT_S, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = json.loads((out / "results.json").read_text())
    effects = results["effects"]
    assert effects["ok"] is True and effects["lost"] == 0 and effects["duplicated"] == 0
    assert results["phases"], "no scenario was measured"
    # The closed loop completes operations: its window refills from the outcomes the load
    # generator sees (by request or on the stream); a loop that never saw one measured nothing.
    closed = [p for p in results["phases"] if p["scenario"] == "max"]
    assert closed and all(p["succeeded"] > 0 for p in closed), closed
    assert all(sum(ld["outcomes_seen"] for ld in p["load"]) > 0 for p in closed), closed
    assert (out / "report.md").exists()
    # Every phase says where its operations' time went, stage by stage (numbers, not speed).
    for phase in results["phases"]:
        if phase["succeeded"]:
            stages = phase["stages_ms"]
            assert all(isinstance(stages[s]["p50"], float) for s in
                       ("accepted_to_claimed", "claimed_to_outcome", "outcome_to_recorded")), phase
    assert "accepted → claimed" in (out / "report.md").read_text()
    # pgbench replayed one operation's SQL at the half phase's rate: the tail's floor, with a
    # latency for every transaction it ran (not a speed: that there is one, at that rate).
    (half,) = [p for p in results["phases"] if p["scenario"] == "half"]
    (paced,) = [p for p in results["peers"] if p["peer"] == "pgbench_paced"]
    assert "error" not in paced, paced
    assert paced["rate"] == half["params"]["rate"] and paced["transactions"] > 0, paced
    assert paced["failed"] == 0 and paced["latency_ms"]["p99"] > 0, paced
    assert "paced at the half rate" in (out / "report.md").read_text()
    # The rate sweep's one point: an open loop at 0.3 of the max rate, its floor beside it.
    (point,) = [p for p in results["phases"] if p["scenario"] == "rate"]
    (top,) = closed
    assert point["params"]["share"] == 0.3 and point["succeeded"] > 0, point
    assert point["params"]["rate"] == round(max(5.0, 0.3 * top["ops_per_s"]), 1), point
    assert point["floor_ms"]["p99"] > 0, point
    assert "## The rate sweep" in (out / "report.md").read_text()
