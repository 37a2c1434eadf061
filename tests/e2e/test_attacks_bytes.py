"""Hostile bytes from every side, against the real processes: they are data, never a wedge.

A provider answering with NUL and an unpaired surrogate (a refusal, and a success whose id
carries NUL) still ends `failed` / `succeeded` on PostgreSQL, the database that cannot store
either; malformed ids, cursors and webhook timestamps are 4xx, never a 500.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster


async def _fault(cluster: Cluster, route: str, kind: str) -> None:
    resp = await cluster.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": {"kind": kind}, "times": 1})
    resp.raise_for_status()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_nul_in_a_providers_answers_ends_failed_and_succeeded_on_postgresql(
        cluster: Cluster) -> None:
    await _fault(cluster, "idempotent", "hostile_refusal")
    refused = await cluster.submit_ok("create_ticket", {"title": "refused"})
    failed = await cluster.wait_state(refused["id"], ["failed", "succeeded", "needs_review"], 60)
    assert failed["state"] == "failed", failed
    assert (await cluster.key_truth(refused["operation_key"]))["applied"] == 0

    await _fault(cluster, "idempotent", "hostile_answer")
    answered = await cluster.submit_ok("create_ticket", {"title": "answered"})
    done = await cluster.wait_state(answered["id"], ["failed", "succeeded", "needs_review"], 60)
    assert done["state"] == "succeeded", done
    assert done["provider_ref"] is not None and "\x00" not in done["provider_ref"]
    assert done["provider_ref"].endswith("\ufffdx")
    assert (await cluster.key_truth(answered["operation_key"]))["applied"] == 1
    # Nothing went to the dead letters on the way.
    assert await cluster.db_rows("SELECT error FROM dead_letters") == []


def _cursor(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_every_malformed_id_and_cursor_is_a_4xx_on_postgresql(cluster: Cluster) -> None:
    op = await cluster.submit_ok("create_ticket", {"title": "x"})
    paths = [f"/v1/operations/{p}" for p in ("op%00x", "%00", "a" * 5000, "%ff%fe")]
    paths += [f"/v1/operations/{op['id']}%00/journal", "/v1/retry-plans/p%00/use"]
    cursors = [_cursor(["2026-11-30T09:00:00", "id"]),  # naive
               _cursor(["2026-11-30T09:00:00+00:00", "id\x00"]),
               base64.urlsafe_b64encode(b"[" * 3000 + b"]" * 3000).decode(),
               "%00", "x" * 3000]
    for path in paths:
        method = "POST" if path.endswith("/use") else "GET"
        resp = await cluster.ledger.request(method, path, json={} if method == "POST" else None)
        assert 400 <= resp.status_code < 500, (path, resp.status_code, resp.text[:200])
    for cursor in cursors:
        resp = await cluster.ledger.get("/v1/operations", params={"cursor": cursor})
        assert 400 <= resp.status_code < 500, (cursor[:40], resp.status_code, resp.text[:200])
    resp = await cluster.ledger.get("/v1/operations?cursor=a%00b&state=pending%00")
    assert 400 <= resp.status_code < 500
    # The ledger still serves.
    assert (await cluster.operation(op["id"]))["id"] == op["id"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_malformed_webhook_timestamps_and_nul_are_4xx(
        make_cluster: Callable[..., Cluster]) -> None:
    c: Cluster = make_cluster()
    await c.start_sandbox()
    await c.start_ledger()
    await c.start_reconciler()
    url = f"{c.reconciler_url}/v1/webhooks/sandbox"
    body = json.dumps({"type": "effect.applied", "data": {"idempotency_key": "k"}})
    async with httpx.AsyncClient(timeout=30) as client:
        for ts in ("253402300800", "999999999999", "-1", "1e9", "%00"):
            resp = await client.post(url, content=body, headers={
                "webhook-id": "msg_1", "webhook-timestamp": ts,
                "webhook-signature": "v1," + base64.b64encode(b"x" * 32).decode()})
            assert 400 <= resp.status_code < 500, (ts, resp.status_code, resp.text[:200])
        resp = await client.post(f"{c.reconciler_url}/v1/webhooks/sand%00box", content=body)
        assert 400 <= resp.status_code < 500
