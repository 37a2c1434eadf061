"""outbox: a partial index on settled rows, for retention

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_SETTLED = sa.text("status IN ('consumed', 'obsolete')")


def upgrade() -> None:
    op.create_index("ix_outbox_settled", "outbox", ["created_at"], unique=False,
                    postgresql_where=_SETTLED, sqlite_where=_SETTLED)


def downgrade() -> None:
    op.drop_index("ix_outbox_settled", table_name="outbox")
