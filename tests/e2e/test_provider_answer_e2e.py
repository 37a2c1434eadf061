"""The provider's answer end to end (issue 13): a success returns what the provider created;
when the response was lost, the readback that found the effect supplies the answer. Real
processes; the sandbox's answer is `{id, idempotency_key, status, route, body, ...}`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from effectledger_client import AsyncClient
from tests.support.cluster import Cluster

pytestmark = pytest.mark.slow


async def test_the_answer_comes_from_the_response_or_from_the_readback(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster()
    await c.start()
    await c.start_reconciler()
    async with AsyncClient(c.ledger_url, token="") as ledger:
        done = (await ledger.submit("create_ticket", {"title": "answer me"},
                                    wait_s=20)).operation
        assert done.state == "succeeded" and done.result is not None
        answer = done.result.value
        assert answer["id"] == done.provider_ref and answer["body"] == {"title": "answer me"}
        assert (await ledger.receipt(done.id)).result == done.result

        # The provider applies and the answer is lost: the readback answers instead.
        resp = await c.sandbox.post("/_faults/append", json={
            "match": {"route": "idempotentfast"}, "action": {"kind": "drop_after_apply"},
            "times": 1})
        assert resp.status_code == 200, resp.text
        lost = (await ledger.submit("fast_ticket", {"title": "lost"})).operation
        settled = await ledger.wait(lost.id, 40)
        assert settled.state == "succeeded", settled
        assert settled.evidence is not None and settled.evidence["source"] == "readback"
        assert settled.result is not None and settled.result.value["id"] == settled.provider_ref
        assert settled.result.value["body"] == {"title": "lost"}
