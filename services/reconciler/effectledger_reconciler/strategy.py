"""What the reconciler does with one delivery of a `ReconcileOperation`: pure decisions.

No I/O here. The worker asks the ledger for the operation, calls `decide`, performs the one
readback `decide` may ask for, calls `after_readback`, and carries out the result: ack, nak with
a delay, publish a verdict, or dead-letter.

The reconciler never holds an operation while it waits: "wait" is a `nak(delay)` and JetStream
redelivers the command later, to this replica or another. Deadlines therefore come from the
message's own timestamps (`claimed_at`, `noticed_at`), never from delivery counts; the delivery
count only sets the backoff.

Evidence rules (docs/design.md, "Verdicts and their fencing"):
- `applied` needs a readback that found the effect;
- `not_applied` needs a readback that found nothing and was *sent* at or after the provider's
  processing horizon (`claimed_at + tool.horizon_s`): before it, a late apply is still possible,
  so "not found" only means "wait";
- everything else that cannot be settled becomes `undecidable` (human review), with the reason.
A provider webhook is applied by the ledger itself; the reconciler only gives it time to arrive.

Audit commands (cause `audit`) are handed to `audit.py`; both speak the types of
`decisions.py`, so neither imports the other's decisions back.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from effectledger_core.catalog import Tool
from effectledger_core.commands import arguments_digest, mismatch
from effectledger_core.messages import Evidence, ReconcileOperation
from effectledger_core.readbacks import ReadbackResult
from effectledger_core.states import UNRESOLVED

from . import audit
from .decisions import (
    AfterReadback,
    Decide,
    Decision,
    Done,
    NeedReadback,
    OperationView,
    Reject,
    Timing,
    Wait,
    backoff,
    bounded,
    wait_until,
)


def horizon_at(cmd: ReconcileOperation, tool: Tool) -> datetime:
    return cmd.claimed_at + timedelta(seconds=tool.horizon_s)


def deadline_at(cmd: ReconcileOperation, tool: Tool | None, timing: Timing) -> datetime:
    """When readback errors stop being retried; never before the provider's horizon."""
    deadline = cmd.claimed_at + timedelta(seconds=timing.reconcile_deadline_s)
    if tool is not None:
        deadline = max(deadline, horizon_at(cmd, tool))
    return deadline


def webhook_until(cmd: ReconcileOperation, timing: Timing) -> datetime:
    return cmd.noticed_at + timedelta(seconds=timing.webhook_wait_s)


def decide(cmd: ReconcileOperation, op: OperationView | None, tool: Tool | None, *,
           now: datetime, deliveries: int, timing: Timing) -> Decision:
    """The decision for one delivery, before any provider call.

    `op` is the ledger's answer (None: the ledger does not know the operation); `tool` is the
    catalog entry for `cmd.tool` (None: not in this reconciler's catalog).
    """
    if cmd.cause == "audit":
        return audit.decide(cmd, op, tool, now=now, deliveries=deliveries, timing=timing)
    if op is None:
        return Reject(f"the ledger does not know operation {cmd.operation_id!r}")
    if op.epoch != cmd.epoch:
        return Done(f"superseded: the ledger is at epoch {op.epoch}, this command is for "
                    f"epoch {cmd.epoch}")
    if op.state not in UNRESOLVED:
        return Done(f"already decided: the operation is {op.state}")
    wrong = command_mismatch(cmd, op)
    if wrong is not None:
        # A readback built from another tool's or other arguments would ask the provider about
        # a different effect, and its answer would decide this operation: never act on it.
        return Reject(bounded(f"the command is not the ledger's operation: {wrong}"))
    if tool is None:
        # The ledger accepted the tool, so our catalog is behind: wait for a rollout, and
        # give the operation to a human once the reconciliation deadline has passed.
        deadline = deadline_at(cmd, None, timing)
        if now >= deadline:
            return Decide("undecidable", bounded(
                f"tool {cmd.tool!r} is not in the reconciler's catalog"))
        return wait_until(deadline, now, deliveries, timing,
                           f"tool {cmd.tool!r} is not in the catalog yet")
    caps = tool.capabilities
    if caps.webhooks:
        until = webhook_until(cmd, timing)
        if now < until:
            return wait_until(until, now, deliveries, timing,
                               "waiting for a verified provider webhook")
    if caps.readback:
        return NeedReadback()
    if caps.webhooks:
        return Decide("undecidable", bounded(
            f"no verified provider webhook within {timing.webhook_wait_s:g}s of the ambiguity "
            f"notice, and the tool has no readback"))
    return Decide("undecidable", "no readback or webhook oracle")


