"""Schema migrations (alembic), run programmatically: `effectledger migrate` or at ledger start.

alembic is imported by the functions that run it, not at the top: the ledger imports this
module to start, and a ledger that does not migrate (EFFECTLEDGER_AUTO_MIGRATE=false, as in
infra/k8s, where a Job migrates) would otherwise keep alembic, mako and pygments resident for
nothing (about 6 MiB).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

from .db.store import Store, is_retryable

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

SCRIPT_LOCATION = str(Path(__file__).with_name("migrations"))


def _config(connection: Any = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


async def upgrade(store: Store, revision: str = "head") -> str | None:
    """Bring the schema to `revision`; returns the revision now current."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    async with store.engine.begin() as conn:
        if store.is_postgres:
            # Several ledger replicas may start together: one migrates, the others wait.
            from sqlalchemy import text

            await conn.execute(text("SELECT pg_advisory_xact_lock(727274001)"))
        await conn.run_sync(lambda c: command.upgrade(_config(c), revision))
        return await conn.run_sync(
            lambda c: MigrationContext.configure(c).get_current_revision())


async def current_revision(store: Store) -> str | None:
    from alembic.runtime.migration import MigrationContext

    async with store.engine.connect() as conn:
        return await conn.run_sync(
            lambda c: MigrationContext.configure(c).get_current_revision())


async def upgrade_when_reachable(store: Store, *, wait_s: float = 300.0,
                                 sleep: Callable[[float], Awaitable[None]] | None = None
                                 ) -> str | None:
    """`upgrade`, waiting up to `wait_s` for a database that is not reachable yet.

    A ledger (re)started while PostgreSQL restarts ("the database system is not yet accepting
    connections", connection refused) used to exit at once, which under an orchestrator is a
    crash loop (found by the proving ground). Errors that are not about reachability (bad
    credentials, a broken migration) still fail at once.
    """
    def note(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("database not reachable yet (%s); waiting (%.0f s so far)",
                    f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                    state.seconds_since_start or 0.0)

    extra: dict[str, Any] = {"sleep": sleep} if sleep is not None else {}
    retrying = AsyncRetrying(
        retry=retry_if_exception(is_retryable), stop=stop_after_delay(wait_s),
        wait=wait_exponential_jitter(multiplier=0.2, max=5.0), before_sleep=note, reraise=True,
        **extra)
    async for attempt in retrying:
        with attempt:
            return await upgrade(store)
    raise AssertionError("unreachable")  # pragma: no cover
