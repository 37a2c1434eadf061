"""Operator actions in the ledger: approvals, cancellation and explicit retry plans.

Every action is a guarded UPDATE bound to the operation's epoch (and, for approvals, the exact
arguments digest), journaled with who did it and on what evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.catalog import Catalog, EffectClass
from effectledger_core.errors import EffectLedgerError, NotFound, UnknownTool
from effectledger_core.recovery import OperationFacts, RecoveryRefused, RetryPlan
from effectledger_core.states import Event, JournalKind, State, sources
from effectledger_core.subjects import Subjects

from .common import append_journal
from .rows import OperationRow
from .schema import OUTBOX_OBSOLETE, operations, outbox, retry_plans
from .transitions import Change, Dispatch, apply


class ActionRejected(EffectLedgerError):
    """An operator action that does not match the operation's current epoch, state or digest."""

    code = "action_rejected"
    http_status = 409


async def load_op(conn: AsyncConnection, operation_id: str) -> OperationRow:
    op = (await conn.execute(
        sa.select(operations).where(operations.c.id == operation_id))).mappings().first()
    if op is None:
        raise NotFound(f"operation {operation_id!r} not found")
    return OperationRow.of(op)


def facts(op: OperationRow) -> OperationFacts:
    last = op.last_outcome or {}
    return OperationFacts(
        operation_id=op.id, operation_key=op.operation_key or None, state=op.state.value,
        epoch=op.epoch, effect_class=EffectClass(op.effect_class),
        arguments_digest=op.arguments_digest, contract_revision=op.contract_revision,
        last_outcome=last.get("type"))


async def move(conn: AsyncConnection, op: OperationRow, event: Event, *, now: datetime,
               actor: str, detail: dict[str, Any], subjects: Subjects,
               outbox_id: str | None = None, extra: dict[str, Any] | None = None,
               traceparent: str | None = None) -> OperationRow:
    """An operator's transition, through the applier; refused when the operation moved on."""
    if op.state not in sources(event):
        raise ActionRejected(f"{event.value} is not allowed in state {op.state.value}",
                             state=op.state.value)
    applied = await apply(conn, Change(
        operation_id=op.id, epoch=op.epoch, from_state=op.state, event=event, at=now,
        actor=actor, detail=detail, values=extra or {}, row=op,
        dispatch=None if outbox_id is None else Dispatch(outbox_id, subjects),
        traceparent=traceparent))
    if applied is None:
        raise ActionRejected("the operation changed concurrently; read it again")
    assert applied.row is not None
    return applied.row


async def approve_txn(conn: AsyncConnection, operation_id: str, *, epoch: int,
                      arguments_digest: str, operator: str, subjects: Subjects,
                      outbox_id: str, now: datetime,
                      traceparent: str | None = None) -> OperationRow:
    op = await load_op(conn, operation_id)
    if op.state is not State.AWAITING_APPROVAL:
        raise ActionRejected(f"operation is {op.state.value}, not awaiting approval")
    if epoch != op.epoch:
        raise ActionRejected(f"approval is for epoch {epoch}; the operation is at {op.epoch}",
                             reason="stale_epoch")
    if arguments_digest != op.arguments_digest:
        raise ActionRejected("approval is for different arguments than the operation's",
                             reason="arguments_changed")
    return (await move(conn, op, Event.APPROVE, now=now, actor=f"operator:{operator}",
                       subjects=subjects, outbox_id=outbox_id, traceparent=traceparent,
                       detail={"arguments_digest": arguments_digest, "operator": operator}))


async def reject_txn(conn: AsyncConnection, operation_id: str, *, epoch: int, operator: str,
                     reason: str, subjects: Subjects, now: datetime,
                     traceparent: str | None = None) -> OperationRow:
    op = await load_op(conn, operation_id)
    if epoch != op.epoch:
        raise ActionRejected(f"rejection is for epoch {epoch}; the operation is at "
                             f"{op.epoch}", reason="stale_epoch")
    return (await move(conn, op, Event.REJECT, now=now, actor=f"operator:{operator}",
                       subjects=subjects, detail={"operator": operator, "reason": reason},
                       traceparent=traceparent))


