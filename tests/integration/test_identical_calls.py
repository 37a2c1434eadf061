"""Identical calls at the ledger (effectledger_core/identical.py), on both databases: a key-less
retry joins the first operation, a failed or cancelled one runs anew, a deliberate repeat (new
key or new label) is a new operation, and the call identity is let go of after its window."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from effectledger_core.catalog import Catalog, Tool
from effectledger_core.messages import SubmitIntent
from effectledger_core.subjects import Subjects
from effectledger_ledger.db.intents import Submitted
from effectledger_ledger.db.schema import operations
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
SUBJECTS = Subjects(prefix="tst", stream_prefix="TST")
CATALOG = Catalog({"send_email": Tool.model_validate({
    "name": "send_email", "endpoint": "https://mail.example/v1/send",
    "effect_class": "non_idempotent", "contract_revision": "2026-11-01",
    "dedupe_window_s": 600})})
EMAIL = {"to": "ops@example.com", "body": "hi"}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def _service(store: Store, clock: Clock) -> LedgerService:
    ids = itertools.count(1)
    return LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=clock,
                         ids=lambda: f"id{next(ids):04d}")


def intent(*, key: str | None = None, repeat: str | None = None, join: bool = True,
           arguments: dict[str, Any] | None = None, tenant: str = "t1") -> SubmitIntent:
    return SubmitIntent(tool="send_email", arguments=arguments or EMAIL, idempotency_key=key,
                        tenant=tenant, join_identical=join, repeat=repeat)


async def _set_state(store: Store, op_id: str, state: str) -> None:
    async with store.transaction() as conn:
        await conn.execute(operations.update().where(operations.c.id == op_id)
                           .values(state=state))


async def _holders(store: Store) -> dict[str, str]:
    async with store.transaction() as conn:
        rows = (await conn.execute(sa.select(operations.c.id, operations.c.call_key).where(
            operations.c.call_key.is_not(None)))).all()
    return {r.call_key: r.id for r in rows}


async def test_a_keyless_retry_of_a_keyed_call_joins_it(store: Store) -> None:
    """Keyed first, the answer lost, the retry without the key: the same operation."""
    svc = _service(store, Clock())
    first = await svc.submit(intent(key="host-key-1"))
    again = await svc.submit(intent())
    assert first.created and not again.created
    assert again.operation["id"] == first.operation["id"]
    assert again.operation["caller_key"] == "host-key-1"  # the key it ran under


async def test_keyless_calls_run_under_their_own_key(store: Store) -> None:
    """A key-less call gets a key of its own, which joins it later like any key."""
    svc = _service(store, Clock())
    first = await svc.submit(intent())
    key = first.operation["caller_key"]
    assert key == "auto-" + first.operation["id"]
    by_key = await svc.submit(intent(key=key))
    assert by_key.operation["id"] == first.operation["id"] and not by_key.created


async def test_a_new_key_or_a_new_label_is_a_deliberate_repeat(store: Store) -> None:
    svc = _service(store, Clock())
    a = await svc.submit(intent(key="k1"))
    b = await svc.submit(intent(key="k2"))
    assert b.created and b.operation["id"] != a.operation["id"]
    # The latest identical operation holds the identity: a key-less retry joins b, not a.
    assert (await svc.submit(intent())).operation["id"] == b.operation["id"]
    c = await svc.submit(intent(repeat="second"))
    assert c.created and c.operation["id"] not in (a.operation["id"], b.operation["id"])
    # The repeat is itself retry-safe: the same label again joins it.
    assert (await svc.submit(intent(repeat="second"))).operation["id"] == c.operation["id"]
    assert len(await _holders(store)) == 2  # one per identity, never two


async def test_failed_or_cancelled_runs_anew(store: Store) -> None:
    svc = _service(store, Clock())
    for state in ("failed", "cancelled"):
        first = await svc.submit(intent())
        await _set_state(store, first.operation["id"], state)
        again = await svc.submit(intent())
        assert again.created and again.operation["id"] != first.operation["id"], state
        # A new operation key too: a provider that cached the refusal under the first key
        # does not refuse the new attempt for it.
        assert again.operation["operation_key"] != first.operation["operation_key"]
        await _set_state(store, again.operation["id"], state)


async def test_succeeded_joins_within_the_window_then_runs_anew(store: Store) -> None:
    clock = Clock()
    svc = _service(store, clock)
    first = await svc.submit(intent())
    await _set_state(store, first.operation["id"], "succeeded")
    clock.now = T0 + timedelta(seconds=599)
    assert (await svc.submit(intent())).operation["id"] == first.operation["id"]
    clock.now = T0 + timedelta(seconds=601)
    later = await svc.submit(intent())
    assert later.created and later.operation["id"] != first.operation["id"]
    assert list((await _holders(store)).values()) == [later.operation["id"]]


async def test_an_unknown_outcome_is_joined_even_after_the_window(store: Store) -> None:
    """While nobody knows whether it applied, running it anew could be the duplicate."""
    clock = Clock()
    svc = _service(store, clock)
    first = await svc.submit(intent())
    for state in ("ambiguous", "needs_review", "in_flight", "pending"):
        await _set_state(store, first.operation["id"], state)
        clock.now = T0 + timedelta(days=3)
        assert (await svc.submit(intent())).operation["id"] == first.operation["id"], state


async def test_only_intents_that_ask_join(store: Store) -> None:
    """Without join_identical an intent behaves as before: no key, a new operation."""
    svc = _service(store, Clock())
    a = await svc.submit(intent(join=False))
    b = await svc.submit(intent(join=False))
    assert a.created and b.created and a.operation["call_key"] is None
    assert a.operation["caller_key"] is None and a.operation["operation_key"] == "op_id0001"


async def test_tenants_and_arguments_are_part_of_the_identity(store: Store) -> None:
    svc = _service(store, Clock())
    a = await svc.submit(intent())
    assert (await svc.submit(intent(tenant="t2"))).operation["id"] != a.operation["id"]
    other = {**EMAIL, "body": "other"}
    assert (await svc.submit(intent(arguments=other))).operation["id"] != a.operation["id"]


async def test_concurrent_identical_calls_create_one_operation(store: Store) -> None:
    """20 simultaneous key-less identical calls: one operation, all agree."""
    svc = _service(store, Clock())
    results: list[Submitted] = await asyncio.gather(*(svc.submit(intent())
                                                      for _ in range(20)))
    assert sum(r.created for r in results) == 1
    assert len({r.operation["id"] for r in results}) == 1


async def test_concurrent_takeovers_after_a_failure_leave_one_holder(store: Store) -> None:
    """After a failure, simultaneous retries race to take the identity over: one wins, the
    rest join it."""
    svc = _service(store, Clock())
    first = await svc.submit(intent())
    await _set_state(store, first.operation["id"], "failed")
    results: list[Submitted] = await asyncio.gather(*(svc.submit(intent())
                                                      for _ in range(10)))
    assert sum(r.created for r in results) == 1
    assert len({r.operation["id"] for r in results}) == 1
    assert list((await _holders(store)).values()) == [results[0].operation["id"]]
