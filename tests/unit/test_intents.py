"""Intent argument validation and operation-key derivation."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from effectledger_core.digest import canonical_json, digest
from effectledger_core.errors import InvalidArguments, PayloadTooLarge
from effectledger_core.ids import operation_key
from effectledger_core.intents import validate_arguments
from effectledger_core.limits import MAX_ARGUMENTS_BYTES, MAX_JSON_DEPTH


def _nested_objects(levels: int, leaf: Any) -> dict[str, Any]:
    """`levels` nested JSON objects, the innermost holding `leaf` under key "k"."""
    value: Any = {"k": leaf}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


@pytest.mark.parametrize("value", [[], [1, 2], "text", 3, None, True, 1.5])
def test_non_object_arguments_are_rejected(value: Any) -> None:
    """Arguments must be a JSON object; arrays and scalars are refused clearly."""
    with pytest.raises(InvalidArguments, match="JSON object"):
        validate_arguments(value)


def test_empty_object_is_valid() -> None:
    """`{}` is a valid argument object with a fixed digest."""
    text, dig = validate_arguments({})
    assert text == "{}" and dig == digest({})


@pytest.mark.parametrize("leaf", [1, "x", None, True])
def test_exactly_max_depth_is_accepted(leaf: Any) -> None:
    """32 levels of objects are allowed, whatever scalar the innermost one holds."""
    validate_arguments(_nested_objects(MAX_JSON_DEPTH, leaf))
    validate_arguments(_nested_objects(MAX_JSON_DEPTH - 1, {}))


@pytest.mark.parametrize(("levels", "leaf"), [(MAX_JSON_DEPTH + 1, 1), (MAX_JSON_DEPTH, {}),
                                             (MAX_JSON_DEPTH, []), (MAX_JSON_DEPTH + 5, "x")])
def test_one_level_too_deep_is_rejected(levels: int, leaf: Any) -> None:
    """33 nested containers are refused with a clear message naming the limit."""
    with pytest.raises(InvalidArguments, match=str(MAX_JSON_DEPTH)):
        validate_arguments(_nested_objects(levels, leaf))


def test_depth_counts_lists_as_levels_too() -> None:
    """A list inside an object is a level: {"a": [[...]]} with 32 lists is 33 deep."""
    value: Any = 1
    for _ in range(MAX_JSON_DEPTH - 1):
        value = [value]
    validate_arguments({"a": value})
    with pytest.raises(InvalidArguments):
        validate_arguments({"a": [value]})


@pytest.mark.parametrize("container", [list, tuple])
def test_hundred_thousand_deep_nesting_is_rejected_without_recursion_error(
        container: type) -> None:
    """A hostile 100k-deep document is a clean InvalidArguments, never a RecursionError."""
    value: Any = container()
    for _ in range(100_000):
        value = container([value])
    with pytest.raises(InvalidArguments, match="deeper"):
        validate_arguments({"a": value})


def test_self_referencing_structure_is_rejected_not_looped() -> None:
    """A cyclic Python structure hits the depth bound instead of looping or recursing."""
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    with pytest.raises(InvalidArguments):
        validate_arguments(cyclic)


@given(st.integers(min_value=1, max_value=80))
def test_depth_bound_property(levels: int) -> None:
    """For any nesting depth, validation passes iff the depth is within the limit."""
    value = _nested_objects(levels, "leaf")
    if levels <= MAX_JSON_DEPTH:
        validate_arguments(value)
    else:
        with pytest.raises(InvalidArguments):
            validate_arguments(value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_rejected(bad: float) -> None:
    """NaN and ±Infinity are not JSON: refused, wherever they are nested."""
    with pytest.raises(InvalidArguments, match="plain JSON"):
        validate_arguments({"x": bad})
    with pytest.raises(InvalidArguments):
        validate_arguments({"x": [{"y": bad}]})


@pytest.mark.parametrize("bad", [{1, 2}, b"bytes", object()])
def test_non_json_values_are_rejected(bad: Any) -> None:
    """Sets, bytes and arbitrary objects cannot be canonicalised: InvalidArguments."""
    with pytest.raises(InvalidArguments):
        validate_arguments({"x": bad})


def test_oversize_arguments_are_payload_too_large() -> None:
    """Canonical arguments over 64 KiB are refused with the limit in the error."""
    filler = "a" * MAX_ARGUMENTS_BYTES
    with pytest.raises(PayloadTooLarge) as info:
        validate_arguments({"x": filler})
    assert info.value.details["limit"] == MAX_ARGUMENTS_BYTES


def test_arguments_exactly_at_the_size_limit_are_accepted() -> None:
    """The bound is inclusive and measured in UTF-8 bytes of the canonical form."""
    overhead = len(canonical_json({"x": ""}).encode())
    text, _ = validate_arguments({"x": "a" * (MAX_ARGUMENTS_BYTES - overhead)})
    assert len(text.encode()) == MAX_ARGUMENTS_BYTES
    with pytest.raises(PayloadTooLarge):
        validate_arguments({"x": "é" * ((MAX_ARGUMENTS_BYTES - overhead) // 2 + 1)})


def test_digest_is_stable_under_key_order() -> None:
    """The same arguments in any key order give the same canonical text and digest."""
    a = {"b": 1, "a": {"y": [1, 2], "x": "é"}}
    b = {"a": {"x": "é", "y": [1, 2]}, "b": 1}
    assert validate_arguments(a) == validate_arguments(b)
    text, dig = validate_arguments(a)
    assert json.loads(text) == a
    assert dig.startswith("sha256:") and len(dig) == len("sha256:") + 64


def test_digest_distinguishes_different_arguments() -> None:
    """Different values, list orders or types give different digests."""
    digests = {validate_arguments(v)[1] for v in (
        {"a": 1}, {"a": 2}, {"a": "1"}, {"a": [1, 2]}, {"a": [2, 1]}, {"a": 1.5}, {"b": 1})}
    assert len(digests) == 7


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=6))
def test_digest_invariant_under_shuffled_keys(arguments: dict[str, Any]) -> None:
    """Property: rebuilding every object in reverse key order never changes the digest."""
    def reverse(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: reverse(v[k]) for k in reversed(list(v))}
        if isinstance(v, list):
            return [reverse(x) for x in v]
        return v

    assert validate_arguments(arguments) == validate_arguments(reverse(arguments))


def test_operation_key_same_inputs_same_key() -> None:
    """The same tenant, task and caller key always derive the same operation key."""
    a = operation_key(tenant="t1", task_id="task", caller_key="k", operation_id="op_a")
    b = operation_key(tenant="t1", task_id="task", caller_key="k", operation_id="op_b")
    assert a == b
    assert a.startswith("ck_") and len(a) <= 128


def test_operation_key_is_scoped_by_tenant_and_task() -> None:
    """Another tenant or task with the same caller key gets a different provider key."""
    keys = {
        operation_key(tenant="t1", task_id="task", caller_key="k", operation_id="op"),
        operation_key(tenant="t2", task_id="task", caller_key="k", operation_id="op"),
        operation_key(tenant="t1", task_id="other", caller_key="k", operation_id="op"),
        operation_key(tenant="t1", task_id=None, caller_key="k", operation_id="op"),
        operation_key(tenant="t1", task_id="task", caller_key="k2", operation_id="op"),
    }
    assert len(keys) == 5


def test_operation_key_scoping_cannot_be_forged_with_separators() -> None:
    """Identifiers containing separator characters cannot collide with another tenant's scope."""
    a = operation_key(tenant="a\x1fb", task_id="c", caller_key="k", operation_id="op")
    b = operation_key(tenant="a", task_id="b\x1fc", caller_key="k", operation_id="op")
    c = operation_key(tenant="a", task_id="b", caller_key="c\x1fk", operation_id="op")
    assert len({a, b, c}) == 3


def test_operation_key_without_caller_key_is_tied_to_the_operation() -> None:
    """Without a caller key each operation has its own key, derived from its id."""
    a = operation_key(tenant="t", task_id="x", caller_key=None, operation_id="op_a")
    b = operation_key(tenant="t", task_id="x", caller_key=None, operation_id="op_b")
    assert a != b
    assert a == "op_op_a"
    assert a == operation_key(tenant="other", task_id=None, caller_key=None, operation_id="op_a")
