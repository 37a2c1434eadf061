"""The metrics reference: every `effectledger_*` metric, read from its definition."""

from __future__ import annotations

from types import ModuleType

from prometheus_client.metrics import MetricWrapperBase

from .md import banner, code, prose, table

# The sample names a metric type exposes beside its own name.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count")}


def metrics(module: ModuleType) -> list[MetricWrapperBase]:
    """The metric objects a module defines at its top level, in definition order."""
    return [v for v in vars(module).values() if isinstance(v, MetricWrapperBase)]


def _row(metric: MetricWrapperBase) -> tuple[str, str, str, str]:
    # prometheus_client keeps a metric's name, type, help and labels on the object; there is
    # no public accessor short of collecting samples, which a labelled metric has none of yet.
    name: str = metric._name
    kind = metric._type or ""
    labels: tuple[str, ...] = metric._labelnames
    shown = " ".join(code(name + s) for s in SUFFIXES.get(kind, ("",)))
    return (shown, kind, ", ".join(code(label) for label in labels),
            prose(metric._documentation))


def render() -> str:
    import effectledger_ledger.gauges as gauges
    import effectledger_obs.http as http
    import effectledger_obs.loopwatch as loopwatch
    import effectledger_obs.metrics as shared

    out = ["# Metrics reference\n", banner("effectledger_docsgen.metrics"),
           "Every service serves Prometheus metrics at `/metrics` (the ledger and the "
           "reconciler on their HTTP port, the dispatcher on `EFFECTLEDGER_DISPATCHER_HEALTH_PORT`"
           "). Labels are bounded: no operation or tenant ids. What to watch and why, the "
           "dashboard and the alerts: [observability](../observability.md).\n",
           "## Every service\n",
           "Defined in `effectledger_obs.metrics`, for HTTP requests `effectledger_obs.http`, "
           "and for the process's own stalls (GC pauses, event-loop lag; the ledger and the "
           "dispatcher) `effectledger_obs.loopwatch`; each process reports those of its role.\n",
           table(["metric", "type", "labels", "meaning"],
                 [_row(m) for m in metrics(shared) + metrics(http) + metrics(loopwatch)]),
           "## The ledger's database gauges\n",
           "Defined in `effectledger_ledger.gauges`: read from the database when `/metrics` is "
           "scraped, so every ledger replica reports the same value (use `max()` across "
           "instances).\n",
           table(["metric", "type", "labels", "meaning"], [_row(m) for m in metrics(gauges)])]
    return "\n".join(out)
