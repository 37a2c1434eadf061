"""The duplicate detector: one re-read after the provider's horizon, when a retry was decided
on "not found" evidence. Pure decisions, like strategy.py, in the types of decisions.py.

A readback that found nothing after the declared horizon lets the ledger retry a
non-idempotent call under a new epoch. If the provider breaks its horizon and applies the
first request late, the key ends with two effects while every record says `succeeded`. So the
ledger sends an audit command (`ReconcileOperation`, cause `audit`) for the epoch it gave up
on, and the reconciler, once the operation has come to rest and
`claimed_at + horizon_s + audit slack` has passed, counts the effects for the key once
(`readback.count_path`). More than one is reported as `duplicate_detected` (an `undecidable`
verdict whose evidence carries `matches`; the ledger records it on the succeeded operation
without changing its state). Audits are as frequent as those retries, which the ledger's
retry budget already bounds.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from effectledger_core.catalog import Tool
from effectledger_core.messages import Evidence, ReconcileOperation
from effectledger_core.readbacks import ReadbackResult
from effectledger_core.states import AT_REST, State

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
    wait_until,
)

# States in which the operation is still moving: the audit waits for it to come to rest.
MOVING = frozenset(State) - AT_REST


def due_at(cmd: ReconcileOperation, tool: Tool, timing: Timing) -> datetime:
    return cmd.claimed_at + timedelta(seconds=tool.horizon_s + timing.audit_slack_s)


def auditable(tool: Tool) -> bool:
    """Only a readback that counts can see a duplicate."""
    return tool.readback is not None and tool.readback.count_path is not None


def decide(cmd: ReconcileOperation, op: OperationView | None, tool: Tool | None, *,
           now: datetime, deliveries: int, timing: Timing) -> Decision:
    if op is None:
        return Reject(f"the ledger does not know operation {cmd.operation_id!r}")
    if tool is None or not auditable(tool):
        return Done("no audit: the tool's readback cannot count effects")
    due = due_at(cmd, tool, timing)
    if now < due:
        return wait_until(due, now, deliveries, timing, "audit waits for the horizon + slack")
    if op.state in MOVING:
        return Wait(backoff(deliveries, timing), f"audit waits: the operation is {op.state}")
    if op.state != State.SUCCEEDED:
        return Done(f"no audit: the operation ended {op.state}")
    return NeedReadback()


def after_readback(cmd: ReconcileOperation, tool: Tool, answer: ReadbackResult, *,
                   answered_at: datetime, deliveries: int, timing: Timing) -> AfterReadback:
    if answer.found is None:
        deadline = due_at(cmd, tool, timing) + timedelta(seconds=timing.reconcile_deadline_s)
        if answered_at >= deadline:
            return Done(f"audit gave up: the readback kept failing ({answer.error})")
        return Wait(backoff(deliveries, timing), f"audit readback failed: {answer.error}")
    matches = answer.matches or 0
    if matches <= 1:
        return Done(f"audit: {matches} effect(s) for the key")
    return Decide("undecidable", f"duplicate_detected: the audit after the horizon found "
                  f"{matches} effects for this operation key", Evidence(
                      source="readback", at=answered_at, provider_ref=answer.provider_ref,
                      digest=answer.evidence_digest, matches=matches,
                      provider_refs=list(answer.provider_refs) or None,
                      detail=f"audit readback found {matches} effects for one key"))
