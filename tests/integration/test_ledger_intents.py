"""Intent submission on both databases: one transaction, idempotency by key, nothing on error."""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from effectledger_core.catalog import Catalog, Tool
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.errors import (
    IdempotencyConflict,
    InvalidArguments,
    PayloadTooLarge,
    UnknownTool,
)
from effectledger_core.messages import DispatchAttempt, SubmitIntent, parse
from effectledger_ledger.db.intents import Submitted, submit_intent_txn
from effectledger_ledger.db.schema import journal, metadata, operations, outbox
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.support.ledger import NOW, SUBJECTS


def make_catalog() -> Catalog:
    demo = Catalog.load(DEMO_CATALOG)
    wire = Tool.model_validate({
        "name": "wire_money", "endpoint": "https://bank.example/v1/wires",
        "effect_class": "non_idempotent", "contract_revision": "2026-11-01",
        "commit_policy": "approval"})
    return Catalog({**demo.tools, "wire_money": wire})


CATALOG = make_catalog()


async def counts(store: Store) -> dict[str, int]:
    async with store.transaction() as conn:
        return {t.name: (await conn.execute(sa.select(sa.func.count()).select_from(t))).scalar_one()
                for t in metadata.sorted_tables}


async def rows(store: Store, table: sa.Table, *where: Any) -> list[dict[str, Any]]:
    async with store.transaction() as conn:
        result = await conn.execute(sa.select(table).where(*where))
        return [dict(r) for r in result.mappings().all()]


async def submit(store: Store, op_id: str, *, tool: str = "create_ticket",
                 arguments: dict[str, Any] | None = None, key: str | None = None,
                 tenant: str = "default", task_id: str | None = None,
                 outbox_id: str | None = None) -> Submitted:
    intent = SubmitIntent(tool=tool, arguments={"title": "t"} if arguments is None else arguments,
                          idempotency_key=key, tenant=tenant, task_id=task_id)
    return await store.run(submit_intent_txn, catalog=CATALOG, intent=intent, subjects=SUBJECTS,
                           operation_id=op_id, outbox_id=outbox_id or f"ob_{op_id}", now=NOW)


def empty() -> dict[str, int]:
    return {t.name: 0 for t in metadata.sorted_tables}


async def test_submit_writes_operation_journal_and_outbox_together(store: Store) -> None:
    """A new intent commits a pending epoch-1 operation, one journal entry and one outbox row."""
    sub = await submit(store, "op1", arguments={"title": "printer on fire", "prio": 2},
                       key="k1", task_id="task9")
    assert sub.created

    [op] = await rows(store, operations)
    tool = CATALOG.get("create_ticket")
    assert op["id"] == "op1" and op["state"] == "pending" and op["epoch"] == 1
    assert op["tool"] == "create_ticket" and op["arguments"] == {"title": "printer on fire",
                                                                 "prio": 2}
    assert op["tool_digest"] == tool.digest()
    assert op["contract_revision"] == tool.contract_revision
    assert op["effect_class"] == "idempotent" and op["commit_policy"] == "auto"
    assert op["operation_key"].startswith("ck_") and op["caller_key"] == "k1"
    assert op["created_at"] == NOW and op["updated_at"] == NOW

    [entry] = await rows(store, journal)
    assert entry["operation_id"] == "op1" and entry["kind"] == "intent_accepted"
    assert entry["epoch"] == 1 and entry["to_state"] == "pending" and entry["at"] == NOW
    assert entry["detail"]["arguments_digest"] == op["arguments_digest"]

    [row] = await rows(store, outbox)
    assert row["id"] == "ob_op1" and row["kind"] == "dispatch" and row["status"] == "pending"
    assert row["epoch"] == 1 and row["publish_count"] == 0 and row["available_at"] == NOW
    assert row["subject"] == SUBJECTS.dispatch("create_ticket")
    cmd = parse(DispatchAttempt, row["payload"].encode())
    assert (cmd.operation_id, cmd.operation_key, cmd.epoch) == ("op1", op["operation_key"], 1)
    assert cmd.arguments == op["arguments"]
    assert cmd.arguments_digest == op["arguments_digest"]
    assert cmd.catalog_digest == tool.digest()
    assert cmd.contract_revision == tool.contract_revision
    assert await counts(store) == {**empty(), "operations": 1, "journal": 1, "outbox": 1}


async def test_failure_after_the_operation_insert_rolls_everything_back(store: Store) -> None:
    """The unit of work is atomic: an outbox insert that fails leaves no operation or journal."""
    await submit(store, "op1", outbox_id="ob_shared")
    before = await counts(store)
    with pytest.raises(IntegrityError):
        await submit(store, "op2", outbox_id="ob_shared")
    assert await counts(store) == before
    assert await rows(store, operations, operations.c.id == "op2") == []


async def test_same_key_same_arguments_returns_the_existing_operation(store: Store) -> None:
    """A repeated submission is idempotent: same operation, created False, nothing new written."""
    first = await submit(store, "op1", arguments={"a": 1, "b": [1, 2]}, key="k1")
    before = await counts(store)
    again = await submit(store, "op2", arguments={"b": [1, 2], "a": 1}, key="k1")
    assert not again.created
    assert again.operation["id"] == "op1"
    assert again.operation["operation_key"] == first.operation["operation_key"]
    assert await counts(store) == before


