"""effectledger_integrations.calls: keys from the framework's call identity, answers a model
can act on (never an exception), a submission the ledger did not answer sent again under the
same key, and no framework loaded by the shared part."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from effectledger_client import AsyncClient, OperationView
from effectledger_integrations.calls import LedgerCalls, call_key, render

NOW = "2026-12-03T08:00:00Z"


def _op(state: str, **extra: Any) -> dict[str, Any]:
    return {"id": "op-1", "tenant": "default", "caller_key": "k-1", "operation_key": "ok-1",
            "tool": "send_email", "arguments": {}, "arguments_digest": "d", "tool_digest": "t",
            "contract_revision": "r", "effect_class": "non_idempotent",
            "commit_policy": "auto", "state": state, "epoch": 1, "created_at": NOW,
            "updated_at": NOW, **extra}


def test_keys_are_stable_per_call_and_distinct_across_scopes() -> None:
    key = call_key("pydantic-ai", "call-1", None, "run-1")
    assert key == call_key("pydantic-ai", "call-1", "", "run-1")  # a missing scope is none
    assert key.startswith("pydantic-ai:")
    assert key != call_key("pydantic-ai", "call-1", None, "run-2")
    assert key != call_key("langgraph", "call-1", None, "run-1")
    # No separator inside an id can make two identities one key.
    assert call_key("f", "c", "a:b") != call_key("f", "b:c", "a")


@pytest.mark.parametrize("state", ["ambiguous", "awaiting_confirmation", "needs_review",
                                   "pending", "in_flight", "awaiting_approval"])
def test_an_unsettled_or_unknown_outcome_says_do_not_retry_and_how_to_learn_it(
        state: str) -> None:
    answer = render(OperationView.model_validate(_op(state)), key="k-1", replayed=False)
    assert answer.do_not_retry is True
    assert 'effectledger_status with operation_id "op-1"' in answer.data["message"]
    assert json.loads(answer.text) == answer.data  # the text is the structured result
    if state in ("ambiguous", "awaiting_confirmation", "needs_review"):
        assert answer.outcome == "unknown" and "Do NOT retry" in answer.data["message"]


def test_success_carries_the_key_the_result_and_whether_it_was_a_replay() -> None:
    op = OperationView.model_validate(_op(
        "succeeded", provider_ref="ref-9", evidence={"source": "readback"},
        result={"kind": "json", "value": {"id": 9}}))
    data = render(op, key="k-1", replayed=True).data
    assert data["outcome"] == "succeeded" and data["do_not_retry"] is False
    assert (data["idempotency_key"], data["replayed"], data["result"]) == ("k-1", True, {"id": 9})
    assert data["decided_by"] == "readback" and data["provider_ref"] == "ref-9"


class FakeLedger:
    """`POST /v1/intents` answered by a script of HTTP statuses; every body is kept."""

    def __init__(self, *statuses: int, submit_takes_s: float = 0.0) -> None:
        self.statuses = list(statuses)
        self.bodies: list[dict[str, Any]] = []
        self.waits: list[str] = []
        # How long a submission holds the caller (blocking, as a slow ledger's answer would):
        # the monotonic clock then moves at least this much during the submission.
        self.submit_takes_s = submit_takes_s

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # a wait on the operation: it settles meanwhile
            self.waits.append(request.url.params["wait"])
            return httpx.Response(200, json=_op("succeeded"))
        assert request.url.path == "/v1/intents"
        self.bodies.append(json.loads(request.content))
        time.sleep(self.submit_takes_s)  # a handler of MockTransport is synchronous
        status = self.statuses.pop(0)
        if status == 201:
            return httpx.Response(201, json=_op("succeeded"))
        if status == 202:  # accepted, but the ledger's cap ended the submission's wait early
            return httpx.Response(201, json=_op("in_flight"))
        code = {503: "store_unavailable", 422: "invalid_request",
                409: "idempotency_key_conflict"}[status]
        return httpx.Response(status, json={"error": {
            "code": code, "message": "nope", "details": {"field": "/to"}}})

    def client(self) -> AsyncClient:
        http = httpx.AsyncClient(base_url="http://ledger", transport=httpx.MockTransport(self))
        return AsyncClient("http://ledger", http=http)


async def test_an_unanswered_submission_is_sent_again_under_the_same_key() -> None:
    ledger = FakeLedger(503, 503, 201)
    answer = await LedgerCalls(ledger.client(), submit_retry_s=5).call(
        "send_email", {"to": "a"}, key="k-1")
    assert answer.outcome == "succeeded"
    assert [b["idempotency_key"] for b in ledger.bodies] == ["k-1"] * 3


async def test_a_call_waits_wait_s_in_all_not_once_more_after_the_submission() -> None:
    # The submission takes 50 ms: an instant one left "2.000s" (the wait is sent in ms), which
    # cannot tell "what was left" from "wait_s once more".
    ledger = FakeLedger(202, submit_takes_s=0.05)
    answer = await LedgerCalls(ledger.client(), wait_s=2).call("send_email", {}, key="k-1")
    assert answer.outcome == "succeeded"
    assert len(ledger.bodies) == 1 and len(ledger.waits) == 1
    assert float(ledger.waits[0].removesuffix("s")) <= 1.95  # only what was left of wait_s


async def test_a_ledger_that_never_answers_is_an_unknown_outcome_not_an_error() -> None:
    ledger = FakeLedger(*[503] * 50)
    answer = await LedgerCalls(ledger.client(), submit_retry_s=0.3).call(
        "send_email", {}, key="k-1")
    assert answer.outcome == "unknown" and answer.do_not_retry is True
    assert answer.data["idempotency_key"] == "k-1" and "same call id" in answer.data["message"]


async def test_a_refusal_is_a_result_naming_what_to_fix() -> None:
    ledger = FakeLedger(422)
    answer = await LedgerCalls(ledger.client()).call("send_email", {}, key="k-1")
    assert answer.outcome == "refused" and answer.do_not_retry is False
    assert answer.data["details"] == {"field": "/to"} and len(ledger.bodies) == 1


async def test_a_call_id_reused_with_other_arguments_is_refused_not_retried() -> None:
    ledger = FakeLedger(409)
    answer = await LedgerCalls(ledger.client()).call("send_email", {"to": "b"}, key="k-1")
    assert answer.outcome == "refused" and answer.data["error"] == "idempotency_key_conflict"
    assert "already used with different arguments" in answer.data["message"]
    assert len(ledger.bodies) == 1


def test_the_shared_part_loads_no_framework() -> None:
    code = ("import json, sys, effectledger_integrations.calls\n"
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    loaded = set(json.loads(out.stdout))
    assert "effectledger_integrations" in loaded
    assert loaded.isdisjoint({"pydantic_ai", "agents", "langgraph", "langchain_core",
                              "faststream"})
