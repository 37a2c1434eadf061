"""The reconciler against real NATS JetStream: its composition root, consumer and webhook API.

`serve()` runs in-process with a private subject prefix and stream names. A tiny stand-in
answers the ledger's `rpc_operation` subject (the ledger itself is not under test here), and the
test reads what the reconciler published straight from the events stream.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from standardwebhooks import Webhook
from starlette.applications import Starlette

from effectledger_bus.publish import JetStreamPublisher
from effectledger_bus.streams import delete_streams, ensure_streams
from effectledger_cli.embedded import free_port
from effectledger_core.config import Settings
from effectledger_core.messages import (
    ReconcileOperation,
    VerdictReached,
    WebhookReceived,
    encode,
    parse,
)
from effectledger_core.subjects import Subjects
from effectledger_reconciler.app import serve
from effectledger_reconciler.signatures import WebhookVerifier
from effectledger_reconciler.webhooks import create_app
from effectledger_sandbox.app import create_app as create_sandbox
from effectledger_sandbox.app import sandbox_state
from effectledger_sandbox.server import serve as serve_sandbox
from tests.support.servers import unique_prefix

pytestmark = pytest.mark.nats

SECRET = "whsec_" + base64.b64encode(b"integration-secret-0123456").decode()
CATALOG = """
[tools.blind]
endpoint = "http://127.0.0.1:9/v1/plain/effects"
contract_revision = "1"

[tools.looked_up]
endpoint = "http://127.0.0.1:@PORT@/v1/idempotent/effects"
contract_revision = "1"
horizon_s = 2
capabilities = { readback = true }
readback = { url = "http://127.0.0.1:@PORT@/v1/idempotent/effects/by-key/{operation_key}" }
"""


@pytest.fixture
def sandbox_port() -> int:
    return free_port()


@pytest.fixture
async def rsettings(nats_url: str, tmp_path: Path, sandbox_port: int) -> AsyncIterator[Settings]:
    """Reconciler settings on a private prefix (no database needed); streams dropped after."""
    subject_prefix, stream_prefix = unique_prefix()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.replace("@PORT@", str(sandbox_port)))
    settings = Settings(nats_url=nats_url, subject_prefix=subject_prefix,
                        stream_prefix=stream_prefix, stream_storage="memory",
                        catalog_path=str(catalog), reconciler_id="rec-it",
                        reconciler_port=free_port(),
                        webhook_secrets={"sandbox": [SECRET]})
    yield settings
    nc = await nats.connect(nats_url)
    try:
        await delete_streams(nc.jetstream(), settings)
    finally:
        await nc.close()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


# operation id -> (operation key, tool) as the stand-in ledger reports it (default ck_1, blind).
LEDGER_VIEW: dict[str, tuple[str, str]] = {}


@pytest.fixture
async def reconciler(rsettings: Settings, nc: NatsClient) -> AsyncIterator[Settings]:
    """The reconciler's `serve()` running, with a stand-in ledger answering rpc_operation."""

    async def ledger(msg: Msg) -> None:
        op_id = json.loads(msg.data)["operation_id"]
        # The reconciler compares its command with the ledger's view, so the stand-in answers
        # with the key and tool the test registered for this operation.
        key, tool = LEDGER_VIEW.get(op_id, ("ck_1", "blind"))
        await msg.respond(json.dumps({"ok": True, "operation": {
            "id": op_id, "state": "ambiguous", "epoch": 1, "operation_key": key,
            "tool": tool, "provider_ref": None}}).encode())

    sub = await nc.subscribe(rsettings.subjects.rpc_operation, cb=ledger)
    started = asyncio.Event()
    task = asyncio.create_task(serve(rsettings, started=started))
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait([task, waiter], timeout=20, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    assert started.is_set(), "the reconciler did not start"
    yield rsettings
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await sub.unsubscribe()


async def next_on(js: JetStreamContext, settings: Settings, subject: str) -> Msg:
    psub = await js.pull_subscribe(subject, stream=settings.subjects.events_stream)
    try:
        [msg] = await psub.fetch(1, timeout=15.0)
        await msg.ack_sync()  # a work queue: the message is gone once this returns
        return msg
    finally:
        await psub.unsubscribe()


def command(op_id: str, tool: str, key: str = "ck_1") -> ReconcileOperation:
    now = datetime.now(UTC)
    return ReconcileOperation(operation_id=op_id, epoch=1, attempt_id="att_1",
                              operation_key=key, tool=tool, arguments={}, cause="ambiguous",
                              reason="timeout", claimed_at=now, noticed_at=now)


def signed(body: bytes, webhook_id: str) -> dict[str, str]:
    now = datetime.now(UTC)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(SECRET).sign(webhook_id, now, body.decode()),
            "content-type": "application/json"}


async def test_a_verified_webhook_is_published_as_webhook_received(
        reconciler: Settings, nc: NatsClient) -> None:
    body = json.dumps({"type": "effect.applied", "data": {
        "id": "eff_7", "idempotency_key": "ck_1", "fencing_token": 1, "final": True}}).encode()
    url = f"http://127.0.0.1:{reconciler.reconciler_port}"
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/readyz")).status_code == 200
        forged = {**signed(body, "msg_x"), "webhook-signature": "v1," + "A" * 44}
        assert (await http.post("/v1/webhooks/sandbox", content=body,
                                headers=forged)).status_code == 401
        first = await http.post("/v1/webhooks/sandbox", content=body,
                                headers=signed(body, "msg_1"))
        again = await http.post("/v1/webhooks/sandbox", content=body,
                                headers=signed(body, "msg_1"))
    assert first.status_code == again.status_code == 200
    assert (first.json()["duplicate"], again.json()["duplicate"]) == (False, True)
    js = nc.jetstream()
    msg = await next_on(js, reconciler, reconciler.subjects.webhook)
    assert msg.headers is not None and msg.headers["Nats-Msg-Id"] == "webhook:sandbox:msg_1"
    received = parse(WebhookReceived, msg.data)
    assert (received.webhook_id, received.operation_key, received.provider_ref,
            received.outcome) == ("msg_1", "ck_1", "eff_7", "applied")
    info = await js.stream_info(reconciler.subjects.events_stream)
    assert info.state.messages == 0  # the forgery and the duplicate left nothing behind


