"""The one read behind the waiters' shared re-check: the states of many operations at once."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from . import hot
from .schema import operations

# Per dialect, built once (`hot.read_rows` compiles each statement once).
_STATES = {d: sa.select(operations.c.id, operations.c.state)
           .where(hot.one_of(operations.c.id, "ids", d)) for d in hot.DIALECTS}


async def states_of(conn: AsyncConnection, operation_ids: list[str]) -> dict[str, str]:
    if not operation_ids:
        return {}
    rows = await hot.read_rows(conn, _STATES[conn.dialect.name], {"ids": operation_ids})
    return {r["id"]: r["state"] for r in rows}
