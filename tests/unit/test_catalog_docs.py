"""docs/catalog.md's worked examples are valid catalogs and behave as the text says."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from effectledger_core.argschema import schema_errors
from effectledger_core.catalog import Catalog
from effectledger_core.urltemplate import parse, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "catalog.md"
BLOCKS = [b for b in re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S) if "[tools." in b]


def example(n: int) -> Catalog:
    return Catalog.from_mapping(tomllib.loads(BLOCKS[n]), f"docs/catalog.md example {n + 1}")


def test_the_three_worked_examples_are_there() -> None:
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("n", range(3))
def test_each_worked_example_loads(n: int) -> None:
    assert example(n).tools


def test_example_one_search_url_renders_with_the_key() -> None:
    tool = example(0).get("create_customer")
    assert tool.readback is not None
    url = render(parse(tool.readback.url, allow_epoch=False), operation_key="k1",
                 operation_id="o", epoch=0, arguments={},
                 env={"BILLING_BASE": "https://billing.test"})
    assert url.endswith("search?query=metadata%5B%27operation_key%27%5D%3A%27k1%27")


@pytest.mark.parametrize("arguments, pointers", [
    ({"customer_id": "cus_9"}, ["/email"]),
    ({"customer_id": "cus_9/../admin", "email": "a@b.test"}, ["/customer_id"]),
    ({"customer_id": "cus_9", "email": "a@b.test"}, []),
])
def test_example_two_schema_points_at_what_the_text_says(arguments: dict[str, Any],
                                                         pointers: list[str]) -> None:
    tool = example(1).get("update_customer")
    assert [e["pointer"] for e in schema_errors(tool, arguments)] == pointers


def test_example_three_binds_the_tool_to_its_provider() -> None:
    cat = example(2)
    assert cat.webhook_tools("pay") == {"charge"}
    assert cat.webhooks["pay"].scheme == "stripe"
