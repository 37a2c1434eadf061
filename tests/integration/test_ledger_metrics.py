"""The ledger's metrics on both databases: committed transitions only, gauges from the rows."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx
import sqlalchemy as sa
from prometheus_client import REGISTRY
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.messages import (
    AttemptSucceeded,
    ClaimAttempt,
    OutcomeAmbiguous,
    SubmitIntent,
)
from effectledger_ledger.api import create_app
from effectledger_ledger.db.common import append_journal
from effectledger_ledger.db.schema import operations
from effectledger_ledger.db.store import Store
from effectledger_ledger.gauges import DbGauges
from effectledger_ledger.service import LedgerService
from tests.support.ledger import DEMO as CATALOG
from tests.support.ledger import NOW as T0
from tests.support.ledger import SUBJECTS


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def service(store: Store, now: list[datetime]) -> LedgerService:
    return LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: now[0])


async def test_transitions_are_counted_once_committed_never_when_rolled_back(
        store: Store) -> None:
    svc = service(store, [T0])
    before = sample("effectledger_transitions_total", from_state="pending", to_state="in_flight")

    async def change_then_fail(conn: AsyncConnection) -> None:
        await append_journal(conn, operation_id="op-x", at=T0, kind="attempt_claimed",
                             actor="t", epoch=1, from_state="pending", to_state="in_flight")
        raise RuntimeError("rolled back")

    try:
        await store.run(change_then_fail)
    except RuntimeError:
        pass
    assert sample("effectledger_transitions_total", from_state="pending",
                  to_state="in_flight") == before

    async def change(conn: AsyncConnection) -> None:
        await append_journal(conn, operation_id="op-x", at=T0, kind="attempt_claimed",
                             actor="t", epoch=1, from_state="pending", to_state="in_flight")

    await store.run(change)
    assert sample("effectledger_transitions_total", from_state="pending",
                  to_state="in_flight") == before + 1
    await svc.close()


async def test_a_pipeline_of_calls_moves_the_counters_and_the_latency_histograms(
        store: Store) -> None:
    now = [T0]
    svc = service(store, now)
    created = sample("effectledger_intents_total", tool="create_ticket", result="created")
    existing = sample("effectledger_intents_total", tool="create_ticket", result="existing")
    refused = sample("effectledger_intents_refused_total", reason="unknown_tool")
    succeeded = sample("effectledger_transitions_total", from_state="in_flight",
                       to_state="succeeded")
    granted = sample("effectledger_claims_total", status="granted")
    e2e = sample("effectledger_operation_duration_seconds_count", tool="create_ticket",
                 state="succeeded")
    try:
        intent = SubmitIntent(tool="create_ticket", arguments={"title": "t"},
                              idempotency_key="k1")
        op = (await svc.submit(intent)).operation
        await svc.submit(intent)
        try:
            await svc.submit(SubmitIntent(tool="no_such_tool", arguments={}))
        except Exception:
            pass
        now[0] = T0 + timedelta(seconds=2)
        await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1, attempt_id="a1",
                                     dispatcher_id="d1"))
        now[0] = T0 + timedelta(seconds=5)
        await svc.record_outcome(AttemptSucceeded(
            operation_id=op["id"], epoch=1, attempt_id="a1", dispatcher_id="d1",
            at=T0 + timedelta(seconds=4), response_digest="sha256:x"),
            consumer="ledger-inbox", message_id="m1")
    finally:
        await svc.close()
    assert sample("effectledger_intents_total", tool="create_ticket",
                  result="created") == created + 1
    assert sample("effectledger_intents_total", tool="create_ticket",
                  result="existing") == existing + 1
    assert sample("effectledger_intents_refused_total", reason="unknown_tool") == refused + 1
    assert sample("effectledger_claims_total", status="granted") == granted + 1
    assert sample("effectledger_transitions_total", from_state="in_flight",
                  to_state="succeeded") == succeeded + 1
    assert sample("effectledger_operation_duration_seconds_count", tool="create_ticket",
                  state="succeeded") == e2e + 1
    # 5 s from acceptance to success: in the (2.5, 5] bucket, not below.
    assert sample("effectledger_operation_duration_seconds_bucket", tool="create_ticket",
                  state="succeeded", le="5.0") == e2e + 1
    assert sample("effectledger_operation_duration_seconds_bucket", tool="create_ticket",
                  state="succeeded", le="2.5") <= e2e


async def test_waiting_gauges_are_read_from_the_rows_on_scrape(store: Store) -> None:
    now = [T0]
    svc = service(store, now)
    try:
        ops = [(await svc.submit(SubmitIntent(tool="create_ticket", arguments={"title": f"t{i}"})))
               .operation for i in range(3)]
        for i, op in enumerate(ops[:2]):
            await svc.claim(ClaimAttempt(operation_id=op["id"], epoch=1, attempt_id=f"a{i}",
                                         dispatcher_id="d1"))
            now[0] = T0 + timedelta(seconds=10 * (i + 1))
            await svc.record_outcome(OutcomeAmbiguous(
                operation_id=op["id"], epoch=1, attempt_id=f"a{i}", dispatcher_id="d1",
                at=now[0], reason="timeout"), consumer="ledger-inbox", message_id=f"m{i}")
        async with store.transaction() as conn:
            await conn.execute(operations.update().where(operations.c.id == ops[2]["id"])
                               .values(state="needs_review", updated_at=T0))
        now[0] = T0 + timedelta(seconds=100)
        gauges = DbGauges(store, reconcile_deadline_s=3600, min_interval_s=0, clock=lambda: now[0])
        app = create_app(svc, ready=_ready, before_scrape=gauges.refresh)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            text = (await client.get("/metrics")).text
    finally:
        await svc.close()
    assert "effectledger_ambiguous_operations 2.0" in text
    assert "effectledger_ambiguous_oldest_age_seconds 90.0" in text  # ambiguous since T0+10 s
    assert "effectledger_review_queue_operations 1.0" in text
    assert "effectledger_review_oldest_age_seconds 100.0" in text
    assert 'effectledger_operations{state="ambiguous"} 2.0' in text
    assert "effectledger_reconcile_deadline_seconds 3600.0" in text
    # The claims consumed two dispatch commands; each ambiguous outcome queued a reconcile
    # command that nobody has published: 1 dispatch + 2 reconcile.
    assert "effectledger_outbox_unpublished_rows 3.0" in text
    assert "effectledger_outbox_oldest_unpublished_age_seconds 100.0" in text  # written at T0
    async with store.transaction() as conn:
        ambiguous = (await conn.execute(sa.select(sa.func.count()).select_from(operations)
                                        .where(operations.c.state == "ambiguous"))).scalar()
    assert ambiguous == 2


async def _ready() -> dict[str, bool]:
    return {"database": True}
