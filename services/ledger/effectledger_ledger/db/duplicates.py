"""`duplicate_detected`: the provider shows more than one effect for one operation key.

A readback that counts matches (`readback.count_path`) can see what no response could: the
provider applied one decision twice (it broke its declared horizon, or ignored the key). The
ledger never treats that as a quiet "applied". It is recorded in the journal (kind
`duplicate_detected`), the operation's evidence (so the receipt lists it among the open
uncertainties) and the review queue, and announced to `observers` after the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.limits import MAX_DUPLICATE_REFS
from effectledger_core.messages import ReconcileOperation
from effectledger_core.states import JournalKind, OutboxKind, OutboxStatus, State
from effectledger_core.subjects import Subjects

from .common import append_journal
from .rows import DuplicateFound, OperationRow
from .schema import attempts, journal, operations, outbox, webhook_events
from .transitions import annotate

log = logging.getLogger(__name__)
KIND = JournalKind.DUPLICATE_DETECTED

# Called once per recorded duplicate, after its transaction committed, with the tool name and
# the number of effects seen. The metrics layer registers its counter here.
observers: list[Callable[[str, int], None]] = []


def matches_of(evidence: dict[str, Any] | None) -> int:
    value = (evidence or {}).get("matches")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def is_duplicate(evidence: dict[str, Any] | None) -> bool:
    """The evidence reports more than one effect (a readback's count or an audit's mark)."""
    duplicate = (evidence or {}).get("duplicate")
    return matches_of(evidence) > 1 or (isinstance(duplicate, dict)
                                        and matches_of(duplicate) > 1)


def duplicate_count(evidence: dict[str, Any] | None) -> int:
    duplicate = (evidence or {}).get("duplicate")
    return max(matches_of(evidence), matches_of(duplicate) if isinstance(duplicate, dict)
               else 0)


def found_refs(evidence: dict[str, Any]) -> list[str]:
    """Every provider reference the evidence found for the key (its list, then its own
    `provider_ref` if the list lacks it): what an operator refunds or deletes."""
    listed = evidence.get("provider_refs")
    refs = [*(listed if isinstance(listed, list) else []), evidence.get("provider_ref")]
    return list(dict.fromkeys(r for r in refs if isinstance(r, str) and r))


async def note_duplicate_txn(conn: AsyncConnection, *, op: OperationRow, epoch: int,
                             evidence: dict[str, Any], actor: str, now: datetime) -> None:
    await append_journal(conn, operation_id=op.id, at=now, kind=KIND, actor=actor,
                         epoch=epoch, detail={
                             "matches": matches_of(evidence), "tool": op.tool,
                             "operation_key": op.operation_key,
                             "provider_ref": evidence.get("provider_ref"),
                             # All of them, not only the first: each is an effect to deal with.
                             "provider_refs": found_refs(evidence),
                             "operation_provider_ref": op.provider_ref,
                             "digest": evidence.get("digest"),
                             "source": evidence.get("source")})


def announce(tool: str, matches: int, operation_id: str) -> None:
    """After the commit: log it loudly and tell every registered observer."""
    log.warning("duplicate_detected: operation %s (tool %s): the provider shows %d effects "
                "for one operation key", operation_id, tool, matches)
    for observer in observers:
        try:
            observer(tool, matches)
        except Exception:  # an observer's bug must not undo a committed record
            log.exception("duplicate_detected observer failed")


async def schedule_audit_txn(conn: AsyncConnection, *, op: OperationRow, epoch: int,
                             now: datetime, subjects: Subjects, outbox_id: str,
                             reason: str = "retried after a not-applied verdict") -> None:
    """Queue the duplicate audit for `epoch`: the attempt a "not applied" verdict gave up on,
    or a retry an "applied" verdict settled (its own request may still land late).

    The reconciler decides when (after the horizon plus slack, once the operation is at rest)
    and whether (only tools whose readback counts effects); see the reconciler's audit.py.
    """
    claimed_at = (await conn.execute(
        sa.select(attempts.c.claimed_at).where(attempts.c.operation_id == op.id,
                                               attempts.c.epoch == epoch))).scalar() or now
    cmd = ReconcileOperation(
        operation_id=op.id, epoch=epoch, attempt_id=f"audit:{op.id}:{epoch}"[:1024],
        operation_key=op.operation_key, tool=op.tool, arguments=op.arguments,
        cause="audit", reason=reason, claimed_at=claimed_at,
        noticed_at=now)
    await conn.execute(outbox.insert().values(
        id=outbox_id, operation_id=op.id, epoch=epoch, kind=OutboxKind.AUDIT.value,
        subject=subjects.ambiguous, payload=cmd.model_dump_json(),
        status=OutboxStatus.PENDING.value,
        created_at=now, available_at=now, publish_count=0))


async def record_audit_duplicate_txn(conn: AsyncConnection, *, op: OperationRow, epoch: int,
                                     evidence: dict[str, Any], actor: str,
                                     now: datetime) -> bool:
    """An audit found a duplicate for a succeeded operation: journal it and keep it on the
    operation's evidence (the receipt lists it; the review queue shows it). The state stays
    `succeeded`: the effect was applied; a human deals with the extra one."""
    if not await annotate(conn, op.id, state=State.SUCCEEDED,
                          evidence=_marked(op, epoch, evidence, now), at=now):
        return False
    await note_duplicate_txn(conn, op=op, epoch=epoch, evidence=evidence, actor=actor, now=now)
    return True


def _marked(op: OperationRow, epoch: int, evidence: dict[str, Any],
            now: datetime) -> dict[str, Any]:
    """A succeeded operation's evidence with a duplicate finding about `epoch` on it."""
    current = op.evidence if isinstance(op.evidence, dict) else None
    # Keep the succeeding epoch's own evidence; an earlier epoch's belongs to the journal.
    base = current if current and current.get("epoch", op.epoch) == op.epoch else {}
    return {**base, "epoch": op.epoch, "duplicate": {
        "matches": matches_of(evidence), "audited_epoch": epoch, "at": now.isoformat(),
        "provider_ref": evidence.get("provider_ref"), "provider_refs": found_refs(evidence),
        "digest": evidence.get("digest")}}


