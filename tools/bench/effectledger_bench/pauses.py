"""The services' loop stalls during a phase: garbage-collection pauses and event-loop lag
(`effectledger_obs.loopwatch`), from the ledger's and the dispatchers' /metrics before and
after the phase.

A phase whose p99 is far above its p95 has a few operations that waited for something rare;
a stall of the loop that serves all of them is one such thing, and these counts say whether it
happened, how often and how long (the histograms' bucket bounds: "at most")."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]
GC, LAG = "effectledger_gc_pause_seconds", "effectledger_event_loop_lag_seconds"
# The ledger's group-commit transactions (commit included): their summed time is how long its
# writers were busy, which says whether one writer was the queue the operations waited in.
WRITER = "effectledger_db_transaction_duration_seconds"


async def scrape(base_url: str, families: tuple[str, ...] = (GC, LAG, WRITER)
                 ) -> Scrape | None:
    """The samples of `families` (by default the histograms: GC, loop lag, and on the ledger
    its writers' transactions), or None when the service does not answer."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"{base_url}/metrics")).raise_for_status().text
    except Exception as exc:  # a figure missing from a report, never a failed phase
        log.debug("no metrics from %s: %s", base_url, exc)
        return None
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        if family.name in families or f"{family.name}_total" in families:  # a counter's
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _buckets(d: Scrape, name: str, **match: str) -> list[tuple[float, float]]:
    """(upper bound, count in the phase) of a histogram's cumulative buckets, summed over the
    label sets that match."""
    sums: dict[float, float] = {}
    for (sample, labels), v in d.items():
        lab = dict(labels)
        if sample == f"{name}_bucket" and all(lab.get(k) == x for k, x in match.items()):
            le = float(lab["le"])
            sums[le] = sums.get(le, 0.0) + v
    return sorted(sums.items())


def _over(buckets: list[tuple[float, float]], bound: float) -> int:
    total = buckets[-1][1] if buckets else 0.0
    at_most = max((c for le, c in buckets if le <= bound), default=0.0)
    return round(total - at_most)


def _pct_bound(buckets: list[tuple[float, float]], p: float) -> float | None:
    """The upper bound (ms) of the bucket holding the p-th percentile."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    for le, c in buckets:
        if c >= total * p / 100:
            return round(le * 1000, 2) if le != float("inf") else None
    return None


async def scrape_many(base_urls: list[str]) -> dict[str, Scrape | None]:
    """`scrape` of each of several processes (the dispatchers), by URL."""
    return {url: await scrape(url) for url in base_urls}


def delta(before: Scrape | None, after: Scrape | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    return summarise({k: v - before.get(k, 0.0) for k, v in after.items()})


def delta_many(before: Mapping[str, Scrape | None],
               after: Mapping[str, Scrape | None]) -> dict[str, Any] | None:
    """The phase's stalls summed over several processes. One that started during the phase
    counts from zero; one gone by its end (scaled down, killed) is left out: its last figures
    are not known."""
    total: Scrape = {}
    for url, a in after.items():
        if a is None:
            continue
        b = before.get(url) or {}
        for k, v in a.items():
            total[k] = total.get(k, 0.0) + v - b.get(k, 0.0)
    return summarise(total) if total else None


def summarise(d: Scrape) -> dict[str, Any]:
    """GC pauses per generation, loop-lag samples and (the ledger's) group-commit
    transactions of a phase's histogram deltas."""
    out: dict[str, Any] = {}
    gens = sorted({dict(labels).get("generation", "?") for (s, labels) in d
                   if s == f"{GC}_count"})
    for gen in gens:
        b = _buckets(d, GC, generation=gen)
        total_s = sum(v for (s, labels), v in d.items()
                      if s == f"{GC}_sum" and dict(labels).get("generation") == gen)
        out[f"gc_gen{gen}"] = {"count": round(b[-1][1]) if b else 0,
                               "total_ms": round(total_s * 1000, 1),
                               "over_10ms": _over(b, 0.01)}
    tx = [(sample, v) for (sample, _labels), v in d.items()
          if sample in (f"{WRITER}_count", f"{WRITER}_sum")]
    if tx:
        count = sum(v for sample, v in tx if sample.endswith("_count"))
        busy = sum(v for sample, v in tx if sample.endswith("_sum"))
        out["writer"] = {"transactions": round(count), "busy_s": round(busy, 3),
                         "mean_ms": round(1000 * busy / count, 2) if count else None}
    lag = _buckets(d, LAG)
    out["loop_lag"] = {"samples": round(lag[-1][1]) if lag else 0,
                       "p99_at_most_ms": _pct_bound(lag, 99),
                       "over_10ms": _over(lag, 0.01), "over_25ms": _over(lag, 0.025),
                       "over_100ms": _over(lag, 0.1)}
    return out