@pytest.mark.parametrize(("tool", "arguments"), [("create_ticket", {"a": 2}),
                                                 ("send_email", {"a": 1})])
async def test_same_key_different_request_is_a_conflict(store: Store, tool: str,
                                                        arguments: dict[str, Any]) -> None:
    """Reusing a key with other arguments or another tool is refused and writes nothing."""
    await submit(store, "op1", arguments={"a": 1}, key="k1")
    before = await counts(store)
    with pytest.raises(IdempotencyConflict) as info:
        await submit(store, "op2", tool=tool, arguments=arguments, key="k1")
    assert info.value.details["operation_id"] == "op1"
    assert info.value.http_status == 409
    assert await counts(store) == before


async def test_same_caller_key_in_another_tenant_or_task_is_another_operation(
        store: Store) -> None:
    """Keys are scoped: the same caller key in another tenant or task creates its own operation."""
    a = await submit(store, "op1", key="k", tenant="acme")
    b = await submit(store, "op2", key="k", tenant="globex")
    c = await submit(store, "op3", key="k", tenant="acme", task_id="t2")
    assert a.created and b.created and c.created
    assert len({a.operation["operation_key"], b.operation["operation_key"],
                c.operation["operation_key"]}) == 3
    assert (await counts(store))["outbox"] == 3


async def test_without_a_key_every_submission_is_a_new_operation(store: Store) -> None:
    """No caller key: identical submissions are distinct operations with per-operation keys."""
    a = await submit(store, "op1")
    b = await submit(store, "op2")
    assert a.created and b.created
    assert a.operation["operation_key"] == "op_op1" and b.operation["operation_key"] == "op_op2"


@pytest.mark.parametrize(
    ("tool", "arguments", "error"),
    [
        ("no_such_tool", {"a": 1}, UnknownTool),
        ("create_ticket", {"x": math.nan}, InvalidArguments),
        ("create_ticket", {"x": math.inf}, InvalidArguments),
        ("create_ticket", {"x": "a" * 70_000}, PayloadTooLarge),
        ("create_ticket", {"x": {1, 2}}, InvalidArguments),
    ],
    ids=["unknown_tool", "nan", "infinity", "oversize", "set"],
)
async def test_invalid_submission_writes_nothing(store: Store, tool: str,
                                                 arguments: dict[str, Any],
                                                 error: type[Exception]) -> None:
    """Unknown tools and bad arguments fail with our own errors and leave every table empty."""
    with pytest.raises(error):
        await submit(store, "op1", tool=tool, arguments=arguments, key="k")
    assert await counts(store) == empty()


async def test_too_deep_arguments_write_nothing(store: Store) -> None:
    """A 100k-deep argument document is refused cleanly before anything is written."""
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidArguments):
        await submit(store, "op1", arguments={"x": deep})
    assert await counts(store) == empty()


async def test_approval_policy_parks_the_operation_without_dispatch(store: Store) -> None:
    """A tool with commit_policy=approval starts awaiting_approval and emits no dispatch row."""
    sub = await submit(store, "op1", tool="wire_money", arguments={"amount": 10}, key="k")
    assert sub.created and sub.operation["state"] == "awaiting_approval"
    [op] = await rows(store, operations)
    assert op["state"] == "awaiting_approval" and op["commit_policy"] == "approval"
    [entry] = await rows(store, journal)
    assert entry["to_state"] == "awaiting_approval"
    assert await counts(store) == {**empty(), "operations": 1, "journal": 1}


def _service(store: Store) -> LedgerService:
    ids = itertools.count(1)
    return LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS,
                         clock=lambda: NOW, ids=lambda: f"id{next(ids):04d}")


async def test_concurrent_same_key_submissions_create_exactly_one_operation(
        store: Store) -> None:
    """20 simultaneous submissions with one key: one operation, one outbox row, all agree."""
    svc = _service(store)
    intent = SubmitIntent(tool="create_ticket", arguments={"title": "once"},
                          idempotency_key="same")
    results = await asyncio.gather(*(svc.submit(intent) for _ in range(20)))
    assert sum(r.created for r in results) == 1
    assert len({r.operation["id"] for r in results}) == 1
    assert await counts(store) == {**empty(), "operations": 1, "journal": 1, "outbox": 1}
    assert svc.outbox_wake.is_set()


async def test_concurrent_submissions_with_conflicting_arguments(store: Store) -> None:
    """Racing submissions with one key and different arguments: one wins, the rest conflict."""
    svc = _service(store)
    intents = [SubmitIntent(tool="create_ticket", arguments={"title": f"t{i}"},
                            idempotency_key="same")
               for i in range(10)]
    results = await asyncio.gather(*(svc.submit(i) for i in intents), return_exceptions=True)
    created = [r for r in results if isinstance(r, Submitted)]
    assert len(created) == 1 and created[0].created
    assert all(isinstance(r, IdempotencyConflict) for r in results if r not in created)
    assert await counts(store) == {**empty(), "operations": 1, "journal": 1, "outbox": 1}


async def test_service_refuses_unknown_tool_before_any_transaction(store: Store) -> None:
    """LedgerService.submit raises UnknownTool and writes nothing."""
    with pytest.raises(UnknownTool):
        await _service(store).submit(SubmitIntent(tool="nope", arguments={}))
    assert await counts(store) == empty()
