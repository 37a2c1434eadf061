"""The ledger's sender-bound request subjects: the tenant and the claiming dispatcher are read
from the subject (which NATS permissions let only that principal publish on), never from the
payload."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

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
from effectledger_core.subjects import Subjects
from effectledger_core.views import OperationView
from effectledger_ledger.messaging import Requests
from tests.support.views import operation_view

S = Subjects("fx", "FX")
OP = {"id": "op1", "state": "pending", "epoch": 1, "operation_key": "k", "tool": "t",
      "tenant": "acme", "provider_ref": "ref_1"}


@dataclass
class Service:
    subjects: Subjects = S
    submitted: list[tuple[SubmitIntent, str]] = field(default_factory=list)
    claims: list[ClaimAttempt] = field(default_factory=list)

    async def submit(self, intent: SubmitIntent, *, actor: str) -> Any:
        self.submitted.append((intent, actor))

        @dataclass
        class Done:
            operation: dict[str, Any]
            created: bool = True

        return Done({**OP, "tenant": intent.tenant})

    async def claim(self, claim: ClaimAttempt) -> ClaimReply:
        self.claims.append(claim)
        return ClaimReply(status=ClaimStatus.GRANTED, operation_id=claim.operation_id,
                          epoch=claim.epoch, attempt_id=claim.attempt_id)

    async def operation(self, operation_id: str) -> OperationView:
        if operation_id != OP["id"]:
            raise NotFound(f"operation {operation_id!r} not found")
        return operation_view(**OP)


def _body(**kw: Any) -> bytes:
    return json.dumps({"schema_version": 1, "tool": "t", "arguments": {}, **kw}).encode()


async def test_an_intent_takes_its_tenant_from_the_subject() -> None:
    service = Service()
    requests = Requests(service)  # type: ignore[arg-type]
    reply = await requests.intent_for(S.rpc_intents_for("acme"), _body())
    assert isinstance(parse_answer(IntentReply, reply), IntentReply)
    [(intent, actor)] = service.submitted
    assert (intent.tenant, actor) == ("acme", "agent:acme")


async def test_an_intent_naming_another_tenant_is_refused_before_anything_is_written() -> None:
    service = Service()
    reply = await Requests(service).intent_for(  # type: ignore[arg-type]
        S.rpc_intents_for("acme"), _body(tenant="globex"))
    answer = parse_answer(IntentReply, reply)
    assert isinstance(answer, ErrorReply) and answer.error.code == "invalid_request"
    assert "globex" in answer.error.message and service.submitted == []


async def test_another_tenants_operation_reads_exactly_like_a_missing_one() -> None:
    requests = Requests(Service())  # type: ignore[arg-type]
    mine = parse_answer(OperationReply, await requests.operation_for(
        S.rpc_operation_for("acme"), encode(OperationQuery(operation_id="op1"))))
    assert isinstance(mine, OperationReply) and mine.operation.provider_ref is None
    theirs = parse_answer(OperationReply, await requests.operation_for(
        S.rpc_operation_for("globex"), encode(OperationQuery(operation_id="op1"))))
    missing = parse_answer(OperationReply, await requests.operation_for(
        S.rpc_operation_for("globex"), encode(OperationQuery(operation_id="op9"))))
    assert isinstance(theirs, ErrorReply) and isinstance(missing, ErrorReply)
    assert theirs.error.code == missing.error.code == "not_found"
    assert theirs.error.message.replace("op1", "X") == missing.error.message.replace("op9", "X")


async def test_a_claim_is_granted_only_in_the_name_of_the_subjects_dispatcher() -> None:
    service = Service()
    requests = Requests(service)  # type: ignore[arg-type]
    claim = ClaimAttempt(operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1",
                         tool="t", arguments_digest="sha256:a")
    ok = parse_answer(ClaimReply, await requests.claim_by(S.rpc_claim_by("d1"), encode(claim)))
    assert isinstance(ok, ClaimReply) and ok.status is ClaimStatus.GRANTED
    refused = parse_answer(ClaimReply, await requests.claim_by(S.rpc_claim_by("d2"),
                                                               encode(claim)))
    assert isinstance(refused, ErrorReply) and refused.error.code == "invalid_request"
    # On the sender-bound subject a claim must say which command it is for.
    unnamed = claim.model_copy(update={"tool": None, "arguments_digest": None})
    refused = parse_answer(ClaimReply, await requests.claim_by(S.rpc_claim_by("d1"),
                                                               encode(unnamed)))
    assert isinstance(refused, ErrorReply) and refused.error.code == "invalid_request"
    assert service.claims == [claim]
