"""The site's generated reference (tools/docsgen) covers everything the code defines: every
command and option, route, subject, catalog field, metric and alert. The strict site build
(`mkdocs build --strict`, .ci/run) checks the links and anchors; these tests check coverage and
run without MkDocs installed."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel

import effectledger_ledger.gauges  # noqa: F401 - registers the database gauges
import effectledger_obs.metrics  # noqa: F401 - registers the services' metrics
from effectledger_bus.asyncapi import build as asyncapi
from effectledger_cli.main import build_parser
from effectledger_core.catalog import Tool
from effectledger_core.webhookspec import WebhookProvider
from effectledger_docsgen import alerts, catalog, cli, http, messages, metrics
from effectledger_docsgen.md import slug


def _walk(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str,
                                                                     argparse.ArgumentParser]]:
    found = [(prefix, parser)]
    for name, _, sub in cli._subcommands(parser):
        found += _walk(sub, f"{prefix} {name}")
    return found


def test_the_cli_page_has_every_command_and_option() -> None:
    parser = build_parser()
    page = cli.render(parser)
    commands = _walk(parser, "effectledger")
    assert len(commands) > 20
    for name, sub in commands[1:]:
        assert f"`{name}`" in page, name
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in page, (name, option)


def test_the_http_page_has_every_route_and_model() -> None:
    doc = http.openapi()
    page = http.render(doc)
    routes = [(m.upper(), p) for p, item in doc["paths"].items() for m in item
              if m in http.METHODS]
    assert ("POST", "/v1/intents") in routes and len(routes) >= 15
    for method, path in routes:
        assert f"### `{method} {path}`" in page
    for name in doc["components"]["schemas"]:
        assert f"### {name}\n" in page


def test_the_messages_page_has_every_subject_and_payload() -> None:
    doc = asyncapi()
    page = messages.render(doc)
    for channel in doc["channels"].values():
        assert f"`{channel['address']}`" in page
    for name in doc["components"]["schemas"]:
        assert f"### {name}\n" in page


@pytest.mark.parametrize("model", [Tool, WebhookProvider])
def test_the_catalog_page_has_every_field(model: type[BaseModel]) -> None:
    page = catalog.render()
    for name in model.model_fields:
        if name != "name":  # the table's key, never written as a field
            assert f"| `{name}` |" in page, name


def test_a_fields_comment_is_the_block_above_it_and_its_own_line() -> None:
    class Example(BaseModel):
        # Seconds to wait.
        # At most a minute.
        wait_s: float = 1.0
        plain: int = 0  # inline
        bare: str = ""

    assert catalog.field_comments(Example) == {
        "wait_s": "Seconds to wait. At most a minute.", "plain": "inline", "bare": ""}


def test_the_metrics_page_has_every_registered_metric() -> None:
    page = metrics.render()
    registered = {f.name for f in REGISTRY.collect() if f.name.startswith("effectledger_")}
    assert len(registered) > 20
    shown = set(re.findall(r"`(effectledger_[a-z0-9_]+)`", page))
    for name in registered:
        # prometheus_client names a family without `_total` or `_bucket`; the page shows samples.
        assert {name, f"{name}_total", f"{name}_bucket"} & shown, name


def test_the_alerts_page_has_every_rule_with_its_runbook() -> None:
    page = alerts.render()
    found = alerts.rules()
    assert found
    for rule in found:
        assert f"## {rule['alert']}\n" in page
        assert rule["annotations"]["runbook"].strip().splitlines()[0] in page


@pytest.mark.parametrize("heading", ["`effectledger bench-agent`", "POST /v1/intents",
                                     "GET /v1/operations/{operation_id}/receipt", "ClaimReply",
                                     "`[tools.<name>.readback]`"])
def test_slug_is_the_toc_extensions(heading: str) -> None:
    toc: Any = pytest.importorskip("markdown.extensions.toc", reason="Markdown (docs extra)")
    assert slug(heading) == toc.slugify(heading, "-")


def test_every_relative_link_in_the_readme_names_a_file() -> None:
    # The README is outside the site, so the strict build does not check its links.
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", (repo / "README.md").read_text())
    relative = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert len(relative) > 20
    assert [link for link in relative if not (repo / link).exists()] == []


def test_prose_escapes_angle_brackets_outside_code_spans_only() -> None:
    from effectledger_docsgen.md import prose

    assert prose("stream <P>_EVENTS, `<prefix>.x` & more") == (
        "stream &lt;P&gt;_EVENTS, `<prefix>.x` &amp; more")


def test_the_settings_page_has_every_variable() -> None:
    from effectledger_core.config import Settings
    from effectledger_docsgen import settings

    page = settings.render()
    for name in Settings.model_fields:
        assert f"| `EFFECTLEDGER_{name.upper()}` |" in page, name
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    assert repo not in page  # no path of the machine that built the site
