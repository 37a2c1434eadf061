"""Submit-and-wait over NATS: `<prefix>.rpc.v1.operation.wait` answers once the operation
settles, pushed by the commit (real NATS, both databases)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NatsClient

from effectledger_core.config import Settings
from effectledger_core.messages import SubmitIntent
from effectledger_ledger.db.store import Store
from effectledger_ledger.messaging import serve_requests
from effectledger_ledger.service import LedgerService
from tests.integration.test_api_auth import CATALOG
from tests.integration.test_waits import _claim, _success, _waiting


@pytest.fixture
async def wired(settings: Settings, store: Store
                ) -> AsyncIterator[tuple[LedgerService, NatsClient]]:
    svc = LedgerService(store=store, catalog=CATALOG, subjects=settings.subjects,
                        wait_recheck_s=0)
    nc = await nats.connect(settings.nats_url)
    server = await serve_requests(nc, settings, svc)
    try:
        yield svc, nc
    finally:
        await server.close()
        await nc.close()
        await svc.close()


async def _ask(nc: NatsClient, settings: Settings, body: object) -> dict[str, object]:
    msg = await nc.request(settings.subjects.rpc_operation_wait, json.dumps(body).encode(),
                           timeout=30)
    return dict(json.loads(msg.data))


async def test_a_nats_wait_is_answered_when_the_outcome_commits(
        wired: tuple[LedgerService, NatsClient], settings: Settings) -> None:
    svc, nc = wired
    op = (await svc.submit(SubmitIntent(tool="lookup", arguments={"q": 1}))).operation
    reply = asyncio.create_task(_ask(nc, settings, {"operation_id": op["id"], "wait_s": 25}))
    await _waiting(svc)
    await svc.claim(_claim(op["id"]))
    await svc.record_outcome(_success(op["id"]), consumer="ledger", message_id="n1")
    answer = await asyncio.wait_for(reply, 10)
    assert answer["ok"] is True
    assert answer["operation"]["state"] == "succeeded"  # type: ignore[index]


@pytest.mark.parametrize("body", [{"operation_id": "x", "wait_s": "10s"},
                                  {"operation_id": "x", "wait_s": -1},
                                  {"operation_id": "x", "wait_s": True}, {"wait_s": 1}])
async def test_a_bad_nats_wait_gets_an_error_reply(
        wired: tuple[LedgerService, NatsClient], settings: Settings, body: object) -> None:
    _, nc = wired
    answer = await _ask(nc, settings, body)
    assert answer["ok"] is False
    # Like every request subject: input that can never be served is a poison message, and
    # the message names the field.
    error = answer["error"]
    assert error["code"] == "poison_message"  # type: ignore[index]
    assert "wait_s" in error["message"] or "operation_id" in error["message"]  # type: ignore[index]


async def test_a_nats_wait_for_an_unknown_operation_is_not_found(
        wired: tuple[LedgerService, NatsClient], settings: Settings) -> None:
    _, nc = wired
    answer = await _ask(nc, settings, {"operation_id": "nope", "wait_s": 5})
    assert answer["error"]["code"] == "not_found"  # type: ignore[index]


async def test_an_agent_waits_on_its_own_tenants_subject_and_not_on_anothers(
        wired: tuple[LedgerService, NatsClient], settings: Settings) -> None:
    """`<prefix>.rpc.v1.tenant.<tenant>.wait`: the tenant comes from the subject (bound by NATS
    permissions); another tenant's operation reads like a missing one."""
    svc, nc = wired
    op = (await svc.submit(SubmitIntent(tool="lookup", arguments={"q": 2},
                                        tenant="acme"))).operation
    body = json.dumps({"operation_id": op["id"], "wait_s": 25}).encode()
    subjects = settings.subjects
    other = json.loads((await nc.request(subjects.rpc_operation_wait_for("globex"), body,
                                         timeout=30)).data)
    assert other["ok"] is False and other["error"]["code"] == "not_found"
    reply = asyncio.create_task(nc.request(subjects.rpc_operation_wait_for("acme"), body,
                                           timeout=30))
    await _waiting(svc)
    await svc.claim(_claim(op["id"]))
    await svc.record_outcome(_success(op["id"]), consumer="ledger", message_id="n2")
    answer = json.loads((await asyncio.wait_for(reply, 10)).data)
    assert answer["ok"] is True and answer["operation"]["state"] == "succeeded"
