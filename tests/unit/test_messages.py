"""Bus messages: strict parsing into our own errors, bounded sizes, and the outcome union."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from effectledger_core.errors import PayloadTooLarge, PoisonMessage
from effectledger_core.limits import MAX_IDENTIFIER_BYTES, MAX_MESSAGE_BYTES
from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    ClaimAttempt,
    DeadLetter,
    DispatchAttempt,
    FailureClass,
    OutcomeAmbiguous,
    SubmitIntent,
    encode,
    excerpt,
    parse,
    parse_outcome,
)

AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
BASE = dict(operation_id="op_1", epoch=2, attempt_id="att_1", dispatcher_id="d_1", at=AT)


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


CLAIM = {"operation_id": "op_1", "epoch": 1, "attempt_id": "a", "dispatcher_id": "d"}


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"not json at all",
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        b"null",
        b'"a string"',
    ],
    ids=["empty", "truncated", "text", "binary", "array", "null", "string"],
)
def test_malformed_payload_is_a_poison_message(raw: bytes) -> None:
    """Anything that is not a JSON object of the right shape becomes PoisonMessage."""
    with pytest.raises(PoisonMessage):
        parse(ClaimAttempt, raw)


def test_wrong_schema_version_is_a_poison_message_naming_the_field() -> None:
    """A message from a newer (or older) schema is refused clearly, not half-understood."""
    with pytest.raises(PoisonMessage, match="schema_version"):
        parse(ClaimAttempt, _json({**CLAIM, "schema_version": 2}))


def test_unknown_field_is_a_poison_message_naming_the_field() -> None:
    """A typo or an unexpected field is an error, never silently dropped."""
    with pytest.raises(PoisonMessage, match="atempt_id"):
        parse(ClaimAttempt, _json({**CLAIM, "atempt_id": "x"}))


def test_missing_field_and_bad_epoch_are_poison() -> None:
    """A missing identifier or an epoch below 1 is refused."""
    with pytest.raises(PoisonMessage, match="attempt_id"):
        parse(ClaimAttempt, _json({k: v for k, v in CLAIM.items() if k != "attempt_id"}))
    with pytest.raises(PoisonMessage, match="epoch"):
        parse(ClaimAttempt, _json({**CLAIM, "epoch": 0}))


def test_oversize_payload_is_payload_too_large_before_parsing() -> None:
    """A payload over MAX_MESSAGE_BYTES is refused by size, even if it is not JSON at all."""
    with pytest.raises(PayloadTooLarge):
        parse(ClaimAttempt, b"x" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(PayloadTooLarge):
        parse_outcome(b" " * (MAX_MESSAGE_BYTES + 1))


def test_payload_at_the_size_limit_is_parsed() -> None:
    """Exactly MAX_MESSAGE_BYTES (padded with whitespace) is still accepted."""
    raw = _json(CLAIM)
    raw = raw + b" " * (MAX_MESSAGE_BYTES - len(raw))
    assert len(raw) == MAX_MESSAGE_BYTES
    assert parse(ClaimAttempt, raw).attempt_id == "a"


def test_deeply_nested_json_is_poison_not_a_crash() -> None:
    """A 100k-deep nested array under the size limit is PoisonMessage, not RecursionError."""
    depth = 100_000
    raw = b'{"tool":"t","arguments":{"a":' + b"[" * depth + b"]" * depth + b"}}"
    assert len(raw) < MAX_MESSAGE_BYTES
    with pytest.raises(PoisonMessage):
        parse(SubmitIntent, raw)


@pytest.mark.parametrize("field", ["operation_id", "attempt_id", "dispatcher_id"])
def test_identifier_over_1024_characters_is_rejected(field: str) -> None:
    """Identifiers are bounded: 1024 characters pass, 1025 are poison."""
    ok = parse(ClaimAttempt, _json({**CLAIM, field: "i" * MAX_IDENTIFIER_BYTES}))
    assert len(getattr(ok, field)) == MAX_IDENTIFIER_BYTES
    with pytest.raises(PoisonMessage, match=field):
        parse(ClaimAttempt, _json({**CLAIM, field: "i" * (MAX_IDENTIFIER_BYTES + 1)}))


def test_empty_identifier_is_rejected() -> None:
    """An empty identifier is as invalid as a missing one."""
    with pytest.raises(PoisonMessage, match="operation_id"):
        parse(ClaimAttempt, _json({**CLAIM, "operation_id": ""}))


def test_long_identifiers_in_constructed_models_are_rejected_too() -> None:
    """The bound holds for Python callers as well as for bus payloads."""
    with pytest.raises(ValidationError):
        SubmitIntent(tool="t", idempotency_key="k" * (MAX_IDENTIFIER_BYTES + 1))
    with pytest.raises(ValidationError):
        SubmitIntent(tool="t", tenant="t" * (MAX_IDENTIFIER_BYTES + 1))


OUTCOMES = [
    AttemptSucceeded(**BASE, response_digest="sha256:ab", provider_ref="pr_1", http_status=201,
                     duration_ms=12.5),
    AttemptAccepted(**BASE, response_digest="sha256:cd", http_status=202),
    AttemptFailed(**BASE, failure_class=FailureClass.INVALID_ARGUMENT, code="bad_amount",
                  message="amount must be positive", http_status=422, retry_after_s=None),
    OutcomeAmbiguous(**BASE, reason="timeout", message="no response in 5s"),
]


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda o: o.type)
def test_outcome_union_round_trips(outcome: Any) -> None:
    """Each outcome encodes and parses back to an equal object of the same class."""
    back = parse_outcome(encode(outcome))
    assert type(back) is type(outcome)
    assert back == outcome
    assert back.at == AT and back.at.tzinfo is not None


def test_outcome_union_dispatches_on_type_not_on_shape() -> None:
    """The `type` discriminator picks the class: a succeeded body labelled failed is poison."""
    body = json.loads(encode(OUTCOMES[0]))
    body["type"] = "attempt_failed"
    with pytest.raises(PoisonMessage):
        parse_outcome(json.dumps(body).encode())
    body["type"] = "attempt_exploded"
    with pytest.raises(PoisonMessage):
        parse_outcome(json.dumps(body).encode())


def test_ambiguous_reason_is_a_closed_set() -> None:
    """An ambiguity reason outside the documented list is poison."""
    body = json.loads(encode(OUTCOMES[3]))
    body["reason"] = "felt_like_it"
    with pytest.raises(PoisonMessage, match="reason"):
        parse_outcome(json.dumps(body).encode())


def test_provider_ref_is_bounded() -> None:
    """A provider reference over 256 characters is refused (it is kept as evidence)."""
    body = json.loads(encode(OUTCOMES[0]))
    body["provider_ref"] = "p" * 257
    with pytest.raises(PoisonMessage, match="provider_ref"):
        parse_outcome(json.dumps(body).encode())


def test_messages_are_frozen_and_carry_schema_version_1() -> None:
    """Messages are immutable values with schema_version 1 in their encoding."""
    cmd = DispatchAttempt(operation_id="op", operation_key="k", epoch=1, tool="t",
                          arguments={"a": 1}, arguments_digest="d", catalog_digest="c",
                          contract_revision="r")
    assert json.loads(encode(cmd))["schema_version"] == 1
    with pytest.raises(ValidationError):
        cmd.epoch = 2  # type: ignore[misc]
    assert parse(DispatchAttempt, encode(cmd)) == cmd


def test_excerpt_is_bounded_and_printable() -> None:
    """Dead-letter excerpts never exceed the limit and survive invalid UTF-8."""
    text = excerpt(b"\xff" * 5000)
    assert len(text) == 2048
    letter = DeadLetter(consumer="c", subject="s", error="e", payload_excerpt=text)
    assert parse(DeadLetter, encode(letter)) == letter
