"""Resolving uncertainty: reconciler verdicts, verified webhooks and the reconciliation handoff.

All three share one rule (the ambiguity firewall, evidence before verdict, fencing): evidence is
applied only to the epoch it is about and only from a state that is waiting for it, through the
transition applier's guarded UPDATE; anything else is rejected and journaled, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.failures import Failure, Idempotency, policy_digest
from effectledger_core.messages import FailureClass, VerdictReached, WebhookReceived
from effectledger_core.retry_policy import RetryDecision
from effectledger_core.states import UNRESOLVED, Event, JournalKind, State
from effectledger_core.subjects import Subjects

from .common import append_journal, insert_ignore
from .duplicates import (
    already_recorded,
    is_duplicate,
    note_duplicate_txn,
    record_audit_duplicate_txn,
    schedule_audit_txn,
    webhook_duplicate_txn,
)
from .rows import OperationRow, Recorded
from .schema import attempts, inbox, operations, webhook_events
from .transitions import Change, Dispatch, apply

__all__ = ["Recorded", "RetryDecider", "WebhookBinding", "apply_verdict", "record_verdict_txn",
           "record_webhook_txn", "settle_from_stored_webhooks"]

RetryDecider = Callable[[OperationRow, Failure], RetryDecision]
# (provider, tool) -> may that provider's verified webhook decide an operation of that tool
# (`Catalog.webhook_speaks_for`). None: every stored webhook counts (callers without a catalog).
WebhookBinding = Callable[[str, str], bool]


async def apply_verdict(conn: AsyncConnection, *, op: OperationRow, epoch: int, verdict: str,
                        evidence: dict[str, Any], actor: str, now: datetime,
                        subjects: Subjects, outbox_id: str,
                        decide_retry: RetryDecider | None,
                        result: dict[str, Any] | None = None,
                        traceparent: str | None = None) -> Recorded:
    """Apply applied / not_applied / undecidable for `epoch` of `op` (already row-locked).
    `result`: the provider's answer the evidence brought (a readback's), kept with `applied`.
    `traceparent`: the context of the message that brought the verdict, for the journal."""
    if op.epoch != epoch:
        return Recorded("rejected", reason="stale_epoch")
    if op.state not in UNRESOLVED:
        return Recorded("rejected", reason=f"state_{op.state.value}")
    decision = None
    if verdict == "applied":
        event = Event.VERDICT_APPLIED
    elif verdict == "undecidable":
        event = Event.VERDICT_UNDECIDABLE
    else:
        # Known not applied (after the horizon, or a final webhook): as safe as a refusal.
        failure = Failure(FailureClass.TRANSIENT, "not_applied", "verified not applied",
                          idempotency=Idempotency.YES)
        decision = (decide_retry(op, failure) if decide_retry is not None
                    else RetryDecision(False, "no_retry_policy"))
        event = (Event.VERDICT_NOT_APPLIED_RETRY if decision.retry
                 else Event.VERDICT_NOT_APPLIED_FINAL)
    # The stored evidence names what it proved and for which epoch: a later epoch's receipt
    # must not read an earlier "not applied" readback as the proof of its success.
    evidence = {**evidence, "verdict": verdict, "epoch": epoch}
    values: dict[str, Any] = {"evidence": evidence}
    if verdict == "applied" and evidence.get("provider_ref"):
        values["provider_ref"] = evidence["provider_ref"]
    if verdict == "applied" and result is not None:
        values["result"] = result
    due = now + timedelta(seconds=decision.delay_s) if decision is not None else now
    applied = await apply(conn, Change(
        operation_id=op.id, epoch=epoch, from_state=op.state, event=event, at=now, actor=actor,
        detail={"verdict": verdict, "evidence": evidence}, values=values, row=op,
        dispatch=Dispatch(outbox_id, subjects, available_at=due), traceparent=traceparent))
    if applied is None:
        return Recorded("rejected", reason="concurrent_change")
    if decision is not None:
        await _journal_retry(conn, op, decision, now=now, due=due, traceparent=traceparent)
        if decision.retry:
            # A retry on "not found" evidence is where a provider that breaks its horizon
            # makes a duplicate: look again once it could have shown (duplicates.py).
            await schedule_audit_txn(conn, op=op, epoch=epoch, now=now, subjects=subjects,
                                     outbox_id=f"{outbox_id}.audit"[:64])
    elif verdict == "applied" and epoch > 1:
        # A retry decided applied from evidence: its own request may still land at a provider
        # that breaks its horizon, after the audit of the epoch it retried has looked. It gets
        # an audit of its own (the outbox id is free: "applied" queues no dispatch).
        await schedule_audit_txn(conn, op=op, epoch=epoch, now=now, subjects=subjects,
                                 outbox_id=f"{outbox_id}.audit"[:64],
                                 reason="a retry decided applied")
    return Recorded("applied", to_state=applied.step.to.value)


async def _journal_retry(conn: AsyncConnection, op: OperationRow, decision: RetryDecision, *,
                         now: datetime, due: datetime, traceparent: str | None) -> None:
    """Journal the retry policy's decision (a retry's delayed command came with the change)."""
    detail = {"reason": decision.reason, "delay_s": round(decision.delay_s, 3),
              "policy_digest": policy_digest()}
    if not decision.retry:
        await append_journal(conn, operation_id=op.id, at=now, kind=JournalKind.RETRY_DECLINED,
                             actor="ledger.retry_policy", epoch=op.epoch, detail=detail,
                             traceparent=traceparent)
        return
    await append_journal(conn, operation_id=op.id, at=now, kind=JournalKind.RETRY_SCHEDULED,
                         actor="ledger.retry_policy", epoch=op.epoch + 1,
                         traceparent=traceparent, detail={**detail, "due_at": due.isoformat(),
                                 "operation_key": op.operation_key})


async def lock_op(conn: AsyncConnection, operation_id: str) -> OperationRow | None:
    row = (await conn.execute(sa.select(operations).where(operations.c.id == operation_id)
                              .with_for_update())).mappings().first()
    return OperationRow.of(row) if row is not None else None


async def record_verdict_txn(conn: AsyncConnection, v: VerdictReached, *, consumer: str,
                             message_id: str, subjects: Subjects, now: datetime,
                             outbox_id: str, decide_retry: RetryDecider | None,
                             traceparent: str | None = None) -> Recorded:
    if not await insert_ignore(conn, inbox, dict(consumer=consumer, message_id=message_id,
                                                 received_at=now)):
        return Recorded("duplicate")
    op = await lock_op(conn, v.operation_id)
    evidence = (v.evidence.model_dump(mode="json") if v.evidence else {})
    evidence |= {"reason": v.reason, "reconciler_id": v.reconciler_id}
    verdict = v.verdict
    audit_finding = op is not None and op.state is State.SUCCEEDED and is_duplicate(evidence)
    repeat = audit_finding and op is not None and already_recorded(op.evidence, evidence)
    if audit_finding and not repeat:
        assert op is not None
        # A duplicate audit's finding: recorded on the succeeded operation, state unchanged.
        if await record_audit_duplicate_txn(conn, op=op, epoch=v.epoch, evidence=evidence,
                                            actor=f"reconciler:{v.reconciler_id}", now=now):
            return Recorded("applied", to_state=State.SUCCEEDED.value,
                            reason="duplicate_detected")
    if verdict != "undecidable" and v.evidence is None:
        # Evidence before verdict: a bare "applied" or "not
        # applied" is a guess, and a guess goes to a human, never to success or a retry.
        evidence["claimed_verdict"], verdict = verdict, "undecidable"
    result = (Recorded("rejected", reason="unknown_operation") if op is None else
              # Another epoch's audit of the key found the same effects: journaled once.
              Recorded("rejected", reason="duplicate_already_recorded") if repeat else
              await apply_verdict(conn, op=op, epoch=v.epoch, verdict=verdict,
                                  evidence=evidence, actor=f"reconciler:{v.reconciler_id}",
                                  now=now, subjects=subjects, outbox_id=outbox_id,
                                  decide_retry=decide_retry, traceparent=traceparent,
                                  result=v.result.model_dump(mode="json") if v.result else None))
    if result.status == "applied" and op is not None and is_duplicate(evidence):
        await note_duplicate_txn(conn, op=op, epoch=v.epoch, evidence=evidence,
                                 actor=f"reconciler:{v.reconciler_id}", now=now)
    if result.status == "rejected":
        # A paused replica waking after another decided, or a verdict for a superseded epoch.
        await append_journal(conn, operation_id=v.operation_id, at=now,
                             kind=JournalKind.VERDICT_REJECTED,
                             actor=f"reconciler:{v.reconciler_id}", epoch=v.epoch,
                             traceparent=traceparent,
                             detail={"reason": result.reason, "verdict": v.verdict,
                                     "message_id": message_id})
    return result


def _webhook_verdict(hook: dict[str, Any]) -> str | None:
    if hook["outcome"] == "applied":
        return "applied"
    if hook["outcome"] == "not_applied" and hook["final"]:
        return "not_applied"
    return None  # pending / unknown / non-final: kept as evidence only


async def record_webhook_txn(conn: AsyncConnection, hook: WebhookReceived, *, now: datetime,
                             subjects: Subjects, outbox_id: str,
                             decide_retry: RetryDecider | None,
                             tools: Collection[str] | None = None,
                             traceparent: str | None = None) -> Recorded:
    """Store a verified webhook (dedup by provider + webhook id) and apply it if it can be.

    `tools`: the tools this provider may speak for (`Catalog.webhook_tools`); a webhook naming
    an operation of any other tool is kept, marked refused and journaled, never applied.
    """
    op = None
    if hook.operation_key:
        op = (await conn.execute(sa.select(operations.c.id, operations.c.tool).where(
            operations.c.operation_key == hook.operation_key))).first()
    if op is None and hook.provider_ref:
        op = (await conn.execute(sa.select(operations.c.id, operations.c.tool).where(
            operations.c.provider_ref == hook.provider_ref))).first()
    foreign = op is not None and tools is not None and op.tool not in tools
    row = dict(provider=hook.provider, webhook_id=hook.webhook_id, event_type=hook.event_type,
               operation_key=hook.operation_key, provider_ref=hook.provider_ref,
               outcome=hook.outcome, final=hook.final, fencing_token=hook.fencing_token,
               body_digest=hook.body_digest, signed_at=hook.signed_at, received_at=now,
               operation_id=op.id if op is not None else None,
               # Marked used, so no later state change applies it as early evidence either.
               applied="refused:provider_not_bound" if foreign else None)
    if not await insert_ignore(conn, webhook_events, row):
        return Recorded("duplicate")
    if foreign:
        assert op is not None
        # A verified webhook from one provider never speaks for another provider's tool.
        await append_journal(conn, operation_id=op.id, at=now,
                             kind=JournalKind.WEBHOOK_REFUSED,
                             actor=f"webhook:{hook.provider}",
                             detail={"webhook_id": hook.webhook_id, "tool": op.tool,
                                     "reason": "provider_not_bound"})
        return Recorded("rejected", reason="provider_not_bound")
    if op is None:
        # Before its operation exists (or for one we never made): kept, never dropped.
        await append_journal(conn, operation_id=None, at=now, kind=JournalKind.WEBHOOK_UNMATCHED,
                             actor=f"webhook:{hook.provider}",
                             detail={"webhook_id": hook.webhook_id,
                                     "operation_key": hook.operation_key})
        return Recorded("kept", reason="unknown_operation")
    locked = await lock_op(conn, op.id)
    assert locked is not None
    return await _use_webhook(conn, locked, row, now=now, subjects=subjects, outbox_id=outbox_id,
                              decide_retry=decide_retry, traceparent=traceparent)


async def _use_webhook(conn: AsyncConnection, op: OperationRow, hook: dict[str, Any], *,
                       now: datetime, subjects: Subjects, outbox_id: str,
                       decide_retry: RetryDecider | None,
                       traceparent: str | None = None) -> Recorded:
    verdict = _webhook_verdict(hook)
    where = sa.and_(webhook_events.c.provider == hook["provider"],
                    webhook_events.c.webhook_id == hook["webhook_id"])
    actor = f"webhook:{hook['provider']}"
    if verdict is None or op.state not in UNRESOLVED:
        if verdict == "not_applied" and op.state is State.SUCCEEDED:
            # The provider contradicts a recorded success: a human must look at it.
            await append_journal(conn, operation_id=op.id, at=now,
                                 kind=JournalKind.EVIDENCE_CONFLICT, actor=actor, epoch=op.epoch,
                                 detail={"webhook_id": hook["webhook_id"], "says": verdict})
        elif verdict == "applied" and (
                found := await webhook_duplicate_txn(conn, op=op, hook=hook, now=now)):
            # Another provider object for the same key: a second effect, reported at once.
            await conn.execute(webhook_events.update().where(where).values(
                applied="duplicate_detected"))
            return Recorded("kept", reason="duplicate_detected", duplicate=found)
        else:
            await append_journal(conn, operation_id=op.id, at=now, kind=JournalKind.WEBHOOK_KEPT,
                                 actor=actor, epoch=op.epoch,
                                 detail={"webhook_id": hook["webhook_id"],
                                         "outcome": hook["outcome"], "state": op.state.value})
        return Recorded("kept", reason=f"state_{op.state.value}")
    token = hook.get("fencing_token")
    if verdict == "not_applied" and token is not None and token != op.epoch:
        # "Not applied" speaks only for the attempt it names; "applied" speaks for the key.
        await conn.execute(webhook_events.update().where(where).values(applied="ignored"))
        return Recorded("kept", reason="other_epoch")
    if verdict == "not_applied" and token is None and await _before_attempt(conn, op, hook):
        # Without a token, a "not applied" received before this epoch's attempt was even
        # claimed is about an earlier attempt: applying it would retry on stale evidence.
        await conn.execute(webhook_events.update().where(where).values(applied="ignored"))
        return Recorded("kept", reason="earlier_attempt")
    if verdict == "not_applied" and token is None and not await _names_attempt(conn, op, hook):
        # Without a token, "not applied" counts only for the attempt it names by provider
        # reference. Otherwise the same event, resent under a new webhook id once the next
        # epoch has started, would retry that epoch too: a duplicate effect. Kept as evidence
        # for a person; readback or review decides.
        await conn.execute(webhook_events.update().where(where).values(
            applied="ignored:unnamed_attempt"))
        await append_journal(conn, operation_id=op.id, at=now, kind=JournalKind.WEBHOOK_KEPT,
                             actor=actor, epoch=op.epoch,
                             detail={"webhook_id": hook["webhook_id"], "outcome": "not_applied",
                                     "reason": "names_no_attempt_of_this_epoch"})
        return Recorded("kept", reason="unnamed_attempt")
    evidence = {"source": "webhook", "provider_ref": hook["provider_ref"],
                "digest": hook["body_digest"], "at": now.isoformat(),
                "webhook_id": hook["webhook_id"], "event_type": hook["event_type"]}
    result = await apply_verdict(conn, op=op, epoch=op.epoch, verdict=verdict,
                                 evidence=evidence, actor=actor, now=now, subjects=subjects,
                                 outbox_id=outbox_id, decide_retry=decide_retry,
                                 traceparent=traceparent)
    await conn.execute(webhook_events.update().where(where).values(
        applied="applied" if result.status == "applied" else f"rejected:{result.reason}"))
    if result.status == "applied" and verdict == "applied":
        # An event of this provider kept before the operation was unresolved may name
        # another object for the same key.
        found = await webhook_duplicate_txn(conn, op=op, hook=hook, now=now, settled=True)
        if found is not None:
            return Recorded("applied", to_state=result.to_state, reason="duplicate_detected",
                            duplicate=found)
    return result


async def _before_attempt(conn: AsyncConnection, op: OperationRow,
                          hook: dict[str, Any]) -> bool:
    claimed_at = (await conn.execute(
        sa.select(attempts.c.claimed_at).where(attempts.c.operation_id == op.id,
                                               attempts.c.epoch == op.epoch))).scalar()
    return claimed_at is not None and hook["received_at"] < claimed_at


async def _names_attempt(conn: AsyncConnection, op: OperationRow,
                         hook: dict[str, Any]) -> bool:
    """Whether the webhook's provider reference is that of this epoch's attempt."""
    ref = hook.get("provider_ref")
    if not ref:
        return False
    held = (await conn.execute(
        sa.select(attempts.c.provider_ref).where(attempts.c.operation_id == op.id,
                                                 attempts.c.epoch == op.epoch))).scalar()
    return held is not None and held == ref


async def settle_from_stored_webhooks(conn: AsyncConnection, op: OperationRow, *,
                                     now: datetime, subjects: Subjects, outbox_id: str,
                                     decide_retry: RetryDecider | None,
                                     binding: WebhookBinding | None = None,
                                     traceparent: str | None = None) -> Recorded | None:
    """When an operation becomes unresolved, evidence that arrived early decides it at once.

    Only evidence from a provider bound to the operation's tool counts: operation keys are
    predictable, so another provider could have planted an event before the operation existed.
    """
    rows = (await conn.execute(
        sa.select(webhook_events).where(
            sa.or_(webhook_events.c.operation_id == op.id,
                   webhook_events.c.operation_key == op.operation_key),
            webhook_events.c.applied.is_(None))
        .order_by(webhook_events.c.id))).mappings().all()
    # "applied" evidence wins over any "not applied": the effect exists.
    ordered = sorted(rows, key=lambda r: 0 if r["outcome"] == "applied" else 1)
    for hook in ordered:
        if _webhook_verdict(dict(hook)) is None:
            continue
        if binding is not None and not binding(hook["provider"], op.tool):
            # Planted before the operation existed by a provider that does not speak for its
            # tool: refused now, as it would have been had it come after (and never re-read).
            await conn.execute(webhook_events.update().where(
                webhook_events.c.provider == hook["provider"],
                webhook_events.c.webhook_id == hook["webhook_id"]).values(
                    applied="refused:provider_not_bound", operation_id=op.id))
            await append_journal(conn, operation_id=op.id, at=now,
                                 kind=JournalKind.WEBHOOK_REFUSED,
                                 actor=f"webhook:{hook['provider']}",
                                 detail={"webhook_id": hook["webhook_id"], "tool": op.tool,
                                         "reason": "provider_not_bound"})
            continue
        result = await _use_webhook(conn, op, dict(hook), now=now, subjects=subjects,
                                    outbox_id=outbox_id, decide_retry=decide_retry,
                                    traceparent=traceparent)
        if result.status == "applied":
            return result
    return None
