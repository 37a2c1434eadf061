"""The sandbox's real-provider shapes (issue 12): path-addressed updates read from the raw
path, a search answer listing every effect for a key, and a provider that applies twice."""

from __future__ import annotations

import httpx

from effectledger_sandbox.app import create_app, sandbox_state


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app()),
                             base_url="http://sandbox")


async def test_a_path_addressed_update_records_its_object() -> None:
    async with client() as c:
        r = await c.patch("/v1/plain/objects/cus_42", json={"email": "a@b"},
                          headers={"Idempotency-Key": "k1"})
        assert r.status_code == 201 and r.json()["target"] == "cus_42"


async def test_an_encoded_slash_and_dots_stay_one_object_id() -> None:
    async with client() as c:
        r = await c.post("/v1/plain/objects/a%2F..%2Fb", json={})
        assert r.status_code == 201 and r.json()["target"] == "a/../b"


async def test_an_unencoded_slash_or_dot_segment_is_not_an_object() -> None:
    async with client() as c:
        for path in ("/v1/plain/objects/a/b", "/v1/plain/objects/%2E%2E"):
            r = await c.post(path, json={})
            assert r.status_code == 404, path
        assert sandbox_state(c._transport.app).total_applied == 0  # type: ignore[attr-defined]


async def test_search_lists_every_effect_for_a_key() -> None:
    async with client() as c:
        for _ in range(2):
            await c.post("/v1/plain/effects", json={}, headers={"Idempotency-Key": "k2"})
        r = await c.get("/v1/plain/effects", params={"key": "k2"})
        assert [e["idempotency_key"] for e in r.json()["data"]] == ["k2", "k2"]
        assert (await c.get("/v1/plain/effects", params={"key": "none"})).json() == {"data": []}
        assert (await c.get("/v1/plain/effects")).status_code == 400


async def test_duplicate_apply_fault_applies_one_request_twice() -> None:
    async with client() as c:
        await c.post("/_faults", json=[{"match": {"key": "k3"},
                                        "action": {"kind": "duplicate_apply"}, "times": 1}])
        r = await c.post("/v1/idempotent/effects", json={}, headers={"Idempotency-Key": "k3"})
        assert r.status_code == 201
        assert (await c.get("/_truth/k3")).json()["applied"] == 2
        assert len((await c.get("/v1/idempotent/effects", params={"key": "k3"})).json()[
            "data"]) == 2


class _Published:
    def __init__(self) -> None:
        self.messages: list[bytes] = []

    async def publish(self, subject: str, payload: bytes, *, msg_id: str) -> bool:
        self.messages.append(payload)
        return False


async def test_a_stripe_scheme_route_sends_events_the_native_ingress_verifies() -> None:
    """The sandbox's Stripe-signed events pass the reconciler's catalog-declared verification
    and carry the key, the effect id and the fencing token to the evidence message."""
    from effectledger_core.catalog import Catalog
    from effectledger_core.messages import WebhookReceived, parse
    from effectledger_core.subjects import Subjects
    from effectledger_reconciler.native import NativeWebhooks
    from effectledger_reconciler.signatures import WebhookVerifier
    from effectledger_reconciler.webhooks import create_app as reconciler_app
    from effectledger_sandbox.webhooks import WebhookSender, new_secret

    secret = new_secret()
    catalog = Catalog.from_mapping({
        "tools": {"t": {"endpoint": "https://p.test/x", "contract_revision": "r",
                        "webhook_provider": "pay"}},
        "webhooks": {"pay": {
            "scheme": "stripe", "secrets": ["${PAY_WHSEC}"],
            "events": {"effect.applied": "applied", "effect.pending": "ignore"},
            "operation_key_path": "$.data.idempotency_key", "provider_ref_path": "$.data.id",
            "fencing_token_path": "$.data.fencing_token"}}})
    published = _Published()
    receiver = reconciler_app(verifier=WebhookVerifier({}), publisher=published,
                              subjects=Subjects(prefix="t", stream_prefix="T"),
                              native=NativeWebhooks.from_catalog(catalog, {"PAY_WHSEC": secret}))
    sender = WebhookSender(url="http://reconciler/v1/webhooks/sandbox", secret=secret,
                           transport=httpx.ASGITransport(app=receiver))
    sandbox = create_app(webhooks=sender)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sandbox),
                                 base_url="http://sandbox") as c:
        r = await c.post("/_config/routes/plainpay", json={
            "webhooks": True, "scheme": "stripe", "url": "http://reconciler/v1/webhooks/pay"})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/plainpay/effects", json={},
                         headers={"Idempotency-Key": "k9", "Fencing-Token": "3"})
        await sender.drain()
        log = (await c.get("/_webhooks")).json()["webhooks"]
    assert [e["status_codes"] for e in log] == [[200]]
    [raw] = published.messages
    msg = parse(WebhookReceived, raw)
    assert (msg.provider, msg.operation_key, msg.provider_ref, msg.fencing_token,
            msg.outcome) == ("pay", "k9", r.json()["id"], 3, "applied")
    assert msg.webhook_id == log[0]["webhook_id"]  # read from the body's top-level "id"
