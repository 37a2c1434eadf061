"""The provider's answer as the ledger keeps it: bounded, scrubbed, narrowed by result_path."""

from __future__ import annotations

import json

import pytest

from effectledger_core.results import (
    REDACTED,
    ProviderResult,
    check_result_path,
    keep_result,
)


def test_json_is_kept_as_a_value() -> None:
    kept = keep_result(b'{"id": "tk_1", "status": "open"}', "application/json")
    assert kept == ProviderResult(kind="json", value={"id": "tk_1", "status": "open"}, bytes=32)


def test_result_path_keeps_only_the_part_a_model_needs() -> None:
    body = json.dumps({"data": {"ticket": {"id": "tk_1"}, "items": [{"id": 1}, {"id": 2}]}})
    one = keep_result(body.encode(), "application/json", path="$.data.ticket.id")
    assert one is not None and one.value == "tk_1"
    many = keep_result(body.encode(), "application/json", path="$.data.items[*].id")
    assert many is not None and many.value == [1, 2]
    none = keep_result(body.encode(), "application/json", path="$.nothing")
    assert none is not None and none.value is None and none.omitted == "no_match"


def test_text_is_cut_at_the_limit_on_a_character_boundary() -> None:
    kept = keep_result(("é" * 100).encode(), "text/plain", limit=13)
    assert kept is not None and kept.truncated and kept.value == "é" * 5 and kept.bytes == 200


def test_the_limit_bounds_the_text_as_json_escapes_included() -> None:
    kept = keep_result("\u0001".encode() * 1000, "text/plain", limit=100)
    assert kept is not None and kept.truncated and kept.value
    assert len(json.dumps(kept.value, ensure_ascii=False).encode()) <= 100


def test_json_over_the_limit_is_omitted_not_cut() -> None:
    kept = keep_result(json.dumps({"a": "x" * 100}).encode(), "application/json", limit=50)
    assert kept is not None and kept.value is None and kept.omitted == "too_large"


def test_credentials_and_nul_are_scrubbed_everywhere() -> None:
    body = json.dumps({"echo": "Bearer sk_live_123", "sk_live_123": "k", "n": "a\u0000b"})
    kept = keep_result(body.encode(), "application/json", secrets=["Bearer sk_live_123",
                                                                    "sk_live_123", "1"])
    assert kept is not None
    assert kept.value == {"echo": REDACTED, REDACTED: "k", "n": "a\ufffdb"}
    text = keep_result(b"token sk_live_123 here", "text/plain", secrets=["sk_live_123"])
    assert text is not None and text.value == f"token {REDACTED} here"


def test_binary_and_empty_bodies() -> None:
    binary = keep_result(b"\xff\xfe\x00", "application/octet-stream")
    assert binary is not None and binary.omitted == "binary" and binary.value is None
    assert keep_result(b"", "application/json") is None


def test_json_that_does_not_parse_is_kept_as_text() -> None:
    kept = keep_result(b'{"a": NaN}', "application/json")
    assert kept is not None and kept.kind == "text" and kept.value == '{"a": NaN}'


def test_bad_result_paths_are_refused_with_the_reason() -> None:
    assert check_result_path("$.a[0]") == "$.a[0]"
    with pytest.raises(ValueError, match="JSONPath"):
        check_result_path("data.id")
