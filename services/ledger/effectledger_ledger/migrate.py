"""Schema migrations (alembic), run programmatically: `effectledger migrate` or at ledger start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from .db.store import Store

SCRIPT_LOCATION = str(Path(__file__).with_name("migrations"))


def _config(connection: Any = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


async def upgrade(store: Store, revision: str = "head") -> str | None:
    """Bring the schema to `revision`; returns the revision now current."""
    async with store.engine.begin() as conn:
        if store.is_postgres:
            # Several ledger replicas may start together: one migrates, the others wait.
            from sqlalchemy import text

            await conn.execute(text("SELECT pg_advisory_xact_lock(727274001)"))
        await conn.run_sync(lambda c: command.upgrade(_config(c), revision))
        return await conn.run_sync(
            lambda c: MigrationContext.configure(c).get_current_revision())


async def current_revision(store: Store) -> str | None:
    async with store.engine.connect() as conn:
        return await conn.run_sync(
            lambda c: MigrationContext.configure(c).get_current_revision())
