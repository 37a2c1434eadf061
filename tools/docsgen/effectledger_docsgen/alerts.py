"""The alerts reference: every Prometheus alert rule and its runbook, read from
`infra/observability/alerts.yaml` (the file Prometheus loads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .md import banner, code, prose, slug, table

ALERTS = Path(__file__).resolve().parents[3] / "infra" / "observability" / "alerts.yaml"


def rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def render(path: Path = ALERTS) -> str:
    found = rules(path)
    out = ["# Alerts and runbooks\n", banner("effectledger_docsgen.alerts"),
           "The rules in `infra/observability/alerts.yaml`, as Prometheus loads them. Each "
           "alert's runbook says what it means, what to look at first and what to do. The "
           "metrics they use: [metrics reference](../reference/metrics.md); the dashboard: "
           "[observability](../observability.md).\n",
           table(["alert", "severity", "for", "summary"], [
               (f"[{r['alert']}](#{slug(r['alert'])})", r.get("labels", {}).get("severity", ""),
                r.get("for", ""), prose(r.get("annotations", {}).get("summary", "")))
               for r in found])]
    for r in found:
        notes = r.get("annotations", {})
        out += [f"## {r['alert']}\n", f"**{prose(notes.get('summary', ''))}** "
                f"(severity {code(r.get('labels', {}).get('severity', ''))}, firing after "
                f"{code(r.get('for', '0s'))})\n",
                "```promql\n" + r["expr"].strip() + "\n```\n",
                prose(notes.get("runbook", "").strip()) + "\n"]
    return "\n".join(out)
