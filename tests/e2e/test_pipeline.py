"""The whole pipeline as separate processes: many intents, each applied exactly once."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import nats
import pytest

from tests.support.cluster import Cluster, wait_until

HTTP_INTENTS = 1000
NATS_INTENTS = 5
IN_FLIGHT = 50
TOOLS = ("create_ticket", "send_email", "charge_card")


def _arguments(tool: str, i: int) -> dict[str, Any]:
    if tool == "charge_card":
        return {"amount": 100 + i, "currency": "EUR"}
    return {"title": f"intent {i}"}


async def _bounded(n: int, coros: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(n)

    async def run(c: Any) -> Any:
        async with gate:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))


@pytest.mark.slow
async def test_a_thousand_intents_each_applied_exactly_once(cluster: Cluster) -> None:
    """1,000 HTTP intents (50 in flight) and a few over NATS all succeed, each applied once,
    each with its journal and receipt, and nothing is left in the outbox."""
    subjects = cluster.settings.subjects
    started = time.monotonic()

    async def over_http(i: int) -> str:
        tool = TOOLS[i % len(TOOLS)]
        resp = await cluster.submit(tool, _arguments(tool, i), key=f"pipe-{i}")
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    nc = await nats.connect(cluster.settings.nats_url)
    try:
        async def over_nats(i: int) -> str:
            body = {"tool": "create_ticket", "arguments": {"title": f"nats {i}"},
                    "idempotency_key": f"nats-{i}"}
            msg = await nc.request(subjects.rpc_intents, json.dumps(body).encode(), timeout=30)
            reply = json.loads(msg.data)
            assert reply["ok"] is True and reply["created"] is True, reply
            return str(reply["operation"]["id"])

        http_ids, nats_ids = await asyncio.gather(
            _bounded(IN_FLIGHT, [over_http(i) for i in range(HTTP_INTENTS)]),
            asyncio.gather(*(over_nats(i) for i in range(NATS_INTENTS))))
    finally:
        await nc.close()
    submitted = time.monotonic()
    ids = [*http_ids, *nats_ids]
    total = len(ids)
    assert len(set(ids)) == total

    async def all_succeeded() -> bool:
        ops = (await cluster.stats())["operations"]
        assert set(ops) <= {"pending", "in_flight", "succeeded"}, ops  # nothing went astray
        return bool(ops.get("succeeded") == total)

    await wait_until(all_succeeded, 240, interval=0.2, what="every operation to succeed")
    elapsed = time.monotonic() - started
    print(f"\npipeline [{cluster.settings.database_url.split(':')[0]}]: {total} intents "
          f"submitted in {submitted - started:.1f}s, all succeeded after {elapsed:.1f}s "
          f"({total / elapsed:.0f} ops/s end to end)")

    ops = await cluster.list_all()
    assert len(ops) == total and {o["state"] for o in ops} == {"succeeded"}
    keys = {o["id"]: o["operation_key"] for o in ops}
    assert set(keys) == set(ids)

    # Ground truth at the provider: every key applied once, after exactly one request.
    truth = await cluster.truth()
    assert truth["total_requests"] == total and truth["total_applied"] == total
    for key in keys.values():
        assert truth["keys"][key]["applied"] == 1, (key, truth["keys"][key])
        assert truth["keys"][key]["requests"] == 1, (key, truth["keys"][key])

    async def evidence(op_id: str) -> None:
        kinds = Counter(e["kind"] for e in await cluster.journal(op_id))
        assert kinds == {"intent_accepted": 1, "attempt_claimed": 1, "outcome_recorded": 1}, (
            op_id, kinds)
        receipt = await cluster.receipt(op_id)
        assert receipt["operation_id"] == op_id and receipt["state"] == "succeeded"
        assert receipt["operation_key"] == keys[op_id]
        assert receipt["dispatch_outcome"] == "attempt_succeeded"
        assert receipt["provider_request_ref"] and receipt["digests"]["response"]
        assert len(receipt["attempt_ids"]) == 1 and receipt["open_uncertainties"] == []

    await _bounded(IN_FLIGHT, [evidence(i) for i in ids])

    backlog = (await cluster.stats())["outbox"]
    assert backlog.get("pending", 0) == 0 and backlog.get("publishing", 0) == 0, backlog

    # Resubmitting after the fact: same key and arguments return the same operation.
    for i in range(0, HTTP_INTENTS, 97):
        tool = TOOLS[i % len(TOOLS)]
        resp = await cluster.submit(tool, _arguments(tool, i), key=f"pipe-{i}")
        assert resp.status_code == 200 and resp.json()["id"] == http_ids[i], resp.text
    assert (await cluster.truth())["total_requests"] == total


async def test_resubmission_is_idempotent_and_conflicts_are_refused(cluster: Cluster) -> None:
    """Same key + same arguments: 200 and the same operation; different arguments: 409."""
    first = await cluster.submit("create_ticket", {"title": "once"}, key="same-key")
    assert first.status_code == 201, first.text
    op_id = first.json()["id"]
    again = await cluster.submit("create_ticket", {"title": "once"}, key="same-key")
    assert again.status_code == 200 and again.json()["id"] == op_id
    before = await cluster.table_counts()
    conflict = await cluster.submit("create_ticket", {"title": "twice"}, key="same-key")
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_key_conflict"
    other_tool = await cluster.submit("send_email", {"title": "once"}, key="same-key")
    assert other_tool.status_code == 409
    assert other_tool.json()["error"]["code"] == "idempotency_key_conflict"

    await cluster.wait_state(op_id, "succeeded", 30)
    after_resubmit = await cluster.submit("create_ticket", {"title": "once"}, key="same-key")
    assert after_resubmit.status_code == 200 and after_resubmit.json()["state"] == "succeeded"
    counts = await cluster.table_counts()
    # Only the pipeline's own rows for the one operation were added, never a second operation.
    assert counts["operations"] == before["operations"] == 1
    truth = await cluster.key_truth(first.json()["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1
