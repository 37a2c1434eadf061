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
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from effectledger_bus.backoff import nak_backoff
from effectledger_core.catalog import Tool
from effectledger_core.commands import arguments_digest, mismatch
from effectledger_core.messages import Evidence, ReconcileOperation
from effectledger_core.results import ProviderResult

# States in which the ledger still waits for a verdict for the operation's current epoch.
OPEN_STATES = frozenset({"ambiguous", "awaiting_confirmation"})
# A wait ends a little after its boundary, so the redelivery falls on the far side of it.
BOUNDARY_SLACK_S = 0.05
MIN_DELAY_S = 0.05
MAX_REASON = 1024


@dataclass(frozen=True, slots=True)
class Timing:
    """The reconciler's settings that shape decisions."""

    reconcile_deadline_s: float = 3600.0
    webhook_wait_s: float = 300.0
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    # The duplicate audit re-reads this long after the provider's horizon (audit.py).
    audit_slack_s: float = 60.0


@dataclass(frozen=True, slots=True)
class OperationView:
    """The ledger's current view of an operation (the `rpc_operation` reply)."""

    id: str
    state: str
    epoch: int
    operation_key: str | None = None
    tool: str | None = None
    provider_ref: str | None = None
    arguments_digest: str | None = None


@dataclass(frozen=True, slots=True)
class ReadbackAnswer:
    """What one readback showed; `found` None means the provider could not tell us."""

    found: bool | None
    provider_ref: str | None = None
    digest: str | None = None
    http_status: int | None = None
    error: str | None = None
    matches: int | None = None  # effects listed for the key (readback.count_path)
    result: ProviderResult | None = None  # the answer, kept for the agent, when found


# -- decisions ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Done:
    """Nothing to do for this command (already decided, superseded): ack it."""

    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Not decidable yet: nak with this delay; the redelivery decides again."""

    delay_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class Decide:
    """Publish this verdict for the command's epoch, then ack."""

    verdict: Literal["applied", "not_applied", "undecidable"]
    reason: str
    evidence: Evidence | None = None
    result: ProviderResult | None = None  # the provider's answer, for `applied` by readback


@dataclass(frozen=True, slots=True)
class Reject:
    """The command can never be processed: dead-letter it (recorded by the ledger), then ack."""

    reason: str


@dataclass(frozen=True, slots=True)
class NeedReadback:
    """Ask the provider once (`tool.readback`), then call `after_readback` with the answer."""


Decision = Done | Wait | Decide | Reject | NeedReadback
AfterReadback = Decide | Wait | Done  # Done: an audit that found nothing to report


def backoff(deliveries: int, timing: Timing) -> float:
    """Exponential backoff from the delivery count (1, 2, 3, ...), capped (the bus's rule)."""
    return nak_backoff(deliveries, base_s=timing.backoff_base_s, cap_s=timing.backoff_cap_s)


def _wait_until(boundary: datetime, now: datetime, deliveries: int, timing: Timing,
                reason: str) -> Wait:
    """Back off, but never past the boundary at which the decision changes."""
    left = (boundary - now).total_seconds() + BOUNDARY_SLACK_S
    return Wait(max(MIN_DELAY_S, min(backoff(deliveries, timing), left)), reason)


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


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 1] + "…"


