"""The ledger driven in-process, for integration tests on both databases.

`LedgerDriver` wraps a `LedgerService` with a clock the test moves (`now`), counted ids, a
seeded rng and an unlimited retry budget, and plays the other services' side of the
conversation: the dispatcher's claims and outcomes, the reconciler's verdicts, the webhook
intake. It reads rows back for assertions. A test file subclasses it to name its catalog, its
default tool and its seed:

    class Ledger(LedgerDriver):
        default_catalog, tool, seed = CATALOG, "ticket", 5

Messages come from the same models the services send (`effectledger_core.messages`), so a
test never builds a shape the real services could not.
"""

from __future__ import annotations

import itertools
import random
import tomllib
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

import sqlalchemy as sa

from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.failures import Failure, Idempotency
from effectledger_core.messages import (
    AttemptFailed,
    ClaimAttempt,
    ClaimStatus,
    Evidence,
    FailureClass,
    OutcomeAmbiguous,
    SubmitIntent,
    VerdictReached,
    WebhookReceived,
)
from effectledger_core.retry_policy import RetryBudget
from effectledger_core.subjects import Subjects
from effectledger_ledger.db.rows import Recorded
from effectledger_ledger.db.schema import journal, outbox
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService

NOW = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
# In-process tests publish nothing: the subjects only name what the outbox rows would carry.
SUBJECTS = Subjects(prefix="tst", stream_prefix="TST")
DEMO = Catalog.load(DEMO_CATALOG)  # the catalog `up --demo` serves


def catalog_from_toml(text: str) -> Catalog:
    """A catalog from TOML text, as `catalog.toml` would hold it."""
    return Catalog.from_mapping(tomllib.loads(text))


def unlimited_budget() -> RetryBudget:
    """A retry budget that never runs out: only the policy under test decides retries."""
    return RetryBudget(capacity=1e9, refill_per_s=0.0)


