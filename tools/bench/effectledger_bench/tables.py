"""The report's building blocks: a phase, numbers formatted for a table, medians, a Markdown
table. Below both the report and the scenario sections it assembles (`obscost`), so the
sections need not import the report that imports them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .measure import summary

Phase = dict[str, Any]


def fmt(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def mmm(values: Iterable[float | None], digits: int = 1) -> str:
    """'median (min-max)'; a single value is shown alone."""
    vals = [v for v in values if v is not None]
    s = summary(vals)
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return fmt(s["median"], digits)
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"


def med(values: Iterable[float | None]) -> float | None:
    return summary(values)["median"]


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
