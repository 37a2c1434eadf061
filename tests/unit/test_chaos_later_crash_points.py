"""A crash point added to the code is armed in every run, without moving any fault a seed's plan
already had: each seed's plan is the same run as before, plus the new point."""

from __future__ import annotations

from typing import Any

import pytest

from effectledger_chaos import schedule
from effectledger_chaos.config import ChaosConfig
from effectledger_core.crash import KNOWN


def _plan(seed: int) -> list[tuple[float, str, str, dict[str, Any]]]:
    cfg = ChaosConfig(ops=200, seed=seed, ci=True, duration_s=30.0, workdir="/tmp/unused")
    return [(f.at, f.kind, f.target, f.params) for f in schedule.build(cfg).timed]


# The crash points the seeds' plans were settled with (round seventeen's plans, which CI has
# passed since); every point added after them is a later one.
SETTLED = frozenset({
    "dispatcher.after_claim", "dispatcher.before_call", "dispatcher.after_response",
    "dispatcher.after_outcome_publish", "ledger.after_intent_commit",
    "ledger.intent.after_early_publish", "ledger.relay.after_publish",
    "ledger.inbox.after_commit"})


def test_a_crash_point_added_to_the_code_is_a_later_one() -> None:
    """A new point in crash.KNOWN left out of LATER_CRASH_POINTS would be drawn from the plan's
    own generator and move every fault after it: each seed would be another run."""
    assert SETTLED | set(schedule.LATER_CRASH_POINTS) == KNOWN
    assert not SETTLED & set(schedule.LATER_CRASH_POINTS)


@pytest.mark.parametrize("seed", [1, 2, 3, 11])
def test_later_crash_points_are_planned_and_leave_the_rest_of_the_plan_alone(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    later = set(schedule.LATER_CRASH_POINTS)
    assert later <= KNOWN
    with_them = _plan(seed)
    armed = {p["point"] for _, kind, _, p in with_them if kind == "crash_point"}
    assert KNOWN <= armed
    # The plan as it was before they existed.
    monkeypatch.setattr(schedule, "CRASH_POINTS", KNOWN - later)
    monkeypatch.setattr(schedule, "LATER_CRASH_POINTS", ())
    before = _plan(seed)
    assert [f for f in with_them if f[3].get("point") not in later] == before
