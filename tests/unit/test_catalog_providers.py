"""Catalog fields for real providers: input schemas, readback paths, webhook providers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from effectledger_core.catalog import Catalog, tool_input_schema
from effectledger_core.errors import CatalogError
from effectledger_core.readbacks import read_answer


def catalog(tool: dict[str, Any], webhooks: dict[str, Any] | None = None) -> Catalog:
    base = {"endpoint": "https://p.test/v1/customers", "contract_revision": "r1"}
    data: dict[str, Any] = {"tools": {"t": {**base, **tool}}}
    if webhooks is not None:
        data["webhooks"] = webhooks
    return Catalog.from_mapping(data, "test.toml")


def test_unknown_endpoint_placeholder_fails_naming_tool_and_field() -> None:
    with pytest.raises(CatalogError) as err:
        catalog({"endpoint": "https://p.test/v1/customers/{customer_id}"})
    assert err.value.details == {"tool": "t", "field": "endpoint"}
    assert "unknown placeholder {customer_id}" in err.value.message


def test_unknown_body_placeholder_fails_but_literal_braces_are_text() -> None:
    with pytest.raises(CatalogError, match=r"field 'body'.*\{amount\}"):
        catalog({"body": {"amount": "{amount}"}})
    tool = catalog({"body": {"note": "{ not a placeholder }", "empty": "{}"}}).get("t")
    assert tool.body == {"note": "{ not a placeholder }", "empty": "{}"}


def test_readback_url_placeholder_in_host_fails() -> None:
    with pytest.raises(CatalogError, match=r"field 'readback.url'.*host"):
        catalog({"readback": {"url": "https://{args.region}.p.test/v1/x"}})


def test_schema_is_derived_from_the_placeholders_the_entry_uses() -> None:
    tool = catalog({
        "endpoint": "https://p.test/v1/customers/{args.customer_id}",
        "body": {"amount": "{args.charge.amount}", "ref": "{operation_key}"},
        "readback": {"url": "https://p.test/v1/search?email={args.email}"},
    }).get("t")
    schema = tool_input_schema(tool)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["required"] == ["charge", "customer_id", "email"]
    assert schema["properties"]["charge"] == {
        "type": "object", "properties": {"amount": {}}, "required": ["amount"]}


def test_declared_schema_wins_and_must_be_a_valid_object_schema() -> None:
    declared = {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1}},
                "required": ["amount"], "additionalProperties": False}
    tool = catalog({"input_schema": declared}).get("t")
    assert tool_input_schema(tool)["properties"] == declared["properties"]
    with pytest.raises(CatalogError, match=r"field 'input_schema'.*2020-12"):
        catalog({"input_schema": {"type": "object", "properties": {"a": {"type": 5}}}})
    with pytest.raises(CatalogError, match="object"):
        catalog({"input_schema": {"type": "array"}})


def test_public_view_shows_the_effective_schema() -> None:
    tool = catalog({"endpoint": "https://p.test/v1/c/{args.id}"}).get("t")
    assert tool.public_view()["input_schema"]["required"] == ["id"]


def test_invalid_jsonpath_fails_at_load() -> None:
    with pytest.raises(CatalogError, match=r"readback.ref_path"):
        catalog({"readback": {"url": "https://p.test/s", "ref_path": "data[0"}})


STRIPE = {"scheme": "stripe", "secrets": ["${STRIPE_WHSEC}"],
          "events": {"customer.created": "applied"},
          "operation_key_path": "$.data.object.metadata.operation_key"}


def test_webhook_provider_table_is_parsed_and_binds_tools() -> None:
    c = Catalog.from_mapping({"tools": {
        "a": {"endpoint": "https://p.test/a", "contract_revision": "r",
              "webhook_provider": "stripe"},
        "b": {"endpoint": "https://p.test/b", "contract_revision": "r"},
    }, "webhooks": {"stripe": STRIPE}})
    assert c.webhooks["stripe"].id_source() == ("path", "$.id")
    assert c.webhook_tools("stripe") == {"a"}
    # Bound by default: a tool naming no provider is decided by no webhook, neither one
    # configured outside the catalog nor one it declares.
    assert c.webhook_tools("sandbox") == frozenset()
    assert not c.webhook_speaks_for("sandbox", "b") and not c.webhook_speaks_for("stripe", "b")


def test_a_webhook_capable_tool_must_name_its_provider() -> None:
    with pytest.raises(CatalogError, match="webhook_provider") as info:
        Catalog.from_mapping({"tools": {
            "hook": {"endpoint": "https://p.test/a", "contract_revision": "r",
                     "capabilities": {"webhooks": True}}}})
    assert info.value.details["tool"] == "hook"


@pytest.mark.parametrize("change, message", [
    ({"secrets": ["whsec_literal"]}, "environment reference"),
    ({"scheme": "hmac_header"}, "needs 'header'"),
    ({"operation_key_path": None}, "how an event finds its operation"),
    ({"events": {"x": "maybe"}}, "events"),
    ({"events": {}}, "at least one"),
])
def test_invalid_webhook_tables_fail_naming_provider_and_field(change: dict[str, Any],
                                                               message: str) -> None:
    body = {k: v for k, v in {**STRIPE, **change}.items() if v is not None}
    with pytest.raises(CatalogError, match=message) as err:
        catalog({}, {"stripe": body})
    assert err.value.details["provider"] == "stripe"


# --- reading a readback answer ---------------------------------------------------------------

def rb(**fields: Any) -> Any:
    return catalog({"readback": {"url": "https://p.test/s?k={operation_key}", **fields}}
                   ).get("t").readback


LIST = b'{"data": [{"id": "cus_1", "email": "a@b"}]}'
TWO = b'{"data": [{"id": "cus_1"}, {"id": "cus_2"}]}'
NONE = b'{"data": []}'


def test_a_list_answer_gives_the_reference_through_ref_path() -> None:
    r = read_answer(rb(ref_path="$.data[0].id", count_path="$.data[*]"), 200, LIST, {})
    assert (r.found, r.provider_ref, r.matches) == (True, "cus_1", 1)


def test_without_ref_path_a_list_answer_has_no_reference() -> None:
    assert read_answer(rb(), 200, LIST, {}).provider_ref is None


def test_count_path_counts_duplicates_and_zero_means_not_found() -> None:
    two = read_answer(rb(ref_path="$.data[0].id", count_path="$.data[*]"), 200, TWO, {})
    assert (two.found, two.matches) == (True, 2)
    none = read_answer(rb(count_path="$.data"), 200, NONE, {})
    assert (none.found, none.matches) == (False, 0)
    assert read_answer(rb(count_path="$.data"), 200, TWO, {}).matches == 2


def test_a_counting_answer_names_every_effect_it_lists() -> None:
    """A duplicate must say what to refund or delete: every listed effect's reference (its
    `id`, or the value itself when the path selects references), distinct and bounded."""
    two = read_answer(rb(ref_path="$.data[0].id", count_path="$.data[*]"), 200, TWO, {})
    assert two.provider_refs == ("cus_1", "cus_2")
    ids = read_answer(rb(count_path="$.data[*].id"), 200, TWO, {})
    assert (ids.matches, ids.provider_refs) == (2, ("cus_1", "cus_2"))
    many = json.dumps({"data": [{"id": f"c{i % 150}"} for i in range(300)]}).encode()
    assert len(read_answer(rb(count_path="$.data[*]"), 200, many, {}).provider_refs) == 100


def test_unexpected_answers_cannot_tell() -> None:
    assert read_answer(rb(count_path="$.data"), 200, b"<html>", {}).found is None
    assert read_answer(rb(count_path="$.data"), 500, TWO, {}).found is None
    assert read_answer(rb(), 404, b"", {}).found is False
