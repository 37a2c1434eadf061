"""CI hook for the agent's benchmark: `effectledger bench-agent` runs small and every waiter is
answered with its operation's final state. It asserts nothing about speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_bench_quick import _why_no_private_postgres

TIME_LIMIT_S = 300


@pytest.mark.slow
@pytest.mark.xdist_group("heavy")
@pytest.mark.timeout(TIME_LIMIT_S + 120)
def test_bench_agent_measures_and_answers_every_waiter(tmp_path: Path) -> None:
    reason = _why_no_private_postgres()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "agentwait.json"
    proc = subprocess.run(
        [sys.executable, "-m", "effectledger_cli", "bench-agent", "--n", "20", "--waiters",
         "200", "--out", str(out)],
        capture_output=True, text=True, timeout=TIME_LIMIT_S, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(out.read_text())
    for figure in ("bare_provider_ms", "submit_and_wait_ms", "overhead_ms"):
        assert isinstance(result[figure]["p50"], float), result
    # Each operation so far claimed once, and (the ledger waits for the intent's statement
    # before deciding a claim) none found before its commit.
    claims = {status: n for status, n in result["claims"].items() if n}
    assert claims == {"granted": 90 + 4 * 20}, result["claims"]
    # The latency budget: every hop of both paths measured, beside floors measured in the run.
    budget = result["latency_budget"]
    floors = budget["floors_ms"]
    assert set(floors) == {"pg_commit", "nats_request_reply", "js_publish_ack",
                           "http_round_trip", "provider_call"}
    assert all(isinstance(f["p50"], float) for f in floors.values()), floors
    hops = {"submit_to_intent", "intent_to_claim", "claim_to_call", "provider_call",
            "call_to_outcome", "outcome_to_answer"}
    for path in ("client", "mcp"):
        assert budget[path]["n"] == 20
        assert set(budget[path]["hops"]) == hops
        assert all(isinstance(h["p50_ms"], float) for h in budget[path]["hops"].values())
    assert "| outcome_to_answer |" in out.with_suffix(".md").read_text()
    # The chain's floor: the skeleton ran beside ours, call by call, and its hops are budgeted.
    skeleton = result["skeleton"]
    assert "error" not in skeleton, skeleton
    assert skeleton["n"] == 20 and isinstance(skeleton["skeleton_ms"]["p50"], float), skeleton
    assert set(skeleton["cpu_ms_per_call"]) == {"ledger", "dispatcher-1", "skeleton-ledger",
                                                "skeleton-dispatcher"}, skeleton
    assert budget["skeleton"]["n"] == 20 and set(budget["skeleton"]["hops"]) == hops
    assert "| ours - skeleton |" in out.with_suffix(".md").read_text()
    waiters = result["waiters"]
    assert waiters["answered_states"] == {"succeeded": 200}, waiters
    assert waiters["still_waiting_after_window"] == 200  # nothing answered before its commit
