"""The tool catalog: loading, validation with clear errors, secrets, digests and templates."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from effectledger_core.catalog import (
    Catalog,
    EffectClass,
    TemplateError,
    Tool,
    render,
    resolve_env,
)
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.errors import CatalogError, UnknownTool


def _tool(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "endpoint": "https://provider.example/v1/things",
        "effect_class": "non_idempotent",
        "contract_revision": "r1",
    }
    body.update(overrides)
    return body


def _load(body: dict[str, Any], name: str = "make_thing") -> Catalog:
    return Catalog.from_mapping({"catalog_version": 1, "tools": {name: body}}, "test.toml")


def _error(body: dict[str, Any], name: str = "make_thing") -> CatalogError:
    with pytest.raises(CatalogError) as info:
        _load(body, name)
    return info.value


def test_demo_catalog_loads_with_its_documented_tools() -> None:
    """The bundled demo catalog is valid and declares the documented tools and classes."""
    cat = Catalog.load(DEMO_CATALOG)
    assert set(cat.tools) == {"create_ticket", "send_email", "charge_card", "post_message",
                              "page_oncall", "wire_funds"}
    assert cat.get("post_message").capabilities.webhooks
    assert cat.get("wire_funds").commit_policy == "approval"
    assert cat.get("create_ticket").effect_class is EffectClass.IDEMPOTENT
    assert cat.get("send_email").effect_class is EffectClass.NON_IDEMPOTENT
    assert cat.get("charge_card").body_encoding == "form"
    for tool in cat.tools.values():
        # A readback section exactly where the capability is declared, and vice versa.
        assert (tool.readback is not None) == tool.capabilities.readback
    assert not cat.get("page_oncall").capabilities.readback


def test_unknown_tool_lookup_is_a_clear_error() -> None:
    """Catalog.get on an undeclared tool raises UnknownTool listing the known tools."""
    cat = _load(_tool())
    with pytest.raises(UnknownTool) as info:
        cat.get("nope")
    assert "nope" in str(info.value)
    assert info.value.details["known"] == ["make_thing"]


def test_effect_class_defaults_to_unknown() -> None:
    """A tool that declares no effect class is treated as `unknown`, the most cautious class."""
    body = _tool()
    del body["effect_class"]
    assert _load(body).get("make_thing").effect_class is EffectClass.UNKNOWN


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        (_tool(effect_class="sometimes_idempotent"), "effect_class", "effect_class"),
        ({k: v for k, v in _tool().items() if k != "contract_revision"}, "contract_revision",
         "contract_revision"),
        (_tool(contract_revision=""), "contract_revision", "contract_revision"),
        (_tool(endpoint="ftp://provider.example/x"), "endpoint", "endpoint"),
        (_tool(endpoint="provider.example/x"), "endpoint", "endpoint"),
        (_tool(timeout=5), "timeout", "timeout"),
        (_tool(capabilities={"readbak": True}), "capabilities.readbak", "readbak"),
        (_tool(timeout_s=0), "timeout_s", "timeout_s"),
        (_tool(method="TRACE"), "method", "method"),
    ],
    ids=["unknown_effect_class", "missing_contract_revision", "empty_contract_revision",
         "ftp_endpoint", "schemeless_endpoint", "unknown_field", "unknown_capability",
         "zero_timeout", "bad_method"],
)
def test_invalid_field_names_tool_and_field(body: dict[str, Any], field: str,
                                            fragment: str) -> None:
    """Each invalid field gives a CatalogError whose message and details name tool and field."""
    err = _error(body)
    assert "'make_thing'" in str(err) and fragment in str(err)
    assert err.details == {"tool": "make_thing", "field": field}
    assert "test.toml" in str(err)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (_tool(effect_class="idempotent"), "accepts_idempotency_key"),
        (_tool(effect_class="idempotent", capabilities={"accepts_idempotency_key": True},
               idempotency_header=None), "idempotency_header"),
        (_tool(capabilities={"readback": True}), "[readback]"),
        (_tool(headers={"Authorization": "Bearer abc"}), "Authorization"),
        (_tool(headers={"X-Api-Key": "abc"}), "X-Api-Key"),
        (_tool(headers={"X-Client-Secret": "abc"}), "X-Client-Secret"),
        (_tool(headers={"Idempotency-Key": "${K}"}), "Idempotency-Key"),
        (_tool(readback={"url": "https://p.example/{operation_key}",
                         "found_when": {"status": 200, "json_path": "$.id"}}), "exactly one"),
    ],
    ids=["idempotent_without_key", "idempotent_without_header", "readback_without_section",
         "literal_bearer", "literal_api_key", "literal_secret", "dispatcher_header",
         "found_when_both"],
)
def test_inconsistent_tool_is_rejected_naming_tool_and_cause(body: dict[str, Any],
                                                            fragment: str) -> None:
    """Cross-field rules fail at load, naming the tool and the offending field in the message."""
    err = _error(body)
    assert "'make_thing'" in str(err)
    assert fragment in str(err)
    assert err.details["tool"] == "make_thing"


@pytest.mark.parametrize("name", ["Make_Thing", "1thing", "make-thing", "", "x" * 64])
def test_bad_tool_name_is_rejected(name: str) -> None:
    """Tool names must match [a-z][a-z0-9_]{0,62}; the error names the tool and `name`."""
    err = _error(_tool(), name=name)
    assert err.details == {"tool": name, "field": "name"}


def test_longest_valid_tool_name_is_accepted() -> None:
    """A 63-character lowercase name is the upper bound and still valid."""
    assert "a" * 63 in _load(_tool(), name="a" * 63).tools


def test_catalog_without_tools_or_with_unknown_top_level_key_is_rejected() -> None:
    """An empty catalog and a misspelt top-level key are load errors, not silently ignored."""
    with pytest.raises(CatalogError, match="at least one tool"):
        Catalog.from_mapping({"tools": {}})
    with pytest.raises(CatalogError, match="tool"):
        Catalog.from_mapping({"tools": {"a": _tool()}, "tool": {}})
    with pytest.raises(CatalogError, match="expected a table"):
        Catalog.from_mapping({"tools": {"a": "not a table"}})


def test_load_reports_missing_file_and_bad_toml(tmp_path: Path) -> None:
    """Catalog.load turns a missing file and invalid TOML into CatalogError with the path."""
    with pytest.raises(CatalogError, match="not found"):
        Catalog.load(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[tools.x\nendpoint = ")
    with pytest.raises(CatalogError, match="not valid TOML"):
        Catalog.load(bad)


def test_env_referenced_secret_headers_are_accepted() -> None:
    """A secret-looking header whose value references ${ENV} is how secrets are declared."""
    tool = _load(_tool(headers={"Authorization": "Bearer ${PROVIDER_TOKEN}",
                                "X-Api-Key": "${API_KEY}", "Accept": "application/json"}))
    assert tool.get("make_thing").headers["Authorization"] == "Bearer ${PROVIDER_TOKEN}"


def test_public_view_withholds_header_values() -> None:
    """Agents see header names only: no value (which may name a secret) appears in the view."""
    tool = _load(_tool(headers={"Authorization": "Bearer ${PROVIDER_TOKEN}",
                                "X-Trace": "literal-trace-value"})).get("make_thing")
    view = tool.public_view()
    assert view["headers"] == ["Authorization", "X-Trace"]
    text = repr(view)
    assert "PROVIDER_TOKEN" not in text and "literal-trace-value" not in text
    assert view["digest"] == tool.digest()
    assert view["contract_revision"] == "r1"


def test_digest_is_stable_across_dict_order() -> None:
    """The same declaration in any key order digests identically, tool and catalog alike."""
    body = _tool(headers={"A": "1", "B": "2"}, body={"x": "{args.x}", "y": "{args.y}"},
                 capabilities={"webhooks": True, "fencing_token": True},
                 webhook_provider="sandbox")
    reordered = {k: body[k] for k in reversed(list(body))}
    reordered["headers"] = {"B": "2", "A": "1"}
    reordered["body"] = {"y": "{args.y}", "x": "{args.x}"}
    reordered["capabilities"] = {"fencing_token": True, "webhooks": True}
    a, b = _load(body), _load(reordered)
    assert a.get("make_thing").digest() == b.get("make_thing").digest()
    assert a.digest() == b.digest()
    two = {"t1": _tool(), "t2": _tool(contract_revision="r2")}
    assert (Catalog.from_mapping({"tools": two}).digest()
            == Catalog.from_mapping({"tools": dict(reversed(two.items()))}).digest())


def test_a_digest_remembered_for_another_tool_object_is_not_taken() -> None:
    """Tool.digest is remembered by the object's id; an id reused by a new object (the old
    one gone) must not hand it the old tool's digest."""
    from effectledger_core import catalog as catalog_module

    a, b = _load(_tool(contract_revision="r1")), _load(_tool(contract_revision="r2"))
    tool_a, tool_b = a.get("make_thing"), b.get("make_thing")
    expected = tool_b.digest()
    catalog_module._DIGESTS.memo[id(tool_b)] = (tool_a, tool_a.digest())  # as after an id reuse
    assert tool_b.digest() == expected != tool_a.digest()


