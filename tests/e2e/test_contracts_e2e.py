"""Issue 3 end to end: the policy table and the recovery contracts against the real sandbox.

Each test runs the sandbox, the ledger and a dispatcher (and, where a verdict is needed, the
reconciler) as processes, on SQLite only to stay quick, with fast tools from catalog.toml
(`fast_*`: 1 s timeouts, short horizons). Faults are armed through the sandbox's `/_faults`;
what the provider really saw comes from `/_requests` and `/_truth`. Nothing sleeps to
synchronise: every wait polls an observable condition with a deadline.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any

import pytest

from tests.support.cluster import Cluster

pytestmark = [pytest.mark.slow,
              pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

FAST = {"EFFECTLEDGER_ACK_WAIT_S": "3", "EFFECTLEDGER_INBOX_ACK_WAIT_S": "3",
        "EFFECTLEDGER_WEBHOOK_WAIT_S": "2", "EFFECTLEDGER_RECONCILE_DEADLINE_S": "15"}


async def _up(make_cluster: Any, *, reconciler: bool = False,
              webhook_routes: list[str] | None = None) -> Cluster:
    c: Cluster = make_cluster(env=FAST)
    await c.start_sandbox(webhook_routes=webhook_routes)
    await c.start_ledger()
    await c.start_dispatcher()
    if reconciler:
        await c.start_reconciler()
    return c


async def _fault(c: Cluster, route: str, action: dict[str, Any], times: int | None = 1) -> None:
    # By route: the provider sees the operation key, which the ledger derives at submit time,
    # and each test has its own sandbox, so the route picks exactly this test's requests.
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": action, "times": times})
    assert resp.status_code == 200, resp.text


async def _requests(c: Cluster, key: str) -> list[dict[str, Any]]:
    resp = await c.sandbox.get("/_requests", params={"key": key})
    resp.raise_for_status()
    return resp.json()["requests"]  # type: ignore[no-any-return]


def _kinds(journal: list[dict[str, Any]]) -> Counter[str]:
    return Counter(e["kind"] for e in journal)


async def test_429_retry_after_is_honoured_with_same_key_and_new_epoch(
        make_cluster: Any) -> None:
    """429 with `Retry-After: 2`: the retry reaches the provider no sooner than 2 s later, with
    the same operation key and a new epoch (fencing token), and succeeds."""
    c = await _up(make_cluster)
    await _fault(c, "idempotentfast", {"kind": "rate_limit", "retry_after": "2"})
    op = await c.submit_ok("fast_ticket", {"title": "rate limited"}, key="c-429")
    final = await c.wait_state(op["id"], "succeeded", 30)
    reqs = await _requests(c, op["operation_key"])
    assert [r["outcome"] for r in reqs] == ["fault:rate_limit", "applied"], reqs
    assert reqs[1]["at"] - reqs[0]["at"] >= 2.0, reqs
    assert {r["key"] for r in reqs} == {op["operation_key"]}
    assert reqs[1]["fencing_token"] > reqs[0]["fencing_token"], reqs
    assert [a["epoch"] for a in final["attempts"]] == [1, 2]
    assert final["attempts"][0]["outcome"]["retry_after_s"] == 2.0
    assert (await c.key_truth(op["operation_key"]))["applied"] == 1


async def test_400_fails_without_retry_and_with_guidance(make_cluster: Any) -> None:
    c = await _up(make_cluster)
    await _fault(c, "idempotentfast", {"kind": "status_before_apply", "status": 400})
    op = await c.submit_ok("fast_ticket", {"title": "bad"}, key="c-400")
    final = await c.wait_state(op["id"], "failed", 30)
    reqs = await _requests(c, op["operation_key"])
    assert len(reqs) == 1, reqs
    assert len(final["attempts"]) == 1 and final["epoch"] == 1
    assert "retry_scheduled" not in _kinds(await c.journal(op["id"]))
    receipt = await c.receipt(op["id"])
    guidance = receipt["guidance"] or final["last_outcome"].get("guidance")
    assert isinstance(guidance, str) and guidance.strip(), receipt


async def test_503_before_body_retries_within_max_attempts_then_fails(
        make_cluster: Any) -> None:
    c = await _up(make_cluster)
    await _fault(c, "idempotentfast", {"kind": "status_before_apply", "status": 503,
                                        "retry_after": "1"}, times=None)
    op = await c.submit_ok("fast_ticket", {"title": "unavailable"}, key="c-503")
    final = await c.wait_state(op["id"], "failed", 40)
    reqs = await _requests(c, op["operation_key"])
    assert len(reqs) == 3, reqs  # fast_ticket: max_attempts = 3
    assert {r["key"] for r in reqs} == {op["operation_key"]}
    tokens = [r["fencing_token"] for r in reqs]
    assert tokens == sorted(set(tokens)), tokens
    assert all(b["at"] - a["at"] >= 1.0 for a, b in pairwise(reqs)), reqs
    assert len(final["attempts"]) == 3
    assert (await c.key_truth(op["operation_key"]))["applied"] == 0


async def test_read_only_timeout_is_retried_once_explicitly_with_same_key(
        make_cluster: Any) -> None:
    c = await _up(make_cluster)
    await _fault(c, "plainread", {"kind": "delay", "seconds": 2.5})  # timeout_s = 1
    op = await c.submit_ok("fast_lookup", {"q": "x"}, key="c-ro")
    await c.wait_state(op["id"], "ambiguous", 30)
    resp = await c.ledger.post(f"/v1/operations/{op['id']}/retry", json={"operator": "ops"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["admitted"] is True
    await c.wait_state(op["id"], "succeeded", 30)
    reqs = await _requests(c, op["operation_key"])
    assert len(reqs) == 2 and {r["key"] for r in reqs} == {op["operation_key"]}, reqs
    # Succeeded: no further retry is admitted.
    again = await c.ledger.post(f"/v1/operations/{op['id']}/retry", json={"operator": "ops"})
    assert again.status_code == 409, again.text


async def test_non_idempotent_timeout_refuses_retry_until_review_not_executed(
        make_cluster: Any) -> None:
    c = await _up(make_cluster, reconciler=True)
    await _fault(c, "plainpager", {"kind": "delay", "seconds": 2.5})
    op = await c.submit_ok("fast_page", {"who": "oncall"}, key="c-ni")
    await c.wait_state(op["id"], "needs_review", 40)
    refused = await c.ledger.post(f"/v1/operations/{op['id']}/retry", json={"operator": "ops"})
    assert refused.status_code == 409, refused.text
    assert len(await _requests(c, op["operation_key"])) == 1
    resp = await c.ledger.post(f"/v1/operations/{op['id']}/reviews", json={
        "conclusion": "not_executed", "operator": "ops", "evidence_ref": "ticket-123"})
    assert resp.status_code == 200, resp.text
    if resp.json()["state"] not in ("pending", "in_flight", "succeeded"):
        admitted = await c.ledger.post(f"/v1/operations/{op['id']}/retry", json={"operator": "ops"})
        assert admitted.status_code == 200, admitted.text
    await c.wait_state(op["id"], "succeeded", 30)
    assert len(await _requests(c, op["operation_key"])) == 2


async def test_approval_gated_tool_nothing_before_approval_and_stale_or_altered_rejected(
        make_cluster: Any) -> None:
    c = await _up(make_cluster)
    op = await c.submit_ok("fast_wire", {"amount": 100, "to": "acct-1"}, key="c-appr")
    op = await c.wait_state(op["id"], "awaiting_approval", 20)
    assert (await c.truth())["total_requests"] == 0
    url = f"/v1/operations/{op['id']}/approve"
    stale = await c.ledger.post(url, json={"operator": "ops", "epoch": op["epoch"] + 1,
                                           "arguments_digest": op["arguments_digest"]})
    assert stale.status_code == 409, stale.text
    altered = await c.ledger.post(url, json={"operator": "ops", "epoch": op["epoch"],
                                             "arguments_digest": "sha256:" + "0" * 64})
    assert altered.status_code == 409, altered.text
    assert (await c.operation(op["id"]))["state"] == "awaiting_approval"
    assert (await c.truth())["total_requests"] == 0
    ok = await c.ledger.post(url, json={"operator": "ops", "epoch": op["epoch"],
                                        "arguments_digest": op["arguments_digest"]})
    assert ok.status_code == 200, ok.text
    await c.wait_state(op["id"], "succeeded", 30)
    assert len(await _requests(c, op["operation_key"])) == 1
