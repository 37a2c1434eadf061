"""Provider-native webhook schemes, checked against vectors from each provider's documentation,
and the reading of native events into evidence."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from effectledger_core.catalog import Catalog
from effectledger_core.errors import ConfigError
from effectledger_core.webhookspec import WebhookProvider
from effectledger_reconciler.native import NativeWebhooks
from effectledger_reconciler.schemes import SchemeVerifier
from effectledger_reconciler.signatures import WebhookRejected

NOW = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
TS = int(NOW.timestamp())


def spec(scheme: str, **fields: Any) -> WebhookProvider:
    return WebhookProvider.model_validate({
        "name": "p", "scheme": scheme, "secrets": ["${S}"], "events": {"x": "applied"},
        "operation_key_path": "$.key", **fields})


def verifier(scheme: str, secrets: list[str], now: datetime = NOW,
             **fields: Any) -> SchemeVerifier:
    return SchemeVerifier(spec(scheme, **fields), secrets, lambda: now)


# --- Standard Webhooks: the specification's own example --------------------------------------

SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SW_BODY = b'{"test": 2432232314}'
SW_HEADERS = {"webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek", "webhook-timestamp": "1614265330",
              "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="}
SW_NOW = datetime.fromtimestamp(1614265330, tz=UTC)


def test_standard_webhooks_specification_vector_verifies() -> None:
    v = verifier("standard", [SW_SECRET], SW_NOW)
    assert v.verify(SW_HEADERS, SW_BODY).webhook_id == "msg_p5jXN8AQM9LWM0D4loKWxJek"


def test_standard_webhooks_tampered_and_expired_are_refused() -> None:
    with pytest.raises(WebhookRejected, match="no signature matches"):
        verifier("standard", [SW_SECRET], SW_NOW).verify(SW_HEADERS, SW_BODY + b" ")
    with pytest.raises(WebhookRejected, match="ago"):
        verifier("standard", [SW_SECRET], SW_NOW + timedelta(seconds=301)).verify(
            SW_HEADERS, SW_BODY)


# --- GitHub: the example in "Validating webhook deliveries" ---------------------------------

GH_SECRET = "It's a Secret to Everybody"
GH_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"


def test_github_documented_vector_verifies() -> None:
    verifier("github", [GH_SECRET]).verify({"x-hub-signature-256": GH_SIGNATURE},
                                           b"Hello, World!")


@pytest.mark.parametrize("headers, body, code", [
    ({"x-hub-signature-256": GH_SIGNATURE}, b"Hello, World?", "invalid_signature"),
    ({"x-hub-signature-256": GH_SIGNATURE[7:]}, b"Hello, World!", "invalid_signature"),
    ({}, b"Hello, World!", "missing_signature"),
])
def test_github_forged_or_malformed_is_refused(headers: dict[str, str], body: bytes,
                                               code: str) -> None:
    with pytest.raises(WebhookRejected) as err:
        verifier("github", [GH_SECRET]).verify(headers, body)
    assert err.value.code == code and err.value.status in (400, 401)


def test_github_rotation_accepts_the_old_and_the_new_secret() -> None:
    v = verifier("github", ["new-secret", GH_SECRET])
    v.verify({"x-hub-signature-256": GH_SIGNATURE}, b"Hello, World!")


# --- Stripe: "Verify the signature manually" -------------------------------------------------

def stripe_header(secret: str, body: bytes, t: int = TS, extra: str = "") -> str:
    # Documented: signed_payload = "<t>.<raw body>", HMAC-SHA256 with the endpoint secret,
    # hex encoded, in the v1 element of Stripe-Signature.
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}{extra}"


def test_stripe_signature_verifies_and_gives_the_signed_time() -> None:
    body = b'{"id": "evt_1"}'
    header = stripe_header("whsec_test", body, extra=",v0=deadbeef")
    got = verifier("stripe", ["whsec_test"]).verify({"stripe-signature": header}, body)
    assert got.signed_at == NOW


def test_stripe_any_of_several_v1_and_any_active_secret() -> None:
    body = b"{}"
    good = stripe_header("whsec_new", body).split(",")[1]
    header = f"t={TS},v1={'0' * 64},{good}"
    verifier("stripe", ["whsec_old", "whsec_new"]).verify({"stripe-signature": header}, body)


@pytest.mark.parametrize("case", ["expired", "future", "tampered", "wrong_secret", "no_t"])
def test_stripe_refusals(case: str) -> None:
    body = b'{"id": "evt_1"}'
    header = {
        "expired": stripe_header("whsec_test", body, t=TS - 301),
        "future": stripe_header("whsec_test", body, t=TS + 301),
        "tampered": stripe_header("whsec_test", b'{"id": "evt_2"}'),
        "wrong_secret": stripe_header("whsec_other", body),
        "no_t": stripe_header("whsec_test", body).split(",", 1)[1],
    }[case]
    with pytest.raises(WebhookRejected):
        verifier("stripe", ["whsec_test"]).verify({"stripe-signature": header}, body)


# --- hmac_header: Shopify's base64 header, and a hex one with a prefix -----------------------

def test_shopify_style_base64_header() -> None:
    body = b'{"id": 820982911946154508}'
    mac = base64.b64encode(hmac.new(b"shpss_x", body, hashlib.sha256).digest()).decode()
    v = verifier("hmac_header", ["shpss_x"], header="X-Shopify-Hmac-Sha256",
                 event_id_header="X-Shopify-Webhook-Id")
    v.verify({"x-shopify-hmac-sha256": mac}, body)
    with pytest.raises(WebhookRejected):
        v.verify({"x-shopify-hmac-sha256": mac}, body + b"\n")


def test_hex_header_with_prefix_and_sha512() -> None:
    body = b"payload"
    mac = hmac.new(b"k", body, hashlib.sha512).hexdigest()
    v = verifier("hmac_header", ["k"], header="X-Sig", algorithm="sha512", encoding="hex",
                 prefix="sha512=", event_id_path="$.id")
    v.verify({"x-sig": f"sha512={mac}"}, body)
    with pytest.raises(WebhookRejected, match="must start with"):
        v.verify({"x-sig": mac}, body)


# --- native events into evidence ------------------------------------------------------------

STRIPE_CATALOG: dict[str, Any] = {
    "tools": {"create_customer": {"endpoint": "https://p.test/v1/customers",
                                  "contract_revision": "r", "webhook_provider": "stripe"}},
    "webhooks": {"stripe": {
        "scheme": "stripe", "secrets": ["${STRIPE_WHSEC}", "${STRIPE_WHSEC_OLD}"],
        "events": {"customer.created": "applied", "charge.failed": "not_applied",
                   "customer.updated": "ignore"},
        "operation_key_path": "$.data.object.metadata.operation_key",
        "provider_ref_path": "$.data.object.id"}},
}
ENV = {"STRIPE_WHSEC": "whsec_new", "STRIPE_WHSEC_OLD": "whsec_old"}


def native() -> NativeWebhooks:
    return NativeWebhooks.from_catalog(Catalog.from_mapping(STRIPE_CATALOG), ENV,
                                       clock=lambda: NOW)


def stripe_event(event_type: str, metadata: dict[str, str] | None = None,
                 secret: str = "whsec_old") -> tuple[dict[str, str], bytes]:
    body = json.dumps({"id": "evt_9", "type": event_type, "data": {"object": {
        "id": "cus_9", "metadata": metadata or {}}}}).encode()
    return {"stripe-signature": stripe_header(secret, body)}, body


def test_a_stripe_event_finds_its_operation_by_metadata() -> None:
    headers, body = stripe_event("customer.created", {"operation_key": "opk_1"})
    msg = native().message("stripe", headers, body, NOW)
    assert msg is not None
    assert (msg.webhook_id, msg.event_type, msg.operation_key, msg.provider_ref, msg.outcome,
            msg.final) == ("evt_9", "customer.created", "opk_1", "cus_9", "applied", False)
    assert msg.body_digest == "sha256:" + hashlib.sha256(body).hexdigest()


def test_a_failure_event_is_a_final_not_applied() -> None:
    headers, body = stripe_event("charge.failed", {"operation_key": "opk_1"})
    msg = native().message("stripe", headers, body, NOW)
    assert msg is not None and (msg.outcome, msg.final) == ("not_applied", True)


@pytest.mark.parametrize("event_type", ["customer.updated", "invoice.paid"])
def test_ignored_and_unlisted_types_are_not_evidence(event_type: str) -> None:
    headers, body = stripe_event(event_type, {"operation_key": "opk_1"})
    assert native().message("stripe", headers, body, NOW) is None


def test_a_forged_event_is_refused_before_its_body_is_read() -> None:
    headers, body = stripe_event("customer.created", {"operation_key": "opk_1"},
                                 secret="whsec_attacker")
    with pytest.raises(WebhookRejected) as err:
        native().message("stripe", headers, body, NOW)
    assert err.value.status == 401


def test_a_missing_secret_fails_at_start() -> None:
    with pytest.raises(ConfigError, match="STRIPE_WHSEC_OLD"):
        NativeWebhooks.from_catalog(Catalog.from_mapping(STRIPE_CATALOG),
                                    {"STRIPE_WHSEC": "whsec_new"})


def test_github_event_id_and_type_come_from_headers() -> None:
    cat = Catalog.from_mapping({
        "tools": {"t": {"endpoint": "https://p.test/x", "contract_revision": "r",
                        "webhook_provider": "gh"}},
        "webhooks": {"gh": {"scheme": "github", "secrets": ["${GH}"],
                            "events": {"issues": "applied"},
                            "provider_ref_path": "$.issue.number"}}})
    hooks = NativeWebhooks.from_catalog(cat, {"GH": GH_SECRET}, clock=lambda: NOW)
    body = b'{"action": "opened", "issue": {"number": 42}}'
    mac = hmac.new(GH_SECRET.encode(), body, hashlib.sha256).hexdigest()
    msg = hooks.message("gh", {"x-hub-signature-256": f"sha256={mac}",
                               "x-github-delivery": "d-1", "x-github-event": "issues"},
                        body, NOW)
    assert msg is not None and (msg.webhook_id, msg.provider_ref) == ("d-1", "42")


def test_an_event_without_key_or_reference_is_refused_with_422() -> None:
    headers, body = stripe_event("customer.created", {})
    hooks = NativeWebhooks.from_catalog(Catalog.from_mapping({
        **STRIPE_CATALOG, "webhooks": {"stripe": {
            **STRIPE_CATALOG["webhooks"]["stripe"], "provider_ref_path": "$.data.nothing"}}}),
        ENV, clock=lambda: NOW)
    with pytest.raises(WebhookRejected) as err:
        hooks.message("stripe", headers, body, NOW)
    assert (err.value.status, err.value.code) == (422, "unmatched_event")


def test_shopify_style_events_take_id_and_topic_from_headers() -> None:
    cat = Catalog.from_mapping({
        "tools": {"t": {"endpoint": "https://p.test/x", "contract_revision": "r",
                        "webhook_provider": "shop"}},
        "webhooks": {"shop": {"scheme": "hmac_header", "secrets": ["${SHOP}"],
                              "header": "X-Shopify-Hmac-Sha256",
                              "event_id_header": "X-Shopify-Webhook-Id",
                              "event_type_header": "X-Shopify-Topic",
                              "events": {"orders/create": "applied"},
                              "operation_key_path": "$.note_attributes[0].value"}}})
    hooks = NativeWebhooks.from_catalog(cat, {"SHOP": "shpss_1"}, clock=lambda: NOW)
    body = b'{"id": 1, "note_attributes": [{"name": "operation_key", "value": "opk_7"}]}'
    mac = base64.b64encode(hmac.new(b"shpss_1", body, hashlib.sha256).digest()).decode()
    msg = hooks.message("shop", {"x-shopify-hmac-sha256": mac, "x-shopify-webhook-id": "w-9",
                                 "x-shopify-topic": "orders/create"}, body, NOW)
    assert msg is not None and (msg.webhook_id, msg.operation_key) == ("w-9", "opk_7")
