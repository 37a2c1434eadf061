"""Configuration from `EFFECTLEDGER_*` environment variables and flags (pydantic-settings).

Credentials and TLS settings for NATS and PostgreSQL come from here, never from code. The
database URL carries PostgreSQL's own options (`?ssl=require` etc. for asyncpg).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from .subjects import Subjects

DEMO_CATALOG = Path(__file__).with_name("demo_catalog.toml")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EFFECTLEDGER_", extra="ignore")

    # storage
    database_url: str = "sqlite+aiosqlite:///effectledger-data/ledger.db"
    auto_migrate: bool = True
    # How long a starting ledger waits for an unreachable database before giving up.
    db_startup_wait_s: float = Field(default=300.0, ge=0)
    db_pool_size: int = 10
    # Group commit: at most this many intents/claims/outcomes share one transaction (1: off).
    db_batch_max: int = Field(default=64, ge=1, le=1024)
    # Group-commit transactions in flight at once (None: the default, `default_batch_workers`:
    # 2 on PostgreSQL, 1 on SQLite, which has one connection). With one writer, a call that
    # arrives while a transaction is in flight waits for its commit: at half the maximum rate
    # the one writer was busy 98 % of the time and that queue was most of an operation's
    # latency; a second writer takes such a call at once (docs/benchmark.md, round nineteen).
    db_batch_workers: int | None = Field(default=None, ge=1, le=64)

    # broker
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_token: SecretStr | None = None
    nats_creds_file: str | None = None
    nats_tls_ca_file: str | None = None
    nats_tls_cert_file: str | None = None
    nats_tls_key_file: str | None = None
    subject_prefix: str = Field(default="effects", pattern=r"^[a-zA-Z0-9_-]+(\.[a-zA-Z0-9_-]+)*$")
    stream_prefix: str = Field(default="EFFECTS", pattern=r"^[A-Za-z0-9_-]+$")
    stream_storage: str = Field(default="file", pattern="^(file|memory)$")
    # Replicas and placement of every stream, applied by `effectledger streams apply` only.
    stream_replicas: int = Field(default=1, ge=1, le=5)
    stream_placement_cluster: str | None = None
    stream_placement_tags: list[str] = Field(default_factory=list)
    # A service finding a stream missing creates it (the embedded default); deployments turn
    # this off so that streams exist only as the apply step made them.
    streams_create_missing: bool = True
    stream_max_age_s: float = 7 * 86400
    duplicate_window_s: float = 120.0

    # catalog
    catalog_path: str = str(DEMO_CATALOG)

    # ledger
    ledger_host: str = "127.0.0.1"
    ledger_port: int = Field(default=8600, ge=1, le=65535)
    # Every HTTP port (ledger API, webhook ingress): a client that has not sent its request
    # headers, or its whole body, within these is cut off (408 for the body).
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    # How long an idle kept-alive connection stays open (uvicorn's own default is 5 s). Longer
    # than the clients' (aiohttp 15 s, httpx 5 s) and than common proxies' idle timeouts
    # (60 s), so the client side closes first: a request written as the server closes the
    # connection is lost, and an agent's calls seconds apart keep one connection.
    http_keepalive_s: int = Field(default=75, ge=1)
    # Per-tenant quotas (effectledger_core/quotas.py): 0 is off, the embedded default.
    tenant_rate_per_s: float = Field(default=0.0, ge=0)
    tenant_burst: int = Field(default=0, ge=0)
    tenant_max_in_flight: int = Field(default=0, ge=0)
    tenant_max_awaiting_approval: int = Field(default=0, ge=0)
    relay_batch_size: int = 256
    relay_poll_interval_s: float = 0.5
    relay_lease_s: float = 30.0
    # A new intent's dispatch command is published by the ledger right after its commit, under
    # a lease this long written in that same transaction (0: leave it all to the relay). If the
    # ledger dies before publishing, the relay publishes it once the lease has run out.
    direct_publish_lease_s: float = Field(default=10.0, ge=0)
    # How long the ledger waits, after JetStream has a directly published command, for the
    # command's claim before it marks the row published. A claim granted meanwhile (by this
    # ledger) consumed the row, so the mark would change nothing and is not written: at
    # moderate load that is one write, often one transaction and WAL flush, less per operation.
    # Must stay well below the lease; 0 marks at once.
    direct_publish_mark_linger_s: float = Field(default=0.5, ge=0)
    # An intent alone in its transaction (an agent's keyed call, every MCP call) hands its
    # command to the direct publisher before its one statement is sent, so the publish, the
    # delivery and the claim request travel while the commit's WAL flush does; the claim is
    # granted only on a committed operation (docs/design.md, "A command published with its
    # commit"). false: publish only after the commit, as a batch's intents always are.
    direct_publish_with_commit: bool = True
    sweep_after_s: float = 60.0
    sweep_interval_s: float = 5.0
    reconcile_sweep_after_s: float = 900.0
    # A claimed attempt with no outcome this long is presumed lost by the broker: ambiguous.
    # Far beyond any attempt (timeout_s <= 300, plus outcome publish retries).
    lost_outcome_after_s: float = 900.0
    # Outcomes handled at once; more in flight means larger group commits under load.
    inbox_concurrency: int = 64
    # Submit-and-wait: the longest wait a request may ask for, and how often waits are
    # re-checked against the database for changes made by another ledger replica.
    wait_max_s: float = Field(default=60.0, gt=0, le=3600)
    wait_recheck_s: float = Field(default=2.0, ge=0)
    # How long an unacked inbox message waits before redelivery (a ledger that died mid-commit).
    inbox_ack_wait_s: float = Field(default=30.0, gt=0)
    inbox_retention_s: float = 8 * 86400  # beyond the streams' max age: no redelivery after
    webhook_retention_s: float = 30 * 86400  # webhook ids deduplicated at least this long
    # Consumed and obsolete outbox rows (their payload is never read again) are deleted this
    # long after they were written; the journal stays the audit record. 0 keeps them forever.
    outbox_retention_s: float = Field(default=7 * 86400, ge=0)
    # How often the janitor purges expired dedup state and outbox rows.
    janitor_interval_s: float = Field(default=3600.0, gt=0)
    # {"<token>": "<tenant>"} and {"<token>": "<operator name>"}; none set = open API
    agent_tokens: dict[str, str] = Field(default_factory=dict)
    operator_tokens: dict[str, str] = Field(default_factory=dict)

    # dispatcher
    dispatcher_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    dispatcher_concurrency: int = 32
    claim_timeout_s: float = 5.0
    # How long a dispatcher waits for the ledger's answer to an outcome sent by request (the
    # short path to a waiting agent) before publishing it on JetStream instead; 0 disables
    # the request: every outcome goes by the stream. Either way the command is acked only
    # once the outcome is committed or stored in the stream.
    dispatcher_outcome_request_timeout_s: float = Field(default=2.0, ge=0, le=60)
    ack_wait_s: float = 60.0
    max_deliver: int = 20

    # reconciler
    reconciler_host: str = "127.0.0.1"
    reconciler_port: int = Field(default=8800, ge=1, le=65535)
    reconciler_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # Readback errors are retried until claimed_at + this; then the operation needs review.
    reconcile_deadline_s: float = Field(default=3600.0, gt=0)
    # How long after the ambiguity notice a webhook-capable tool waits for a provider webhook.
    webhook_wait_s: float = Field(default=300.0, ge=0)
    # The duplicate audit re-reads a retried key this long after the provider's horizon.
    audit_slack_s: float = Field(default=60.0, ge=0)
    # Provider -> active Standard Webhooks secrets ("whsec_<base64>"); several during rotation.
    # JSON in the environment: EFFECTLEDGER_WEBHOOK_SECRETS='{"sandbox": ["whsec_..."]}'.
    webhook_secrets: dict[str, list[SecretStr]] = Field(default_factory=dict)
    webhook_max_body_bytes: int = Field(default=256 * 1024, gt=0)
    webhook_tolerance_s: float = Field(default=300.0, gt=0)

    # dispatcher health port: /metrics, /healthz, /readyz (None: no port; 0: any free port)
    dispatcher_health_host: str = "127.0.0.1"
    dispatcher_health_port: int | None = Field(default=None, ge=0, le=65535)

    # logging: text for a terminal, json (one object per line) for collectors
    log_level: str = Field(default="INFO",
                           pattern=r"(?i)^(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)$")
    log_format: str = Field(default="text", pattern="^(text|json)$")

    @property
    def subjects(self) -> Subjects:
        return Subjects(prefix=self.subject_prefix, stream_prefix=self.stream_prefix)


def default_batch_workers(is_postgres: bool) -> int:
    """Group-commit writers when `db_batch_workers` is not set: two on PostgreSQL, so a call
    never waits for another transaction's commit when a writer is free; one on SQLite, whose
    single connection would only make the second wait."""
    return 2 if is_postgres else 1