def decide(cmd: ReconcileOperation, op: OperationView | None, tool: Tool | None, *,
           now: datetime, deliveries: int, timing: Timing) -> Decision:
    """The decision for one delivery, before any provider call.

    `op` is the ledger's answer (None: the ledger does not know the operation); `tool` is the
    catalog entry for `cmd.tool` (None: not in this reconciler's catalog).
    """
    if cmd.cause == "audit":
        from . import audit  # audit builds on this module's types: imported where used

        return audit.decide(cmd, op, tool, now=now, deliveries=deliveries, timing=timing)
    if op is None:
        return Reject(f"the ledger does not know operation {cmd.operation_id!r}")
    if op.epoch != cmd.epoch:
        return Done(f"superseded: the ledger is at epoch {op.epoch}, this command is for "
                    f"epoch {cmd.epoch}")
    if op.state not in OPEN_STATES:
        return Done(f"already decided: the operation is {op.state}")
    wrong = command_mismatch(cmd, op)
    if wrong is not None:
        # A readback built from another tool's or other arguments would ask the provider about
        # a different effect, and its answer would decide this operation: never act on it.
        return Reject(_bounded(f"the command is not the ledger's operation: {wrong}"))
    if tool is None:
        # The ledger accepted the tool, so our catalog is behind: wait for a rollout, and
        # give the operation to a human once the reconciliation deadline has passed.
        deadline = deadline_at(cmd, None, timing)
        if now >= deadline:
            return Decide("undecidable", _bounded(
                f"tool {cmd.tool!r} is not in the reconciler's catalog"))
        return _wait_until(deadline, now, deliveries, timing,
                           f"tool {cmd.tool!r} is not in the catalog yet")
    caps = tool.capabilities
    if caps.webhooks:
        until = webhook_until(cmd, timing)
        if now < until:
            return _wait_until(until, now, deliveries, timing,
                               "waiting for a verified provider webhook")
    if caps.readback:
        return NeedReadback()
    if caps.webhooks:
        return Decide("undecidable", _bounded(
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


def after_readback(cmd: ReconcileOperation, tool: Tool, answer: ReadbackAnswer, *,
                   sent_at: datetime, answered_at: datetime, deliveries: int,
                   timing: Timing) -> AfterReadback:
    """The decision once the readback (sent at `sent_at`) has answered at `answered_at`."""
    if cmd.cause == "audit":
        from . import audit

        return audit.after_readback(cmd, tool, answer, answered_at=answered_at,
                                    deliveries=deliveries, timing=timing)
    horizon = horizon_at(cmd, tool)
    status = f"HTTP {answer.http_status}" if answer.http_status is not None else "no answer"
    if answer.found is True and answer.matches is not None and answer.matches > 1:
        # More than one effect for one key: the provider applied the request more than once.
        # That is not a quiet "applied": the ledger records duplicate_detected and a human
        # decides (refund, cancel the extra effect) from the review queue.
        return Decide("undecidable", _bounded(
            f"duplicate_detected: the provider's readback lists {answer.matches} effects for "
            f"this operation key"), Evidence(
                source="readback", at=answered_at, provider_ref=answer.provider_ref,
                digest=answer.digest, matches=answer.matches,
                detail=f"readback found {answer.matches} effects for one key ({status})"))
    if answer.found is True:
        return Decide("applied", "the provider's readback shows the effect", Evidence(
            source="readback", at=answered_at, provider_ref=answer.provider_ref,
            digest=answer.digest, detail=f"readback found the effect ({status})"),
            result=answer.result)
    if answer.found is False:
        if sent_at >= horizon:
            after = (sent_at - cmd.claimed_at).total_seconds()
            return Decide("not_applied", "the provider's readback after its processing horizon "
                          "shows no effect", Evidence(
                              source="readback", at=answered_at, digest=answer.digest,
                              detail=_bounded(
                                  f"readback found nothing ({status}), sent {after:.3f}s after "
                                  f"the attempt started; provider horizon {tool.horizon_s:g}s")))
        # Before the horizon the provider may still apply it (a late apply): look again then.
        return _wait_until(horizon, answered_at, deliveries, timing,
                           "not found yet, before the provider's processing horizon")
    error = answer.error or "the readback could not tell"
    deadline = deadline_at(cmd, tool, timing)
    if answered_at >= deadline:
        return Decide("undecidable", _bounded(
            f"readback kept failing until the reconciliation deadline "
            f"({timing.reconcile_deadline_s:g}s after the attempt started): {error}"))
    return _wait_until(deadline, answered_at, deliveries, timing,
                       _bounded(f"readback failed: {error}"))


def ledger_unavailable(deliveries: int, timing: Timing) -> Wait:
    """The ledger did not answer: nothing can be decided safely without it; try later."""
    return Wait(backoff(deliveries, timing), "the ledger did not answer")
