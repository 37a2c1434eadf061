"""Intent submission: operation + journal + outbox row in one transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.catalog import Catalog
from effectledger_core.errors import IdempotencyConflict
from effectledger_core.ids import operation_key as derive_operation_key
from effectledger_core.intents import reject_nul, validate_arguments
from effectledger_core.messages import DispatchAttempt, SubmitIntent, encode
from effectledger_core.states import State
from effectledger_core.subjects import Subjects

from .common import append_journal, notify_outbox
from .schema import OUTBOX_PENDING, operations, outbox


@dataclass(frozen=True)
class Submitted:
    operation: dict[str, Any]
    created: bool


def dispatch_row(op: dict[str, Any], *, subjects: Subjects, outbox_id: str,
                 now: datetime) -> dict[str, Any]:
    """The outbox row carrying the DispatchAttempt command for `op` at its current epoch."""
    cmd = DispatchAttempt(
        operation_id=op["id"], operation_key=op["operation_key"], epoch=op["epoch"],
        tool=op["tool"], arguments=op["arguments"], arguments_digest=op["arguments_digest"],
        catalog_digest=op["tool_digest"], contract_revision=op["contract_revision"])
    return dict(id=outbox_id, operation_id=op["id"], epoch=op["epoch"], kind="dispatch",
                subject=subjects.dispatch(op["tool"]), payload=encode(cmd).decode(),
                status=OUTBOX_PENDING, created_at=now, available_at=now, publish_count=0)


async def submit_intent_txn(conn: AsyncConnection, *, catalog: Catalog, intent: SubmitIntent,
                            subjects: Subjects, operation_id: str, outbox_id: str,
                            now: datetime, actor: str = "agent") -> Submitted:
    tool = catalog.get(intent.tool)
    _canonical, args_digest = validate_arguments(intent.arguments)
    reject_nul(intent.arguments)
    op_key = derive_operation_key(tenant=intent.tenant, task_id=intent.task_id,
                                  caller_key=intent.idempotency_key, operation_id=operation_id)
    if intent.idempotency_key is not None:
        existing = (await conn.execute(
            sa.select(operations).where(operations.c.operation_key == op_key))).mappings().first()
        if existing is not None:
            if existing["tool"] != tool.name or existing["arguments_digest"] != args_digest:
                raise IdempotencyConflict(
                    "idempotency key already used with different arguments or tool",
                    operation_id=existing["id"])
            return Submitted(dict(existing), created=False)

    state = State.AWAITING_APPROVAL if tool.commit_policy == "approval" else State.PENDING
    op = dict(
        id=operation_id, tenant=intent.tenant, task_id=intent.task_id,
        caller_key=intent.idempotency_key, operation_key=op_key, tool=tool.name,
        arguments=intent.arguments, arguments_digest=args_digest, tool_digest=tool.digest(),
        contract_revision=tool.contract_revision, effect_class=tool.effect_class.value,
        commit_policy=tool.commit_policy, state=state.value, epoch=1, created_at=now,
        updated_at=now)
    await conn.execute(operations.insert().values(**op))
    await append_journal(conn, operation_id=operation_id, at=now, kind="intent_accepted",
                         actor=actor, epoch=1, to_state=state.value,
                         detail={"arguments_digest": args_digest, "tool_digest": op["tool_digest"],
                                 "contract_revision": tool.contract_revision,
                                 "tenant": intent.tenant, "task_id": intent.task_id})
    if state is State.PENDING:
        await conn.execute(outbox.insert().values(
            **dispatch_row(op, subjects=subjects, outbox_id=outbox_id, now=now)))
        await notify_outbox(conn)
    return Submitted(op, created=True)
