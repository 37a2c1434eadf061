"""operations.call_key: the call identity an operation holds, for key-less identical calls

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("call_key", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint("uq_operations_call_key", ["call_key"])


def downgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_constraint("uq_operations_call_key", type_="unique")
        batch_op.drop_column("call_key")
