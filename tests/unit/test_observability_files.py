"""infra/observability: the dashboard and the alert rules only use metrics the code exports.

`promtool` is not published as a Python package, so the rules are checked by parsing: the
file's structure as Prometheus loads it, balanced brackets in every expression, durations,
severities and runbooks, and every metric name known to the code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

import effectledger_ledger.gauges  # noqa: F401 - registers the database gauges
import effectledger_obs.metrics  # noqa: F401 - registers the services' metrics

INFRA = Path(__file__).resolve().parents[2] / "infra" / "observability"
METRIC = re.compile(r"\beffectledger_[a-z0-9_]+")
DURATION = re.compile(r"^\d+[smhd]$")


def exported() -> set[str]:
    names: set[str] = set()
    for family in REGISTRY.collect():
        if not family.name.startswith("effectledger_"):
            continue
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    in_string = False
    for ch in expr:
        if ch == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and not in_string


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((INFRA / "grafana-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        out.extend((panel["title"], t["expr"]) for t in panel["targets"])
    return out


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((INFRA / "alerts.yaml").read_text())
    assert set(doc) == {"groups"}
    found = []
    for group in doc["groups"]:
        assert set(group) <= {"name", "rules", "interval"} and group["rules"]
        found.extend(group["rules"])
    return found


def test_every_dashboard_query_names_an_exported_metric() -> None:
    known = exported()
    exprs = dashboard_exprs()
    assert len(exprs) >= 30
    for title, expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"{title!r}: no effectledger metric in {expr!r}"
        unknown = set(names) - known
        assert not unknown, f"{title!r}: {sorted(unknown)} are not exported"
        assert balanced(expr), f"{title!r}: unbalanced {expr!r}"


def test_the_dashboard_covers_the_metrics_the_alerts_and_operators_need() -> None:
    used = {n for _, e in dashboard_exprs() for n in METRIC.findall(e)}
    for needed in ("effectledger_ambiguous_operations", "effectledger_review_queue_operations",
                   "effectledger_outbox_unpublished_rows", "effectledger_transitions_total",
                   "effectledger_provider_calls_total", "effectledger_dead_letters_total",
                   "effectledger_nats_connected", "effectledger_retry_budget_tokens",
                   "effectledger_operation_duration_seconds_bucket"):
        assert needed in used, needed


def test_alert_rules_parse_and_name_exported_metrics_with_runbooks() -> None:
    known = exported()
    found = rules()
    names = [r["alert"] for r in found]
    assert len(names) == len(set(names))
    for rule in found:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"[A-Z][A-Za-z]+", rule["alert"])
        expr = rule["expr"]
        assert balanced(expr), rule["alert"]
        metrics = set(METRIC.findall(expr))
        assert metrics and metrics <= known, (rule["alert"], metrics - known)
        if "for" in rule:
            assert DURATION.match(rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        annotations = rule["annotations"]
        assert annotations["summary"].strip()
        assert len(annotations["runbook"].split()) >= 20, f"{rule['alert']}: runbook too thin"


@pytest.mark.parametrize("alert", [
    "EffectledgerAmbiguousBacklogGrowing", "EffectledgerAmbiguousPastReconcileDeadline",
    "EffectledgerReviewQueueWaiting", "EffectledgerOutboxLag", "EffectledgerDeadLetters",
    "EffectledgerDuplicateDetected", "EffectledgerWebhookSignatureFailures",
    "EffectledgerProviderFailureRate", "EffectledgerNatsDisconnected"])
def test_each_alert_the_operators_asked_for_exists(alert: str) -> None:
    assert alert in {r["alert"] for r in rules()}


def test_the_balance_check_can_fail() -> None:
    assert not balanced("sum(rate(x[5m])")
    assert not balanced('max(x{a="b"}')
    assert balanced('max(x{a="(b"})')
