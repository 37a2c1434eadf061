"""The proving ground cannot pass without its faults: a fault planned inside an outage runs
after it, a full run fails when a planned kind was never injected, and a webhook delivery
fault counts as never triggered only when the provider never applied any of its effects."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

import pytest

from effectledger_chaos import faults, metrics, report
from effectledger_chaos.checker import INVARIANTS
from effectledger_chaos.config import ChaosConfig
from effectledger_chaos.faults import FaultRunner
from effectledger_chaos.schedule import OpFault, OpPlan, Schedule, TimedFault
from effectledger_chaos.stack import Stack


class FakeStack:
    def __init__(self) -> None:
        self.down = False

    def broker_down(self) -> bool:
        return self.down


class ProbeRunner(FaultRunner):
    """A runner with two fault kinds of its own that record when they ran."""

    ran_at: float | None = None

    async def _probe(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        self.ran_at = self.now()
        return {"hit": True, "broker_down_when_run": self.dependencies_down()}

    async def _nats_restart(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        self.ran_at = self.now()
        return {"hit": True}


def runner_with(stack: FakeStack) -> ProbeRunner:
    r = ProbeRunner(cast(Stack, stack), cast(Schedule, None), log=lambda _m: None)
    r.phase_start = time.monotonic()
    return r


async def test_a_fault_planned_inside_an_outage_runs_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "RESCHEDULED", frozenset({"probe"}))
    stack = FakeStack()
    stack.down = True
    runner = runner_with(stack)
    task = asyncio.create_task(runner._run(TimedFault(id=1, at=0.0, kind="probe", target="x")))
    with pytest.raises(TimeoutError):  # the broker is down: the fault waits
        await asyncio.wait_for(asyncio.shield(task), 0.5)
    assert runner.ran_at is None
    stack.down = False
    await asyncio.wait_for(task, 10)
    rec = runner.records[0]
    assert rec["result"] == {"hit": True, "broker_down_when_run": False}
    assert rec["rescheduled_from"] < rec["rescheduled_to"] <= cast(float, runner.ran_at)


async def test_a_fault_that_needs_no_broker_is_not_held_back_by_an_outage() -> None:
    """A ledger killed inside the long broker outage is a planned case: it runs on time."""
    stack = FakeStack()
    stack.down = True
    runner = runner_with(stack)
    await asyncio.wait_for(runner._run(TimedFault(id=1, at=0.0, kind="nats_restart",
                                                  target="nats")), 5)
    assert runner.ran_at is not None and "rescheduled_from" not in runner.records[0]


def _result(injected: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {"ok": True, "bad_input": {"ran": False}, "process_exits": {"unexpected": []},
            "invariants": {name: {"count": 0, "examples": []} for name in INVARIANTS},
            "metrics": {k: None for k in (
                "operations_planned", "operations_acknowledged", "operations_in_ledger",
                "final_states", "throughput_ops_per_s", "time_to_rest_s")},
            "faults_injected": injected}


@pytest.mark.parametrize(("ci", "ok"), [(False, False), (True, True)])
def test_a_full_run_fails_when_a_planned_kind_was_never_injected(
        tmp_path: Path, ci: bool, ok: bool) -> None:
    """stream_delete planned twice, injected never: the full run fails and names it; a CI
    run (a short workload may leave a kind without a target) reports it and passes."""
    injected = {"stream_delete": {"planned": 2, "injected": 0},
                "nats_restart": {"planned": 1, "injected": 1}}
    cfg = ChaosConfig(ci=ci)
    out = report.build(cfg, Schedule(seed=1, fault_phase_s=1.0, ops=[], timed=[]),
                       _result(injected), tmp_path)
    assert out["faults_never_injected"] == ["stream_delete"]
    assert out["ok"] is ok and out["invariants_ok"] is True


def test_a_run_that_injected_every_planned_kind_passes(tmp_path: Path) -> None:
    out = report.build(ChaosConfig(), Schedule(seed=1, fault_phase_s=1.0, ops=[], timed=[]),
                       _result({"nats_restart": {"planned": 1, "injected": 1},
                                "late_apply": {"planned": 0, "injected": 0}}), tmp_path)
    assert out["ok"] and out["faults_never_injected"] == []


def test_an_unexpected_exit_fails_the_run_even_with_every_invariant_zero(
        tmp_path: Path) -> None:
    """The report's verdict is not overridden by the invariants' own `ok`."""
    result = _result({})
    result["process_exits"] = {"unexpected": [{"service": "ledger", "exit_code": 1}]}
    out = report.build(ChaosConfig(ci=True), Schedule(seed=1, fault_phase_s=1.0, ops=[],
                                                      timed=[]), result, tmp_path)
    assert out["invariants_ok"] is True and out["ok"] is False


def _op(i: int, *kinds: str) -> OpPlan:
    return OpPlan(index=i, type="c", tool="plain_webhook", route="plainhook",
                  caller_key=f"c{i}", operation_key=f"k{i}", submit_at=0.0, arguments={},
                  faults=[OpFault(k) for k in kinds])


def _hook_fault(key: str, fired: int) -> dict[str, Any]:
    return {"match": {"route": "plainhook", "key": key, "type": "effect.applied"},
            "action": {"kind": "duplicate", "copies": 2, "concurrent": 1}, "fired": fired}


def test_a_delivery_fault_whose_effects_never_applied_is_untriggered_not_missing(
        tmp_path: Path) -> None:
    """Two duplicate faults armed, neither fired, and the provider applied neither effect:
    never injected, and never triggered. With one of the two effects applied (so its
    webhook was sent and the fault should have fired), it is not excused."""
    schedule = Schedule(seed=1, fault_phase_s=1.0, timed=[],
                        ops=[_op(0, "webhook_duplicate"), _op(1, "webhook_duplicate"),
                             _op(2, "late_apply")])
    hooks = {"provider": [], "webhook": [_hook_fault("k0", 0), _hook_fault("k1", 0)]}
    unapplied = {"k0": {"applied": 0}, "k2": {"applied": 1}}
    counted = metrics.injected(schedule, [], hooks, [], {}, unapplied)
    assert counted["webhook_duplicate"] == {"planned": 2, "injected": 0, "untriggered": 2}
    assert "untriggered" not in counted["late_apply"]
    assert "webhook_concurrent" not in counted  # not planned: not listed
    out = report.build(ChaosConfig(ci=True), schedule, _result(counted), tmp_path)
    assert out["faults_never_injected"] == ["late_apply", "webhook_duplicate"]
    assert out["faults_never_triggered"] == ["webhook_duplicate"]

    applied_once = metrics.injected(schedule, [], hooks, [], {}, {"k1": {"applied": 1}})
    assert applied_once["webhook_duplicate"]["untriggered"] == 1
    assert report.never_triggered(applied_once) == []


def test_a_fired_delivery_fault_is_injected() -> None:
    schedule = Schedule(seed=1, fault_phase_s=1.0, timed=[],
                        ops=[_op(0, "webhook_duplicate"), _op(1, "webhook_duplicate")])
    hooks = {"provider": [], "webhook": [_hook_fault("k0", 1), _hook_fault("k1", 0)]}
    counted = metrics.injected(schedule, [], hooks, [], {}, {"k0": {"applied": 1}})
    assert counted["webhook_duplicate"] == {"planned": 2, "injected": 1, "untriggered": 1}
    assert report.never_triggered(counted) == []