async def webhook_duplicate_txn(conn: AsyncConnection, *, op: OperationRow,
                                hook: dict[str, Any], now: datetime,
                                settled: bool = False) -> DuplicateFound | None:
    """A verified "applied" webhook naming a provider object that no verified "applied" webhook
    of its provider for this operation named before it: the provider shows a second effect for
    one key. Recorded at once, whatever the operation's state, like an audit's finding:
    `duplicate_detected` journaled with every reference seen, and marked on the operation's
    evidence when it succeeded (its state never changes). `op` is locked by the caller.

    None when the hook brings no new finding (a resend of an object already named). `settled`:
    this hook just settled the operation; a finding journaled when a later event arrived (the
    operation still in flight then) is then marked on the evidence, not journaled again.
    """
    ref = hook.get("provider_ref")
    if not ref or hook.get("outcome") != "applied":
        return None
    rows = (await conn.execute(
        sa.select(webhook_events.c.provider_ref, webhook_events.c.webhook_id,
                  webhook_events.c.applied)
        .where(webhook_events.c.provider == hook["provider"],
               sa.or_(webhook_events.c.operation_id == op.id,
                      webhook_events.c.operation_key == op.operation_key),
               webhook_events.c.outcome == "applied",
               webhook_events.c.provider_ref.is_not(None),
               # A refused event (a provider not bound to the tool) speaks for nothing.
               sa.or_(webhook_events.c.applied.is_(None),
                      sa.not_(webhook_events.c.applied.like("refused%"))))
        .order_by(webhook_events.c.id))).all()
    mine = next((i for i, r in enumerate(rows) if r.webhook_id == hook["webhook_id"]), len(rows))
    before = {r.provider_ref for r in rows[:mine]}
    new = bool(before) and ref not in before
    found_later = settled and any(r.applied == "duplicate_detected" for r in rows[mine + 1:])
    if not (new or found_later):
        return None
    # In arrival order: the object that settled the operation usually first.
    refs = list(dict.fromkeys(r.provider_ref for r in rows))[:MAX_DUPLICATE_REFS]
    evidence = {"source": "webhook", "provider_ref": ref, "provider_refs": refs,
                "matches": len(refs), "digest": hook.get("body_digest"),
                "webhook_id": hook["webhook_id"]}
    # Read again: the webhook may just have settled the operation in this transaction.
    current = OperationRow.of((await conn.execute(
        sa.select(operations).where(operations.c.id == op.id))).mappings().one())
    if not new:
        if current.state is State.SUCCEEDED:
            await annotate(conn, current.id, state=State.SUCCEEDED,
                           evidence=_marked(current, current.epoch, evidence, now), at=now)
        return None
    actor = f"webhook:{hook['provider']}"
    if not (current.state is State.SUCCEEDED and await record_audit_duplicate_txn(
            conn, op=current, epoch=current.epoch, evidence=evidence, actor=actor, now=now)):
        await note_duplicate_txn(conn, op=current, epoch=current.epoch, evidence=evidence,
                                 actor=actor, now=now)
    return DuplicateFound(op.id, op.tool, len(refs))


def open_duplicate(evidence: dict[str, Any] | None) -> bool:
    """A duplicate mark on a succeeded operation that no operator has dealt with yet."""
    duplicate = (evidence or {}).get("duplicate")
    return isinstance(duplicate, dict) and matches_of(duplicate) > 1 \
        and not duplicate.get("reviewed")


def already_recorded(current: dict[str, Any] | None, finding: dict[str, Any]) -> bool:
    """Whether an open (unreviewed) duplicate mark already says everything `finding` says:
    no more effects, no reference it does not name. Two epochs' audits of one key see the
    same effects; that is one finding, journaled once."""
    if not open_duplicate(current):
        return False
    mark = (current or {})["duplicate"]
    named = mark.get("provider_refs")
    return matches_of(finding) <= matches_of(mark) and set(found_refs(finding)) <= set(
        named if isinstance(named, list) else [])


async def review_duplicate_txn(conn: AsyncConnection, *, op: OperationRow, review_id: str,
                               operator: str, evidence_ref: str, now: datetime) -> None:
    """An operator dealt with a succeeded operation's extra effect (refund, cancellation): the
    mark stays as evidence, closed with the review, and the queue no longer lists it."""
    evidence = dict(op.evidence or {})
    evidence["duplicate"] = {**evidence["duplicate"], "reviewed": {
        "review_id": review_id, "operator": operator, "evidence_ref": evidence_ref,
        "at": now.isoformat()}}
    await annotate(conn, op.id, state=State.SUCCEEDED, evidence=evidence, at=now)


def unreviewed_duplicates() -> Any:
    """Succeeded operations whose latest duplicate_detected has no later review: a WHERE."""
    last_duplicate = (sa.select(sa.func.max(journal.c.id))
                      .where(journal.c.operation_id == operations.c.id,
                             journal.c.kind == KIND.value)
                      .scalar_subquery())
    last_review = (sa.select(sa.func.max(journal.c.id))
                   .where(journal.c.operation_id == operations.c.id,
                          journal.c.kind == JournalKind.REVIEW_RECORDED.value)
                   .scalar_subquery())
    return sa.and_(operations.c.state == State.SUCCEEDED.value, last_duplicate.is_not(None),
                   sa.or_(last_review.is_(None), last_review < last_duplicate))
