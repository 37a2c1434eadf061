"""The ledger's use cases: each one transaction through `Store.run`, time and ids injected."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from effectledger_core.catalog import Catalog
from effectledger_core.crash import crash_point
from effectledger_core.ids import Clock, IdFactory, new_id, utcnow
from effectledger_core.messages import ClaimAttempt, ClaimReply, DeadLetter, Outcome, SubmitIntent
from effectledger_core.subjects import Subjects
from sqlalchemy.exc import IntegrityError

from .db import reads
from .db.claims import claim_txn
from .db.intents import Submitted, submit_intent_txn
from .db.outcomes import Recorded, record_dead_letter_txn, record_outcome_txn
from .db.store import Store

log = logging.getLogger(__name__)


@dataclass
class LedgerService:
    store: Store
    catalog: Catalog
    subjects: Subjects
    clock: Clock = utcnow
    ids: IdFactory = new_id
    # Set after every commit that adds outbox rows, so the in-process relay wakes at once.
    outbox_wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def submit(self, intent: SubmitIntent, *, actor: str = "agent") -> Submitted:
        self.catalog.get(intent.tool)  # unknown tool: a clear error before any transaction
        for _ in range(3):
            try:
                result = await self.store.run(
                    submit_intent_txn, catalog=self.catalog, intent=intent,
                    subjects=self.subjects, operation_id=self.ids(), outbox_id=self.ids(),
                    now=self.clock(), actor=actor)
            except IntegrityError:
                # Two submissions with the same key raced; the loser retries and finds the
                # winner's operation (same arguments) or a conflict (different arguments).
                continue
            if result.created:
                crash_point("ledger.after_intent_commit")
                self.outbox_wake.set()
            return result
        raise RuntimeError("intent submission kept conflicting")

    async def claim(self, claim: ClaimAttempt) -> ClaimReply:
        for _ in range(3):
            try:
                return await self.store.run(claim_txn, claim, now=self.clock())
            except IntegrityError:
                continue  # a concurrent claim for this epoch won; re-read answers "already"
        raise RuntimeError("claim kept conflicting")

    async def record_outcome(self, outcome: Outcome, *, consumer: str,
                             message_id: str) -> Recorded:
        result = await self.store.run(
            record_outcome_txn, outcome, consumer=consumer, message_id=message_id,
            subjects=self.subjects, now=self.clock(), ambiguous_outbox_id=self.ids())
        crash_point("ledger.inbox.after_commit")
        if result.to_state == "ambiguous":
            self.outbox_wake.set()
        if result.status == "rejected":
            log.info("outcome rejected: op=%s reason=%s", outcome.operation_id, result.reason)
        return result

    async def record_dead_letter(self, letter: DeadLetter) -> None:
        await self.store.run(record_dead_letter_txn, letter, now=self.clock())
        log.warning("dead-lettered %s from %s: %s", letter.message_id, letter.consumer,
                    letter.error)

    async def operation(self, operation_id: str) -> dict[str, Any]:
        async with self.store.transaction() as conn:
            return await reads.get_operation(conn, operation_id)

    async def journal(self, operation_id: str) -> list[dict[str, Any]]:
        async with self.store.transaction() as conn:
            return await reads.get_journal(conn, operation_id)

    async def receipt(self, operation_id: str) -> dict[str, Any]:
        return reads.build_receipt(await self.operation(operation_id))

    async def list_operations(self, *, state: str | None, limit: int,
                              cursor: str | None) -> dict[str, Any]:
        async with self.store.transaction() as conn:
            return await reads.list_operations(conn, state=state, limit=limit, cursor=cursor)

    async def stats(self) -> dict[str, Any]:
        from .db.outbox import backlog_txn

        async with self.store.transaction() as conn:
            return {"operations": await reads.count_by_state(conn),
                    "outbox": await backlog_txn(conn)}
