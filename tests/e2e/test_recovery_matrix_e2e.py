"""Issue 4 end to end: the recovery matrix against the real sandbox, reconciler running.

Each test is named after its row. The sandbox, ledger, a dispatcher and the reconciler run as
processes on SQLite (to stay quick), with fast tools from catalog.toml (`fast_*`: 1 s timeouts,
1-1.5 s horizons) and a short webhook wait. The provider's ground truth (`/_truth`,
`/_requests`) is the judge of "applied once" and "no second request". Every wait polls an
observable condition with a deadline.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from tests.support.cluster import Cluster, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

FAST = {"EFFECTLEDGER_ACK_WAIT_S": "3", "EFFECTLEDGER_INBOX_ACK_WAIT_S": "3",
        "EFFECTLEDGER_WEBHOOK_WAIT_S": "2", "EFFECTLEDGER_RECONCILE_DEADLINE_S": "15"}


async def _up(make_cluster: Any, *, webhook_routes: list[str] | None = None,
              reconciler_env: dict[str, str] | None = None) -> Cluster:
    c: Cluster = make_cluster(env=FAST)
    await c.start_sandbox(webhook_routes=webhook_routes)
    await c.start_ledger()
    await c.start_dispatcher()
    await c.start_reconciler(env=reconciler_env)
    return c


async def _fault(c: Cluster, route: str, action: dict[str, Any], times: int | None = 1) -> None:
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": action, "times": times})
    assert resp.status_code == 200, resp.text


async def _requests(c: Cluster, key: str) -> list[dict[str, Any]]:
    resp = await c.sandbox.get("/_requests", params={"key": key})
    resp.raise_for_status()
    return resp.json()["requests"]  # type: ignore[no-any-return]


def _states(journal: list[dict[str, Any]]) -> list[str]:
    return [e["to_state"] for e in journal if e["to_state"]]


def _review_kinds(journal: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in journal if "review" in e["kind"]]


async def test_response_lost_after_apply_idempotent_with_readback_succeeds_by_readback(
        make_cluster: Any) -> None:
    c = await _up(make_cluster)
    await _fault(c, "idempotentfast", {"kind": "drop_after_apply"})
    op = await c.submit_ok("fast_ticket", {"title": "lost answer"}, key="m-a")
    final = await c.wait_state(op["id"], "succeeded", 40)
    journal = await c.journal(op["id"])
    assert "ambiguous" in _states(journal) and "needs_review" not in _states(journal), journal
    assert not _review_kinds(journal), journal
    assert final["evidence"] and final["evidence"]["source"] == "readback", final
    truth = await c.key_truth(op["operation_key"])
    assert truth["applied"] == 1 and truth["requests"] == 1, truth


async def test_response_lost_after_apply_non_idempotent_with_readback_no_second_request(
        make_cluster: Any) -> None:
    c = await _up(make_cluster)
    await _fault(c, "plainrb", {"kind": "drop_after_apply"})
    op = await c.submit_ok("fast_email", {"to": "a@example.com"}, key="m-b")
    final = await c.wait_state(op["id"], "succeeded", 40)
    journal = await c.journal(op["id"])
    assert "needs_review" not in _states(journal) and not _review_kinds(journal), journal
    assert final["evidence"] and final["evidence"]["source"] == "readback", final
    assert len(await _requests(c, op["operation_key"])) == 1
    truth = await c.key_truth(op["operation_key"])
    assert truth["applied"] == 1 and truth["requests"] == 1, truth


async def test_late_apply_before_horizon_is_never_not_applied(make_cluster: Any) -> None:
    """The provider applies 1.3 s after the request (after the 1 s timeout, before the 1.5 s
    horizon): the verdict waits for the horizon and sees the effect."""
    c = await _up(make_cluster)
    await _fault(c, "plainrb", {"kind": "late_apply", "seconds": 1.3})
    op = await c.submit_ok("fast_email", {"to": "late@example.com"}, key="m-c")
    await c.wait_state(op["id"], "succeeded", 40)
    journal = await c.journal(op["id"])
    assert "not_applied" not in str([e["detail"] for e in journal
                                     if e["kind"] != "intent_accepted"]), journal
    assert len(await _requests(c, op["operation_key"])) == 1
    truth = await c.key_truth(op["operation_key"])
    assert truth["applied"] == 1 and truth["requests"] == 1, truth


async def test_never_applied_is_not_applied_after_horizon_then_retried_same_key(
        make_cluster: Any) -> None:
    """A 502 before the provider applied anything looks ambiguous to a non-idempotent tool;
    after the horizon the readback finds nothing: not_applied; a retry with the same key then
    succeeds, applied once."""
    c = await _up(make_cluster)
    await _fault(c, "plainrb", {"kind": "status_before_apply", "status": 502})
    op = await c.submit_ok("fast_email", {"to": "never@example.com"}, key="m-d")
    await wait_until(lambda: _saw_not_applied(c, op["id"]), 40, interval=0.1,
                     what="a not_applied verdict")
    cur = await c.operation(op["id"])
    if cur["state"] not in ("pending", "in_flight", "succeeded"):
        resp = await c.ledger.post(f"/v1/operations/{op['id']}/retry", json={"operator": "ops"})
        assert resp.status_code == 200, resp.text
    await c.wait_state(op["id"], "succeeded", 30)
    reqs = await _requests(c, op["operation_key"])
    assert len(reqs) == 2 and {r["key"] for r in reqs} == {op["operation_key"]}, reqs
    assert (await c.key_truth(op["operation_key"]))["applied"] == 1


async def _saw_not_applied(c: Cluster, op_id: str) -> bool:
    journal = await c.journal(op_id)
    return any("not_applied" in str(e["detail"]) for e in journal if e["actor"] != "anonymous")


def _applied_event(key: str, effect_id: str, token: int) -> dict[str, Any]:
    return {"type": "effect.applied", "data": {
        "id": effect_id, "idempotency_key": key, "fencing_token": token, "final": True,
        "route": "plainhooks", "status": "applied"}}


async def _lost_webhook_op(c: Cluster, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fast_post whose answer is lost and whose own webhook is not sent: ambiguous."""
    resp = await c.sandbox.post("/_config/routes/plainhooks", json={"webhooks": False})
    assert resp.status_code == 200, resp.text
    await _fault(c, "plainhooks", {"kind": "drop_after_apply"})
    op = await c.submit_ok("fast_post", {"text": key}, key=key)
    await c.wait_state(op["id"], "ambiguous", 30)
    reqs = await _requests(c, op["operation_key"])
    assert len(reqs) == 1 and reqs[0].get("effect_id"), reqs
    return op, reqs[0]