class LedgerDriver:
    """A LedgerService with a controllable clock, counted ids and a seeded rng, plus the
    dispatcher's, the reconciler's and the webhook intake's side of the conversation."""

    default_catalog: ClassVar[Catalog]
    tool: ClassVar[str | None] = None  # what `submit()` submits when no tool is named
    seed: ClassVar[int] = 1  # the retry policy's jitter

    def __init__(self, store: Store, catalog: Catalog | None = None, *,
                 budget: RetryBudget | None = None) -> None:
        self.store, self.now = store, NOW
        self.budget = budget or unlimited_budget()
        self._ids = itertools.count(1)
        self._messages = itertools.count(1)
        self.svc = self._service(catalog or self.default_catalog)

    def _service(self, catalog: Catalog) -> LedgerService:
        return LedgerService(
            store=self.store, catalog=catalog, subjects=SUBJECTS, clock=lambda: self.now,
            ids=lambda: f"id{next(self._ids):05d}", rng=random.Random(self.seed),
            budget=self.budget)

    def use_catalog(self, catalog: Catalog) -> None:
        """The ledger restarted with another catalog: same store, clock, ids and messages."""
        self.svc = self._service(catalog)

    def mid(self) -> str:
        """A fresh message id, as JetStream would give each delivery's Nats-Msg-Id."""
        return f"m{next(self._messages):05d}"

    # ---- the caller ----------------------------------------------------------------------

    async def submit(self, tool: str | None = None, *, caller_key: str | None = None,
                     **arguments: Any) -> str:
        tool = tool or self.tool
        assert tool is not None, "name a tool, or set the driver's `tool`"
        result = await self.svc.submit(SubmitIntent(
            tool=tool, arguments=arguments or {"n": 1}, idempotency_key=caller_key))
        return str(result.operation["id"])

    # ---- the dispatcher ------------------------------------------------------------------

    async def claim(self, op_id: str, epoch: int = 1) -> str:
        attempt = f"{op_id}-a{epoch}"
        reply = await self.svc.claim(ClaimAttempt(operation_id=op_id, epoch=epoch,
                                                  attempt_id=attempt, dispatcher_id="d1"))
        assert reply.status is ClaimStatus.GRANTED, reply
        return attempt

    async def ambiguous(self, op_id: str, epoch: int = 1, *, claimed: bool = False,
                        reason: str = "timeout", message: str = "") -> Recorded:
        """The dispatcher lost the provider's answer (claiming first unless `claimed`)."""
        attempt = f"{op_id}-a{epoch}" if claimed else await self.claim(op_id, epoch)
        recorded = await self.svc.record_outcome(OutcomeAmbiguous(
            operation_id=op_id, epoch=epoch, attempt_id=attempt, dispatcher_id="d1",
            at=self.now, reason=reason, message=message), consumer="ledger",
            message_id=self.mid())
        assert recorded.status == "applied", recorded
        return recorded

    async def fail(self, op_id: str, epoch: int, cls: FailureClass, *, code: str,
                   http_status: int, retry_after_s: float | None = None,
                   idempotency: str = "yes", guidance: str | None = None) -> Recorded:
        """The provider refused; the guidance is what the dispatcher renders from the same
        table unless the test gives its own."""
        attempt = await self.claim(op_id, epoch)
        if guidance is None:
            guidance = Failure(cls, code, "provider said no", retry_after_s=retry_after_s,
                               idempotency=Idempotency(idempotency)).guidance()
        outcome = AttemptFailed(
            operation_id=op_id, epoch=epoch, attempt_id=attempt, dispatcher_id="d1",
            at=self.now, http_status=http_status, failure_class=cls, code=code,
            message="provider said no", retry_after_s=retry_after_s, idempotency=idempotency,
            guidance=guidance)
        return await self.svc.record_outcome(outcome, consumer="ledger.outcomes",
                                             message_id=self.mid())

    # ---- the reconciler ------------------------------------------------------------------

    async def verdict(self, op_id: str,
                      verdict: Literal["applied", "not_applied", "undecidable"],
                      epoch: int = 1, *, reconciler: str = "r1",
                      reason: str = "readback") -> Recorded:
        evidence = None
        if verdict != "undecidable":
            evidence = Evidence(source="readback", at=self.now, provider_ref="tk_7",
                                digest="sha256:readback", detail="found by key")
        return await self.svc.record_verdict(VerdictReached(
            operation_id=op_id, epoch=epoch, verdict=verdict, evidence=evidence,
            reconciler_id=reconciler, reason=reason, at=self.now),
            consumer="ledger", message_id=self.mid())

    async def undecidable(self, op_id: str, epoch: int = 1, *, reason: str = "timeout",
                          message: str = "") -> None:
        """Ambiguous, then no machine could decide: the operation waits for a human."""
        assert (await self.ambiguous(op_id, epoch, reason=reason, message=message)
                ).to_state == "ambiguous"
        recorded = await self.verdict(op_id, "undecidable", epoch,
                                      reason="no readback and no webhook")
        assert recorded.to_state == "needs_review", recorded

    # ---- the webhook intake --------------------------------------------------------------

    async def webhook(self, webhook_id: str, *, key: str | None,
                      outcome: Literal["applied", "not_applied", "pending"] = "applied",
                      final: bool = True, fencing_token: int | None = None,
                      event_type: str = "effect.updated") -> Recorded:
        return await self.svc.record_webhook(WebhookReceived(
            provider="sandbox", webhook_id=webhook_id, event_type=event_type,
            operation_key=key, provider_ref="tk_hook", outcome=outcome, final=final,
            fencing_token=fencing_token, body_digest="sha256:body", signed_at=self.now,
            received_at=self.now))

    # ---- reading back --------------------------------------------------------------------

    async def op(self, op_id: str) -> dict[str, Any]:
        """The operation as the HTTP API answers it (its JSON form), for assertions on it."""
        return (await self.svc.operation(op_id)).model_dump(mode="json")

    async def key(self, op_id: str) -> str:
        return str((await self.op(op_id))["operation_key"])

    async def rows(self, table: sa.Table, *where: Any) -> list[dict[str, Any]]:
        """The table's rows matching `where`, in id order where the table has ids."""
        async with self.store.transaction() as conn:
            rows = (await conn.execute(sa.select(table).where(*where))).mappings().all()
        return sorted((dict(r) for r in rows), key=lambda r: str(r.get("id")))

    async def entries(self, op_id: str | None, kind: str) -> list[dict[str, Any]]:
        """Journal entries of one kind for an operation (None: entries about none)."""
        async with self.store.transaction() as conn:
            rows = (await conn.execute(
                sa.select(journal).where(journal.c.operation_id.is_(None) if op_id is None
                                         else journal.c.operation_id == op_id,
                                         journal.c.kind == kind)
                .order_by(journal.c.id))).mappings().all()
        return [dict(r) for r in rows]

    async def kinds(self, op_id: str) -> list[str]:
        """The kinds of the operation's journal entries, oldest first."""
        rows = await self.rows(journal, journal.c.operation_id == op_id)
        return [r["kind"] for r in sorted(rows, key=lambda r: r["id"])]

    async def outbox_rows(self, op_id: str, kind: str = "dispatch") -> list[dict[str, Any]]:
        rows = await self.rows(outbox, outbox.c.operation_id == op_id, outbox.c.kind == kind)
        return sorted(rows, key=lambda r: (r["epoch"], r["id"]))
