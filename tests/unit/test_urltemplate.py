"""URL templates: arguments stay inside one path segment or query value; the host is fixed."""

from __future__ import annotations

from typing import Any

import pytest

from effectledger_core.errors import CatalogError
from effectledger_core.urltemplate import TemplateError, TemplateSyntaxError, parse, render


def url(template: str, env: dict[str, str] | None = None, **args: Any) -> str:
    return render(parse(template), operation_key="k-1", operation_id="op 1", epoch=3,
                  arguments=args, env=env or {})


def test_path_placeholders_address_one_object() -> None:
    assert url("https://p.test/v1/customers/{args.customer_id}", customer_id="cus_42") \
        == "https://p.test/v1/customers/cus_42"
    assert url("https://p.test/v1/{operation_key}/{epoch}/{operation_id}") \
        == "https://p.test/v1/k-1/3/op%201"


def test_nested_arguments_and_numbers_render() -> None:
    assert url("https://p.test/o/{args.order.id}?n={args.n}", order={"id": 7}, n=2.5) \
        == "https://p.test/o/7?n=2.5"


@pytest.mark.parametrize("value, encoded", [
    ("a/b", "a%2Fb"), ("../admin", "..%2Fadmin"), ("x?y=1", "x%3Fy%3D1"), ("a#b", "a%23b"),
    ("100%", "100%25"), ("é", "%C3%A9"), ("a&b=c", "a%26b%3Dc"),
])
def test_a_value_is_one_encoded_segment(value: str, encoded: str) -> None:
    assert url("https://p.test/v1/items/{args.id}/refund", id=value) \
        == f"https://p.test/v1/items/{encoded}/refund"


@pytest.mark.parametrize("value", [".", ".."])
def test_dot_segments_from_arguments_are_refused(value: str) -> None:
    with pytest.raises(TemplateError, match=r"'\.' or '\.\.'"):
        url("https://p.test/v1/items/{args.id}", id=value)


def test_dots_inside_a_longer_segment_are_data() -> None:
    assert url("https://p.test/v1/files/{args.name}", name="report..pdf") \
        == "https://p.test/v1/files/report..pdf"


def test_an_empty_path_value_is_refused_but_an_empty_query_value_is_not() -> None:
    with pytest.raises(TemplateError, match="empty"):
        url("https://p.test/v1/customers/{args.id}", id="")
    assert url("https://p.test/v1/search?q={args.q}", q="") == "https://p.test/v1/search?q="


def test_objects_cannot_go_into_a_url() -> None:
    with pytest.raises(TemplateError, match="string or a number"):
        url("https://p.test/v1/{args.id}", id={"a": 1})


def test_a_missing_argument_is_named() -> None:
    with pytest.raises(TemplateError, match="'customer_id' is missing"):
        url("https://p.test/v1/customers/{args.customer_id}")


def test_environment_references_form_the_base_and_are_resolved_at_call_time() -> None:
    env = {"BASE": "https://eu.p.test", "ACCOUNT": "acct_1"}
    assert url("${BASE}/v1/${ACCOUNT}/customers/{args.id}", env, id="c") \
        == "https://eu.p.test/v1/acct_1/customers/c"
    with pytest.raises(CatalogError, match="BASE is not set"):
        url("${BASE}/v1/customers")


@pytest.mark.parametrize("template", [
    "https://{args.host}/v1", "https://api.{args.tenant}.p.test/v1", "{args.url}",
    "https://p.test:{args.port}/v1", "${BASE}{args.path}", "http{args.s}://p.test/",
])
def test_placeholders_in_scheme_or_host_are_refused_at_load(template: str) -> None:
    with pytest.raises(TemplateSyntaxError):
        parse(template)


@pytest.mark.parametrize("template, message", [
    ("https://p.test/v1/{customer_id}", "unknown placeholder"),
    ("https://p.test/v1/{args}", "unknown placeholder"),
    ("https://p.test/v1/{args.}", "unknown placeholder"),
    ("ftp://p.test/v1", "http"),
    ("https://p.test/v1#{args.x}", "fragment"),
])
def test_invalid_templates_fail_at_load(template: str, message: str) -> None:
    with pytest.raises(TemplateSyntaxError, match=message):
        parse(template)


def test_readback_templates_refuse_epoch() -> None:
    with pytest.raises(TemplateSyntaxError, match="epoch"):
        parse("https://p.test/v1/{epoch}", allow_epoch=False)


def test_an_argument_after_an_environment_base_stays_in_the_path() -> None:
    env = {"BASE": "https://p.test"}
    assert url("${BASE}/v1/{args.a}", env, a="@evil.test") == "https://p.test/v1/%40evil.test"
    assert url("${BASE}/v1/{args.a}", env, a="//evil.test") == "https://p.test/v1/%2F%2Fevil.test"
