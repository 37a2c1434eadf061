"""The dispatcher's pure decision: claim reply → attempt, nak with delay, ack or declare lost."""

from __future__ import annotations

import pytest

from effectledger_core.messages import ClaimReply, ClaimStatus
from effectledger_dispatcher.decision import (
    LOST_GRACE_S,
    NOT_FOUND_RETRIES_S,
    Ack,
    Attempt,
    DeclareLost,
    Nak,
    decide,
)

TIMEOUT_S = 5.0


def reply(status: ClaimStatus, **extra: object) -> ClaimReply:
    return ClaimReply.model_validate(
        {"status": status, "operation_id": "op1", "epoch": 1, **extra})


def test_a_granted_claim_is_attempted_under_the_ledgers_attempt_id() -> None:
    step = decide(reply(ClaimStatus.GRANTED, attempt_id="a-ledger"), attempt_id="a-mine",
                  deliveries=1, tool_timeout_s=TIMEOUT_S)
    assert step == Attempt("a-ledger")


@pytest.mark.parametrize(("deliveries", "delay"), [(1, 1.0), (2, 2.0), (3, 4.0), (5, 10.0),
                                                   (40, 10.0)])
def test_no_claim_reply_naks_with_a_doubling_capped_delay(deliveries: int, delay: float) -> None:
    assert decide(None, attempt_id="a", deliveries=deliveries, tool_timeout_s=TIMEOUT_S) \
        == Nak(delay, "claim_unanswered")


@pytest.mark.parametrize("status", [ClaimStatus.STALE_EPOCH, ClaimStatus.NOT_CLAIMABLE,
                                    ClaimStatus.NOT_FOUND, ClaimStatus.COMMAND_MISMATCH])
def test_a_refused_claim_is_acked_without_a_call(status: ClaimStatus) -> None:
    assert decide(reply(status), attempt_id="a", deliveries=3, tool_timeout_s=TIMEOUT_S) \
        == Ack("stale")


@pytest.mark.parametrize("status", [ClaimStatus.STALE_EPOCH, ClaimStatus.NOT_CLAIMABLE,
                                    ClaimStatus.COMMAND_MISMATCH])
def test_a_refusal_on_a_first_delivery_is_acked_too(status: ClaimStatus) -> None:
    assert decide(reply(status), attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S) \
        == Ack("stale")


def test_not_found_is_asked_again_shortly_twice_then_dropped() -> None:
    """The command travels with its intent's commit: a replica that does not see the commit
    yet answers not found, and the command comes back shortly (later the second time, past a
    stalled WAL flush); a third not found drops it."""
    steps = [decide(reply(ClaimStatus.NOT_FOUND), attempt_id="a", deliveries=n,
                    tool_timeout_s=TIMEOUT_S) for n in (1, 2, 3)]
    assert steps == [Nak(0.02, "not_found_yet"), Nak(0.25, "not_found_yet"), Ack("stale")]
    assert NOT_FOUND_RETRIES_S == (0.02, 0.25)


def test_a_duplicate_of_a_finished_attempt_is_acked() -> None:
    held = reply(ClaimStatus.ALREADY_CLAIMED, attempt_id="other", outcome_recorded=True,
                 claim_age_s=999.0)
    assert decide(held, attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S) \
        == Ack("duplicate")


def test_a_claimer_that_may_still_be_calling_is_waited_for_not_declared_lost() -> None:
    held = reply(ClaimStatus.ALREADY_CLAIMED, attempt_id="other", claim_age_s=2.0)
    step = decide(held, attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S)
    assert isinstance(step, Nak) and step.reason == "claimer_may_be_mid_call"
    # It comes back just after the claimer's call must have ended.
    assert 2.0 + step.delay_s > TIMEOUT_S + LOST_GRACE_S


def test_an_overdue_claimer_is_declared_lost_under_its_own_attempt_id() -> None:
    held = reply(ClaimStatus.ALREADY_CLAIMED, attempt_id="other",
                 claim_age_s=TIMEOUT_S + LOST_GRACE_S)
    assert decide(held, attempt_id="a", deliveries=9, tool_timeout_s=TIMEOUT_S) \
        == DeclareLost("other")


def test_with_claim_before_call_switched_off_a_held_claim_is_attempted_anyway() -> None:
    held = reply(ClaimStatus.ALREADY_CLAIMED, attempt_id="other", outcome_recorded=True)
    assert decide(held, attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S,
                  skip_claim=True) == Attempt("other", unsafe=True)


def test_an_already_claimed_reply_without_its_attempt_is_an_error_not_a_guess() -> None:
    held = reply(ClaimStatus.ALREADY_CLAIMED, claim_age_s=999.0)
    with pytest.raises(ValueError, match="must name the attempt"):
        decide(held, attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S)


def test_a_grant_for_other_arguments_than_those_about_to_be_sent_is_refused() -> None:
    grant = reply(ClaimStatus.GRANTED, attempt_id="a", tool="send_email",
                  arguments_digest="sha256:ledger")
    assert decide(grant, attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S,
                  tool="send_email", arguments_digest="sha256:forged") \
        == Ack("command_mismatch")
    assert decide(grant, attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S,
                  tool="wire_funds", arguments_digest="sha256:ledger") \
        == Ack("command_mismatch")
    assert decide(grant, attempt_id="a", deliveries=1, tool_timeout_s=TIMEOUT_S,
                  tool="send_email", arguments_digest="sha256:ledger") == Attempt("a")
