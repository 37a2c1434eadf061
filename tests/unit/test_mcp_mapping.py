"""How the catalog and the ledger's answers look to an MCP agent (effectledger_mcp.mapping)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from effectledger_core.catalog import Catalog, EffectClass
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.views import OperationView
from effectledger_mcp.mapping import (
    ANNOTATIONS,
    META_KEY,
    REPEAT,
    expected_at,
    idempotency_key,
    published_schema,
    render,
    strict_problems,
    task_id,
    tool_annotations,
)

NOW = datetime(2026, 12, 1, tzinfo=UTC)
DEMO = {n: t.public_view() for n, t in Catalog.load(DEMO_CATALOG).tools.items()}
# What a host must be told about each demo tool (docs/agents.md, "Annotations"): anything that
# moves money, sends a message or cannot be undone is destructive, idempotent or not.
DEMO_HINTS = {  # (readOnly, destructive, idempotent, openWorld)
    "create_ticket": (False, False, True, True),  # undoable: a ticket can be closed
    "send_email": (False, True, False, True),
    "charge_card": (False, True, True, True),
    "post_message": (False, True, False, True),
    "page_oncall": (False, True, False, True),
    "wire_funds": (False, True, True, True),
}


def _hints(tool: dict[str, Any]) -> tuple[bool, bool, bool, bool]:
    a = tool_annotations(tool)
    return a["readOnlyHint"], a["destructiveHint"], a["idempotentHint"], a["openWorldHint"]


def test_the_table_covers_every_effect_class_and_reversibility() -> None:
    assert set(ANNOTATIONS) == {(c.value, r) for c in EffectClass
                                for r in ("undoable", "irreversible")}
    # Unknown is the worst case; only a lookup is read-only; a compensation is no undo.
    assert _hints({"effect_class": "no_such_class"}) == _hints({"effect_class": "unknown"})
    assert _hints({"effect_class": "unknown", "reversibility": "undoable"})[1] is True
    assert _hints({"effect_class": "compensatable", "reversibility": "undoable"})[1] is True
    assert _hints({"effect_class": "read_only"}) == (True, False, True, True)
    # Defaults: a `reversible` tool is undoable, everything else irreversible (destructive).
    assert _hints({"effect_class": "reversible"})[1] is False
    assert _hints({"effect_class": "idempotent"})[1] is True


def test_every_demo_tool_is_annotated_as_the_table_says() -> None:
    assert {name: _hints(tool) for name, tool in DEMO.items()} == DEMO_HINTS
    assert all(tool_annotations(t)["title"] for t in DEMO.values())


@pytest.mark.parametrize("name", sorted(DEMO))
def test_every_demo_tool_has_a_strict_schema_with_descriptions_and_examples(name: str) -> None:
    tool = DEMO[name]
    schema = published_schema(tool)
    assert strict_problems(schema) == []
    props = schema["properties"]
    assert set(props) - {REPEAT}, "a real input schema, not an empty object"
    for prop, sub in props.items():
        assert sub.get("description") and sub.get("examples"), (name, prop)
    assert len(tool["description"]) > 60  # written for a model, not a one-liner


def test_strict_problems_finds_what_strict_mode_refuses() -> None:
    loose = {"type": "object", "properties": {"amount": {}, "currency": {"type": "string"}},
             "required": ["amount"]}
    assert strict_problems(loose) == ["/: additionalProperties must be false",
                                      "/: not required: currency", "/amount: no type"]


def test_repeat_is_added_where_identical_calls_join_and_never_over_the_catalogs_own() -> None:
    card = published_schema(DEMO["charge_card"])
    assert card["properties"][REPEAT]["type"] == ["string", "null"]
    assert card["required"][-1] == REPEAT and "$schema" not in card
    lookup = published_schema({"effect_class": "read_only", "input_schema": {
        "type": "object", "properties": {"q": {"type": "string"}}}})
    assert REPEAT not in lookup["properties"]
    own = {"type": "object", "properties": {REPEAT: {"type": "integer"}}}
    assert published_schema({"effect_class": "idempotent", "input_schema": own})[
        "properties"][REPEAT] == {"type": "integer"}


def test_expected_names_type_description_and_example() -> None:
    schema = published_schema(DEMO["charge_card"])
    said = expected_at(schema, "/amount")
    assert said is not None and 'type "integer"' in said and "e.g. 1999" in said
    assert expected_at(schema, "/nope") is None


def test_idempotency_key_precedence_sep3182_then_meta_then_none() -> None:
    assert idempotency_key({"idempotencyKey": "k1", "_meta": {META_KEY: "k2"}}) == (
        "k1", "idempotencyKey")
    assert idempotency_key({"_meta": {META_KEY: "k2"}}) == ("k2", "_meta")
    # No key: the ledger joins identical calls by their call identity, not a derived key.
    assert idempotency_key({"_meta": {}}) == (None, "none")
    assert task_id({"_meta": {"effectledger/taskId": "conv-1"}}) == "conv-1"
    assert task_id({}) is None


def _op(state: str, **extra: Any) -> OperationView:
    return OperationView.model_validate({
        "id": "op1", "tenant": "t", "operation_key": "ck_1", "caller_key": "host-1",
        "tool": "create_ticket", "arguments": {"title": "a"}, "arguments_digest": "sha256:a",
        "tool_digest": "sha256:b", "contract_revision": "r", "effect_class": "idempotent",
        "commit_policy": "auto", "state": state, "epoch": 1, "created_at": NOW,
        "updated_at": NOW, **extra})


def _structured_in_text(text: str, data: dict[str, Any]) -> None:
    assert json.loads(text.rsplit("Structured: ", 1)[1]) == json.loads(json.dumps(data))


def test_success_names_operation_key_and_replay() -> None:
    answer = {"kind": "json", "value": {"id": "tk_1", "url": "https://t/1"}, "bytes": 40}
    text, data, is_error = render(_op("succeeded", provider_ref="tk_1", result=answer),
                                  replayed=True)
    assert not is_error and data["outcome"] == "succeeded" and "tk_1" in text
    assert data["result"] == {"id": "tk_1", "url": "https://t/1"} and "https://t/1" in text
    assert data["operation_id"] == "op1" and data["idempotency_key"] == "host-1"
    assert data["replayed"] is True and "replay of an earlier identical call" in text
    assert data["decided_by"] == "provider"
    _structured_in_text(text, data)


def test_a_cut_answer_says_so() -> None:
    answer = {"kind": "json", "omitted": "too_large", "bytes": 10**6}
    _, data, _ = render(_op("succeeded", result=answer), replayed=False)
    assert data["result"] is None and data["result_note"] == "omitted: too_large"


@pytest.mark.parametrize("state", ["ambiguous", "awaiting_confirmation", "needs_review"])
def test_an_unknown_outcome_says_do_not_retry_in_text_and_structure(state: str) -> None:
    text, data, is_error = render(_op(state), replayed=False, repeat="2")
    assert is_error is False
    assert data["do_not_retry"] is True and data["outcome"] == "unknown"
    assert "Do NOT retry" in data["warning"] and data["warning"] in text
    # The exact safe re-call (same key, same repeat label) and the way to learn the outcome.
    assert data["safe_recall"] == {"tool": "create_ticket",
                                   "arguments": {"title": "a", "repeat": "2"},
                                   "idempotency_key": "host-1"}
    assert "Safe re-call" in text and "host-1" in text
    assert data["check_status"]["arguments"] == {"operation_id": "op1"}
    assert "operation_status" in data["next"]
    _structured_in_text(text, data)


@pytest.mark.parametrize(("source", "decider"), [
    ("readback", "readback"), ("webhook", "webhook"), ("operator", "operator_review"),
    (None, "provider")])
def test_who_decided_a_settled_outcome(source: str | None, decider: str) -> None:
    evidence = {"source": source} if source else None
    _, data, _ = render(_op("succeeded", evidence=evidence), replayed=None)
    assert data["decided_by"] == decider


def test_failure_is_an_error_with_its_guidance_and_says_it_runs_anew() -> None:
    last = {"type": "attempt_failed", "guidance": "Fix the title."}
    text, data, is_error = render(_op("failed", last_outcome=last), replayed=False)
    assert is_error and data["guidance"] == "Fix the title." and "Fix the title." in text
    assert "runs it anew" in data["next"]


def test_awaiting_approval_and_in_progress_point_at_the_status_tool() -> None:
    text, data, is_error = render(_op("awaiting_approval"), replayed=False)
    assert not is_error and data["outcome"] == "awaiting_approval"
    assert "operation_status" in text
    text, data, is_error = render(_op("in_flight"), replayed=False)
    assert not is_error and data["outcome"] == "in_progress" and "not run twice" in text
    assert "operation_status" in data["next"]
