"""The one read behind the waiters' shared re-check: the states of many operations at once."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import operations


async def states_of(conn: AsyncConnection, operation_ids: list[str]) -> dict[str, str]:
    if not operation_ids:
        return {}
    rows = (await conn.execute(
        sa.select(operations.c.id, operations.c.state)
        .where(operations.c.id.in_(operation_ids)))).all()
    return {r[0]: r[1] for r in rows}
