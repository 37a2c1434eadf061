"""The ledger keeps the provider's answer once, in `operations.result`, and returns it in the
operation view, the receipt and the wait; a readback's answer comes with `applied` (both
databases)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from effectledger_core.messages import (
    AttemptSucceeded,
    Evidence,
    OutcomeAmbiguous,
    VerdictReached,
)
from effectledger_core.results import ProviderResult
from effectledger_ledger.service import LedgerService
from tests.integration.test_api_auth import AGENT_A, auth
from tests.integration.test_waits import (  # noqa: F401 - svc and client are fixtures
    LONG,
    NOW,
    _claim,
    _submit,
    _waiting,
    client,
    svc,
)

ANSWER = ProviderResult(kind="json", value={"id": "tk_7", "url": "https://t/7"}, bytes=36)


def _success(op_id: str, result: ProviderResult | None) -> AttemptSucceeded:
    return AttemptSucceeded(operation_id=op_id, epoch=1, attempt_id=f"{op_id}-a",
                            dispatcher_id="d1", at=NOW, response_digest="sha256:beef",
                            provider_ref="tk_7", http_status=201, result=result)


async def _get(http: httpx.AsyncClient, path: str) -> dict[str, Any]:
    resp = await http.get(path, headers=auth(AGENT_A))
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def test_a_successful_answer_is_in_the_view_receipt_and_wait_and_stored_once(
        svc: LedgerService, client: httpx.AsyncClient) -> None:  # noqa: F811
    op = await _submit(client)
    waiting = asyncio.create_task(client.get(f"/v1/operations/{op['id']}",
                                             params={"wait": LONG}, headers=auth(AGENT_A)))
    await _waiting(svc)
    await svc.claim(_claim(op["id"]))
    await svc.record_outcome(_success(op["id"], ANSWER), consumer="ledger", message_id="r1")
    waited = (await asyncio.wait_for(waiting, 10)).json()
    stored = ANSWER.model_dump(mode="json")
    assert waited["result"] == stored
    assert (await _get(client, f"/v1/operations/{op['id']}/receipt"))["result"] == stored
    # Not copied into the journal, the attempt or last_outcome.
    view = await _get(client, f"/v1/operations/{op['id']}")
    assert "result" not in view["last_outcome"] and "result" not in view["attempts"][0]["outcome"]
    journal = await _get(client, f"/v1/operations/{op['id']}/journal")
    assert all("result" not in e["detail"] for e in journal["entries"])


async def test_a_success_without_an_answer_has_none(
        svc: LedgerService, client: httpx.AsyncClient) -> None:  # noqa: F811
    op = await _submit(client)
    await svc.claim(_claim(op["id"]))
    await svc.record_outcome(_success(op["id"], None), consumer="ledger", message_id="r2")
    view = await _get(client, f"/v1/operations/{op['id']}")
    assert view["state"] == "succeeded" and view["result"] is None


async def test_a_readback_decided_success_carries_the_readbacks_answer(
        svc: LedgerService, client: httpx.AsyncClient) -> None:  # noqa: F811
    op = await _submit(client)
    await svc.claim(_claim(op["id"]))
    await svc.record_outcome(OutcomeAmbiguous(
        operation_id=op["id"], epoch=1, attempt_id=f"{op['id']}-a", dispatcher_id="d1", at=NOW,
        reason="timeout"), consumer="ledger", message_id="r3")
    await svc.record_verdict(VerdictReached(
        operation_id=op["id"], epoch=1, verdict="applied", reconciler_id="r1", at=NOW,
        evidence=Evidence(source="readback", at=NOW, provider_ref="tk_7", digest="sha256:aa"),
        result=ANSWER), consumer="ledger", message_id="v3")
    view = await _get(client, f"/v1/operations/{op['id']}")
    assert view["state"] == "succeeded"
    assert view["result"] == ANSWER.model_dump(mode="json")
    assert view["evidence"]["source"] == "readback"
