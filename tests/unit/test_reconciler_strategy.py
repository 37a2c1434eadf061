"""The reconciler's pure decisions: every capability, state, epoch and point in time.

No I/O: the ledger's answer, the catalog entry, the clock and the readback answer are values.
The invariants at the end run over the whole grid of inputs; the scenario tests replay a delivery
loop with a fake clock and a fake provider (including a provider that applies late).
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from effectledger_core.catalog import Capabilities, Readback, Tool
from effectledger_core.digest import digest
from effectledger_core.messages import ReconcileOperation
from effectledger_core.readbacks import ReadbackResult
from effectledger_core.states import State
from effectledger_reconciler import decisions, strategy
from effectledger_reconciler.decisions import (
    Decide,
    Done,
    NeedReadback,
    OperationView,
    Reject,
    Timing,
    Wait,
    backoff,
)
from effectledger_reconciler.strategy import after_readback, decide

T0 = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)
HORIZON = 10.0
NOTICED = 6.0  # the ambiguity was noticed 6 s after the attempt started
TIMING = Timing(reconcile_deadline_s=600.0, webhook_wait_s=30.0, backoff_base_s=0.5,
                backoff_cap_s=30.0)
OPEN = ("ambiguous", "awaiting_confirmation")
FOUND = ReadbackResult(True, provider_ref="eff_1", evidence_digest="sha256:aa", http_status=200)
NOT_FOUND = ReadbackResult(False, evidence_digest="sha256:bb", http_status=404)
ERROR = ReadbackResult(None, http_status=500, error="unexpected readback status 500")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make_tool(*, readback: bool = False, webhooks: bool = False,
              horizon_s: float = HORIZON) -> Tool:
    return Tool(name="t", endpoint="http://provider/x", contract_revision="1",
                capabilities=Capabilities(readback=readback, webhooks=webhooks),
                readback=Readback(url="http://provider/by-key/{operation_key}")
                if readback else None, horizon_s=horizon_s,
                webhook_provider="sandbox" if webhooks else None)


def make_cmd(*, epoch: int = 2, cause: str = "ambiguous") -> ReconcileOperation:
    return ReconcileOperation(operation_id="op1", epoch=epoch, attempt_id="a1",
                              operation_key="k1", tool="t", arguments={}, cause=cause,
                              claimed_at=T0, noticed_at=at(NOTICED))


def view(state: str = "ambiguous", epoch: int = 2) -> OperationView:
    return OperationView(id="op1", state=state, epoch=epoch, operation_key="k1", tool="t")


def run_decide(tool: Tool | None, now: float, *, op: OperationView | None = None,
               deliveries: int = 1, cmd: ReconcileOperation | None = None) -> Any:
    return decide(cmd or make_cmd(), op if op is not None else view(), tool, now=at(now),
                  deliveries=deliveries, timing=TIMING)


def run_after(tool: Tool, answer: ReadbackResult, sent: float, answered: float | None = None,
              deliveries: int = 1) -> Decide | Wait:
    return after_readback(make_cmd(), tool, answer, sent_at=at(sent),
                          answered_at=at(answered if answered is not None else sent),
                          deliveries=deliveries, timing=TIMING)


# -- the ledger's view decides whether there is anything to do ---------------------------------

def test_an_operation_unknown_to_the_ledger_is_rejected_to_the_dead_letters() -> None:
    d = decide(make_cmd(), None, make_tool(readback=True), now=at(20), deliveries=1,
               timing=TIMING)
    assert isinstance(d, Reject) and "op1" in d.reason


@pytest.mark.parametrize("ledger_epoch", [1, 3, 7])
def test_a_command_for_another_epoch_is_done_without_any_work(ledger_epoch: int) -> None:
    d = run_decide(make_tool(readback=True), 20, op=view(epoch=ledger_epoch))
    assert isinstance(d, Done) and f"epoch {ledger_epoch}" in d.reason


@pytest.mark.parametrize("state", [s.value for s in State if s.value not in OPEN])
def test_an_operation_no_longer_waiting_for_a_verdict_is_done(state: str) -> None:
    d = run_decide(make_tool(readback=True, webhooks=True), 20, op=view(state=state))
    assert d == Done(f"already decided: the operation is {state}")


@pytest.mark.parametrize("ledger", [
    OperationView(id="op1", state=State.AMBIGUOUS, epoch=2, operation_key="k1", tool="other"),
    OperationView(id="op1", state=State.AMBIGUOUS, epoch=2, operation_key="k9", tool="t"),
    OperationView(id="op1", state=State.AMBIGUOUS, epoch=2, operation_key="k1", tool="t",
                  arguments_digest=digest({"amount": 1})),
])
def test_a_command_that_is_not_the_ledgers_operation_is_rejected_before_any_readback(
        ledger: OperationView) -> None:
    """Another tool, key or arguments than the ledger's: a readback would ask the provider
    about another effect, so the command goes to the dead letters instead."""
    d = run_decide(make_tool(readback=True), 20, op=ledger)
    assert isinstance(d, Reject) and "not the ledger's operation" in d.reason


def test_a_command_matching_the_ledgers_digest_is_read_back() -> None:
    ledger = OperationView(id="op1", state=State.AMBIGUOUS, epoch=2, operation_key="k1", tool="t",
                           arguments_digest=digest({}))
    assert isinstance(run_decide(make_tool(readback=True), 20, op=ledger), NeedReadback)


# -- strategy by capability -------------------------------------------------------------------

@pytest.mark.parametrize("state", OPEN)
@pytest.mark.parametrize("now", [NOTICED, 1e6])
def test_no_readback_and_no_webhook_is_undecidable_at_once(state: str, now: float) -> None:
    d = run_decide(make_tool(), now, op=view(state=state))
    assert d == Decide("undecidable", "no readback or webhook oracle")


@pytest.mark.parametrize("now", [NOTICED, 15.0, 40.0, 1e6])
def test_readback_tool_reads_back_at_once(now: float) -> None:
    assert isinstance(run_decide(make_tool(readback=True), now), NeedReadback)


@pytest.mark.parametrize("readback", [False, True])
def test_webhook_tool_waits_for_a_webhook_until_noticed_plus_the_wait(readback: bool) -> None:
    tool = make_tool(webhooks=True, readback=readback)
    until = NOTICED + TIMING.webhook_wait_s
    for now, deliveries in ((NOTICED, 1), (20.0, 5), (until - 0.001, 9)):
        d = run_decide(tool, now, deliveries=deliveries)
        assert isinstance(d, Wait) and "webhook" in d.reason
        # Never past the end of the wait (plus slack), never longer than the backoff.
        assert 0 < d.delay_s <= min(backoff(deliveries, TIMING),
                                    until - now + decisions.BOUNDARY_SLACK_S) + 1e-9


def test_webhook_tool_with_readback_falls_back_to_readback_after_the_wait() -> None:
    tool = make_tool(webhooks=True, readback=True)
    assert isinstance(run_decide(tool, NOTICED + TIMING.webhook_wait_s), NeedReadback)


def test_webhook_only_tool_is_undecidable_after_the_wait_with_the_reason() -> None:
    d = run_decide(make_tool(webhooks=True), NOTICED + TIMING.webhook_wait_s)
    assert isinstance(d, Decide) and d.verdict == "undecidable" and d.evidence is None
    assert "no verified provider webhook within 30s" in d.reason and "no readback" in d.reason


def test_a_tool_missing_from_the_catalog_waits_until_the_deadline_then_needs_review() -> None:
    d = run_decide(None, 20.0, deliveries=3)
    assert isinstance(d, Wait) and d.delay_s == backoff(3, TIMING)
    d = run_decide(None, TIMING.reconcile_deadline_s - 0.01, deliveries=30)
    assert isinstance(d, Wait) and d.delay_s <= 0.01 + decisions.BOUNDARY_SLACK_S + 1e-9
    d = run_decide(None, TIMING.reconcile_deadline_s)
    assert isinstance(d, Decide) and d.verdict == "undecidable" and "catalog" in d.reason


# -- after a readback -------------------------------------------------------------------------

@pytest.mark.parametrize("sent", [0.5, HORIZON - 0.1, HORIZON, 500.0, 1e6])
def test_found_is_applied_with_the_readback_evidence_at_any_time(sent: float) -> None:
    d = run_after(make_tool(readback=True), FOUND, sent, sent + 0.2)
    assert isinstance(d, Decide) and d.verdict == "applied"
    assert d.evidence is not None and d.evidence.source == "readback"
    assert (d.evidence.provider_ref, d.evidence.digest) == ("eff_1", "sha256:aa")
    assert d.evidence.at == at(sent + 0.2)


@pytest.mark.parametrize("sent", [0.0, 3.0, HORIZON - 0.001])
def test_not_found_before_the_horizon_waits_for_the_horizon(sent: float) -> None:
    d = run_after(make_tool(readback=True), NOT_FOUND, sent)
    assert isinstance(d, Wait) and "horizon" in d.reason
    assert d.delay_s <= HORIZON - sent + decisions.BOUNDARY_SLACK_S + 1e-9


def test_not_found_sent_before_but_answered_after_the_horizon_still_waits() -> None:
    """The readback must be *sent* after the horizon; a slow answer does not count."""
    d = run_after(make_tool(readback=True), NOT_FOUND, HORIZON - 1, HORIZON + 5)
    assert isinstance(d, Wait)
    assert d.delay_s == decisions.MIN_DELAY_S


@pytest.mark.parametrize("sent", [HORIZON, HORIZON + 0.001, 400.0, 1e6])
def test_not_found_sent_at_or_after_the_horizon_is_not_applied(sent: float) -> None:
    d = run_after(make_tool(readback=True), NOT_FOUND, sent, sent + 0.3)
    assert isinstance(d, Decide) and d.verdict == "not_applied"
    assert d.evidence is not None and d.evidence.source == "readback"
    assert d.evidence.digest == "sha256:bb" and d.evidence.provider_ref is None
    assert "horizon 10s" in d.evidence.detail


def test_readback_errors_are_retried_until_the_deadline_then_need_review() -> None:
    tool = make_tool(readback=True)
    d = run_after(tool, ERROR, 20.0, deliveries=4)
    assert isinstance(d, Wait) and d.delay_s == backoff(4, TIMING)
    assert "unexpected readback status 500" in d.reason
    d = run_after(tool, ERROR, 599.9, deliveries=40)
    assert isinstance(d, Wait) and d.delay_s <= 0.1 + decisions.BOUNDARY_SLACK_S + 1e-9
    d = run_after(tool, ERROR, 590.0, 600.0)
    assert isinstance(d, Decide) and d.verdict == "undecidable"
    assert "reconciliation deadline" in d.reason and "status 500" in d.reason


def test_the_deadline_is_never_before_the_horizon() -> None:
    tool = make_tool(readback=True, horizon_s=900.0)  # longer than the 600 s deadline
    d = run_after(tool, ERROR, 700.0)
    assert isinstance(d, Wait)
    d = run_after(tool, ERROR, 900.0)
    assert isinstance(d, Decide) and d.verdict == "undecidable"


def test_reasons_are_bounded() -> None:
    long_error = ReadbackResult(None, error="x" * 5000)
    d = run_after(make_tool(readback=True), long_error, 1e6)
    assert isinstance(d, Decide) and len(d.reason) <= decisions.MAX_REASON
    d = run_after(make_tool(readback=True), long_error, 20.0)
    assert isinstance(d, Wait) and len(d.reason) <= decisions.MAX_REASON


def test_backoff_grows_from_the_base_and_is_capped() -> None:
    delays = [backoff(n, TIMING) for n in range(0, 60)]
    assert delays[0] == delays[1] == 0.5 and delays[2] == 1.0 and delays[3] == 2.0
    assert delays == sorted(delays) and max(delays) == TIMING.backoff_cap_s


def test_ledger_unavailable_waits_with_backoff() -> None:
    assert strategy.ledger_unavailable(3, TIMING) == Wait(2.0, "the ledger did not answer")


# -- scenarios: a delivery loop with a fake clock and a fake provider -------------------------

class FakeProvider:
    """Applies the effect at `applies_at` (None: never); readbacks may fail until `fails_until`."""

    def __init__(self, applies_at: float | None, fails_until: float = -1.0) -> None:
        self.applies_at = applies_at
        self.fails_until = fails_until
        self.readbacks: list[float] = []

    def readback(self, now: float) -> ReadbackResult:
        self.readbacks.append(now)
        if now < self.fails_until:
            return ERROR
        if self.applies_at is not None and now >= self.applies_at:
            return FOUND
        return NOT_FOUND


def reconcile(tool: Tool, provider: FakeProvider, *, start: float = NOTICED,
              readback_takes: float = 0.05, max_deliveries: int = 500) -> tuple[Decide, float]:
    """Redeliver the command (nak delays advance the clock) until a verdict; (verdict, time)."""
    now = start
    for deliveries in range(1, max_deliveries + 1):
        d = run_decide(tool, now, deliveries=deliveries)
        if isinstance(d, NeedReadback):
            answer = provider.readback(now)
            d = run_after(tool, answer, now, now + readback_takes, deliveries)
            now += readback_takes
        if isinstance(d, Decide):
            return d, now
        assert isinstance(d, Wait) and d.delay_s > 0
        now += d.delay_s
    raise AssertionError("no verdict")


@pytest.mark.parametrize("applies_at", [NOTICED + 0.1, 7.3, HORIZON - 0.01])
def test_late_apply_before_the_horizon_is_applied_never_not_applied(applies_at: float) -> None:
    provider = FakeProvider(applies_at=applies_at)
    verdict, when = reconcile(make_tool(readback=True), provider)
    assert verdict.verdict == "applied" and when >= applies_at
    assert provider.readbacks[0] == NOTICED  # looked at once, found nothing, waited


def test_never_applied_is_not_applied_only_by_a_readback_sent_after_the_horizon() -> None:
    provider = FakeProvider(applies_at=None)
    verdict, _ = reconcile(make_tool(readback=True), provider)
    assert verdict.verdict == "not_applied"
    assert provider.readbacks[-1] >= HORIZON
    assert all(t < HORIZON for t in provider.readbacks[:-1])
    # The wait ends just after the horizon, not a full backoff later.
    assert provider.readbacks[-1] <= HORIZON + decisions.BOUNDARY_SLACK_S + 0.1


def test_readback_outage_then_recovery_decides_by_the_readback() -> None:
    provider = FakeProvider(applies_at=2.0, fails_until=120.0)
    verdict, when = reconcile(make_tool(readback=True), provider)
    assert verdict.verdict == "applied" and when >= 120.0


def test_readback_outage_past_the_deadline_needs_review() -> None:
    provider = FakeProvider(applies_at=2.0, fails_until=1e9)
    verdict, when = reconcile(make_tool(readback=True), provider)
    assert verdict.verdict == "undecidable"
    assert TIMING.reconcile_deadline_s <= when <= TIMING.reconcile_deadline_s + 1


def test_webhook_and_readback_tool_reads_back_only_after_the_webhook_wait() -> None:
    provider = FakeProvider(applies_at=3.0)
    verdict, _ = reconcile(make_tool(webhooks=True, readback=True), provider)
    assert verdict.verdict == "applied"
    assert provider.readbacks and provider.readbacks[0] >= NOTICED + TIMING.webhook_wait_s


# -- invariants over the whole grid -----------------------------------------------------------

STATES = [s.value for s in State]
TIMES = [0.0, NOTICED, HORIZON - 0.01, HORIZON, 20.0, NOTICED + TIMING.webhook_wait_s - 0.01,
         NOTICED + TIMING.webhook_wait_s, 599.99, 600.0, 1e6]


@pytest.mark.parametrize("readback,webhooks", list(itertools.product([False, True], repeat=2)))
def test_decide_invariants_over_states_epochs_and_times(readback: bool, webhooks: bool) -> None:
    tool = make_tool(readback=readback, webhooks=webhooks)
    for state, epoch, now, deliveries in itertools.product(STATES, (1, 2, 3), TIMES, (1, 4, 50)):
        d = run_decide(tool, now, op=view(state=state, epoch=epoch), deliveries=deliveries)
        if epoch != 2 or state not in OPEN:
            assert isinstance(d, Done)
            continue
        # Without a readback answer nothing is ever found applied or not applied.
        assert not (isinstance(d, Decide) and d.verdict != "undecidable")
        if isinstance(d, NeedReadback):
            assert readback
            assert not webhooks or now >= NOTICED + TIMING.webhook_wait_s
        if isinstance(d, Wait):
            assert webhooks and now < NOTICED + TIMING.webhook_wait_s
            assert decisions.MIN_DELAY_S <= d.delay_s <= TIMING.backoff_cap_s
        if isinstance(d, Decide):
            assert not readback
            assert not webhooks or now >= NOTICED + TIMING.webhook_wait_s


@pytest.mark.parametrize("answer", [FOUND, NOT_FOUND, ERROR], ids=["found", "absent", "error"])
def test_after_readback_invariants(answer: ReadbackResult) -> None:
    tool = make_tool(readback=True)
    for sent, took, deliveries in itertools.product(TIMES, (0.0, 0.5, 30.0), (1, 3, 80)):
        d = run_after(tool, answer, sent, sent + took, deliveries)
        if isinstance(d, Wait):
            assert decisions.MIN_DELAY_S <= d.delay_s <= TIMING.backoff_cap_s
            assert answer is not FOUND
            continue
        if d.verdict == "applied":
            assert answer is FOUND
        elif d.verdict == "not_applied":
            assert answer is NOT_FOUND and sent >= HORIZON  # the evidence rule
        else:
            assert answer is ERROR and sent + took >= TIMING.reconcile_deadline_s
        if answer is NOT_FOUND:
            assert (d.verdict == "not_applied") == (sent >= HORIZON)


@pytest.mark.parametrize("sent", [NOTICED, HORIZON + 1])
def test_two_matches_are_a_duplicate_for_review_never_a_quiet_applied(sent: float) -> None:
    """A readback listing two effects for one key: undecidable (the review queue), with the
    count in the evidence, whenever the readback ran."""
    dup = ReadbackResult(True, provider_ref="cus_1", evidence_digest="sha256:cc", http_status=200,
                         matches=2, provider_refs=("cus_1", "cus_2"))
    d = run_after(make_tool(readback=True), dup, sent)
    assert isinstance(d, Decide) and d.verdict == "undecidable"
    assert d.reason.startswith("duplicate_detected")
    assert d.evidence is not None and d.evidence.matches == 2
    # Every effect listed, not only the first: what an operator refunds or deletes.
    assert (d.evidence.provider_ref, d.evidence.provider_refs) == ("cus_1", ["cus_1", "cus_2"])


def test_one_match_is_applied() -> None:
    one = ReadbackResult(True, provider_ref="cus_1", evidence_digest="sha256:cc", http_status=200,
                         matches=1)
    d = run_after(make_tool(readback=True), one, NOTICED)
    assert isinstance(d, Decide) and d.verdict == "applied"
