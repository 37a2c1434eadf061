"""Read models: operation views, journals, receipts, paginated lists.

Each read returns the typed view the API answers (`effectledger_core.views`), built from the
rows as the database gives them (times stay `datetime` until the JSON is written).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.errors import InvalidRequest, NotFound
from effectledger_core.failures import Failure, Idempotency, policy_digest
from effectledger_core.messages import FailureClass
from effectledger_core.states import UNDECIDED, UNRESOLVED, State
from effectledger_core.views import (
    JournalEntry,
    OperationPage,
    OperationSummary,
    OperationView,
    Receipt,
    ReceiptDigests,
    RecoveryView,
)

from . import hot
from .duplicates import duplicate_count, is_duplicate, open_duplicate
from .schema import attempts, journal, operations


def _iso(v: Any) -> Any:
    return v.isoformat() if hasattr(v, "isoformat") else v


def _row(r: Any) -> dict[str, Any]:
    """A row with its times as text (the console's evidence and dead letters)."""
    return {k: _iso(v) for k, v in dict(r).items()}


# The operation with its attempts, in one statement (one round trip): built once, since
# `hot.read_rows` compiles a statement once and sends it straight to asyncpg.
_A = ATTEMPT_PREFIX = "attempt__"
_OPERATION = (
    sa.select(operations, *(c.label(_A + c.name) for c in attempts.c))
    .select_from(operations.outerjoin(attempts, attempts.c.operation_id == operations.c.id))
    .where(operations.c.id == sa.bindparam("id"))
    .order_by(attempts.c.epoch))
_OPERATION_COLUMNS = tuple(c.name for c in operations.c)
_ATTEMPT_COLUMNS = tuple(c.name for c in attempts.c)


async def get_operation(conn: AsyncConnection, operation_id: str) -> OperationView:
    """The operation's view: read after every submit-and-wait and by every GET, so it is one
    statement on the direct path (`hot.read_rows`): a row per attempt, or one with none."""
    found = await hot.read_rows(conn, _OPERATION, {"id": operation_id})
    if not found:
        raise NotFound(f"operation {operation_id!r} not found")
    return view_of(found)


def view_of(found: Sequence[Mapping[str, Any]]) -> OperationView:
    """The view from `_OPERATION`'s rows (or rows of its shape: the operation's columns, then
    each attempt's prefixed with `ATTEMPT_PREFIX`, by epoch; one row with none)."""
    view: dict[str, Any] = {k: found[0][k] for k in _OPERATION_COLUMNS}
    view["attempts"] = [{k: r[_A + k] for k in _ATTEMPT_COLUMNS} for r in found
                        if r[_A + "id"] is not None]
    evidence = view.get("evidence")
    if isinstance(evidence, dict) and "epoch" in evidence and evidence["epoch"] != view["epoch"]:
        # The view speaks for the current epoch only: an earlier epoch's "not applied" must not
        # stand next to a later success. Earlier evidence stays in the journal.
        view["evidence"] = None
    return OperationView.model_validate(view)


async def get_journal(conn: AsyncConnection, operation_id: str) -> list[JournalEntry]:
    await _exists(conn, operation_id)
    rows = (await conn.execute(
        sa.select(journal).where(journal.c.operation_id == operation_id)
        .order_by(journal.c.id))).mappings().all()
    return [JournalEntry.model_validate(r) for r in rows]


async def count_in_states(conn: AsyncConnection, tenant: str, states: Collection[State], *,
                          cap: int) -> int:
    """How many of the tenant's operations are in `states`, counting no further than `cap`
    (a quota only needs to know whether the limit is reached)."""
    sub = (sa.select(operations.c.id)
           .where(operations.c.state.in_([s.value for s in states]),
                  operations.c.tenant == tenant)
           .limit(cap).subquery())
    return int((await conn.execute(sa.select(sa.func.count()).select_from(sub))).scalar_one())


async def _exists(conn: AsyncConnection, operation_id: str) -> None:
    found = (await conn.execute(
        sa.select(operations.c.id).where(operations.c.id == operation_id))).first()
    if found is None:
        raise NotFound(f"operation {operation_id!r} not found")


def _encode_cursor(created_at: str, op_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([created_at, op_id]).encode()).decode()


def _storable_id(value: str) -> bool:
    """Whether a database can take this string as a query parameter: PostgreSQL refuses NUL,
    and neither driver encodes an unpaired surrogate (`"\\ud800"` in the cursor's JSON, or
    the bytes ED A0 80, which `json.loads` reads with `surrogatepass`)."""
    if "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    """A cursor back into (created_at, id), checked before any query sees it: anyone can send
    one, and a naive time, NUL, an unpaired surrogate or a 3,000-deep document must be a 4xx,
    never a 500. The console's cursors are decoded here too."""
    if len(cursor) > 1024:
        raise InvalidRequest("malformed cursor")
    try:
        value = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidRequest("malformed cursor") from exc
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, str) for v in value)):
        raise InvalidRequest("malformed cursor")
    created_s, op_id = value
    if not op_id or len(op_id) > 64 or not _storable_id(op_id):
        raise InvalidRequest("malformed cursor")
    try:
        created = datetime.fromisoformat(created_s)
    except ValueError as exc:
        raise InvalidRequest("malformed cursor") from exc
    if created.tzinfo is None:
        raise InvalidRequest("malformed cursor")
    try:
        # Stored in UTC: a time at the edge of the calendar (0001-01-01T00:00+14:00) has no
        # UTC value, and converting it while binding the query would fail with a 500.
        created = created.astimezone(UTC)
    except OverflowError as exc:
        raise InvalidRequest("malformed cursor") from exc
    return created, op_id


