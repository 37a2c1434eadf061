"""The ledger's request-reply handlers answer with the typed reply models, bad input included."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from effectledger_core.errors import NotFound
from effectledger_core.messages import (
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    ErrorReply,
    IntentReply,
    OperationQuery,
    OperationReply,
    SubmitIntent,
    encode,
    parse_answer,
)
from effectledger_core.views import OperationView
from effectledger_ledger.messaging import Requests
from tests.support.views import operation_view

OP = {"id": "op1", "state": "ambiguous", "epoch": 2, "operation_key": "ck", "tool": "t",
      "provider_ref": "eff_1", "arguments": {"secret": "not in replies"}}


@dataclass
class Submitted:
    operation: dict[str, Any]
    created: bool


class FakeService:
    """The three calls the handlers make, answering from one operation."""

    async def submit(self, intent: SubmitIntent, *, actor: str) -> Submitted:
        return Submitted(OP, created=True)

    async def claim(self, claim: ClaimAttempt) -> ClaimReply:
        return ClaimReply(status=ClaimStatus.GRANTED, operation_id=claim.operation_id,
                          epoch=claim.epoch, attempt_id=claim.attempt_id)

    async def operation(self, operation_id: str) -> OperationView:
        if operation_id != OP["id"]:
            raise NotFound(f"operation {operation_id!r} not found")
        return operation_view(**OP)


@pytest.fixture
def requests() -> Requests:
    return Requests(FakeService())  # type: ignore[arg-type]


async def test_an_operation_read_answers_the_summary_with_the_provider_ref(
        requests: Requests) -> None:
    answer = parse_answer(OperationReply,
                      await requests.operation(encode(OperationQuery(operation_id="op1"))))
    assert isinstance(answer, OperationReply)
    assert (answer.operation.epoch, answer.operation.provider_ref) == (2, "eff_1")


async def test_an_operation_read_gives_the_digest_of_the_arguments_as_stored(
        requests: Requests) -> None:
    """What a reconcile command is rendered from, so the reconciler can compare its own."""
    from effectledger_core.digest import digest

    answer = parse_answer(OperationReply,
                          await requests.operation(encode(OperationQuery(operation_id="op1"))))
    assert isinstance(answer, OperationReply)
    assert answer.operation.arguments_digest == digest(OP["arguments"])


async def test_an_old_style_operation_query_without_a_schema_version_is_served(
        requests: Requests) -> None:
    answer = parse_answer(OperationReply, await requests.operation(b'{"operation_id": "op1"}'))
    assert isinstance(answer, OperationReply)


@pytest.mark.parametrize(("payload", "code"), [
    (b'{"operation_id": "nope"}', "not_found"),
    (b"{}", "poison_message"),
    (b"not json", "poison_message"),
    (b"[" * 50_000, "poison_message"),
    (b'{"operation_id": ""}', "poison_message"),
])
async def test_a_bad_operation_read_gets_an_error_reply(requests: Requests, payload: bytes,
                                                        code: str) -> None:
    answer = parse_answer(OperationReply, await requests.operation(payload))
    assert isinstance(answer, ErrorReply) and answer.error.code == code


async def test_an_intent_reply_keeps_its_wire_shape(requests: Requests) -> None:
    raw = await requests.intent(encode(SubmitIntent(tool="t")))
    answer = parse_answer(IntentReply, raw)
    assert isinstance(answer, IntentReply) and answer.created
    body = json.loads(raw)  # what untyped clients read
    assert body["ok"] is True and body["operation"]["id"] == "op1"
    assert "arguments" not in body["operation"]


async def test_a_bad_claim_gets_an_error_reply_the_dispatcher_can_read(
        requests: Requests) -> None:
    answer = parse_answer(ClaimReply, await requests.claim(b'{"type": "claim_attempt"}'))
    assert isinstance(answer, ErrorReply) and answer.error.code == "poison_message"