def test_digest_changes_when_contract_revision_changes() -> None:
    """A new contract revision is a different contract: tool and catalog digests change."""
    a, b = _load(_tool(contract_revision="r1")), _load(_tool(contract_revision="r2"))
    assert a.get("make_thing").digest() != b.get("make_thing").digest()
    assert a.digest() != b.digest()
    assert a.get("make_thing").digest().startswith("sha256:")


def test_digest_changes_when_endpoint_or_effect_class_changes() -> None:
    """Any semantic field is covered by the digest, not only the revision."""
    base = _load(_tool()).get("make_thing").digest()
    assert _load(_tool(endpoint="https://other.example/")).get("make_thing").digest() != base
    assert _load(_tool(effect_class="unknown")).get("make_thing").digest() != base


ARGS = {"amount": 1250, "currency": "EUR", "customer": {"id": "c_1", "tags": ["a"]}}


def _render(template: Any, arguments: dict[str, Any] | None = None) -> Any:
    return render(template, operation_key="ck_abc", operation_id="op_1", epoch=3,
                  arguments=ARGS if arguments is None else arguments)


def test_whole_placeholder_keeps_the_json_type() -> None:
    """A string that is exactly one placeholder takes the value with its type (int, dict...)."""
    assert _render("{args.amount}") == 1250
    assert _render("{epoch}") == 3
    assert _render("{args.customer}") == {"id": "c_1", "tags": ["a"]}
    assert _render("{operation_key}") == "ck_abc"
    assert _render("{operation_id}") == "op_1"


