"""Alembic environment: runs migrations on the connection handed over by `migrate.upgrade`."""

from __future__ import annotations

from alembic import context

from effectledger_ledger.db.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through `effectledger migrate`")
context.configure(connection=connection, target_metadata=metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
