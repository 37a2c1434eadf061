"""Submit-and-wait (issue 13): `?wait=` on the intent and operation routes answers as soon as
the operation settles, pushed by the commit that moved it, on both databases. Driven
in-process through httpx.ASGITransport, like the auth tests."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from effectledger_core.messages import AttemptSucceeded, ClaimAttempt
from effectledger_core.retry_policy import RetryBudget
from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator
from effectledger_ledger.db.claims import claim_txn
from effectledger_ledger.db.outcomes import record_outcome_txn
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.integration.test_api_auth import AGENT_A, AGENT_B, AGENTS, CATALOG, SUBJECTS, auth
from tests.support.cluster import wait_until
from tests.support.ledger import NOW

# Long enough that a wait ending early can only have been woken, never timed out.
LONG = "30s"


@pytest.fixture
async def svc(store: Store) -> AsyncIterator[LedgerService]:
    counter = itertools.count(1)
    s = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: NOW,
                      ids=lambda: f"id{next(counter):05d}", rng=random.Random(2),
                      budget=RetryBudget(capacity=1e9, refill_per_s=0.0), wait_recheck_s=0)
    yield s
    await s.close()


@pytest.fixture
async def client(svc: LedgerService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(svc, ready=_ready, auth=Authenticator(AGENTS, {}), max_wait_s=60)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://ledger.test", timeout=60) as c:
        yield c


async def _ready() -> dict[str, Any]:
    return {"database": True}


async def _submit(client: httpx.AsyncClient, tool: str = "lookup") -> dict[str, Any]:
    resp = await client.post("/v1/intents", headers=auth(AGENT_A),
                             json={"tool": tool, "arguments": {"q": 1}})
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def _claim(op_id: str) -> ClaimAttempt:
    return ClaimAttempt(operation_id=op_id, epoch=1, attempt_id=f"{op_id}-a", dispatcher_id="d1")


def _success(op_id: str) -> AttemptSucceeded:
    return AttemptSucceeded(operation_id=op_id, epoch=1, attempt_id=f"{op_id}-a",
                            dispatcher_id="d1", at=NOW, response_digest="sha256:beef",
                            provider_ref="ref-1", http_status=200)


async def _waiting(svc: LedgerService, n: int = 1) -> None:
    await wait_until(lambda: len(svc.waiters) == n, 10, interval=0.01, what=f"{n} waiter(s)")


async def test_wait_answers_when_the_outcome_commits_not_at_the_deadline(
        svc: LedgerService, client: httpx.AsyncClient) -> None:
    """A GET with a 30 s wait stays open through `in_flight` (not settled) and answers with
    `succeeded` as soon as the outcome's commit signals it."""
    op = await _submit(client)
    get = asyncio.create_task(client.get(f"/v1/operations/{op['id']}", params={"wait": LONG},
                                         headers=auth(AGENT_A)))
    await _waiting(svc)
    await svc.claim(_claim(op["id"]))
    await _waiting(svc)  # in_flight is not settled: still waiting
    assert not get.done()
    await svc.record_outcome(_success(op["id"]), consumer="ledger", message_id="m1")
    resp = await asyncio.wait_for(get, 10)
    assert resp.status_code == 200 and resp.json()["state"] == "succeeded"
    assert resp.json()["provider_ref"] == "ref-1"
    assert len(svc.waiters) == 0  # nothing left behind


async def test_changed_from_answers_at_the_next_state(
        svc: LedgerService, client: httpx.AsyncClient) -> None:
    """`changed_from=pending` answers at `in_flight`: what a progress display needs."""
    op = await _submit(client)
    get = asyncio.create_task(client.get(
        f"/v1/operations/{op['id']}", params={"wait": LONG, "changed_from": "pending"},
        headers=auth(AGENT_A)))
    await _waiting(svc)
    await svc.claim(_claim(op["id"]))
    resp = await asyncio.wait_for(get, 10)
    assert resp.json()["state"] == "in_flight"


async def test_submit_and_wait_stops_at_awaiting_approval(client: httpx.AsyncClient) -> None:
    """An approval-gated tool needs a human: the wait answers at once with awaiting_approval."""
    resp = await asyncio.wait_for(client.post(
        "/v1/intents", params={"wait": LONG}, headers=auth(AGENT_A),
        json={"tool": "payout", "arguments": {"amount": 5}}), 10)
    assert resp.status_code == 201 and resp.json()["state"] == "awaiting_approval"


async def test_wait_ends_at_its_deadline_with_the_current_state(
        client: httpx.AsyncClient) -> None:
    """Nothing moves the operation: the answer comes at the end of the wait, still pending."""
    resp = await client.post("/v1/intents", params={"wait": "200ms"}, headers=auth(AGENT_A),
                             json={"tool": "lookup", "arguments": {"q": 2}})
    assert resp.status_code == 201 and resp.json()["state"] == "pending"


async def test_invalid_wait_is_refused_before_anything_is_submitted(
        svc: LedgerService, client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/intents", params={"wait": "soon"}, headers=auth(AGENT_A),
                             json={"tool": "lookup", "arguments": {"q": 3}})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_request"
    assert "wait" in resp.json()["error"]["message"]
    assert (await svc.list_operations(state=None, limit=10, cursor=None)).items == []


async def test_waiting_on_another_tenants_operation_is_not_found(
        svc: LedgerService, client: httpx.AsyncClient) -> None:
    op = await _submit(client)
    resp = await client.get(f"/v1/operations/{op['id']}", params={"wait": LONG},
                            headers=auth(AGENT_B))
    assert resp.status_code == 404 and len(svc.waiters) == 0


