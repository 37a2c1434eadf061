"""Trace context kept in outbox rows, on both databases: the intent's, and the follow-ups'."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span

from effectledger_core.messages import ClaimAttempt, OutcomeAmbiguous, SubmitIntent
from effectledger_ledger.db.schema import journal, outbox
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from effectledger_obs import tracing
from tests.support.ledger import DEMO as CATALOG
from tests.support.ledger import NOW as T0
from tests.support.ledger import SUBJECTS


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("test", exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


async def traceparents(store: Store) -> dict[str, str | None]:
    async with store.transaction() as conn:
        rows = (await conn.execute(sa.select(outbox.c.kind, outbox.c.traceparent))).all()
    return {r.kind: r.traceparent for r in rows}


async def test_the_dispatch_and_reconcile_rows_keep_their_trace_context(
        store: Store, spans: InMemorySpanExporter) -> None:
    now = [T0]
    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: now[0])
    try:
        with tracing.span("POST /v1/intents") as request:
            assert request is not None
            op = (await svc.submit(_ticket())).operation
        await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1, attempt_id="a1",
                                     dispatcher_id="d1"))
        now[0] = T0 + timedelta(seconds=3)
        with tracing.span("inbox outcome") as inbox:
            assert inbox is not None
            await svc.record_outcome(OutcomeAmbiguous(
                operation_id=op["id"], epoch=1, attempt_id="a1", dispatcher_id="d1",
                at=now[0], reason="timeout"), consumer="ledger-inbox", message_id="m1")
    finally:
        await svc.close()
    kept = await traceparents(store)
    async with store.transaction() as conn:
        [accepted] = (await conn.execute(sa.select(journal.c.detail).where(
            journal.c.kind == "intent_accepted"))).scalars().all()
    ctx = request.get_span_context()
    assert (accepted["trace_id"], accepted["span_id"]) == (
        format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))
    [finished] = [s for s in spans.get_finished_spans() if s.name == "POST /v1/intents"]
    assert finished.attributes is not None
    assert finished.attributes["effectledger.operation_id"] == op["id"]
    for kind, span in (("dispatch", request), ("reconcile", inbox)):
        ctx = span.get_span_context()
        stored = kept[kind]
        assert stored is not None, kind
        # version-trace id-parent id-flags: the flags are the SDK's (sampled, random id)
        assert stored.split("-")[:3] == ["00", format(ctx.trace_id, "032x"),
                                         format(ctx.span_id, "016x")], kind


async def test_without_tracing_no_context_is_stored(store: Store) -> None:
    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: T0)
    try:
        await svc.submit(_ticket())
    finally:
        await svc.close()
    assert await traceparents(store) == {"dispatch": None}


async def journal_details(store: Store, operation_id: str) -> dict[str, dict[str, object]]:
    async with store.transaction() as conn:
        rows = (await conn.execute(sa.select(journal.c.kind, journal.c.detail).where(
            journal.c.operation_id == operation_id).order_by(journal.c.id))).all()
    return {r.kind: r.detail for r in rows}


async def test_claim_and_outcome_entries_carry_their_messages_trace_ids(
        store: Store, spans: InMemorySpanExporter) -> None:
    now = [T0]
    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: now[0])
    seen: dict[str, tuple[str, str]] = {}

    async def claim_in_span(op_id: str) -> None:
        with tracing.span("consume claim") as s:
            assert s is not None
            seen["claim"] = ids(s)
            await svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id="a1",
                                         dispatcher_id="d1"))

    try:
        op = (await svc.submit(_ticket())).operation
        other = (await svc.submit(_ticket())).operation
        # Submitted together, so group commit may decide both in one set-based batch: each
        # entry must carry its own call's context (the second has none), not a neighbour's.
        await asyncio.gather(claim_in_span(op["id"]), svc.claim(ClaimAttempt(
            operation_id=other["id"], epoch=1, attempt_id="b1", dispatcher_id="d1")))
        with tracing.span("consume stale claim") as stale:
            assert stale is not None
            await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=7, attempt_id="a2",
                                         dispatcher_id="d2"))
        now[0] = T0 + timedelta(seconds=3)
        with tracing.span("consume outcome") as outcome:
            assert outcome is not None
            await svc.record_outcome(OutcomeAmbiguous(
                operation_id=op["id"], epoch=1, attempt_id="a1", dispatcher_id="d1",
                at=now[0], reason="timeout"), consumer="ledger-inbox", message_id="m1")
    finally:
        await svc.close()
    entries = await journal_details(store, op["id"])
    assert _ids(entries["attempt_claimed"]) == seen["claim"]
    assert _ids(entries["claim_rejected"]) == ids(stale)
    assert _ids(entries["outcome_recorded"]) == ids(outcome)
    # Neither the intent (submitted outside any span) nor the untraced claim has trace keys.
    assert "trace_id" not in entries["intent_accepted"]
    assert (await journal_details(store, other["id"]))["attempt_claimed"] == {
        "attempt_id": "b1"}


def ids(span: Span) -> tuple[str, str]:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def _ids(detail: dict[str, object]) -> tuple[object, object]:
    return detail.get("trace_id"), detail.get("span_id")


async def test_a_claim_without_trace_context_journals_no_ids(store: Store) -> None:
    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: T0)
    try:
        op = (await svc.submit(_ticket())).operation
        await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1, attempt_id="a1",
                                     dispatcher_id="d1"))
    finally:
        await svc.close()
    claimed = (await journal_details(store, op["id"]))["attempt_claimed"]
    assert claimed == {"attempt_id": "a1"}


def _ticket() -> SubmitIntent:
    return SubmitIntent(tool="create_ticket", arguments={"title": "t"})


async def test_a_request_makes_one_server_span_the_ledgers_own(
        store: Store, spans: InMemorySpanExporter) -> None:
    """FastAPI from 0.165 traces requests itself once a tracer provider is set; the ledger's
    HttpObservability already does, so the ledger's app turns FastAPI's off: one server span
    per request (the console's, mounted inside, included), not two, and no FastAPI internals."""
    import httpx

    from effectledger_ledger.api import create_app

    async def ready() -> dict[str, object]:
        return {"ready": True}

    svc = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS)
    try:
        app = create_app(svc, ready=ready)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://ledger.test") as client:
            assert (await client.get("/v1/operations/nope")).status_code == 404
            assert (await client.get("/console/login")).status_code == 200
    finally:
        await svc.close()
    finished = spans.get_finished_spans()
    assert [(s.name, s.instrumentation_scope.name if s.instrumentation_scope else None)
            for s in finished] == [("GET /v1/operations/{operation_id}", "effectledger"),
                                   ("GET /login", "effectledger")], finished
