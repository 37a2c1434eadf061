"""The sandbox's webhooks: signed so the reconciler verifies them, retried, and faulted on purpose.

The sandbox runs in-process; its webhook sender posts either into the reconciler's own ASGI app
(verification end to end, with a fake publisher) or into a recording receiver whose answers a
test scripts (retries, ordering, concurrency).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook
from starlette.applications import Starlette

from effectledger_bus.testing import FakePublisher
from effectledger_core.errors import BrokerUnavailable
from effectledger_core.messages import WebhookReceived
from effectledger_core.subjects import Subjects
from effectledger_reconciler.signatures import WebhookRejected, WebhookVerifier
from effectledger_reconciler.webhooks import create_app as reconciler_app
from effectledger_sandbox.app import create_app
from effectledger_sandbox.server import main as sandbox_main
from effectledger_sandbox.webhooks import (
    SEND_MODES,
    WebhookSender,
    bad_delivery,
    new_secret,
    sign,
)

SECRET = new_secret()
URL = "http://reconciler/v1/webhooks/sandbox"
IDEM = "/v1/idempotent/effects"
SUBJECTS = Subjects(prefix="t", stream_prefix="T")


@dataclass
class Receiver:
    """A scripted webhook endpoint: answers `statuses` in turn (then 200), records requests."""

    statuses: list[int | Exception] = field(default_factory=list)
    requests: list[httpx.Request] = field(default_factory=list)
    hold_s: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold_s:
                await asyncio.sleep(self.hold_s)
            answer = self.statuses.pop(0) if self.statuses else 200
        finally:
            self.in_flight -= 1
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={})

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]


def verifier() -> WebhookVerifier:
    return WebhookVerifier({"sandbox": [SECRET]})  # the real clock: the sandbox signs with it


@dataclass
class Rig:
    sandbox: Starlette
    sender: WebhookSender
    client: httpx.AsyncClient
    publisher: FakePublisher

    async def post(self, key: str, route: str = "idempotent", **kw: Any) -> httpx.Response:
        return await self.client.post(f"/v1/{route}/effects", json={"n": 1},
                                      headers={"Idempotency-Key": key}, **kw)

    async def log(self, key: str | None = None) -> dict[str, Any]:
        params = {"key": key} if key else {}
        body: dict[str, Any] = (await self.client.get("/_webhooks", params=params)).json()
        return body


def sender_for(transport: httpx.AsyncBaseTransport, **kw: Any) -> WebhookSender:
    return WebhookSender(url=URL, secret=SECRET, transport=transport, retry_base_s=0.01,
                         retry_cap_s=0.02, **kw)


async def make_rig(transport: httpx.AsyncBaseTransport | None = None,
                   **kw: Any) -> AsyncIterator[Rig]:
    publisher = FakePublisher()
    if transport is None:
        app = reconciler_app(verifier=verifier(), publisher=publisher, subjects=SUBJECTS)
        transport = httpx.ASGITransport(app=app)
    sender = sender_for(transport, **kw)
    sandbox = create_app(webhooks=sender)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sandbox),
                                 base_url="http://sandbox") as client:
        await client.post("/_config/routes/idempotent", json={"webhooks": True})
        yield Rig(sandbox, sender, client, publisher)
    await sender.aclose()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async for r in make_rig():
        yield r


@pytest.fixture
def receiver() -> Receiver:
    return Receiver()


@pytest.fixture
async def scripted(receiver: Receiver) -> AsyncIterator[Rig]:
    async for r in make_rig(httpx.MockTransport(receiver)):
        yield r


async def test_an_applied_effect_sends_a_webhook_the_reconciler_verifies(rig: Rig) -> None:
    r = await rig.post("k1")
    assert r.status_code == 201
    await rig.sender.drain()
    [msg] = rig.publisher.decoded(WebhookReceived)
    assert (msg.operation_key, msg.provider_ref, msg.outcome, msg.final) \
        == ("k1", r.json()["id"], "applied", True)
    [entry] = (await rig.log("k1"))["webhooks"]
    assert entry["webhook_id"] == msg.webhook_id and entry["type"] == "effect.applied"
    assert entry["status_codes"] == [200] and entry["state"] == "delivered"
    assert entry["effect_id"] == r.json()["id"]


async def test_a_replay_sends_no_second_webhook(rig: Rig) -> None:
    await rig.post("k1")
    await rig.post("k1")
    await rig.sender.drain()
    assert len((await rig.log())["webhooks"]) == 1


async def test_routes_without_webhooks_send_nothing(rig: Rig) -> None:
    await rig.post("k1", route="other")
    await rig.sender.drain()
    assert (await rig.log())["webhooks"] == [] and rig.publisher.messages == []


async def test_route_config_shows_and_sets_webhook_flags(rig: Rig) -> None:
    c = rig.client
    r = await c.post("/_config/routes/pay", json={"webhooks": True,
                                                  "not_applied_webhooks": True})
    assert r.json() == {"route": "pay", "webhooks": True, "not_applied_webhooks": True}
    assert (await c.get("/_config/routes/pay")).json() == {
        "route": "pay", "idempotent": True, "webhooks": True, "not_applied_webhooks": True,
        "scheme": "standard", "url": None}
    for bad in ({}, {"webhooks": "yes"}, {"colour": True}, [True]):
        assert (await c.post("/_config/routes/pay", json=bad)).status_code == 400


async def test_default_routes_send_from_the_start_and_after_a_reset(receiver: Receiver) -> None:
    sender = sender_for(httpx.MockTransport(receiver), default_routes=["*"])
    app = create_app(webhooks=sender)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://s") as c:
        await c.post("/v1/anything/effects", json={}, headers={"Idempotency-Key": "a"})
        await sender.drain()
        await c.post("/_reset")
        await c.post("/v1/plain/effects", json={}, headers={"Idempotency-Key": "b"})
        await sender.drain()
    assert [e["data"]["idempotency_key"] for e in receiver.events()] == ["a", "b"]
    await sender.aclose()


async def test_without_url_and_secret_webhooks_are_off() -> None:
    app = create_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://s") as c:
        await c.post("/_config/routes/idempotent", json={"webhooks": True})
        await c.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
        log = (await c.get("/_webhooks")).json()
        assert log["enabled"] is False and log["webhooks"] == []
        r = await c.post("/_webhooks/send", json={"type": "effect.applied", "data": {}})
        assert r.status_code == 409


async def test_a_late_apply_announces_pending_then_applied(rig: Rig) -> None:
    await rig.client.post("/_faults", json=[{"action": {"kind": "late_apply", "seconds": 0.05},
                                             "times": 1}])
    with pytest.raises(Exception):  # noqa: B017 - the sandbox drops the connection
        await rig.post("k1")
    await asyncio.gather(*rig.sandbox.state.background_tasks)
    await rig.sender.drain()
    msgs = rig.publisher.decoded(WebhookReceived)
    assert [(m.outcome, m.final) for m in msgs] == [("pending", False), ("applied", True)]
    assert all(m.operation_key == "k1" for m in msgs)


async def test_a_refusal_before_apply_sends_not_applied_when_configured(rig: Rig) -> None:
    await rig.client.post("/_config/routes/idempotent", json={"not_applied_webhooks": True})
    await rig.client.post("/_faults", json=[{"action": {"kind": "status_before_apply",
                                                        "status": 503}, "times": 1}])
    r = await rig.client.post(IDEM, json={}, headers={"Idempotency-Key": "k1",
                                                      "Fencing-Token": "4"})
    assert r.status_code == 503
    await rig.sender.drain()
    [entry] = (await rig.log("k1"))["webhooks"]
    assert entry["type"] == "effect.not_applied" and entry["fencing_token"] == 4
    [msg] = rig.publisher.decoded(WebhookReceived)
    assert (msg.outcome, msg.final, msg.operation_key, msg.fencing_token) \
        == ("not_applied", True, "k1", 4)


async def test_no_not_applied_without_the_flag_or_once_the_key_has_an_effect(rig: Rig) -> None:
    fault = [{"action": {"kind": "rate_limit"}, "times": 1}]
    await rig.client.post("/_faults", json=fault)
    assert (await rig.post("k1")).status_code == 429  # flag off: nothing
    await rig.client.post("/_config/routes/idempotent", json={"not_applied_webhooks": True})
    assert (await rig.post("k2")).status_code == 201
    await rig.client.post("/_faults", json=fault)
    assert (await rig.post("k2")).status_code == 429  # k2 is applied: a refusal is no news
    await rig.sender.drain()
    assert [e["type"] for e in (await rig.log())["webhooks"]] == ["effect.applied"]


async def test_non_2xx_answers_are_retried_with_the_same_id_until_accepted(
        scripted: Rig, receiver: Receiver) -> None:
    receiver.statuses = [500, 503, httpx.ConnectError("refused"), 200]
    await scripted.post("k1")
    await scripted.sender.drain()
    [entry] = (await scripted.log())["webhooks"]
    assert entry["status_codes"] == [500, 503, None, 200] and entry["state"] == "delivered"
    assert "ConnectError" in entry["deliveries"][2]["error"]
    ids = {r.headers["webhook-id"] for r in receiver.requests}
    sigs = {r.headers["webhook-signature"] for r in receiver.requests}
    assert len(receiver.requests) == 4 and len(ids) == 1 and len(sigs) == 1


async def test_retries_are_bounded(scripted: Rig, receiver: Receiver) -> None:
    receiver.statuses = [500] * 100
    await scripted.post("k1")
    await scripted.sender.drain()
    [entry] = (await scripted.log())["webhooks"]
    assert entry["status_codes"] == [500] * scripted.sender.max_attempts
    assert entry["state"] == "failed"


async def test_duplicate_fault_delivers_k_copies_some_at_once_and_changes_state_once(
        rig: Rig) -> None:
    await rig.client.post("/_webhooks/faults", json=[{
        "action": {"kind": "duplicate", "copies": 5, "concurrent": 3}, "times": 1}])
    await rig.post("k1")
    await rig.sender.drain()
    [entry] = (await rig.log())["webhooks"]
    assert entry["status_codes"] == [200] * 5 and entry["faults"] == ["duplicate"]
    assert rig.publisher.publishes == 5 and len(rig.publisher.messages) == 1


async def test_duplicate_copies_are_concurrent(scripted: Rig, receiver: Receiver) -> None:
    receiver.hold_s = 0.05
    await scripted.client.post("/_webhooks/faults", json={"faults": [{
        "action": {"kind": "duplicate", "copies": 4, "concurrent": 3}}]})
    await scripted.post("k1")
    await scripted.sender.drain()
    assert len(receiver.requests) == 4 and receiver.max_in_flight == 3


async def test_resign_fault_gives_copies_new_timestamps_that_all_verify(
        scripted: Rig, receiver: Receiver) -> None:
    await scripted.client.post("/_webhooks/faults", json=[
        {"action": {"kind": "duplicate", "copies": 3, "concurrent": 1}},
        {"action": {"kind": "resign"}}])
    await scripted.post("k1")
    await scripted.sender.drain()
    stamps = [r.headers["webhook-timestamp"] for r in receiver.requests]
    assert len(set(stamps)) == 3
    assert len({r.headers["webhook-id"] for r in receiver.requests}) == 1
    for request in receiver.requests:
        verified = verifier().verify("sandbox", request.headers, request.content)
        assert verified.webhook_id == request.headers["webhook-id"]


async def test_reorder_fault_sends_the_later_event_first(scripted: Rig,
                                                         receiver: Receiver) -> None:
    await scripted.client.post("/_webhooks/faults", json=[{
        "match": {"key": "k1"}, "action": {"kind": "reorder", "seconds": 30}}])
    await scripted.post("k1")
    assert (await scripted.log("k1"))["webhooks"][0]["state"] == "held"
    await scripted.post("k2")
    await scripted.sender.drain()
    assert [e["data"]["idempotency_key"] for e in receiver.events()] == ["k2", "k1"]


async def test_a_held_event_without_a_successor_is_sent_after_its_hold(
        scripted: Rig, receiver: Receiver) -> None:
    await scripted.client.post("/_webhooks/faults", json=[{
        "action": {"kind": "reorder", "seconds": 0.05}, "times": 1}])
    await scripted.post("k1")
    await scripted.sender.drain()
    assert [e["data"]["idempotency_key"] for e in receiver.events()] == ["k1"]


async def test_delay_fault_holds_the_first_delivery(scripted: Rig, receiver: Receiver) -> None:
    await scripted.client.post("/_webhooks/faults", json=[{
        "match": {"type": "effect.applied"}, "action": {"kind": "delay", "seconds": 0.2}}])
    started = time.monotonic()
    await scripted.post("k1")
    await asyncio.sleep(0.05)
    assert receiver.requests == []
    await scripted.sender.drain()
    assert len(receiver.requests) == 1 and time.monotonic() - started >= 0.2


async def test_webhook_faults_are_validated_listed_and_cleared(rig: Rig) -> None:
    c = rig.client
    for bad in ({"action": {"kind": "explode"}}, {"action": {"kind": "duplicate", "copies": 1}},
                {"action": {"kind": "duplicate", "copies": 3, "concurrent": 4}},
                {"action": {"kind": "delay", "seconds": -1}}, {"match": {"route": 1},
                                                                "action": {"kind": "resign"}},
                {"action": {"kind": "resign"}, "times": -1}, "nope"):
        r = await c.post("/_webhooks/faults", json=[bad])
        assert r.status_code == 400, bad
    r = await c.post("/_webhooks/faults", json=[{"match": {"route": "idempotent"},
                                                 "action": {"kind": "duplicate", "copies": 3},
                                                 "times": 2}])
    assert r.json()["faults"] == [{"match": {"route": "idempotent"}, "action": {
        "kind": "duplicate", "copies": 3, "concurrent": 2}, "times": 2, "fired": 0}]
    assert (await c.delete("/_webhooks/faults")).json() == {"faults": []}


async def test_reset_forgets_the_log_faults_routes_and_held_events(rig: Rig) -> None:
    await rig.client.post("/_webhooks/faults", json=[{"action": {"kind": "reorder",
                                                                 "seconds": 30}}])
    await rig.post("k1")
    assert (await rig.log())["pending"] == 1
    await rig.client.post("/_reset")
    await rig.sender.drain()
    log = await rig.log()
    assert log["webhooks"] == [] and log["pending"] == 0 and rig.publisher.messages == []
    assert (await rig.client.get("/_webhooks/faults")).json() == {"faults": []}
    assert (await rig.client.get("/_config/routes/idempotent")).json()["webhooks"] is False


async def test_send_helper_bad_signatures_are_refused_by_the_reconciler(rig: Rig) -> None:
    data = {"id": "eff_x", "idempotency_key": "k9", "final": True}
    results = {}
    for mode in SEND_MODES:
        r = await rig.client.post("/_webhooks/send", json={
            "type": "effect.applied", "data": data, "mode": mode})
        results[mode] = r.json()["status"]
    assert results == {"valid": 200, "forged": 401, "wrong_key": 401, "expired": 401,
                       "future": 401, "unsigned": 401, "tampered_body": 401}
    [msg] = rig.publisher.decoded(WebhookReceived)
    assert msg.operation_key == "k9"
    modes = [e["mode"] for e in (await rig.log("k9"))["webhooks"]]
    assert modes == list(SEND_MODES)
    assert (await rig.client.post("/_webhooks/send", json={"type": 1})).status_code == 400


def test_bad_deliveries_fail_verification_for_the_documented_reason() -> None:
    now = int(time.time())
    body = b'{"type":"effect.applied","data":{}}'
    expected = {"valid": None, "forged": "invalid_signature", "wrong_key": "invalid_signature",
                "expired": "timestamp_too_old", "future": "timestamp_in_future",
                "unsigned": "missing_signature", "tampered_body": "invalid_signature"}
    for mode, code in expected.items():
        headers, sent = bad_delivery(mode, SECRET, "msg_1", now, body)
        try:
            verifier().verify("sandbox", headers, sent)
            got = None
        except WebhookRejected as exc:
            got = exc.code
        assert got == code, mode


def test_signatures_verify_with_the_reference_library() -> None:
    body = b'{"type":"effect.applied","data":{"id":"eff_1"}}'
    headers = sign(SECRET, "msg_1", int(time.time()), body)
    assert Webhook(SECRET).verify(body, headers) == json.loads(body)


async def test_undeliverable_to_a_down_reconciler_is_retried_then_failed() -> None:
    class Down:
        async def publish(self, subject: str, payload: bytes, *, msg_id: str) -> bool:
            raise BrokerUnavailable("down")

    app = reconciler_app(verifier=verifier(), publisher=Down(), subjects=SUBJECTS)
    sender = sender_for(httpx.ASGITransport(app=app), max_attempts=3, default_routes=["*"])
    sandbox = create_app(webhooks=sender)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sandbox),
                                 base_url="http://s") as c:
        await c.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
        await sender.drain()
        [entry] = (await c.get("/_webhooks")).json()["webhooks"]
    assert entry["status_codes"] == [503, 503, 503] and entry["state"] == "failed"
    await sender.aclose()


@pytest.mark.parametrize("argv", [["--webhook-url", URL],
                                  ["--webhook-secret", SECRET],
                                  ["--webhook-url", URL, "--webhook-secret", "not-a-secret"]])
def test_the_sandbox_command_refuses_inconsistent_webhook_flags(
        argv: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("URL", "SECRET", "ROUTES"):
        monkeypatch.delenv(f"EFFECTLEDGER_SANDBOX_WEBHOOK_{name}", raising=False)
    assert sandbox_main(["--port", "0", *argv]) == 2
    assert "error:" in capsys.readouterr().err