async def list_operations(conn: AsyncConnection, *, state: str | None, limit: int,
                          cursor: str | None, tenant: str | None = None) -> OperationPage:
    if state is not None and state not in {s.value for s in State}:
        raise InvalidRequest(f"unknown state {state!r}", known=[s.value for s in State])
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be between 1 and 1000")
    q = sa.select(operations.c.id, operations.c.tool, operations.c.state, operations.c.epoch,
                  operations.c.operation_key, operations.c.created_at, operations.c.updated_at)
    if state is not None:
        q = q.where(operations.c.state == state)
    if tenant is not None:
        q = q.where(operations.c.tenant == tenant)
    if cursor:
        created, op_id = _decode_cursor(cursor)
        q = q.where(sa.or_(operations.c.created_at > created,
                           sa.and_(operations.c.created_at == created, operations.c.id > op_id)))
    rows = (await conn.execute(
        q.order_by(operations.c.created_at, operations.c.id).limit(limit + 1))).mappings().all()
    items = [OperationSummary.model_validate(r) for r in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        last = items[-1]
        next_cursor = _encode_cursor(last.created_at.isoformat(), last.id)
    return OperationPage(items=items, next_cursor=next_cursor)


async def count_by_state(conn: AsyncConnection, tenant: str | None = None) -> dict[str, int]:
    """Operations per state; only `tenant`'s when given."""
    stmt = sa.select(operations.c.state, sa.func.count()).group_by(operations.c.state)
    if tenant is not None:
        stmt = stmt.where(operations.c.tenant == tenant)
    rows = (await conn.execute(stmt)).all()
    return {r[0]: int(r[1]) for r in rows}


def _recovery(op: OperationView) -> RecoveryView:
    from effectledger_core.recovery import inspect_recovery

    from .recovery import facts
    from .rows import OperationRow

    a = inspect_recovery(facts(OperationRow.of(dict(op))))
    return RecoveryView(fact=a.fact.value, decision=a.decision.value, reason=a.reason)


def _guidance(last: dict[str, Any]) -> str | None:
    """The model's one line for a failure: the one the outcome carried, else rendered here
    from the same policy table, so a failure's receipt never lacks it."""
    if last.get("type") != "attempt_failed":
        return None
    if last.get("guidance"):
        return str(last["guidance"])
    failure = Failure(FailureClass(last["failure_class"]), last.get("code", ""),
                      last.get("message", ""), retry_after_s=last.get("retry_after_s"),
                      idempotency=Idempotency(last.get("idempotency", "unset")))
    return failure.guidance()


def build_receipt(op: OperationView) -> Receipt:
    """The receipt: evidence, not success; it lists what is still open."""
    last = op.attempts[-1] if op.attempts else None
    state = State(op.state)
    open_items = []
    if state in UNDECIDED:
        open_items.append(f"operation is {state.value}: no final outcome yet")
    if state in UNRESOLVED:
        open_items.append("provider outcome unknown: awaiting reconciliation")
    if state is State.NEEDS_REVIEW:
        open_items.append("no machine can decide: awaiting operator review")
    evidence = op.evidence or None
    if is_duplicate(evidence) and (state is not State.SUCCEEDED or open_duplicate(evidence)):
        open_items.append(f"duplicate_detected: the provider lists {duplicate_count(evidence)} "
                          f"effects for this operation key")
    if state in UNRESOLVED:
        reconciliation = "pending"
    elif state is State.NEEDS_REVIEW:
        reconciliation = "needs_review"
    elif evidence and state in (State.SUCCEEDED, State.FAILED):
        reconciliation = "resolved"
    else:
        reconciliation = "not_needed"
    return Receipt(
        operation_id=op.id,
        operation_key=op.operation_key,
        run_id=op.task_id,
        tenant=op.tenant,
        attempt_ids=[a.id for a in op.attempts],
        tool=op.tool,
        state=state.value,
        epoch=op.epoch,
        effect_class=op.effect_class,
        commit_policy=op.commit_policy,
        contract_revision=op.contract_revision,
        digests=ReceiptDigests(
            catalog_entry=op.tool_digest,
            request=op.arguments_digest,
            response=op.response_digest,
            policy=policy_digest(),
        ),
        provider_request_ref=op.provider_ref,
        dispatch_outcome=last.status if last else None,
        reconciliation_status=reconciliation,
        # How the outcome became known when no provider response said so (readback, webhook,
        # operator): the evidence itself, never a synthesized response digest.
        evidence=evidence,
        recovery_decision=_recovery(op),
        guidance=_guidance(op.last_outcome or {}),
        open_uncertainties=open_items,
        # What the provider answered (response, or the readback that found the effect).
        result=op.result,
    )
