"""The ledger schema. Migrations (alembic, ../migrations) create exactly these tables.

SQLAlchemy Core tables rather than ORM classes: every state change is a guarded UPDATE whose
row count is the answer, which Core expresses directly.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from effectledger_core.states import ACTIVE, OutboxStatus, State

metadata = sa.MetaData(naming_convention={
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
})


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC on every backend (SQLite stores naive text; we re-attach UTC)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the ledger")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# In the table's declaration order, so the index predicate reads exactly as the migration's.
ACTIVE_STATES = tuple(s.value for s in State if s in ACTIVE)
_active = sa.text(f"state IN ({', '.join(repr(s) for s in ACTIVE_STATES)})")

operations = sa.Table(
    "operations", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(1024), nullable=False),
    sa.Column("task_id", sa.String(1024)),
    sa.Column("caller_key", sa.String(1024)),
    sa.Column("operation_key", sa.String(128), nullable=False, unique=True),
    sa.Column("tool", sa.String(64), nullable=False),
    sa.Column("arguments", JSONType, nullable=False),
    sa.Column("arguments_digest", sa.String(80), nullable=False),
    sa.Column("tool_digest", sa.String(80), nullable=False),
    sa.Column("contract_revision", sa.String(64), nullable=False),
    sa.Column("effect_class", sa.String(32), nullable=False),
    sa.Column("commit_policy", sa.String(32), nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("epoch", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    sa.Column("provider_ref", sa.String(256)),
    sa.Column("response_digest", sa.String(80)),
    sa.Column("last_outcome", JSONType),
    # How the operation's outcome became known (reconciliation or operator evidence).
    sa.Column("evidence", JSONType),
    # The provider's answer for the agent (effectledger_core.results.ProviderResult): from the
    # successful response or the readback that found the effect. Never synthesized.
    sa.Column("result", JSONType),
    # The call identity (effectledger_core/identical.py) while this operation holds it: set
    # only for intents that join identical calls; cleared when a newer identical operation
    # takes it over, so the unique index admits one holder and never deduplicates forever.
    sa.Column("call_key", sa.String(64), unique=True),
    # Operations that are not yet at rest are what relays, sweepers and dashboards query.
    sa.Index("ix_operations_active_state", "state", "updated_at",
             postgresql_where=_active, sqlite_where=_active),
    sa.Index("ix_operations_state_created", "state", "created_at", "id"),
    sa.Index("ix_operations_created", "created_at", "id"),
)

attempts = sa.Table(
    "attempts", metadata,
    sa.Column("id", sa.String(1024), primary_key=True),
    sa.Column("operation_id", sa.String(64), sa.ForeignKey("operations.id"), nullable=False),
    sa.Column("epoch", sa.Integer, nullable=False),
    sa.Column("dispatcher_id", sa.String(1024), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),  # claimed | <outcome type>
    sa.Column("claimed_at", UTCDateTime, nullable=False),
    sa.Column("finished_at", UTCDateTime),
    sa.Column("http_status", sa.Integer),
    sa.Column("provider_ref", sa.String(256)),
    sa.Column("response_digest", sa.String(80)),
    sa.Column("outcome", JSONType),
    # The database-level form of "one claim per epoch".
    sa.UniqueConstraint("operation_id", "epoch"),
)

journal = sa.Table(
    "journal", metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("operation_id", sa.String(64), index=False),
    sa.Column("at", UTCDateTime, nullable=False),
    sa.Column("kind", sa.String(64), nullable=False),
    sa.Column("epoch", sa.Integer),
    sa.Column("from_state", sa.String(32)),
    sa.Column("to_state", sa.String(32)),
    sa.Column("actor", sa.String(1024), nullable=False),
    sa.Column("detail", JSONType, nullable=False),
    sa.Index("ix_journal_operation", "operation_id", "id"),
)

OUTBOX_PENDING, OUTBOX_PUBLISHING, OUTBOX_PUBLISHED, OUTBOX_CONSUMED, OUTBOX_OBSOLETE = (
    s.value for s in (OutboxStatus.PENDING, OutboxStatus.PUBLISHING, OutboxStatus.PUBLISHED,
                      OutboxStatus.CONSUMED, OutboxStatus.OBSOLETE))

outbox = sa.Table(
    "outbox", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("operation_id", sa.String(64), nullable=False),
    sa.Column("epoch", sa.Integer, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),  # OutboxKind: dispatch | reconcile
    sa.Column("subject", sa.String(512), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("available_at", UTCDateTime, nullable=False),
    sa.Column("lease_until", UTCDateTime),
    sa.Column("published_at", UTCDateTime),
    sa.Column("publish_count", sa.Integer, nullable=False, server_default="0"),
    # JetStream's sequence from the publish-ack: lets the sweeper tell "still queued" from
    # "lost" instead of guessing from age alone (a long backlog is not a loss).
    sa.Column("stream_seq", sa.BigInteger),
    sa.Column("last_error", sa.String(1024)),
    # W3C traceparent of the request that wrote the row (null when tracing is off): a publish
    # long after the request, or by another replica after a restart, still joins its trace.
    sa.Column("traceparent", sa.String(64)),
    sa.Index("ix_outbox_unpublished", "available_at",
             postgresql_where=sa.text("status IN ('pending', 'publishing')"),
             sqlite_where=sa.text("status IN ('pending', 'publishing')")),
    sa.Index("ix_outbox_published", "published_at",
             postgresql_where=sa.text("status = 'published'"),
             sqlite_where=sa.text("status = 'published'")),
    sa.Index("ix_outbox_operation", "operation_id", "epoch"),
    # Retention (db/retention.py) finds what it may delete without scanning live rows.
    sa.Index("ix_outbox_settled", "created_at",
             postgresql_where=sa.text("status IN ('consumed', 'obsolete')"),
             sqlite_where=sa.text("status IN ('consumed', 'obsolete')")),
)

inbox = sa.Table(
    "inbox", metadata,
    sa.Column("consumer", sa.String(128), primary_key=True),
    sa.Column("message_id", sa.String(1024), primary_key=True),
    sa.Column("received_at", UTCDateTime, nullable=False),
)

dead_letters = sa.Table(
    "dead_letters", metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("at", UTCDateTime, nullable=False),
    sa.Column("consumer", sa.String(128), nullable=False),
    sa.Column("subject", sa.String(1024), nullable=False),
    sa.Column("message_id", sa.String(1024)),
    sa.Column("error", sa.String(1024), nullable=False),
    sa.Column("payload_excerpt", sa.Text, nullable=False),
    sa.Column("deliveries", sa.Integer, nullable=False),
)

# Single-use recovery plans: bound to operation, epoch, arguments and contract.
retry_plans = sa.Table(
    "retry_plans", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("operation_id", sa.String(64), sa.ForeignKey("operations.id"), nullable=False),
    sa.Column("epoch", sa.Integer, nullable=False),
    sa.Column("arguments_digest", sa.String(80), nullable=False),
    sa.Column("contract_revision", sa.String(64), nullable=False),
    sa.Column("review", JSONType),
    sa.Column("requested_by", sa.String(1024), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("consumed_at", UTCDateTime),
    sa.Column("admission", sa.String(64)),  # admitted | refused:<reason>
    sa.Index("ix_retry_plans_operation", "operation_id"),
)

# Verified provider webhooks, kept as evidence and for deduplication by webhook id for at least
# the provider's whole retry schedule (days, not minutes).
webhook_events = sa.Table(
    "webhook_events", metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("provider", sa.String(1024), nullable=False),
    sa.Column("webhook_id", sa.String(1024), nullable=False),
    sa.Column("event_type", sa.String(1024), nullable=False),
    sa.Column("operation_key", sa.String(1024)),
    sa.Column("provider_ref", sa.String(256)),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("final", sa.Boolean, nullable=False),
    sa.Column("fencing_token", sa.Integer),
    sa.Column("body_digest", sa.String(80), nullable=False),
    sa.Column("signed_at", UTCDateTime, nullable=False),
    sa.Column("received_at", UTCDateTime, nullable=False),
    sa.Column("operation_id", sa.String(64)),
    sa.Column("applied", sa.String(64)),  # null until used: applied | rejected:<why> | ignored
    sa.UniqueConstraint("provider", "webhook_id"),
    sa.Index("ix_webhook_events_key", "operation_key"),
    sa.Index("ix_webhook_events_ref", "provider_ref"),
    sa.Index("ix_webhook_events_received", "received_at"),
)

# Operator reviews of operations no machine could decide.
reviews = sa.Table(
    "reviews", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("operation_id", sa.String(64), sa.ForeignKey("operations.id"), nullable=False),
    sa.Column("epoch", sa.Integer, nullable=False),
    sa.Column("operator", sa.String(1024), nullable=False),
    sa.Column("evidence_ref", sa.String(1024), nullable=False),
    sa.Column("conclusion", sa.String(32), nullable=False),
    sa.Column("at", UTCDateTime, nullable=False),
    sa.Index("ix_reviews_operation", "operation_id", "epoch"),
)
