"""retry plans (explicit, single-use recovery)

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "retry_plans",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=64), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("arguments_digest", sa.String(length=80), nullable=False),
        sa.Column("contract_revision", sa.String(length=64), nullable=False),
        sa.Column("review", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()),
                                                   "postgresql"), nullable=True),
        sa.Column("requested_by", sa.String(length=1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("consumed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("admission", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["operation_id"], ["operations.id"],
                                name=op.f("fk_retry_plans_operation_id_operations")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retry_plans")),
    )
    with op.batch_alter_table("retry_plans", schema=None) as batch_op:
        batch_op.create_index("ix_retry_plans_operation", ["operation_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("retry_plans", schema=None) as batch_op:
        batch_op.drop_index("ix_retry_plans_operation")
    op.drop_table("retry_plans")