def test_placeholders_inside_strings_are_interpolated() -> None:
    """Placeholders inside longer strings become text; nested dicts and lists are walked."""
    template = {"url": "https://p.example/by-key/{operation_key}?e={epoch}",
                "ref": ["{args.customer.id}-{args.currency}", 7, None, True]}
    assert _render(template) == {"url": "https://p.example/by-key/ck_abc?e=3",
                                 "ref": ["c_1-EUR", 7, None, True]}


def test_non_placeholder_braces_are_left_alone() -> None:
    """Only known placeholders are rendered; other brace text passes through verbatim."""
    assert _render("{not_a_placeholder} {args}") == "{not_a_placeholder} {args}"


def test_interpolated_values_are_not_rendered_again() -> None:
    """An argument containing placeholder text is data, not a template."""
    assert _render("x={args.note}", {"note": "{operation_key}"}) == "x={operation_key}"


@pytest.mark.parametrize("template", ["{args.missing}", "id={args.customer.missing}",
                                      "{args.amount.cents}"])
def test_missing_argument_is_a_template_error(template: str) -> None:
    """A placeholder naming an absent argument path raises TemplateError naming the path."""
    with pytest.raises(TemplateError, match="missing"):
        _render(template)


def test_resolve_env_substitutes_and_reports_missing_variables() -> None:
    """${NAME} is replaced from the given environment; an unset variable is a CatalogError."""
    env = {"TOKEN": "s3cr3t", "REGION": "eu"}
    assert resolve_env("Bearer ${TOKEN} in ${REGION}", env) == "Bearer s3cr3t in eu"
    assert resolve_env("no references", env) == "no references"
    with pytest.raises(CatalogError, match="UNSET_VAR"):
        resolve_env("Bearer ${UNSET_VAR}", env)


def test_tool_model_is_frozen() -> None:
    """A loaded tool cannot be mutated after validation (its digest would lie)."""
    tool = _load(_tool()).get("make_thing")
    with pytest.raises(ValueError, match="frozen"):
        tool.contract_revision = "r9"  # type: ignore[misc]
    assert isinstance(copy.copy(tool), Tool)
