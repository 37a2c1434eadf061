"""Real providers without code (issue 12), with the services as real processes: path-addressed
calls with `${ENV}` URLs, arguments that stay inside one path segment, readback by a search
that gives the provider's reference or finds a duplicate, admission by input schema, and
provider-native (Stripe, GitHub, Standard Webhooks) signed events."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from effectledger_core.config import Settings
from tests.support.cluster import Cluster, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.slow]
TEMPLATE = Path(__file__).with_name("catalog_providers.toml")
STRIPE, STRIPE_OLD = "whsec_" + secrets.token_hex(8), "whsec_" + secrets.token_hex(8)
GITHUB = "gh-" + secrets.token_hex(8)
SVIX_RAW = secrets.token_bytes(24)
SVIX = "whsec_" + base64.b64encode(SVIX_RAW).decode()


@pytest.fixture
async def stack(settings: Settings, tmp_path: Path,
                request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    c = Cluster(settings, tmp_path / "cluster", catalog_template=TEMPLATE,
                env={"STRIPE_WHSEC": STRIPE, "STRIPE_WHSEC_OLD": STRIPE_OLD,
                     "GITHUB_WHSEC": GITHUB, "SVIX_WHSEC": SVIX,
                     # A webhook-only tool must not fall back to review during the test.
                     "EFFECTLEDGER_WEBHOOK_WAIT_S": "120",
                     "EFFECTLEDGER_AUDIT_SLACK_S": "3"})
    try:
        await c.start_sandbox()
        await c.start_ledger()
        # Only the processes that call the provider get the base URL.
        base = {"PROVIDER_BASE": c.sandbox_url}
        await c.start_dispatcher(env=base)
        await c.start_reconciler(env=base)
        yield c
    finally:
        if getattr(getattr(request.node, "rep_call", None), "failed", False):
            print(f"\n===== service logs ({c.workdir}) =====\n{c.log_tails(60)}")
        await c.aclose()


async def effects(c: Cluster, route: str, key: str) -> list[dict[str, Any]]:
    r = await c.sandbox.get(f"/v1/{route}/effects", params={"key": key},
                            headers={"Authorization": f"Bearer {c.api_key}"})
    r.raise_for_status()
    return list(r.json()["data"])


async def fault(c: Cluster, route: str, *kinds: dict[str, Any]) -> None:
    for action in kinds:
        r = await c.sandbox.post("/_faults/append", json={
            "match": {"route": route}, "action": action, "times": 1})
        r.raise_for_status()


async def test_path_addressed_update_with_env_url_and_hostile_ids(stack: Cluster) -> None:
    """`{args.customer_id}` addresses the object; `..` and `/` stay inside its segment; the
    base URL comes from `${PROVIDER_BASE}` in the calling processes' environment."""
    for customer in ("cus_42", "../admin/x", "..", "a?b=c#d"):
        op = await stack.submit_ok("update_customer", {"customer_id": customer,
                                                       "email": "a@b.test"})
        done = await stack.wait_state(op["id"], ("succeeded", "failed"), 30)
        if customer == "..":
            # A whole-segment ".." can never be sent: refused before the provider call.
            assert done["state"] == "failed", done
            assert await effects(stack, "plainobj", op["operation_key"]) == []
            continue
        assert done["state"] == "succeeded", done
        [effect] = await effects(stack, "plainobj", op["operation_key"])
        assert effect["target"] == customer
        assert effect["body"] == {"email": "a@b.test", "reference": op["operation_key"]}


async def test_invalid_intent_is_422_with_pointers_and_nothing_enqueued(stack: Cluster) -> None:
    r = await stack.submit("update_customer", {"email": 5})
    assert r.status_code == 422, r.text
    assert [e["pointer"] for e in r.json()["error"]["details"]["errors"]] == ["/customer_id"]
    assert sum((await stack.stats())["operations"].values()) == 0
    tools = {t["name"]: t for t in (await stack.ledger.get("/v1/tools")).json()["tools"]}
    assert tools["update_customer"]["input_schema"]["required"] == ["customer_id", "email"]


async def test_search_readback_gives_the_reference_and_finds_duplicates(stack: Cluster) -> None:
    """A lost answer is decided by a search readback that names the customer; a provider that
    applied one request twice is reported as duplicate_detected, not as a quiet success."""
    await fault(stack, "plaincust", {"kind": "drop_after_apply"})
    op = await stack.submit_ok("create_customer", {"name": "one"})
    done = await stack.wait_state(op["id"], ("succeeded", "needs_review"), 60)
    [effect] = await effects(stack, "plaincust", op["operation_key"])
    assert done["state"] == "succeeded" and done["provider_ref"] == effect["id"]
    assert done["evidence"]["source"] == "readback" and done["evidence"]["digest"]

    await fault(stack, "plaincust", {"kind": "duplicate_apply"}, {"kind": "drop_after_apply"})
    dup = await stack.submit_ok("create_customer", {"name": "two"})
    done = await stack.wait_state(dup["id"], ("succeeded", "needs_review"), 60)
    assert done["state"] == "needs_review", done
    assert len(await effects(stack, "plaincust", dup["operation_key"])) == 2
    kinds = [e["kind"] for e in await stack.journal(dup["id"])]
    assert "duplicate_detected" in kinds
    receipt = await stack.receipt(dup["id"])
    assert any(u.startswith("duplicate_detected") for u in receipt["open_uncertainties"])
    queue = (await stack.ledger.get("/v1/reviews")).json()["items"]
    assert [i["operation"]["id"] for i in queue] == [dup["id"]]


