"""The ledger's sender-bound request subjects: the tenant and the claiming dispatcher are read
from the subject (which NATS permissions let only that principal publish on), never from the
payload."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from effectledger_core.errors import NotFound, StoreUnavailable
from effectledger_core.limits import MAX_MESSAGE_BYTES
from effectledger_core.messages import (
    AttemptSucceeded,
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    DeadLetter,
    ErrorReply,
    IntentReply,
    OperationQuery,
    OperationReply,
    Outcome,
    OutcomeRecorded,
    SubmitIntent,
    encode,
    parse_answer,
)
from effectledger_core.subjects import Subjects
from effectledger_core.views import OperationView
from effectledger_ledger.db.rows import Recorded
from effectledger_ledger.messaging import INBOX_CONSUMER, Requests
from tests.support.views import operation_view

S = Subjects("fx", "FX")
OP = {"id": "op1", "state": "pending", "epoch": 1, "operation_key": "k", "tool": "t",
      "tenant": "acme", "provider_ref": "ref_1"}


@dataclass
class Service:
    subjects: Subjects = S
    submitted: list[tuple[SubmitIntent, str]] = field(default_factory=list)
    claims: list[ClaimAttempt] = field(default_factory=list)
    # (outcome, consumer, message id) as committed; dead letters as recorded
    outcomes: list[tuple[Outcome, str, str]] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    store_down: bool = False

    async def record_outcome(self, outcome: Outcome, *, consumer: str,
                             message_id: str) -> Recorded:
        if self.store_down:
            raise StoreUnavailable("database unreachable")
        seen = any(m == message_id and c == consumer for _, c, m in self.outcomes)
        self.outcomes.append((outcome, consumer, message_id))
        return Recorded("duplicate") if seen else Recorded("applied", to_state="succeeded")

    async def record_dead_letter(self, letter: DeadLetter) -> None:
        self.dead_letters.append(letter)

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


OUTCOME = AttemptSucceeded(operation_id="op1", epoch=1, attempt_id="a1", dispatcher_id="d1",
                           at=datetime(2026, 12, 1, tzinfo=UTC), http_status=201,
                           response_digest="sha256:00")


async def test_an_outcome_by_request_is_committed_under_its_stream_copys_inbox_id() -> None:
    service = Service()
    requests = Requests(service)  # type: ignore[arg-type]
    first = parse_answer(OutcomeRecorded, await requests.outcome_by(S.rpc_outcome_by("d1"),
                                                                    encode(OUTCOME)))
    assert isinstance(first, OutcomeRecorded)
    assert (first.status, first.message_id, first.attempt_id) == \
        ("applied", "attempt_succeeded:a1", "a1")
    # The consumer and message id the JetStream copy's delivery would be committed under.
    assert service.outcomes == [(OUTCOME, INBOX_CONSUMER, "attempt_succeeded:a1")]
    again = parse_answer(OutcomeRecorded, await requests.outcome_by(S.rpc_outcome_by("d1"),
                                                                    encode(OUTCOME)))
    assert isinstance(again, OutcomeRecorded) and again.status == "duplicate"


async def test_an_outcome_naming_another_dispatcher_is_refused_and_kept_as_evidence() -> None:
    service = Service()
    reply = await Requests(service).outcome_by(  # type: ignore[arg-type]
        S.rpc_outcome_by("d2"), encode(OUTCOME))
    answer = parse_answer(OutcomeRecorded, reply)
    assert isinstance(answer, ErrorReply)
    assert (answer.error.code, answer.error.retryable) == ("invalid_request", False)
    assert service.outcomes == []
    [letter] = service.dead_letters
    assert (letter.consumer, letter.subject, letter.message_id) == \
        (INBOX_CONSUMER, S.rpc_outcome_by("d2"), "attempt_succeeded:a1")
    assert "'d2'" in letter.error and "'d1'" in letter.error
    assert letter.payload_excerpt == encode(OUTCOME).decode()


async def test_bad_outcome_requests_get_an_error_reply_and_change_nothing() -> None:
    service = Service()
    requests = Requests(service)  # type: ignore[arg-type]
    for subject, raw, code in [
            (S.rpc_outcome_by("d1"), b"{not json", "poison_message"),
            (S.rpc_outcome_by("d1"), encode(OUTCOME)[:-1] + b', "extra": 1}', "poison_message"),
            (S.rpc_outcome_by("d1"), b" " * (MAX_MESSAGE_BYTES + 1), "payload_too_large"),
            (S.rpc_outcome, encode(OUTCOME), "invalid_request")]:
        answer = parse_answer(OutcomeRecorded, await requests.outcome_by(subject, raw))
        assert isinstance(answer, ErrorReply) and answer.error.code == code, (raw[:40], answer)
        assert answer.error.retryable is False
    assert service.outcomes == [] and service.dead_letters == []


async def test_an_outcome_the_store_could_not_commit_is_answered_retryable() -> None:
    service = Service(store_down=True)
    answer = parse_answer(OutcomeRecorded, await Requests(service).outcome_by(  # type: ignore[arg-type]
        S.rpc_outcome_by("d1"), encode(OUTCOME)))
    assert isinstance(answer, ErrorReply)
    assert (answer.error.code, answer.error.retryable) == ("store_unavailable", True)
