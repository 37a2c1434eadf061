"""Webhook ingestion: Standard Webhooks verification and what reaches the bus.

The reconciler's ASGI app runs in-process with a fake publisher (JetStream-like duplicate
detection by message id). Every rejected delivery must answer 4xx and publish nothing; a valid
one publishes exactly one `WebhookReceived` before its 2xx.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import MutableMapping
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook
from starlette.applications import Starlette

from effectledger_bus.testing import FakePublisher
from effectledger_core.config import Settings
from effectledger_core.errors import ConfigError
from effectledger_core.messages import WebhookReceived
from effectledger_core.subjects import Subjects
from effectledger_reconciler.app import build_verifier, skip_verification_requested
from effectledger_reconciler.signatures import WebhookVerifier
from effectledger_reconciler.webhooks import create_app

NOW = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)
SUBJECTS = Subjects(prefix="t", stream_prefix="T")
SECRET = "whsec_" + base64.b64encode(b"s" * 24).decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"o" * 24).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"x" * 24).decode()
URL = "/v1/webhooks/sandbox"
LIMIT = 4096


def event(type_: str = "effect.applied", **data: Any) -> bytes:
    body = {"type": type_, "data": {"id": "eff_1", "idempotency_key": "ck_1",
                                    "fencing_token": 2, "final": True, **data}}
    return json.dumps(body).encode()


def signed(body: bytes, *, secret: str = SECRET, webhook_id: str = "msg_1",
           at: datetime = NOW) -> dict[str, str]:
    sig = Webhook(secret).sign(webhook_id, at, body.decode())
    return {"webhook-id": webhook_id, "webhook-timestamp": str(int(at.timestamp())),
            "webhook-signature": sig, "content-type": "application/json"}


def make_app(publisher: FakePublisher, *, secrets: dict[str, list[str]] | None = None,
             skip: bool = False) -> Starlette:
    verifier = WebhookVerifier(secrets if secrets is not None else {"sandbox": [SECRET]},
                               tolerance_s=300, clock=lambda: NOW, skip_verification=skip)
    return create_app(verifier=verifier, publisher=publisher, subjects=SUBJECTS,
                      clock=lambda: NOW + timedelta(seconds=1), max_body_bytes=LIMIT)


@pytest.fixture
def publisher() -> FakePublisher:
    return FakePublisher()


@pytest.fixture
async def client(publisher: FakePublisher) -> Any:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(publisher)),
                                 base_url="http://reconciler") as c:
        yield c


async def test_valid_delivery_publishes_one_webhook_received_then_answers_2xx(
        client: httpx.AsyncClient, publisher: FakePublisher) -> None:
    body = event()
    r = await client.post(URL, content=body, headers=signed(body))
    assert r.status_code == 200
    assert r.json() == {"ok": True, "webhook_id": "msg_1", "duplicate": False}
    [(subject, _, msg_id)] = publisher.messages
    assert subject == SUBJECTS.webhook and msg_id == "webhook:sandbox:msg_1"
    [msg] = publisher.decoded(WebhookReceived)
    assert (msg.provider, msg.webhook_id, msg.event_type) == ("sandbox", "msg_1", "effect.applied")
    assert (msg.operation_key, msg.provider_ref, msg.outcome, msg.final, msg.fencing_token) \
        == ("ck_1", "eff_1", "applied", True, 2)
    assert msg.body_digest == "sha256:" + hashlib.sha256(body).hexdigest()
    assert msg.signed_at == NOW and msg.received_at == NOW + timedelta(seconds=1)


async def test_valid_duplicate_is_an_idempotent_2xx(client: httpx.AsyncClient,
                                                    publisher: FakePublisher) -> None:
    body = event()
    first = await client.post(URL, content=body, headers=signed(body))
    # The provider's retry: same id, re-signed a minute later.
    again = await client.post(URL, content=body,
                              headers=signed(body, at=NOW + timedelta(seconds=60)))
    assert first.status_code == again.status_code == 200
    assert again.json()["duplicate"] is True and len(publisher.messages) == 1


@pytest.mark.parametrize("type_,outcome,final", [
    ("effect.applied", "applied", True), ("effect.not_applied", "not_applied", True),
    ("effect.pending", "pending", False), ("effect.refunded", "unknown", True)])
async def test_event_types_map_to_outcomes(client: httpx.AsyncClient, publisher: FakePublisher,
                                           type_: str, outcome: str, final: bool) -> None:
    body = event(type_, final=final)
    assert (await client.post(URL, content=body, headers=signed(body))).status_code == 200
    [msg] = publisher.decoded(WebhookReceived)
    assert (msg.outcome, msg.final, msg.event_type) == (outcome, final, type_)


async def test_event_without_data_is_kept_as_evidence_without_key(
        client: httpx.AsyncClient, publisher: FakePublisher) -> None:
    body = json.dumps({"type": "ping"}).encode()
    assert (await client.post(URL, content=body, headers=signed(body))).status_code == 200
    [msg] = publisher.decoded(WebhookReceived)
    assert (msg.operation_key, msg.provider_ref, msg.outcome) == (None, None, "unknown")


def _without(headers: dict[str, str], name: str) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k != name}


def _rejections() -> list[Any]:
    body = event()
    ok = signed(body)
    sig = ok["webhook-signature"]
    forged = "v1," + base64.b64encode(os.urandom(32)).decode()
    return [
        pytest.param(body, _without(ok, "webhook-signature"), 401, "missing_signature",
                     id="unsigned"),
        pytest.param(body, _without(ok, "webhook-timestamp"), 401, "missing_signature",
                     id="no-timestamp"),
        pytest.param(body, _without(ok, "webhook-id"), 400, "invalid_webhook_id", id="no-id"),
        pytest.param(body, {**ok, "webhook-signature": forged}, 401, "invalid_signature",
                     id="forged"),
        pytest.param(body, signed(body, secret=OTHER_SECRET), 401, "invalid_signature",
                     id="wrong-key"),
        pytest.param(body + b" ", ok, 401, "invalid_signature", id="tampered-body"),
        pytest.param(body, {**ok, "webhook-id": "msg_2"}, 401, "invalid_signature",
                     id="other-id"),
        pytest.param(body, {**ok, "webhook-signature": sig.replace("v1,", "v2,")}, 401,
                     "invalid_signature", id="unknown-version"),
        pytest.param(body, {**ok, "webhook-signature": "v1,not-base64!!"}, 401,
                     "invalid_signature", id="garbage-signature"),
        pytest.param(body, signed(body, at=NOW - timedelta(seconds=301)), 401,
                     "timestamp_too_old", id="expired"),
        pytest.param(body, signed(body, at=NOW + timedelta(seconds=301)), 401,
                     "timestamp_in_future", id="future-dated"),
        pytest.param(body, {**ok, "webhook-timestamp": "1.7e9"}, 400, "invalid_timestamp",
                     id="float-timestamp"),
        pytest.param(body, {**ok, "webhook-timestamp": "soon"}, 400, "invalid_timestamp",
                     id="text-timestamp"),
        pytest.param(body, {**ok, "webhook-timestamp": "253402300800"}, 401,
                     "timestamp_in_future", id="past-the-year-9999"),
        pytest.param(body, {**ok, "webhook-timestamp": "999999999999"}, 401,
                     "timestamp_in_future", id="beyond-datetime"),
        pytest.param(b"{not json", signed(b"{not json"), 400, "invalid_json",
                     id="malformed-json"),
        pytest.param(b"[1, 2]", signed(b"[1, 2]"), 400, "invalid_event", id="json-array"),
        pytest.param(event(idempotency_key=7), signed(event(idempotency_key=7)), 400,
                     "invalid_event", id="key-not-a-string"),
        pytest.param(event(id="r" * 300), signed(event(id="r" * 300)), 422, "invalid_event",
                     id="ref-too-long"),
        pytest.param(event(fencing_token="2"), signed(event(fencing_token="2")), 400,
                     "invalid_event", id="token-not-an-integer"),
        pytest.param(b"\xff\xfe", {**ok}, 400, "invalid_body", id="not-utf8"),
    ]


@pytest.mark.parametrize("body,headers,status,code", _rejections())
async def test_bad_deliveries_are_4xx_and_publish_nothing(
        client: httpx.AsyncClient, publisher: FakePublisher, body: bytes,
        headers: dict[str, str], status: int, code: str) -> None:
    r = await client.post(URL, content=body, headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code)
    assert publisher.messages == []


@pytest.mark.parametrize("offset", [-300, 300])
async def test_timestamps_at_the_tolerance_edge_are_accepted(
        client: httpx.AsyncClient, publisher: FakePublisher, offset: int) -> None:
    body = event()
    r = await client.post(URL, content=body,
                          headers=signed(body, at=NOW + timedelta(seconds=offset)))
    assert r.status_code == 200 and len(publisher.messages) == 1


async def test_unknown_provider_is_404(client: httpx.AsyncClient,
                                       publisher: FakePublisher) -> None:
    body = event()
    r = await client.post("/v1/webhooks/stripe", content=body, headers=signed(body))
    assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_provider")
    assert publisher.messages == []


async def test_rotation_accepts_the_new_and_the_old_secret(publisher: FakePublisher) -> None:
    app = make_app(publisher, secrets={"sandbox": [SECRET, OLD_SECRET]})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://r") as c:
        b1, b2, b3 = event(), event(id="eff_2"), event(id="eff_3")
        assert (await c.post(URL, content=b1, headers=signed(b1))).status_code == 200
        assert (await c.post(URL, content=b2, headers=signed(
            b2, secret=OLD_SECRET, webhook_id="msg_2"))).status_code == 200
        r = await c.post(URL, content=b3, headers=signed(b3, secret=OTHER_SECRET,
                                                         webhook_id="msg_3"))
        assert r.status_code == 401
    assert [m.provider_ref for m in publisher.decoded(WebhookReceived)] == ["eff_1", "eff_2"]


async def test_one_valid_signature_among_several_is_enough(client: httpx.AsyncClient,
                                                           publisher: FakePublisher) -> None:
    body = event()
    headers = signed(body)
    other = signed(body, secret=OTHER_SECRET)["webhook-signature"]
    headers["webhook-signature"] = f"v2,abc {other} {headers['webhook-signature']}"
    assert (await client.post(URL, content=body, headers=headers)).status_code == 200


async def test_oversized_by_content_length_is_refused_before_reading_the_body(
        publisher: FakePublisher) -> None:
    """A huge Content-Length is refused without a single read of the body."""
    app = make_app(publisher)
    reads = 0
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    body = event()
    headers = {**signed(body), "content-length": str(10 ** 12)}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": URL, "raw_path": URL.encode(),
             "query_string": b"", "root_path": "", "server": ("r", 80), "client": ("c", 1),
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    await app(scope, receive, send)
    assert sent[0]["status"] == 413 and reads == 0 and publisher.messages == []


async def test_oversized_stream_without_content_length_stops_at_the_limit(
        publisher: FakePublisher) -> None:
    app = make_app(publisher)
    chunks_read = 0

    async def stream() -> Any:
        nonlocal chunks_read
        for _ in range(1000):
            chunks_read += 1
            yield b"x" * 1024

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://r") as c:
        r = await c.post(URL, content=stream(), headers=_without(signed(event()),
                                                                 "content-length"))
    assert r.status_code == 413 and publisher.messages == []
    assert r.json()["error"]["code"] == "payload_too_large"
    assert chunks_read <= LIMIT // 1024 + 1  # stopped reading at the limit


async def test_publish_failure_is_503_so_the_provider_retries(
        client: httpx.AsyncClient, publisher: FakePublisher) -> None:
    publisher.down = True
    body = event()
    r = await client.post(URL, content=body, headers=signed(body))
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    publisher.down = False
    r = await client.post(URL, content=body, headers=signed(body))
    assert r.status_code == 200 and len(publisher.messages) == 1


async def test_unsafe_skip_switch_accepts_forgeries_and_says_so_loudly(
        publisher: FakePublisher, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="effectledger_reconciler.webhooks"):
        app = make_app(publisher, skip=True)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://r") as c:
            body = event()
            forged = {**signed(body, secret=OTHER_SECRET,
                               at=NOW - timedelta(days=3))}
            assert (await c.post(URL, content=body, headers=forged)).status_code == 200
            assert (await c.post("/v1/webhooks/anyone", content=body,
                                 headers={"webhook-id": "msg_9"})).status_code == 200
    assert len(publisher.messages) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any(r.levelno == logging.CRITICAL and "UNSAFE" in r.getMessage()
               for r in caplog.records)
    assert sum("WITHOUT signature verification" in m for m in messages) == 2


def test_the_unsafe_switch_is_read_from_the_environment() -> None:
    assert skip_verification_requested({"EFFECTLEDGER_UNSAFE_SKIP_WEBHOOK_VERIFICATION": "1"})
    assert not skip_verification_requested({})
    assert not skip_verification_requested(
        {"EFFECTLEDGER_UNSAFE_SKIP_WEBHOOK_VERIFICATION": "0"})


async def test_health_and_readiness() -> None:
    state = {"nats": True}

    async def ready() -> dict[str, bool]:
        return dict(state)

    app = create_app(verifier=WebhookVerifier({}), publisher=FakePublisher(),
                     subjects=SUBJECTS, ready=ready)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://r") as c:
        assert (await c.get("/healthz")).json() == {"ok": True}
        assert (await c.get("/readyz")).status_code == 200
        state["nats"] = False
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"] == {"nats": False}
        assert (await c.get("/nope")).json()["error"]["code"] == "not_found"
        assert (await c.get(URL)).status_code == 405


def test_secrets_come_from_settings_json_and_bad_ones_fail_at_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EFFECTLEDGER_WEBHOOK_SECRETS",
                       json.dumps({"sandbox": [SECRET, OLD_SECRET], "other": []}))
    settings = Settings()
    assert repr(SECRET) not in repr(settings)  # secrets stay out of logs and reprs
    verifier = build_verifier(settings)
    assert verifier.providers == ["sandbox"]
    with pytest.raises(ConfigError, match="'sandbox'") as info:
        WebhookVerifier({"sandbox": ["whsec_"]})
    assert "whsec_" not in info.value.details.get("provider", "")
    with pytest.raises(ConfigError, match="provider name"):
        WebhookVerifier({"bad provider": [SECRET]})


async def test_nul_and_unpaired_surrogates_in_a_signed_event_are_stored_escaped(
        client: httpx.AsyncClient, publisher: FakePublisher) -> None:
    """Provider text a database cannot hold (NUL, "\\ud800") is escaped, not lost: the event
    still reaches the ledger as evidence."""
    body = json.dumps({"type": "effect.applied\u0000x", "data": {
        "id": "ref\u0000\ud800", "idempotency_key": "ck_1", "final": True}}).encode()
    r = await client.post(URL, content=body, headers=signed(body))
    assert r.status_code == 200, r.text
    [(_subject, payload, _msg_id)] = publisher.messages
    sent = json.loads(payload)
    assert (sent["event_type"], sent["provider_ref"]) == ("effect.applied\ufffdx", "ref\ufffd?")
