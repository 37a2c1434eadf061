"""Reading the final state of a run: the ledger's database, the provider's truth, JetStream.

Read directly (not through the proxy, not through the services' APIs): the checker must see
what is stored, not what a service chooses to report.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from nats.js.errors import NotFoundError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from .natsconn import connect_quiet
from .stack import STREAM_PREFIX, Stack

AT_REST = frozenset({"succeeded", "failed", "cancelled", "needs_review"})


JSON_COLUMNS = frozenset({"detail", "evidence", "last_outcome", "arguments", "review"})


def _jsonable(column: str, v: Any, parse: bool) -> Any:
    if isinstance(v, datetime):
        return v.isoformat()
    if parse and column in JSON_COLUMNS and isinstance(v, str):
        try:
            return json.loads(v)
        except (ValueError, RecursionError):
            return v
    return v


async def db_rows(url: str, sql: str, *, parse: bool = True,
                  **params: Any) -> list[dict[str, Any]]:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text(sql), params)).mappings().all()
            return [{k: _jsonable(k, v, parse) for k, v in r.items()} for r in rows]
    finally:
        await engine.dispose()


async def state_counts(url: str) -> dict[str, int]:
    rows = await db_rows(url, "SELECT state, count(*) AS n FROM operations GROUP BY state")
    return {r["state"]: int(r["n"]) for r in rows}


async def claims_by(url: str, dispatcher_id: str, tool: str) -> list[datetime]:
    """When each attempt of `tool` claimed by `dispatcher_id` was claimed (UTC)."""
    rows = await db_rows(url, "SELECT a.claimed_at FROM attempts a JOIN operations o "
                              "ON o.id = a.operation_id WHERE a.dispatcher_id = :d "
                              "AND o.tool = :t", d=dispatcher_id, t=tool)
    return [_utc(r["claimed_at"]) for r in rows]


def _utc(value: Any) -> datetime:
    """A timestamp read without the ledger's column type: an ISO string (naive on SQLite)."""
    at = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


async def backlog(url: str) -> dict[str, int]:
    rows = await db_rows(url, "SELECT status, count(*) AS n FROM outbox "
                              "WHERE status IN ('pending', 'publishing', 'published') "
                              "GROUP BY status")
    return {r["status"]: int(r["n"]) for r in rows}


async def read_database(url: str) -> dict[str, Any]:
    q = {
        "operations": "SELECT id, tool, state, epoch, operation_key, caller_key, created_at, "
                      "updated_at, provider_ref, evidence, last_outcome, tenant FROM operations",
        "attempts": "SELECT id, operation_id, epoch, dispatcher_id, status, claimed_at, "
                    "finished_at FROM attempts",
        "journal": "SELECT id, operation_id, at, kind, epoch, from_state, to_state, actor, "
                   "detail FROM journal ORDER BY id",
        "outbox": "SELECT kind, status, count(*) AS n FROM outbox GROUP BY kind, status",
        "dead_letters": "SELECT id, at, consumer, subject, message_id, error, deliveries, "
                        "substr(payload_excerpt, 1, 512) AS payload_excerpt "
                        "FROM dead_letters ORDER BY id",
        "webhook_events": "SELECT provider, webhook_id, event_type, operation_key, outcome, "
                          "final, fencing_token, operation_id, applied FROM webhook_events",
        "reviews": "SELECT operation_id, epoch, conclusion FROM reviews",
    }
    out: dict[str, Any] = {}
    for name, sql in q.items():
        out[name] = await db_rows(url, sql)
    out["inbox_rows"] = (await db_rows(url, "SELECT count(*) AS n FROM inbox"))[0]["n"]
    return out


async def dump_text(url: str, tables: list[str]) -> dict[str, str]:
    """Every row of `tables` as text, for the canary scan."""
    out = {}
    for t in tables:
        rows = await db_rows(url, f"SELECT * FROM {t}", parse=False)  # our own table names
        out[t] = json.dumps(rows, default=str)
    return out


async def read_jetstream(url: str | list[str]) -> dict[str, Any]:
    nc = await connect_quiet(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        out: dict[str, Any] = {}
        for suffix in ("DISPATCH", "EVENTS"):
            name = f"{STREAM_PREFIX}_{suffix}"
            try:
                info = await js.stream_info(name)
            except NotFoundError:
                out[name] = {"missing": True}
                continue
            consumers = {}
            for c in await js.consumers_info(name):
                consumers[c.name] = {"num_pending": c.num_pending,
                                     "num_ack_pending": c.num_ack_pending,
                                     "num_redelivered": c.num_redelivered,
                                     "num_waiting": c.num_waiting}
            out[name] = {"messages": info.state.messages, "bytes": info.state.bytes,
                         "first_seq": info.state.first_seq, "last_seq": info.state.last_seq,
                         "consumers": consumers}
        return out
    finally:
        await nc.close()


async def read_sandbox(stack: Stack) -> dict[str, Any]:
    return {"truth": await stack.sandbox_get("/_truth"),
            "requests": (await stack.sandbox_get("/_requests"))["requests"],
            "webhooks": (await stack.sandbox_get("/_webhooks"))["webhooks"]}


def scan_files(paths: list[Path], canaries: dict[str, str]) -> list[dict[str, Any]]:
    hits = []
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        for name, value in canaries.items():
            if value.encode() in data:
                hits.append({"where": str(p.name), "canary": name})
    return hits


def scan_text(where: str, text: str, canaries: dict[str, str]) -> list[dict[str, Any]]:
    return [{"where": where, "canary": n} for n, v in canaries.items() if v in text]
