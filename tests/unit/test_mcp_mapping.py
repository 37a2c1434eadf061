"""How the catalog and the ledger's answers look to an MCP agent (effectledger_mcp.mapping)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from effectledger_core.catalog import EffectClass
from effectledger_core.views import OperationView, Receipt
from effectledger_mcp.mapping import (
    ANNOTATIONS,
    META_KEY,
    idempotency_key,
    input_schema,
    render,
    task_id,
    tool_annotations,
)

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def test_every_effect_class_has_annotations_and_unknown_is_the_worst_case() -> None:
    assert set(ANNOTATIONS) == {c.value for c in EffectClass}
    assert tool_annotations("read_only") == {"readOnlyHint": True, "destructiveHint": False,
                                             "idempotentHint": True, "openWorldHint": True}
    assert tool_annotations("no_such_class") == tool_annotations("unknown")
    assert tool_annotations("unknown")["destructiveHint"] is True
    assert not tool_annotations("non_idempotent")["idempotentHint"]


def test_a_declared_input_schema_wins() -> None:
    declared = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert input_schema({"input_schema": declared, "body": {"a": "{args.y}"}}) == declared


def test_placeholders_become_required_properties() -> None:
    tool = {"endpoint": "https://p.example/{args.account}/charges",
            "body": {"amount": "{args.amount}", "meta": {"ref": "{args.customer.id}"},
                     "key": "{operation_key}"},
            "readback": {"url": "https://p.example/by-key/{operation_key}"}}
    schema = input_schema(tool)
    assert schema["required"] == ["account", "amount", "customer"]
    assert schema["properties"]["customer"] == {"type": "object"}


def test_a_tool_whose_arguments_are_the_body_takes_any_object() -> None:
    assert input_schema({"endpoint": "https://p.example/x", "body": None}) == {
        "type": "object", "properties": {}}


def test_idempotency_key_precedence_sep3182_then_meta_then_derived() -> None:
    args = {"title": "a"}
    assert idempotency_key("t", args, {"idempotencyKey": "k1", "_meta": {META_KEY: "k2"}}) == (
        "k1", "idempotencyKey")
    assert idempotency_key("t", args, {"_meta": {META_KEY: "k2"}}) == ("k2", "_meta")
    derived, source = idempotency_key("t", args, {})
    assert source == "derived" and derived.startswith("mcp:")
    assert idempotency_key("t", {"title": "a"}, {"_meta": {}})[0] == derived  # a retry
    assert idempotency_key("t", {"title": "b"}, {})[0] != derived
    assert idempotency_key("u", args, {})[0] != derived
    assert task_id({"_meta": {"effectledger/taskId": "conv-1"}}) == "conv-1"
    assert task_id({}) is None


def _op(state: str, **extra: Any) -> OperationView:
    return OperationView.model_validate({
        "id": "op1", "tenant": "t", "operation_key": "k", "tool": "create_ticket",
        "arguments": {}, "arguments_digest": "sha256:a", "tool_digest": "sha256:b",
        "contract_revision": "r", "effect_class": "idempotent", "commit_policy": "auto",
        "state": state, "epoch": 1, "created_at": NOW, "updated_at": NOW, **extra})


def _receipt(state: str, guidance: str | None = None) -> Receipt:
    return Receipt.model_validate({
        "operation_id": "op1", "operation_key": "k", "tenant": "t", "attempt_ids": [],
        "tool": "create_ticket", "state": state, "epoch": 1, "effect_class": "idempotent",
        "commit_policy": "auto", "contract_revision": "r",
        "digests": {"catalog_entry": "a", "request": "b", "response": None, "policy": "c"},
        "reconciliation_status": "pending",
        "recovery_decision": {"fact": "f", "decision": "d", "reason": "r"},
        "guidance": guidance, "open_uncertainties": []})


def test_success_is_a_result_with_the_provider_reference_and_answer() -> None:
    answer = {"kind": "json", "value": {"id": "tk_1", "url": "https://t/1"}, "bytes": 40}
    text, data, is_error = render(_op("succeeded", provider_ref="tk_1", result=answer),
                                  _receipt("succeeded"))
    assert not is_error and data["outcome"] == "succeeded" and "tk_1" in text
    assert data["result"] == {"id": "tk_1", "url": "https://t/1"} and "https://t/1" in text
    assert data["receipt"]["digests"]["request"] == "b"


def test_a_cut_answer_says_so() -> None:
    answer = {"kind": "json", "omitted": "too_large", "bytes": 10**6}
    _, data, _ = render(_op("succeeded", result=answer), None)
    assert data["result"] is None and data["result_note"] == "omitted: too_large"


@pytest.mark.parametrize("state", ["ambiguous", "awaiting_confirmation", "needs_review"])
def test_an_unknown_outcome_is_never_an_error_and_says_do_not_retry(state: str) -> None:
    text, data, is_error = render(_op(state), _receipt(state))
    assert is_error is False
    assert data["do_not_retry"] is True and data["outcome"] == "unknown"
    assert "Do NOT retry" in text and data["next"]


def test_failure_is_an_error_with_its_guidance() -> None:
    text, data, is_error = render(_op("failed"), _receipt("failed", "Fix the title."))
    assert is_error and data["guidance"] == "Fix the title." and "Fix the title." in text


def test_awaiting_approval_and_in_progress_invite_the_same_call_again() -> None:
    text, data, is_error = render(_op("awaiting_approval"), None)
    assert not is_error and data["outcome"] == "awaiting_approval" and "again" in text
    text, data, is_error = render(_op("in_flight"), None)
    assert not is_error and data["outcome"] == "in_progress" and "not run twice" in text