async def cancel_txn(conn: AsyncConnection, operation_id: str, *, operator: str, reason: str,
                     subjects: Subjects, now: datetime,
                     traceparent: str | None = None) -> OperationRow:
    op = await load_op(conn, operation_id)
    return (await move(conn, op, Event.CANCEL, now=now, actor=f"operator:{operator}",
                       subjects=subjects, detail={"operator": operator, "reason": reason},
                       traceparent=traceparent))


async def record_plan_txn(conn: AsyncConnection, plan: RetryPlan, *, plan_id: str,
                          requested_by: str, now: datetime) -> None:
    review = None
    if plan.review is not None:
        r = plan.review
        review = {"operator": r.operator, "evidence_ref": r.evidence_ref,
                  "conclusion": r.conclusion.value, "epoch": r.epoch}
    await conn.execute(retry_plans.insert().values(
        id=plan_id, operation_id=plan.operation_id, epoch=plan.epoch,
        arguments_digest=plan.arguments_digest, contract_revision=plan.contract_revision,
        review=review, requested_by=requested_by, created_at=now))
    await append_journal(conn, operation_id=plan.operation_id, at=now,
                         kind=JournalKind.RETRY_PLANNED,
                         actor=f"operator:{requested_by}", epoch=plan.epoch,
                         detail={"plan_id": plan_id, "review": review})


@dataclass(frozen=True)
class Admission:
    admitted: bool
    reason: str
    operation: OperationRow | None = None  # as admitted


async def consume_plan_txn(conn: AsyncConnection, plan_id: str, *, catalog: Catalog,
                           subjects: Subjects, outbox_id: str, now: datetime,
                           traceparent: str | None = None) -> Admission:
    """Consume the plan (once, ever) and run admission. A refusal still consumes it."""
    taken = await conn.execute(
        retry_plans.update().where(retry_plans.c.id == plan_id,
                                   retry_plans.c.consumed_at.is_(None))
        .values(consumed_at=now).returning(retry_plans))
    plan = taken.mappings().first()
    if plan is None:
        exists = (await conn.execute(sa.select(retry_plans.c.id)
                                     .where(retry_plans.c.id == plan_id))).first()
        if exists is None:
            raise NotFound(f"retry plan {plan_id!r} not found")
        raise RecoveryRefused("plan_already_used", "this retry plan was already used")
    op = await load_op(conn, plan["operation_id"])
    reason = await _admission_refusal(op, dict(plan), catalog)
    if reason is not None:
        await conn.execute(retry_plans.update().where(retry_plans.c.id == plan_id)
                           .values(admission=f"refused:{reason}"))
        await append_journal(conn, operation_id=op.id, at=now, kind=JournalKind.RETRY_REFUSED,
                             actor="ledger.admission", epoch=op.epoch, traceparent=traceparent,
                             detail={"plan_id": plan_id, "reason": reason})
        return Admission(False, reason)
    tool = catalog.get(op.tool)
    new = await move(conn, op, Event.PLAN_ADMITTED, now=now,
                     actor=f"operator:{plan['requested_by']}",
                     subjects=subjects, outbox_id=outbox_id, traceparent=traceparent,
                     detail={"plan_id": plan_id, "review": plan["review"],
                             "operation_key": op.operation_key})
    if tool.commit_policy == "approval":
        # A plan is not a permission: an approval-gated tool needs a fresh approval.
        await conn.execute(outbox.update().where(outbox.c.id == outbox_id)
                           .values(status=OUTBOX_OBSOLETE))
        new = await move(conn, new, Event.REQUIRE_APPROVAL, now=now, actor="ledger.admission",
                         subjects=subjects, detail={}, traceparent=traceparent)
    await conn.execute(retry_plans.update().where(retry_plans.c.id == plan_id)
                       .values(admission="admitted"))
    return Admission(True, "admitted", new)


async def _admission_refusal(op: OperationRow, plan: dict[str, Any],
                             catalog: Catalog) -> str | None:
    if op.epoch != plan["epoch"]:
        return "superseded_attempt"
    if op.arguments_digest != plan["arguments_digest"]:
        return "arguments_changed"
    try:
        tool = catalog.get(op.tool)
    except UnknownTool:
        return "tool_not_in_catalog"
    if tool.contract_revision != plan["contract_revision"] or (
            tool.contract_revision != op.contract_revision):
        return "contract_changed"
    if op.state not in sources(Event.PLAN_ADMITTED):
        return f"state_{op.state.value}"
    return None
