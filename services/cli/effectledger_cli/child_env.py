"""Each child of `effectledger up` gets the environment its role uses, and nothing else.

Built from allow lists, not by removing known names: a secret in the user's shell that no one
listed (a cloud key, a client's EFFECTLEDGER_TOKEN, a setting added later for another role)
reaches no child. The database URL (a password in production) and the HTTP API tokens reach
the ledger alone; provider keys the processes that call or read back from providers
(dispatchers, reconcilers) and the variables the catalog's `${NAME}` references name; webhook
secrets the reconcilers; nats-server gets no EFFECTLEDGER_* setting at all.

Every child keeps what a process needs to run at all: PATH, PYTHONPATH, VIRTUAL_ENV, HOME,
LANG and LC_*, TMPDIR (and TZ, USER, LOGNAME). The per-child secrets `up` generates (NATS
passwords, API tokens, the sandbox's key and webhook secret) are added by `up` for each child
on top of this.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path

E = "EFFECTLEDGER_"
BASE = frozenset({"PATH", "PYTHONPATH", "VIRTUAL_ENV", "HOME", "LANG", "TMPDIR", "TZ", "USER",
                  "LOGNAME"})
BASE_PREFIXES = ("LC_",)


class ChildRole(Enum):
    LEDGER = "ledger"
    DISPATCHER = "dispatcher"
    RECONCILER = "reconciler"
    SANDBOX = "sandbox"
    NATS = "nats-server"


# Settings (effectledger_core.config) every service reads: logging, metrics, the event loop,
# crash points for tests, subjects, streams and the catalog. NATS credentials are not here:
# `up` gives each child its own user, never the shell's.
_SERVICE = (
    "LOG_LEVEL", "LOG_FORMAT", "EVENT_LOOP", "METRICS", "TRACES_FILE", "CRASH_POINTS",
    "SUBJECT_PREFIX", "STREAM_PREFIX", "STREAM_STORAGE", "STREAM_REPLICAS",
    "STREAM_PLACEMENT_*", "STREAMS_CREATE_MISSING", "STREAM_MAX_AGE_S", "DUPLICATE_WINDOW_S",
    "CATALOG_PATH", "ACK_WAIT_S", "MAX_DELIVER", "NATS_URL", "NATS_TLS_*",
    "HTTP_HEADER_TIMEOUT_S", "HTTP_BODY_TIMEOUT_S")
# What calling providers needs beyond the catalog's own references: proxies and CA bundles.
_PROVIDER_CALLS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
                   "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")
_OTEL = ("OTEL_*",)  # traces, when OTEL_* ask for them (effectledger_obs.tracing)

ALLOWED: Mapping[ChildRole, tuple[str, ...]] = {
    ChildRole.LEDGER: (*_OTEL, *(E + n for n in (
        *_SERVICE, "DATABASE_URL", "AUTO_MIGRATE", "DB_*", "LEDGER_HOST", "LEDGER_PORT",
        "TENANT_*", "RELAY_*", "DIRECT_PUBLISH_*", "SWEEP_*", "RECONCILE_SWEEP_AFTER_S",
        "LOST_OUTCOME_AFTER_S", "INBOX_*", "WAIT_*", "WEBHOOK_RETENTION_S", "AGENT_TOKENS",
        "OPERATOR_TOKENS"))),
    ChildRole.DISPATCHER: (*_OTEL, *_PROVIDER_CALLS, *(E + n for n in (
        *_SERVICE, "DISPATCHER_*", "CLAIM_TIMEOUT_S", "UNSAFE_SKIP_CLAIM",
        "UNSAFE_NO_SEND_DEADLINE"))),
    ChildRole.RECONCILER: (*_OTEL, *_PROVIDER_CALLS, *(E + n for n in (
        *_SERVICE, "RECONCILER_*", "RECONCILE_DEADLINE_S", "WEBHOOK_WAIT_S", "AUDIT_SLACK_S",
        "WEBHOOK_MAX_BODY_BYTES", "WEBHOOK_TOLERANCE_S", "UNSAFE_SKIP_WEBHOOK_VERIFICATION"))),
    ChildRole.SANDBOX: tuple(E + n for n in ("LOG_LEVEL", "LOG_FORMAT", "EVENT_LOOP",
                                             "METRICS")),
    ChildRole.NATS: (),
}
# The roles that resolve the catalog's `${NAME}` references (they call providers).
CATALOG_READERS = frozenset({ChildRole.DISPATCHER, ChildRole.RECONCILER})
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def catalog_references(catalog: Path) -> frozenset[str]:
    """The environment variables a catalog names (`${NAME}` in headers, URLs, secrets)."""
    try:
        return frozenset(_REFERENCE.findall(catalog.read_text()))
    except (OSError, UnicodeDecodeError):
        return frozenset()


def allowed(role: ChildRole, name: str, references: Iterable[str] = ()) -> bool:
    if name in BASE or name.startswith(BASE_PREFIXES):
        return True
    if role in CATALOG_READERS and name in references:
        return True
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p
               for p in ALLOWED[role])


def build(role: ChildRole, *sources: Mapping[str, str],
          references: Iterable[str] = ()) -> dict[str, str]:
    """The allowed names of `sources` (later ones win): the user's environment, then `up`'s
    own settings for the run. The child's own secrets are added by the caller."""
    refs = frozenset(references)
    env: dict[str, str] = {}
    for source in sources:
        env.update({k: v for k, v in source.items() if allowed(role, k, refs)})
    return env
