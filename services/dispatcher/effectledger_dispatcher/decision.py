"""What the dispatcher does with a claim reply: a pure decision, no I/O.

| claim reply                                       | decision                                   |
|---------------------------------------------------|--------------------------------------------|
| none (the ledger did not answer, or refused)      | `Nak`, doubling from the delivery count    |
| granted                                           | `Attempt` (the one provider call)          |
| granted, but for another tool or other arguments  | `Ack` (refused: nothing is sent)           |
| already claimed, outcome recorded                 | `Ack` (a duplicate of a finished attempt)  |
| already claimed, claimer may still be mid-call    | `Nak` until its call must have ended       |
| already claimed, claimer overdue                  | `DeclareLost` (ambiguous; never a call)    |
| not found, first or second delivery               | `Nak`, shortly (see below)                 |
| stale epoch, not claimable, not found, mismatch   | `Ack` (the ledger journaled the refusal)   |

"Mid-call" is judged by the tool's timeout plus `LOST_GRACE_S`: a duplicate delivery (a sweeper
republish, a redelivery) while the claimer may still be calling the provider comes back once
that call must have ended, rather than declaring a live attempt lost.

"Not found" on a first or second delivery: the ledger publishes an agent's command with its
intent's commit, not after it (docs/design.md, "A command published with its commit"), so a
claim can reach a ledger replica that does not see that commit yet (a commit normally lands
within a millisecond of the claim's arrival, a WAL flush that stalls within tens). The command
comes back after `NOT_FOUND_RETRIES_S[delivery - 1]`; not found a third time, it is a command
whose intent was never written (its statement found the key taken, or failed) and is dropped,
with nothing sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from effectledger_bus.backoff import nak_backoff
from effectledger_core.commands import mismatch
from effectledger_core.messages import ClaimReply, ClaimStatus

# Beyond a tool's timeout, how long a claim may go unanswered before it is presumed lost.
LOST_GRACE_S = 5.0
# Redelivery pauses while the ledger does not answer claims: 1 s doubling, at most 10 s.
UNANSWERED_BASE_S = 1.0
UNANSWERED_CAP_S = 10.0
# Past the claimer's patience, a little slack so the nak does not land right at the boundary.
PATIENCE_SLACK_S = 0.5
# A command whose operation a claim did not find: asked again this much later, by delivery
# (its intent's commit may not have been visible to the ledger that answered), then dropped.
NOT_FOUND_RETRIES_S = (0.02, 0.25)


@dataclass(frozen=True, slots=True)
class Attempt:
    """Call the provider once under `attempt_id`."""

    attempt_id: str
    unsafe: bool = False  # claim-before-call switched off and the claim is held by another


@dataclass(frozen=True, slots=True)
class Ack:
    reason: Literal["duplicate", "stale", "command_mismatch"]


@dataclass(frozen=True, slots=True)
class Nak:
    delay_s: float
    reason: Literal["claim_unanswered", "claimer_may_be_mid_call", "not_found_yet"]


@dataclass(frozen=True, slots=True)
class DeclareLost:
    """Publish an ambiguous outcome for `attempt_id`: claimed, never reported."""

    attempt_id: str


Decision = Attempt | Ack | Nak | DeclareLost


def decide(reply: ClaimReply | None, *, attempt_id: str, deliveries: int,
           tool_timeout_s: float, skip_claim: bool = False, tool: str | None = None,
           arguments_digest: str | None = None) -> Decision:
    """The dispatcher's next step for one command, from the ledger's claim reply.

    `tool` and `arguments_digest` are those of the command about to be sent (the digest computed
    here from its arguments, not copied from the message): a grant for anything else is refused.
    """
    if reply is None:
        return Nak(nak_backoff(deliveries, base_s=UNANSWERED_BASE_S, cap_s=UNANSWERED_CAP_S),
                   "claim_unanswered")
    if reply.status is ClaimStatus.GRANTED:
        if tool is not None and reply.tool is not None and mismatch(
                ledger_tool=reply.tool, ledger_digest=reply.arguments_digest, tool=tool,
                digest_=arguments_digest) is not None:
            # The claim stays unreported; the lost-outcome sweep hands it to reconciliation,
            # which finds nothing sent. Calling would run a command the ledger never accepted.
            return Ack("command_mismatch")
        return Attempt(reply.attempt_id or attempt_id)
    if reply.status is ClaimStatus.NOT_FOUND and deliveries <= len(NOT_FOUND_RETRIES_S):
        return Nak(NOT_FOUND_RETRIES_S[max(deliveries, 1) - 1], "not_found_yet")
    if reply.status is not ClaimStatus.ALREADY_CLAIMED:
        return Ack("stale")
    if skip_claim:
        # The guard this whole service exists for, switched off: only the chaos harness's
        # "can it fail" runs do this, to prove that duplicates would be detected.
        return Attempt(reply.attempt_id or attempt_id, unsafe=True)
    if reply.outcome_recorded:
        return Ack("duplicate")
    patience = tool_timeout_s + LOST_GRACE_S
    if reply.claim_age_s is not None and reply.claim_age_s < patience:
        return Nak(patience - reply.claim_age_s + PATIENCE_SLACK_S, "claimer_may_be_mid_call")
    # Someone claimed this epoch and never reported: nobody can know whether the provider saw
    # the request, so it is ambiguous. The provider is never called here.
    if reply.attempt_id is None:
        raise ValueError("an already_claimed reply must name the attempt that holds the claim")
    return DeclareLost(reply.attempt_id)