async def test_webhook_only_tool_webhook_decides_forged_and_expired_change_nothing(
        make_cluster: Any) -> None:
    c = await _up(make_cluster, webhook_routes=["plainhooks"],
                  reconciler_env={"EFFECTLEDGER_WEBHOOK_WAIT_S": "30"})
    # The sandbox's own signed webhook decides a lost answer.
    await _fault(c, "plainhooks", {"kind": "drop_after_apply"})
    first = await c.submit_ok("fast_post", {"text": "hello"}, key="m-e1")
    done = await c.wait_state(first["id"], "succeeded", 30)
    assert done["evidence"] and done["evidence"]["source"] == "webhook", done
    # Forged and expired webhooks for an open operation change nothing.
    op, req = await _lost_webhook_op(c, "m-e2")
    event = _applied_event(op["operation_key"], req["effect_id"], req["fencing_token"])
    for mode in ("forged", "expired", "wrong_key", "tampered_body"):
        sent = await c.sandbox.post("/_webhooks/send", json={**event, "mode": mode})
        assert sent.status_code == 200, sent.text
        assert sent.json()["status"] is not None and sent.json()["status"] >= 400, sent.json()
    cur = await c.operation(op["id"])
    assert cur["state"] == "ambiguous" and cur["epoch"] == op["epoch"], cur
    assert not any(e["actor"] != "anonymous" and "webhook" in str(e["detail"])
                   for e in await c.journal(op["id"]) if e["to_state"] == "succeeded")
    valid = await c.sandbox.post("/_webhooks/send", json={**event, "mode": "valid"})
    assert valid.status_code == 200 and valid.json()["status"] < 300, valid.text
    await c.wait_state(op["id"], "succeeded", 20)
    assert (await c.truth())["total_requests"] == 2


async def test_no_oracle_non_idempotent_needs_review_completed_or_not_executed(
        make_cluster: Any) -> None:
    c = await _up(make_cluster)
    await _fault(c, "plainpager", {"kind": "delay", "seconds": 2.5}, times=2)
    done = await c.submit_ok("fast_page", {"who": "a"}, key="m-f1")
    retried = await c.submit_ok("fast_page", {"who": "b"}, key="m-f2")
    await c.wait_state(done["id"], "needs_review", 40)
    await c.wait_state(retried["id"], "needs_review", 40)

    resp = await c.ledger.post(f"/v1/operations/{done['id']}/reviews", json={
        "conclusion": "completed", "operator": "ops", "evidence_ref": "pager-log-1"})
    assert resp.status_code == 200, resp.text
    await c.wait_state(done["id"], "succeeded", 10)

    resp = await c.ledger.post(f"/v1/operations/{retried['id']}/reviews", json={
        "conclusion": "not_executed", "operator": "ops", "evidence_ref": "pager-log-2"})
    assert resp.status_code == 200, resp.text
    if resp.json()["state"] not in ("pending", "in_flight", "succeeded"):
        admitted = await c.ledger.post(f"/v1/operations/{retried['id']}/retry",
                                       json={"operator": "ops"})
        assert admitted.status_code == 200, admitted.text
    await c.wait_state(retried["id"], "succeeded", 30)
    # Once succeeded, no further retry.
    again = await c.ledger.post(f"/v1/operations/{retried['id']}/retry", json={"operator": "ops"})
    assert again.status_code == 409, again.text

    assert len(await _requests(c, done["operation_key"])) == 1
    assert len(await _requests(c, retried["operation_key"])) == 2


async def test_duplicate_webhook_deliveries_leave_one_effect_on_state(
        make_cluster: Any) -> None:
    c = await _up(make_cluster, webhook_routes=["plainhooks"],
                  reconciler_env={"EFFECTLEDGER_WEBHOOK_WAIT_S": "30"})
    op, req = await _lost_webhook_op(c, "m-g")
    event = _applied_event(op["operation_key"], req["effect_id"], req["fencing_token"])
    wid = "msg_duplicate_m_g"
    # k = 5 deliveries of one event: 3 at once, then 2 one after another.
    sent = await asyncio.gather(*(c.sandbox.post("/_webhooks/send",
                                                 json={**event, "webhook_id": wid})
                                  for _ in range(3)))
    for _ in range(2):
        sent.append(await c.sandbox.post("/_webhooks/send",
                                         json={**event, "webhook_id": wid}))
    assert all(s.status_code == 200 and s.json()["status"] is not None
               and s.json()["status"] < 300 for s in sent), [s.text for s in sent]
    final = await c.wait_state(op["id"], "succeeded", 20)
    journal = await c.journal(op["id"])
    assert Counter(_states(journal))["succeeded"] == 1, journal
    assert final["epoch"] == op["epoch"]
    assert (await c.key_truth(op["operation_key"]))["applied"] == 1
    n = await c.db_scalar("SELECT count(*) FROM webhook_events")
    assert n == 1, n