def command_mismatch(cmd: ReconcileOperation, op: OperationView) -> str | None:
    """Why the command differs from the ledger's view of its operation, or None."""
    if op.operation_key is not None and op.operation_key != cmd.operation_key:
        return "the command's operation key is not the operation's"
    if op.tool is None:
        return None
    return mismatch(ledger_tool=op.tool, ledger_digest=op.arguments_digest, tool=cmd.tool,
                    digest_=arguments_digest(cmd.arguments))


def after_readback(cmd: ReconcileOperation, tool: Tool, answer: ReadbackResult, *,
                   sent_at: datetime, answered_at: datetime, deliveries: int,
                   timing: Timing) -> AfterReadback:
    """The decision once the readback (sent at `sent_at`) has answered at `answered_at`."""
    if cmd.cause == "audit":
        return audit.after_readback(cmd, tool, answer, answered_at=answered_at,
                                    deliveries=deliveries, timing=timing)
    horizon = horizon_at(cmd, tool)
    status = f"HTTP {answer.http_status}" if answer.http_status is not None else "no answer"
    if answer.found is True and answer.matches is not None and answer.matches > 1:
        # More than one effect for one key: the provider applied the request more than once.
        # That is not a quiet "applied": the ledger records duplicate_detected and a human
        # decides (refund, cancel the extra effect) from the review queue.
        return Decide("undecidable", bounded(
            f"duplicate_detected: the provider's readback lists {answer.matches} effects for "
            f"this operation key"), Evidence(
                source="readback", at=answered_at, provider_ref=answer.provider_ref,
                digest=answer.evidence_digest, matches=answer.matches,
                provider_refs=list(answer.provider_refs) or None,
                detail=f"readback found {answer.matches} effects for one key ({status})"))
    if answer.found is True:
        return Decide("applied", "the provider's readback shows the effect", Evidence(
            source="readback", at=answered_at, provider_ref=answer.provider_ref,
            digest=answer.evidence_digest, detail=f"readback found the effect ({status})"),
            result=answer.result)
    if answer.found is False:
        if sent_at >= horizon:
            after = (sent_at - cmd.claimed_at).total_seconds()
            return Decide("not_applied", "the provider's readback after its processing horizon "
                          "shows no effect", Evidence(
                              source="readback", at=answered_at, digest=answer.evidence_digest,
                              detail=bounded(
                                  f"readback found nothing ({status}), sent {after:.3f}s after "
                                  f"the attempt started; provider horizon {tool.horizon_s:g}s")))
        # Before the horizon the provider may still apply it (a late apply): look again then.
        return wait_until(horizon, answered_at, deliveries, timing,
                           "not found yet, before the provider's processing horizon")
    error = answer.error or "the readback could not tell"
    deadline = deadline_at(cmd, tool, timing)
    if answered_at >= deadline:
        return Decide("undecidable", bounded(
            f"readback kept failing until the reconciliation deadline "
            f"({timing.reconcile_deadline_s:g}s after the attempt started): {error}"))
    return wait_until(deadline, answered_at, deliveries, timing,
                       bounded(f"readback failed: {error}"))


def ledger_unavailable(deliveries: int, timing: Timing) -> Wait:
    """The ledger did not answer: nothing can be decided safely without it; try later."""
    return Wait(backoff(deliveries, timing), "the ledger did not answer")