async def test_a_provider_that_applies_after_its_horizon_is_flagged_by_the_audit(
        stack: Cluster) -> None:
    """The first request applies 2.5 s late, after the declared 1 s horizon: the readback
    said "not applied", the retry succeeded, and the audit after horizon + slack finds the
    second customer and reports it instead of leaving a quiet success."""
    await fault(stack, "plaincust", {"kind": "late_apply", "seconds": 2.5})
    op = await stack.submit_ok("create_customer", {"name": "late"})
    done = await stack.wait_state(op["id"], "succeeded", 60)
    assert done["epoch"] == 2

    async def flagged() -> bool:
        return "duplicate_detected" in [e["kind"] for e in await stack.journal(op["id"])]

    await wait_until(flagged, 60, what="the audit to flag the duplicate")
    assert len(await effects(stack, "plaincust", op["operation_key"])) == 2
    op = await stack.operation(op["id"])
    assert op["state"] == "succeeded" and op["evidence"]["duplicate"]["matches"] == 2
    receipt = await stack.receipt(op["id"])
    assert any(u.startswith("duplicate_detected") for u in receipt["open_uncertainties"])
    queue = (await stack.ledger.get("/v1/reviews")).json()["items"]
    assert [i["operation"]["id"] for i in queue] == [op["id"]]


# --- provider-native webhooks ---------------------------------------------------------------

def stripe_signed(body: bytes, secret: str = STRIPE, t: int | None = None) -> dict[str, str]:
    ts = int(time.time()) if t is None else t
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={ts},v1={mac}", "Content-Type": "application/json"}


def stripe_event(key: str, event_type: str = "charge.succeeded", evt: str = "evt_1") -> bytes:
    return json.dumps({"id": evt, "type": event_type, "data": {"object": {
        "id": "ch_1", "metadata": {"operation_key": key}}}}).encode()


async def ambiguous(c: Cluster, tool: str, route: str) -> dict[str, Any]:
    await fault(c, route, {"kind": "status_after_apply", "status": 500})
    op = await c.submit_ok(tool, {"amount": 1})
    return await c.wait_state(op["id"], "ambiguous", 30)


async def post(c: Cluster, provider: str, body: bytes, headers: dict[str, str]
               ) -> httpx.Response:
    async with httpx.AsyncClient(base_url=c.reconciler_url, timeout=10) as h:
        return await h.post(f"/v1/webhooks/{provider}", content=body, headers=headers)


async def test_native_signed_events_decide_only_their_own_tools(stack: Cluster) -> None:
    op = await ambiguous(stack, "charge", "plainpay")
    key = op["operation_key"]
    # Forged, expired and tampered Stripe deliveries are refused and change nothing.
    body = stripe_event(key)
    forged = await post(stack, "stripe", body, stripe_signed(body, secret="whsec_attacker"))
    expired = await post(stack, "stripe", body, stripe_signed(body, t=int(time.time()) - 600))
    tampered = await post(stack, "stripe", stripe_event(key, evt="evt_2"), stripe_signed(body))
    assert [r.status_code for r in (forged, expired, tampered)] == [401, 401, 401]
    # A validly signed event from another provider (GitHub) that names this key is verified
    # but never speaks for the Stripe-bound tool.
    gh_body = json.dumps({"action": "opened", "issue": {"body": key}}).encode()
    gh_mac = hmac.new(GITHUB.encode(), gh_body, hashlib.sha256).hexdigest()
    gh = await post(stack, "github", gh_body, {"X-Hub-Signature-256": f"sha256={gh_mac}",
                                               "X-GitHub-Delivery": "d-1",
                                               "X-GitHub-Event": "issues"})
    assert gh.status_code == 200, gh.text

    async def refused() -> bool:
        return "webhook_refused" in [e["kind"] for e in await stack.journal(op["id"])]

    await wait_until(refused, 30, what="the github webhook to be refused")
    assert (await stack.operation(op["id"]))["state"] == "ambiguous"
    # An ignored event type is acknowledged and is no evidence.
    ignored = stripe_event(key, "charge.updated", evt="evt_3")
    r = await post(stack, "stripe", ignored, stripe_signed(ignored))
    assert r.json() == {"ok": True, "ignored": True}
    # The real event, signed with the old secret during a rotation, decides the operation.
    r = await post(stack, "stripe", body, stripe_signed(body, secret=STRIPE_OLD))
    assert r.status_code == 200, r.text
    done = await stack.wait_state(op["id"], "succeeded", 30)
    assert done["provider_ref"] == "ch_1" and done["evidence"]["event_type"] == "charge.succeeded"


async def test_standard_webhooks_signed_native_event_decides(stack: Cluster) -> None:
    op = await ambiguous(stack, "message", "plainmsg")
    body = json.dumps({"type": "message.delivered",
                       "data": {"reference": op["operation_key"]}}).encode()
    msg_id, ts = "msg_" + secrets.token_hex(6), str(int(time.time()))
    mac = hmac.new(SVIX_RAW, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    r = await post(stack, "svix", body, {"webhook-id": msg_id, "webhook-timestamp": ts,
                                         "webhook-signature": "v1," + base64.b64encode(mac)
                                         .decode()})
    assert r.status_code == 200, r.text
    await stack.wait_state(op["id"], "succeeded", 30)
