"""The duplicate audit's pure decisions: when it reads, and what it reports."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from effectledger_core.catalog import Capabilities, Readback, Tool
from effectledger_core.messages import ReconcileOperation
from effectledger_core.readbacks import ReadbackResult
from effectledger_core.states import State
from effectledger_reconciler.decisions import (
    Decide,
    Done,
    NeedReadback,
    OperationView,
    Reject,
    Timing,
    Wait,
)
from effectledger_reconciler.strategy import after_readback, decide

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
TIMING = Timing(reconcile_deadline_s=600.0, audit_slack_s=20.0)
HORIZON = 10.0
DUE = HORIZON + 20.0


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def tool(count: bool = True) -> Tool:
    return Tool(name="t", endpoint="http://provider/x", contract_revision="1",
                capabilities=Capabilities(readback=True), horizon_s=HORIZON,
                readback=Readback(url="http://provider/s?k={operation_key}",
                                  count_path="$.data[*]" if count else None))


CMD = ReconcileOperation(operation_id="op1", epoch=1, attempt_id="audit:op1:1",
                         operation_key="k1", tool="t", arguments={}, cause="audit",
                         claimed_at=T0, noticed_at=at(HORIZON))


def run(state: str | None, now: float, t: Tool | None = None) -> Any:
    op = None if state is None else OperationView(id="op1", state=state, epoch=2)
    return decide(CMD, op, t or tool(), now=at(now), deliveries=1, timing=TIMING)


def test_the_audit_waits_for_the_horizon_plus_slack_then_reads() -> None:
    wait = run("succeeded", HORIZON + 1)
    assert isinstance(wait, Wait) and wait.delay_s <= DUE - HORIZON - 1 + 0.1
    assert isinstance(run("succeeded", DUE), NeedReadback)


@pytest.mark.parametrize("state", ["pending", "in_flight", "ambiguous"])
def test_the_audit_waits_while_the_operation_moves(state: str) -> None:
    assert isinstance(run(state, DUE + 1), Wait)


@pytest.mark.parametrize("state", ["failed", "cancelled", "needs_review"])
def test_the_audit_reads_only_succeeded_operations(state: str) -> None:
    assert isinstance(run(state, DUE + 1), Done)


def test_a_tool_whose_readback_cannot_count_is_not_audited() -> None:
    assert isinstance(run("succeeded", DUE + 1, tool(count=False)), Done)
    assert isinstance(run(None, DUE + 1), Reject)


def after(answer: ReadbackResult, when: float = DUE + 1) -> Any:
    return after_readback(CMD, tool(), answer, sent_at=at(when), answered_at=at(when),
                          deliveries=1, timing=TIMING)


def test_two_effects_are_reported_as_duplicate_detected() -> None:
    d = after(ReadbackResult(True, provider_ref="cus_1", evidence_digest="sha256:d",
                             http_status=200, matches=2, provider_refs=("cus_1", "cus_2")))
    assert isinstance(d, Decide) and d.verdict == "undecidable"
    assert d.evidence is not None and d.evidence.matches == 2
    assert d.evidence.provider_refs == ["cus_1", "cus_2"]
    assert d.reason.startswith("duplicate_detected")


def test_a_retry_decided_applied_is_audited_from_its_own_claim() -> None:
    """The retry's own request may land after the first epoch's audit looked: the ledger
    audits the retry's epoch too, and that audit waits for the retry's horizon, not the
    first claim's, then counts; an effect landing between the two audits is seen."""
    retried_at = 25.0  # epoch 2 claimed; epoch 1's audit is due at DUE (30 s)
    retry = CMD.model_copy(update={"epoch": 2, "attempt_id": "audit:op1:2",
                                   "claimed_at": at(retried_at)})
    view = OperationView(id="op1", state=State.SUCCEEDED, epoch=2)
    first_due = decide(CMD, view, tool(), now=at(DUE), deliveries=1, timing=TIMING)
    assert isinstance(first_due, NeedReadback)  # epoch 1's audit reads at 30 s: one effect
    early = decide(retry, view, tool(), now=at(DUE), deliveries=1, timing=TIMING)
    assert isinstance(early, Wait)  # the retry's audit is not due before 25 + 10 + 20 s
    due = decide(retry, view, tool(), now=at(retried_at + DUE), deliveries=1, timing=TIMING)
    assert isinstance(due, NeedReadback)
    late = after_readback(retry, tool(), ReadbackResult(
        True, provider_ref="cus_1", matches=2, provider_refs=("cus_1", "cus_2")),
        sent_at=at(retried_at + DUE), answered_at=at(retried_at + DUE), deliveries=1,
        timing=TIMING)
    assert isinstance(late, Decide) and late.verdict == "undecidable"
    assert late.evidence is not None and late.evidence.provider_refs == ["cus_1", "cus_2"]


@pytest.mark.parametrize("matches", [0, 1])
def test_one_effect_or_none_is_nothing_to_report(matches: int) -> None:
    assert isinstance(after(ReadbackResult(matches > 0, matches=matches)), Done)


def test_a_failing_audit_readback_retries_then_gives_up_without_a_verdict() -> None:
    err = ReadbackResult(None, error="HTTP 500")
    assert isinstance(after(err), Wait)
    assert isinstance(after(err, DUE + TIMING.reconcile_deadline_s + 1), Done)
