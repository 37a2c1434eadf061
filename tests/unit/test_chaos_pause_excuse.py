"""`pause_before_send` armed while too few claims of its tool reached its dispatcher: excused
(never triggered), never counted as injected, and excused only on the database's word."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from effectledger_chaos.collect import _utc
from effectledger_chaos.metrics import injected
from effectledger_chaos.report import never_injected, never_triggered
from effectledger_chaos.schedule import Schedule, TimedFault

NTH = 3


def _faults(result: dict[str, Any]) -> dict[str, Any]:
    fault = TimedFault(id=1, at=10.0, kind="pause_before_send", target="dispatcher-1",
                       params={"point": "dispatcher.after_claim", "tool": "plain_readback",
                               "nth": NTH, "seconds": 27.0})
    schedule = Schedule(seed=1, fault_phase_s=30.0, ops=[], timed=[fault])
    record = {"id": 1, "kind": fault.kind, "target": fault.target, "params": fault.params,
              "result": result}
    return injected(schedule, [record], {}, [], {})


def test_stopped_is_injected() -> None:
    faults = _faults({"armed": "x", "hit": True})
    assert faults["pause_before_send"]["injected"] == 1
    assert not never_injected(faults)


@pytest.mark.parametrize("claims", [0, NTH - 1])
def test_too_few_claims_while_armed_is_excused(claims: int) -> None:
    faults = _faults({"armed": "x", "hit": False, "claims_while_armed": claims})
    assert faults["pause_before_send"]["injected"] == 0
    assert never_triggered(faults) == ["pause_before_send"]


@pytest.mark.parametrize("claims", [NTH, NTH + 5, None])
def test_enough_claims_or_no_word_from_the_database_is_not(claims: int | None) -> None:
    """Claims enough to reach the point and no stop: the injector's failure, never excused;
    nor when the database could not be read."""
    faults = _faults({"armed": "x", "hit": False, "claims_while_armed": claims})
    assert never_injected(faults) == ["pause_before_send"]
    assert never_triggered(faults) == []


def test_claimed_at_as_either_database_returns_it() -> None:
    aware = datetime(2026, 12, 7, 13, 0, 1, 250000, tzinfo=UTC)
    assert _utc(aware) == aware
    assert _utc("2026-12-07 13:00:01.250000") == aware  # SQLite: naive text, UTC
    assert _utc("2026-12-07T13:00:01.250000+00:00") == aware