async def test_recheck_wakes_a_wait_for_a_change_made_elsewhere(
        svc: LedgerService, store: Store, client: httpx.AsyncClient) -> None:
    """A commit this process did not signal (another ledger replica) is found by the shared
    re-check: one query for all watched ids, and only the moved operation's wait wakes."""
    moved, still = await _submit(client), await _submit(client)
    waits = [asyncio.create_task(client.get(f"/v1/operations/{o['id']}", params={"wait": LONG},
                                            headers=auth(AGENT_A))) for o in (moved, still)]
    await _waiting(svc, 2)
    # Both waits have read the state they sleep on: a wait whose read came after the writes
    # below would end by itself, and the re-check would have nothing to wake (seen under load).
    await wait_until(lambda: all(w.seen is not None for ws in svc.waiters._by_op.values()
                                 for w in ws), 10, interval=0.01, what="the waits' reads")
    # Written straight to the database, as another replica would: no signal here.
    await store.run(claim_txn, _claim(moved["id"]), now=NOW)
    await store.run(record_outcome_txn, _success(moved["id"]), consumer="ledger",
                    message_id="m2", subjects=SUBJECTS, now=NOW, ambiguous_outbox_id="amb")
    assert await svc.waiters.recheck() == 1
    resp = await asyncio.wait_for(waits[0], 10)
    assert resp.json()["state"] == "succeeded"
    assert not waits[1].done()
    waits[1].cancel()


async def test_waits_starting_together_share_their_state_reads(
        svc: LedgerService, client: httpx.AsyncClient) -> None:
    """Two hundred waits arriving at once read their states in a handful of batched queries,
    not one query each: the connection pool stays free for everyone else."""
    ops = [await _submit(client) for _ in range(200)]
    before = svc.waiters.state_queries
    waits = [asyncio.create_task(svc.wait_operation(o["id"], 30)) for o in ops]
    await _waiting(svc, 200)
    await wait_until(lambda: svc.waiters.state_queries > before, 10, interval=0.01,
                     what="the batched read")
    assert svc.waiters.state_queries - before <= 5
    await svc.claim(_claim(ops[0]["id"]))
    await svc.record_outcome(_success(ops[0]["id"]), consumer="ledger", message_id="m9")
    assert (await asyncio.wait_for(waits[0], 10)).state == "succeeded"
    for w in waits[1:]:
        w.cancel()
    await asyncio.gather(*waits[1:], return_exceptions=True)
    assert len(svc.waiters) == 0


async def test_submit_and_wait_sleeps_on_its_own_commit_and_wakes_only_to_answer(
        svc: LedgerService, client: httpx.AsyncClient) -> None:
    """POST /v1/intents?wait= reads no state before it sleeps (its own commit told it
    `pending`), and the claim's `in_flight`, which cannot end the wait, wakes no one; the
    outcome's commit does, and the answer is the settled operation."""
    before_reads, before_wakes = svc.waiters.state_queries, svc.waiters.wakeups
    post = asyncio.create_task(client.post("/v1/intents", headers=auth(AGENT_A), params={
        "wait": LONG}, json={"tool": "lookup", "arguments": {"q": 2}}))
    await _waiting(svc)
    [op_id] = list(svc.waiters._by_op)
    await svc.claim(_claim(op_id))
    assert svc.waiters.wakeups == before_wakes  # in_flight: noted, nobody woken
    assert not post.done()
    await svc.record_outcome(_success(op_id), consumer="ledger", message_id="m10")
    resp = await asyncio.wait_for(post, 10)
    assert resp.status_code == 201 and resp.json()["state"] == "succeeded"
    assert svc.waiters.wakeups == before_wakes + 1
    assert svc.waiters.state_queries == before_reads


async def test_a_success_alone_answers_the_wait_with_its_own_view(
        svc: LedgerService, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """On PostgreSQL a success alone returns the operation's view from its own statement
    (db/outcomes.py `_success_alone`); the wait it ends answers with it, without a read, and
    it is what a read gives. On SQLite the wait reads it, as before."""
    reads: list[str] = []
    real = svc.operation

    async def counted(operation_id: str) -> Any:
        reads.append(operation_id)
        return await real(operation_id)

    monkeypatch.setattr(svc, "operation", counted)
    post = asyncio.create_task(client.post("/v1/intents", headers=auth(AGENT_A), params={
        "wait": LONG}, json={"tool": "lookup", "arguments": {"q": 4}}))
    await _waiting(svc)
    [op_id] = list(svc.waiters._by_op)
    await svc.claim(_claim(op_id))
    await svc.record_outcome(_success(op_id), consumer="ledger", message_id="m12")
    resp = await asyncio.wait_for(post, 10)
    assert resp.status_code == 201 and resp.json()["state"] == "succeeded"
    assert reads == ([] if svc.store.is_postgres else [op_id])
    assert resp.json() == (await real(op_id)).model_dump(mode="json")


async def test_a_wait_on_an_existing_operation_still_reads_its_state(
        svc: LedgerService, client: httpx.AsyncClient) -> None:
    """Only the commit that created the operation may stand for the first read: a keyed
    resubmission of a settled operation answers at once from the database."""
    body = {"tool": "lookup", "arguments": {"q": 3}, "idempotency_key": "k-settled"}
    first = await client.post("/v1/intents", headers=auth(AGENT_A), json=body)
    op_id = first.json()["id"]
    await svc.claim(_claim(op_id))
    await svc.record_outcome(_success(op_id), consumer="ledger", message_id="m11")
    again = await asyncio.wait_for(client.post("/v1/intents", headers=auth(AGENT_A),
                                               params={"wait": LONG}, json=body), 10)
    assert again.status_code == 200 and again.json()["state"] == "succeeded"
