"""reconciliation: evidence column, webhook events, operator reviews

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("evidence", JSONType, nullable=True))
    op.create_table(
        "webhook_events",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("provider", sa.String(length=1024), nullable=False),
        sa.Column("webhook_id", sa.String(length=1024), nullable=False),
        sa.Column("event_type", sa.String(length=1024), nullable=False),
        sa.Column("operation_key", sa.String(length=1024), nullable=True),
        sa.Column("provider_ref", sa.String(length=256), nullable=True),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("final", sa.Boolean(), nullable=False),
        sa.Column("fencing_token", sa.Integer(), nullable=True),
        sa.Column("body_digest", sa.String(length=80), nullable=False),
        sa.Column("signed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("operation_id", sa.String(length=64), nullable=True),
        sa.Column("applied", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_events")),
        sa.UniqueConstraint("provider", "webhook_id",
                            name=op.f("uq_webhook_events_provider_webhook_id")),
    )
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.create_index("ix_webhook_events_key", ["operation_key"], unique=False)
        batch_op.create_index("ix_webhook_events_ref", ["provider_ref"], unique=False)
        batch_op.create_index("ix_webhook_events_received", ["received_at"], unique=False)
    op.create_table(
        "reviews",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=64), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("operator", sa.String(length=1024), nullable=False),
        sa.Column("evidence_ref", sa.String(length=1024), nullable=False),
        sa.Column("conclusion", sa.String(length=32), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["operation_id"], ["operations.id"],
                                name=op.f("fk_reviews_operation_id_operations")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reviews")),
    )
    with op.batch_alter_table("reviews", schema=None) as batch_op:
        batch_op.create_index("ix_reviews_operation", ["operation_id", "epoch"], unique=False)


def downgrade() -> None:
    op.drop_table("reviews")
    op.drop_table("webhook_events")
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_column("evidence")