async def test_a_tool_without_oracles_yields_an_undecidable_verdict(
        reconciler: Settings, nc: NatsClient) -> None:
    js = nc.jetstream()
    now = datetime.now(UTC)
    cmd = ReconcileOperation(operation_id="op_it_1", epoch=1, attempt_id="att_1",
                             operation_key="ck_1", tool="blind", arguments={},
                             cause="ambiguous", reason="timeout",
                             claimed_at=now - timedelta(seconds=6), noticed_at=now)
    await js.publish(reconciler.subjects.ambiguous, encode(cmd),
                     headers={"Nats-Msg-Id": "outbox-it-1"})
    msg = await next_on(js, reconciler, reconciler.subjects.verdict)
    verdict = parse(VerdictReached, msg.data)
    assert (verdict.operation_id, verdict.epoch, verdict.verdict) == ("op_it_1", 1, "undecidable")
    assert verdict.reason == "no readback or webhook oracle"
    assert verdict.reconciler_id == "rec-it"
    assert msg.headers is not None
    assert msg.headers["Nats-Msg-Id"] == "verdict:op_it_1:1:undecidable"
    # The command was acked after the verdict's publish-ack: nothing left to redeliver.
    for _ in range(100):
        consumer = await js.consumer_info(reconciler.subjects.events_stream, "reconciler")
        if consumer.num_ack_pending == 0 and consumer.num_pending == 0:
            break
        await asyncio.sleep(0.05)
    assert (consumer.num_ack_pending, consumer.num_pending) == (0, 0)
    assert consumer.config.max_deliver == -1


async def test_webhook_is_503_when_jetstream_cannot_store_it(nats_url: str) -> None:
    """No stream captures the subject: no publish-ack, so the provider is told to retry."""
    client = await nats.connect(nats_url)
    try:
        prefix, stream_prefix = unique_prefix()
        subjects = Subjects(prefix=prefix, stream_prefix=stream_prefix)
        app = create_app(verifier=WebhookVerifier({"sandbox": [SECRET]}),
                         publisher=JetStreamPublisher(client.jetstream(), timeout_s=1.0),
                         subjects=subjects)
        body = b'{"type": "effect.applied", "data": {}}'
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://r") as http:
            r = await http.post("/v1/webhooks/sandbox", content=body,
                                headers=signed(body, "msg_503"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable"
    finally:
        await client.close()


async def test_streams_exist_after_start(reconciler: Settings, nc: NatsClient) -> None:
    await ensure_streams(nc.jetstream(), reconciler)  # idempotent with the reconciler's own
    info = await nc.jetstream().stream_info(reconciler.subjects.events_stream)
    assert reconciler.subjects.reconcile_all in (info.config.subjects or [])


@pytest.fixture
async def sandbox(sandbox_port: int) -> AsyncIterator[Starlette]:
    app = create_sandbox()
    ready = asyncio.Event()
    task = asyncio.create_task(serve_sandbox("127.0.0.1", sandbox_port, app=app, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    yield app
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_readback_waits_by_redelivery_for_a_late_apply_and_the_horizon(
        reconciler: Settings, nc: NatsClient, sandbox: Starlette) -> None:
    """Real nak(delay) redeliveries: a late apply (1 s) is found; a missing effect is
    declared not applied only by a readback after the 2 s horizon."""
    js = nc.jetstream()
    started = time.monotonic()

    async def apply_late() -> None:
        await asyncio.sleep(1.0)
        sandbox_state(sandbox).apply("idempotent", "ck_late", {}, 1)

    late = asyncio.create_task(apply_late())
    for op_id, key in (("op_late", "ck_late"), ("op_never", "ck_never")):
        LEDGER_VIEW[op_id] = (key, "looked_up")
        await js.publish(reconciler.subjects.ambiguous, encode(command(op_id, "looked_up", key)),
                         headers={"Nats-Msg-Id": f"outbox-{op_id}"})
    psub = await js.pull_subscribe(reconciler.subjects.verdict,
                                   stream=reconciler.subjects.events_stream)
    verdicts: dict[str, tuple[VerdictReached, float]] = {}
    try:
        while len(verdicts) < 2:
            for msg in await psub.fetch(1, timeout=15.0):
                await msg.ack_sync()
                v = parse(VerdictReached, msg.data)
                verdicts[v.operation_id] = (v, time.monotonic() - started)
    finally:
        await psub.unsubscribe()
        await late
    applied, applied_after = verdicts["op_late"]
    assert applied.verdict == "applied" and applied_after >= 1.0
    assert applied.evidence is not None and applied.evidence.provider_ref is not None
    absent, absent_after = verdicts["op_never"]
    assert absent.verdict == "not_applied" and absent_after >= 2.0
    assert absent.evidence is not None and absent.evidence.source == "readback"
    assert sandbox_state(sandbox).requests_json() == []  # only readbacks (GET), never a POST
