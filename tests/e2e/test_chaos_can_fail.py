"""The harness can fail: with a guard switched off, the same seed reports the violation.

A checker that always says zero proves nothing. Each test switches off one safety mechanism
with its test-only switch and runs seed 1 again, with the faults that matter to that mechanism
(the full fault set gives the same verdict, just slower; docs/reports/proving-ground.md records
such runs):
- `EFFECTLEDGER_UNSAFE_SKIP_CLAIM=1`: dispatchers call the provider even when the attempt is
  already claimed, so every redelivered command (a killed or paused dispatcher, a crash point)
  reaches the provider again: more than one request per operation epoch, and duplicate effects
  on non-idempotent routes (with the send deadline off as well, which would otherwise refuse
  such a call whenever its claim was slow);
- `EFFECTLEDGER_UNSAFE_SKIP_WEBHOOK_VERIFICATION=1`: reconcilers accept unsigned, forged and
  expired webhooks, so the harness's lying webhooks are stored as evidence and move operations;
- `EFFECTLEDGER_UNSAFE_NO_SEND_DEADLINE=1`: a dispatcher frozen between its claim and its send
  (`pause_before_send`) sends on waking, long after the horizon, when the reconciler has decided
  `not_applied` and a new epoch applied the effect: a second effect on the type-b provider,
  which ignores the fencing token. The same run with the deadline on passes.
- `EFFECTLEDGER_UNSAFE_NATS_WITHOUT_PERMISSIONS=1`: the broker has no users or permissions, so
  the attacker's forgeries (anonymous and with an agent's credentials) reach the services and
  take effect; the same seed with permissions counts none.
"""

from __future__ import annotations

from typing import Any

import pytest

from effectledger_chaos import ChaosConfig, parse_faults, run_chaos
from effectledger_chaos.procs import database_choice

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("heavy")]
SEED = 1


def _run(tmp_path: Any, **options: Any) -> dict[str, Any]:
    cfg = ChaosConfig(seed=SEED, ci=True, database=database_choice(),
                      workdir=str(tmp_path / "run"), progress=True, progress_interval_s=15.0,
                      **options)
    return run_chaos(cfg)


def test_without_claim_before_call_duplicate_requests_are_reported(tmp_path: Any) -> None:
    """Seed 1 with claim-before-call disabled: redelivered commands call the provider again.

    The send deadline is off too: it is a guard of its own, and on a loaded host (a CI run
    beside a proving-ground run) a redelivered command's claim waited 4.4 s for a restarting
    ledger, so the deadline refused the very call that would have been the duplicate, and no
    fault of the short run was left to show the claim's absence.
    """
    report = _run(tmp_path, ops=60, duration_s=15.0, unsafe_skip_claim=True,
                  unsafe_no_send_deadline=True, faults=parse_faults("kill,pause,crash_point"))
    inv = report["invariants"]
    assert inv["duplicate_requests_per_epoch"]["count"] > 0, inv
    assert not report["invariants_ok"]


def test_without_webhook_verification_forged_webhooks_are_counted(tmp_path: Any) -> None:
    """Seed 1 with verification disabled: forged and expired webhooks change ledger state."""
    report = _run(tmp_path, ops=30, duration_s=8.0, unsafe_skip_webhook_verification=True,
                  tool_mix={"a": 0, "b": 0, "c": 1, "d": 0},
                  faults=parse_faults("webhook_forged,webhook_expired"))
    inv = report["invariants"]
    assert inv["bad_webhook_state_changes"]["count"] > 0, inv
    assert not report["invariants_ok"]


PAUSE_RUN: dict[str, Any] = dict(ops=40, duration_s=10.0, tool_mix={"a": 0, "b": 1, "c": 0, "d": 0},
                                 faults=parse_faults("pause_before_send"))


def _paused(report: dict[str, Any]) -> bool:
    return any(r["kind"] == "pause_before_send" and (r.get("result") or {}).get("hit")
               for r in report["fault_log"])


def test_without_the_send_deadline_a_dispatcher_paused_before_its_send_applies_twice(
        tmp_path: Any) -> None:
    report = _run(tmp_path, unsafe_no_send_deadline=True, **PAUSE_RUN)
    assert _paused(report), report["fault_log"]
    inv = report["invariants"]
    assert inv["duplicate_effects"]["count"] > 0, inv
    assert not report["invariants_ok"]


def test_with_the_send_deadline_the_same_pause_sends_nothing(tmp_path: Any) -> None:
    report = _run(tmp_path, **PAUSE_RUN)
    assert _paused(report), report["fault_log"]
    assert report["invariants_ok"], report["invariants"]
    # The woken dispatcher reported its attempt as not sent; the ledger, already at a later
    # epoch, journaled that outcome as stale.
    assert report["fencing"].get("outcome_rejected:stale_epoch", 0) >= 1, report["fencing"]
def test_without_nats_permissions_the_attackers_forgeries_are_counted(tmp_path: Any) -> None:
    """Seed 1, attacker only: with the product's NATS users and permissions no forgery takes
    effect; with the broker open the same rounds create operations in another tenant (and
    whatever else the live operations allowed), and invariant 11 counts them."""
    options: dict[str, Any] = dict(ops=30, duration_s=10.0, faults=parse_faults("attacker"))
    guarded = _run(tmp_path / "guarded", **options)
    assert guarded["invariants"]["forged_messages_effective"]["count"] == 0, guarded["invariants"]
    assert guarded["invariants_ok"]
    report = _run(tmp_path / "open", unsafe_nats_without_permissions=True, **options)
    inv = report["invariants"]
    assert inv["forged_messages_effective"]["count"] > 0, inv
    assert not report["invariants_ok"]
