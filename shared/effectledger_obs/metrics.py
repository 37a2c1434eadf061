"""Every Prometheus metric the services export, in one place.

Names follow Prometheus conventions (`effectledger_` prefix, base units in the name, `_total`
for counters). Labels are bounded sets only: tool names (from the catalog, which the operator
controls), states, outcome types, failure classes, reply statuses, reasons that are stable
error codes, providers named in the configuration. Never an operation id, a tenant, a key, an
argument or any other caller-supplied text: each label value is a time series, forever.

Gauges read from the ledger's database on scrape live in `effectledger_ledger.gauges`; they are
registered by the ledger only, so they are not defined here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics

# `*_created` samples double the series count and no dashboard or alert here uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Seconds from milliseconds to an hour: stages are milliseconds, reconciliation is minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
PROVIDER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

OTHER = "other"

# `metric.labels(...)` costs ~2 us (argument checks, a lock); the hot paths (several metrics
# per operation) look each labelled child up once. Label sets are bounded, so is this table.
_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def child(metric: Counter | Gauge | Histogram, *labels: str) -> Any:
    """`metric.labels(*labels)`, cached."""
    key = (id(metric), labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


def inc(metric: Counter, *labels: str, amount: float = 1.0) -> None:
    child(metric, *labels).inc(amount)


def observe(metric: Histogram, value: float, *labels: str) -> None:
    child(metric, *labels).observe(value)


def bounded(value: str | None, allowed: Iterable[str]) -> str:
    """`value` if it is one of `allowed`, else "other": keeps a label set bounded when the
    value comes from a message or a request rather than from the configuration."""
    if value is None:
        return OTHER
    return value if value in allowed else OTHER


# ---- ledger: intents, transitions, latency ------------------------------------------------

INTENTS = Counter(
    "effectledger_intents_total",
    "Intents the ledger accepted, by tool; result is created (a new operation) or existing "
    "(the same key and arguments again).", ["tool", "result"])
INTENTS_REFUSED = Counter(
    "effectledger_intents_refused_total",
    "Intents the ledger refused, by stable error code.", ["reason"])
TRANSITIONS = Counter(
    "effectledger_transitions_total",
    "Committed state transitions of operations (one per journal entry that changes state).",
    ["from_state", "to_state"])
OPERATION_DURATION = Histogram(
    "effectledger_operation_duration_seconds",
    "From the intent's acceptance to a state at rest, by tool and that state.",
    ["tool", "state"], buckets=LATENCY_BUCKETS)
STAGE_DURATION = Histogram(
    "effectledger_stage_duration_seconds",
    "Each stage of an attempt: accepted_to_claimed, claimed_to_outcome (the provider's answer "
    "as the dispatcher saw it), outcome_to_recorded (the outcome's trip to the ledger's commit).",
    ["stage"], buckets=LATENCY_BUCKETS)
LATENCY_UNTRACKED = Counter(
    "effectledger_latency_untracked_total",
    "Operations that came to rest without an acceptance time in this ledger process (accepted "
    "before a restart, or evicted from the bounded table): left out of the latency histograms.")
CLAIMS = Counter(
    "effectledger_claims_total", "Claim requests answered by the ledger, by reply status.",
    ["status"])
CLAIMS_ASKED_AGAIN = Counter(
    "effectledger_claims_asked_again_total",
    "Claims not found at first for an operation made under a second ago, asked again by the "
    "ledger in case another replica was committing it, by what the last look answered.",
    ["status"])
OUTCOMES = Counter(
    "effectledger_outcomes_total",
    "Attempt outcomes the ledger's inbox handled (from the stream or by request), by outcome "
    "type and what became of them (applied, duplicate, rejected, kept).", ["type", "status"])
INBOX_DUPLICATES = Counter(
    "effectledger_inbox_duplicates_total",
    "Messages the ledger's inbox dropped as already handled, by kind.", ["kind"])
VERDICTS = Counter(
    "effectledger_verdicts_total",
    "Reconciler verdicts the ledger handled, by verdict and status (rejected: stale epoch or "
    "operation no longer waiting).", ["verdict", "status"])
WEBHOOKS_RECORDED = Counter(
    "effectledger_webhooks_recorded_total",
    "Verified webhooks the ledger recorded, by what became of them.", ["status"])
RPC_REPLIES_REFUSED = Counter(
    "effectledger_rpc_replies_refused_total",
    "Requests refused before any work because their reply subject is not an inbox of a user "
    "that may ask them, by reason (not_an_inbox, another_users_inbox).", ["reason"])
WEBHOOKS_UNBOUND = Counter(
    "effectledger_webhooks_unbound_total",
    "Verified webhooks the ledger refused because they named an operation of a tool bound to "
    "another provider (or to none), by provider ('other': not named in the catalog).",
    ["provider"])
DEAD_LETTERS = Counter(
    "effectledger_dead_letters_total", "Poison messages recorded as dead letters, by consumer.",
    ["consumer"])
RETRY_BUDGET_TOKENS = Gauge(
    "effectledger_retry_budget_tokens",
    "Tokens left in the ledger-wide automatic retry budget.")

# ---- ledger: outbox relay and sweeper -------------------------------------------------------

RELAY_PUBLISHED = Counter(
    "effectledger_relay_published_total",
    "Outbox rows published to JetStream and acknowledged, by row kind and the way they went "
    "(direct: right after the intent's commit; relay: leased from the outbox).", ["kind", "via"])
RELAY_PUBLISH_FAILURES = Counter(
    "effectledger_relay_publish_failures_total",
    "Outbox publishes that failed and were handed back for a later try, by the way they went.",
    ["via"])
SWEEPER_REPUBLISHED = Counter(
    "effectledger_sweeper_republished_total",
    "Published commands the sweeper sent again because nobody took them (broker message "
    "loss), by kind (dispatch, reconcile).", ["kind"])
OUTBOX_PURGED = Counter(
    "effectledger_outbox_purged_total",
    "Consumed and obsolete outbox rows deleted by the janitor once their retention passed.")
LOST_OUTCOMES = Counter(
    "effectledger_lost_outcomes_total",
    "Claimed attempts that never reported an outcome, handed to reconciliation as ambiguous.")

# ---- ledger: database -----------------------------------------------------------------------

DB_BATCH_SIZE = Histogram(
    "effectledger_db_batch_size",
    "Calls sharing one group-commit transaction.", ["writer"], buckets=BATCH_BUCKETS)
DB_TRANSACTION_DURATION = Histogram(
    "effectledger_db_transaction_duration_seconds",
    "Duration of group-commit transactions, commit included.", ["writer"],
    buckets=LATENCY_BUCKETS)
DB_BATCH_FALLBACKS = Counter(
    "effectledger_db_batch_fallbacks_total",
    "Group-commit batches rolled back and replayed call by call.", ["writer"])
DB_ALONE = Counter(
    "effectledger_db_alone_total",
    "Calls alone in their transaction that tried one guarded statement (intent, claim, "
    "outcome), by whether it wrote (written) or left the call to the locked path (declined).",
    ["call", "result"])

# ---- HTTP (ledger API, reconciler webhooks, health ports) -----------------------------------

HTTP_REQUESTS = Counter(
    "effectledger_http_requests_total",
    "HTTP requests served, by route template (never the raw path), method and status code.",
    ["route", "method", "status"])
HTTP_DURATION = Histogram(
    "effectledger_http_request_duration_seconds",
    "HTTP request duration, by route template and method.", ["route", "method"],
    buckets=LATENCY_BUCKETS)

# ---- dispatcher -----------------------------------------------------------------------------

PROVIDER_CALLS = Counter(
    "effectledger_provider_calls_total",
    "Provider calls made by dispatchers, by tool, outcome type and failure class ('none' when "
    "the call did not fail).", ["tool", "outcome", "failure_class"])
PROVIDER_CALL_DURATION = Histogram(
    "effectledger_provider_call_duration_seconds",
    "Provider call duration as the dispatcher measured it, by tool and outcome type.",
    ["tool", "outcome"], buckets=PROVIDER_BUCKETS)
DISPATCH_CLAIM_REPLIES = Counter(
    "effectledger_dispatcher_claim_replies_total",
    "Claim replies as dispatchers received them, by status ('timeout': no reply in time).",
    ["status"])
DISPATCH_OUTCOMES = Counter(
    "effectledger_dispatcher_outcomes_reported_total",
    "Outcomes dispatchers reported, by route: 'request' (committed by the ledger, which "
    "answered) or 'stream' (published with its publish-ack), and for the stream why the "
    "request was not enough: off, no_reply, retryable, refused, failed, mismatch.",
    ["route", "reason"])

# ---- reconciler -----------------------------------------------------------------------------

READBACKS = Counter(
    "effectledger_readbacks_total",
    "Provider readbacks made by reconcilers, by tool and result (found, not_found, error).",
    ["tool", "result"])
VERDICTS_PUBLISHED = Counter(
    "effectledger_reconciler_verdicts_total",
    "Verdicts reconcilers published, by verdict and the evidence's source.",
    ["verdict", "source"])
WEBHOOKS_RECEIVED = Counter(
    "effectledger_webhooks_received_total",
    "Webhook deliveries reaching a reconciler, by provider ('other': not configured).",
    ["provider"])
WEBHOOKS_VERIFIED = Counter(
    "effectledger_webhooks_verified_total",
    "Webhooks whose signature verified, by provider.", ["provider"])
WEBHOOKS_REFUSED = Counter(
    "effectledger_webhooks_refused_total",
    "Webhooks refused, by provider and stable reason code (invalid_signature, "
    "missing_signature, timestamp_too_old, payload_too_large, unknown_provider, ...).",
    ["provider", "reason"])

# ---- provider ground truth ------------------------------------------------------------------

DUPLICATES_DETECTED = Counter(
    "effectledger_duplicates_detected_total",
    "Effects a provider applied more than once for one operation, as found by a readback "
    "count or a webhook, by tool. Should stay at zero: each one needs a human.", ["tool"])

# ---- messaging (every service) --------------------------------------------------------------

NATS_RECONNECTS = Counter(
    "effectledger_nats_reconnects_total", "Reconnections to NATS after a lost connection.")
NATS_DISCONNECTS = Counter(
    "effectledger_nats_disconnects_total", "Connections to NATS lost.")
NATS_CONNECTED = Gauge(
    "effectledger_nats_connected", "1 while this process is connected to NATS, else 0.")
MESSAGES_HANDLED = Counter(
    "effectledger_messages_handled_total",
    "JetStream messages a consumer finished with, by consumer and result (ack, nak, term, "
    "dead_letter).", ["consumer", "result"])


# The metric families defined above, for the dashboard test and the docs.
def exported_names() -> set[str]:
    """Every sample name these metrics can expose (with _total, _bucket, _sum, _count)."""
    names: set[str] = set()
    for value in globals().values():
        if isinstance(value, Counter | Gauge | Histogram):
            for metric in value.describe():
                for suffix in _SUFFIXES[metric.type]:
                    names.add(metric.name + suffix)
    return names


_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def enabled_from_env(value: str | None) -> bool:
    """`EFFECTLEDGER_METRICS`: `on` (the default) or `off`; anything else is refused."""
    if value is None or value.strip().lower() in ("", "on"):
        return True
    if value.strip().lower() == "off":
        return False
    raise ValueError(f"EFFECTLEDGER_METRICS must be 'on' or 'off', got {value!r}")


class _Off:
    """Stands in for every metric when metrics are off: each call is one attribute lookup and
    a no-op call, and `labels()` returns the same object, so call sites need no flag."""

    def labels(self, *_: Any, **__: Any) -> _Off:
        return self

    def inc(self, *_: Any, **__: Any) -> None:
        return None

    dec = set = observe = set_function = inc


OFF = _Off()
# Read once at import (service start-up): the benchmark compares a process with metrics
# against one without, and switching later would leave half-built series behind.
ENABLED = enabled_from_env(os.environ.get("EFFECTLEDGER_METRICS"))
if not ENABLED:
    for _name, _value in list(globals().items()):
        if isinstance(_value, Counter | Gauge | Histogram):
            REGISTRY.unregister(_value)
            globals()[_name] = OFF
