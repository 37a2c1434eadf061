"""Intent submission: operation + journal + outbox row in one transaction."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.catalog import Catalog, Tool
from effectledger_core.crash import crash_point
from effectledger_core.errors import EffectLedgerError, IdempotencyConflict
from effectledger_core.identical import call_identity, joins
from effectledger_core.ids import operation_key as derive_operation_key
from effectledger_core.intents import reject_nul, validate_arguments
from effectledger_core.messages import SubmitIntent
from effectledger_core.states import JournalKind, OutboxKind, State
from effectledger_core.subjects import Subjects
from effectledger_obs import metrics

from . import hot
from .calls import BatchCall
from .common import execute_rows, insert_journal, journal_row, note_transitions, notify_outbox
from .outbox import OutboxItem, dispatch_row
from .rows import JournalRow, OperationRow
from .schema import OUTBOX_PUBLISHING, journal, operations, outbox
from .transitions import RELEASE_CALL_IDENTITY


@dataclass(frozen=True)
class Submitted:
    operation: dict[str, Any]  # the operation's columns (OperationRow.as_dict())
    created: bool
    # The dispatch command, leased to this ledger for publishing right after the commit
    # (only when the caller asked for a lease, see `lease_until`).
    command: OutboxItem | None = None
    # Whether `command` was already handed to `SubmitCall.early` (published with the commit).
    published: bool = False


# Built once (see common._LOCK_WITH_ATTEMPTS).
_BY_KEYS = {d: sa.select(operations).where(hot.one_of(operations.c.operation_key, "keys", d))
            for d in hot.DIALECTS}
_BY_CALLS = {d: sa.select(operations).where(hot.one_of(operations.c.call_key, "calls", d))
             for d in hot.DIALECTS}
_INSERT_OPERATION = operations.insert()
_INSERT_OUTBOX = outbox.insert()


async def _submit(conn: AsyncConnection, items: Sequence[SubmitCall]
                  ) -> list[Submitted | Exception]:
    """Intents, set-based: one read for the caller keys, one INSERT per table for the batch.

    A refused intent (invalid arguments, unknown tool, key reused with other arguments) gets
    its error instead of a result and writes nothing; intents after it are unaffected.

    An intent that joins identical calls (`join_identical`) is also known by its call
    identity (effectledger_core/identical.py): without a key it joins the identity's holder
    when `joins` says so; a new operation takes the identity over (the holder lets go of it in
    the same transaction, so the unique index sees one holder at a time).
    """
    results: list[Submitted | Exception | None] = [None] * len(items)
    keys: dict[int, str] = {}
    caller: dict[int, str | None] = {}  # the caller key each new operation would carry
    calls: dict[int, str] = {}  # the call identity, for intents that join identical calls
    valid: dict[int, tuple[Tool, str]] = {}  # the tool and the arguments digest, by position
    for i, kw in enumerate(items):
        intent = kw.intent
        try:
            tool, args_digest = _checked(kw)
        except EffectLedgerError as exc:
            results[i] = exc
            continue
        valid[i] = (tool, args_digest)
        given, call_key = _names(kw, tool, args_digest)
        if call_key is not None:
            calls[i] = call_key
        caller[i] = given
        keys[i] = derive_operation_key(tenant=intent.tenant, task_id=intent.task_id,
                                       caller_key=given, operation_id=kw.operation_id)
    caller_keys = [keys[i] for i in keys if items[i].intent.idempotency_key is not None]
    known: dict[str, OperationRow] = {}
    if caller_keys:
        # Lockless: the unique key re-checks it at the INSERT (see the note below).
        known = {r["operation_key"]: OperationRow.of(r) for r in await hot.fetch(
            conn, _BY_KEYS[conn.dialect.name], {"keys": caller_keys}, lockless=True)}
    holders: dict[str, OperationRow] = {}  # the current holder of each call identity
    if calls:
        holders = {r["call_key"]: OperationRow.of(r) for r in await hot.fetch(
            conn, _BY_CALLS[conn.dialect.name], {"calls": sorted(set(calls.values()))},
            lockless=True)}
    releases: list[dict[str, Any]] = []
    batch_columns: dict[str, dict[str, Any]] = {}  # this batch's new operations, by id

    relay = False  # whether any command is left to the relays (then wake them)
    new_ops: list[dict[str, Any]] = []
    entries: list[JournalRow] = []
    commands: list[dict[str, Any]] = []
    for i, op_key in keys.items():
        kw = items[i]
        intent = kw.intent
        tool, args_digest = valid[i]
        existing = known.get(op_key) if intent.idempotency_key is not None else None
        call_key = calls.get(i)
        holder = holders.get(call_key) if call_key is not None else None
        if existing is None and holder is not None and intent.idempotency_key is None \
                and joins(state=holder.state.value, created_at=holder.created_at, now=kw.now,
                          window_s=tool.dedupe_window_s):
            existing = holder  # the same call again: that operation, not a second effect
        if existing is not None:
            if existing.tool != tool.name or existing.arguments_digest != args_digest:
                results[i] = IdempotencyConflict(
                    "idempotency key already used with different arguments or tool",
                    operation_id=existing.id)
            else:
                results[i] = Submitted(existing.as_dict(), created=False)
            continue
        new = _new_operation(kw, tool, args_digest, caller_key=caller[i], op_key=op_key,
                             call_key=call_key)
        op, columns = new.op, new.columns
        new_ops.append(columns)
        known[op_key] = op  # a second intent with this key in the same batch finds it
        if call_key is not None:
            if holder is not None:
                if holder.id in batch_columns:
                    batch_columns[holder.id]["call_key"] = None
                else:
                    releases.append({"holder_id": holder.id, "held": call_key})
            holders[call_key] = op
            batch_columns[op.id] = columns
        entries.append(new.entry)
        if new.command_row is not None:
            commands.append(new.command_row)
            relay = relay or new.command is None
        results[i] = new.submitted
    if releases:
        await conn.execute(RELEASE_CALL_IDENTITY, releases)
    if new_ops:
        # A unique violation (the same key committed meanwhile by another transaction) aborts
        # the batch; the service then retries each intent on its own and finds the winner.
        await execute_rows(conn, _INSERT_OPERATION, new_ops)
        await insert_journal(conn, entries)
    if commands:
        await execute_rows(conn, _INSERT_OUTBOX, commands)
    if relay:
        await notify_outbox(conn)
    return [r for r in results if r is not None]


def _names(kw: SubmitCall, tool: Tool, args_digest: str) -> tuple[str | None, str | None]:
    """The caller key a new operation for `kw` carries, and its call identity (None unless
    it joins identical calls)."""
    intent = kw.intent
    if not intent.join_identical:
        return intent.idempotency_key, None
    call_key = call_identity(tenant=intent.tenant, task_id=intent.task_id, tool=tool.name,
                             arguments_digest=args_digest, repeat=intent.repeat)
    # A key-less call still runs under a key the caller can send again later: its own.
    return intent.idempotency_key or "auto-" + kw.operation_id, call_key


def _checked(kw: SubmitCall) -> tuple[Tool, str]:
    """The intent's tool and arguments digest; EffectLedgerError when it is refused."""
    tool = kw.catalog.get(kw.intent.tool)
    _canonical, args_digest = validate_arguments(kw.intent.arguments)
    reject_nul(kw.intent.arguments)
    return tool, args_digest


class _New(NamedTuple):
    """A new operation's rows, and the caller's answer once they are committed."""

    op: OperationRow
    columns: dict[str, Any]
    entry: JournalRow
    command_row: dict[str, Any] | None  # its dispatch command (none while awaiting approval)
    command: OutboxItem | None  # the command, leased to this ledger (None: the relays')
    submitted: Submitted


def _new_operation(kw: SubmitCall, tool: Tool, args_digest: str, *, caller_key: str | None,
                   op_key: str, call_key: str | None) -> _New:
    intent, now = kw.intent, kw.now
    state = State.AWAITING_APPROVAL if tool.commit_policy == "approval" else State.PENDING
    op = OperationRow(
        id=kw.operation_id, tenant=intent.tenant, task_id=intent.task_id,
        caller_key=caller_key, operation_key=op_key, tool=tool.name,
        arguments=intent.arguments, arguments_digest=args_digest,
        tool_digest=tool.digest(), contract_revision=tool.contract_revision,
        effect_class=tool.effect_class.value, commit_policy=tool.commit_policy,
        state=state, epoch=1, created_at=now, updated_at=now, call_key=call_key)
    columns = op.as_dict()
    entry = journal_row(
        operation_id=kw.operation_id, at=now, kind=JournalKind.INTENT_ACCEPTED, actor=kw.actor,
        epoch=1, to_state=state.value,
        detail={"arguments_digest": args_digest, "tool_digest": op.tool_digest,
                "contract_revision": tool.contract_revision, "tenant": intent.tenant,
                "task_id": intent.task_id}, traceparent=kw.traceparent)
    command = row = None
    if state is State.PENDING:
        row = dispatch_row(op, subjects=kw.subjects, outbox_id=kw.outbox_id, now=now)
        # Every row has the same columns: a multi-row INSERT is compiled from its first
        # row, and would drop a later leased row's lease_until if the first had none.
        lease_until = row["lease_until"] = kw.lease_until
        row["traceparent"] = kw.traceparent
        if lease_until is not None:
            # Written as already leased, so no relay takes it while we publish it.
            row["status"] = OUTBOX_PUBLISHING
            command = OutboxItem(row["id"], row["subject"], row["payload"].encode(), 0,
                                 OutboxKind.DISPATCH.value, row["traceparent"])
    return _New(op, columns, entry, row, command,
                Submitted(columns, created=True, command=command))


# ---- a new intent alone: one statement -------------------------------------------------------
#
# An intent with a caller key read the key (lockless), then wrote its three rows (fused); one
# that joins identical calls read its call identity's holder instead: two round trips, each its
# own transaction. Alone in its transaction (an agent's call, one at a time; every MCP call is
# one that joins) it is one statement instead: the operation's INSERT with ON CONFLICT DO
# NOTHING, and the journal entry and the dispatch command inserted from the row it inserted.
# The conflict is any unique key: the operation key (a caller key already taken) or the call
# identity (a holder exists, which the call may join or take over). Either writes nothing, and
# the intent is decided as a batch of one, which reads the key or the holder as before. Only
# for an intent that goes straight to dispatch (not one awaiting approval).

def _bound(prefix: str, table: sa.Table, names: Sequence[str]) -> list[sa.BindParameter[Any]]:
    return [sa.bindparam(f"{prefix}{n}", type_=table.c[n].type) for n in names]


_OP_COLUMNS = OperationRow._fields
_ENTRY_COLUMNS = tuple(JournalRow.__annotations__)
_COMMAND_COLUMNS = ("id", "operation_id", "epoch", "kind", "subject", "payload", "status",
                    "created_at", "available_at", "publish_count", "lease_until", "traceparent")


def _new_alone() -> sa.Insert:
    new_op = (postgresql.insert(operations)
              .values(dict(zip(_OP_COLUMNS, _bound("op_", operations, _OP_COLUMNS),
                               strict=True)))
              .on_conflict_do_nothing()
              .returning(operations.c.id).cte("new_op"))
    inserted = sa.select(new_op.c.id).exists()
    entry = journal.insert().from_select(
        list(_ENTRY_COLUMNS),
        sa.select(*_bound("j_", journal, _ENTRY_COLUMNS)).where(inserted)).cte("new_entry")
    return (outbox.insert().from_select(
        list(_COMMAND_COLUMNS),
        sa.select(*_bound("o_", outbox, _COMMAND_COLUMNS)).where(inserted))
        .returning(outbox.c.id).add_cte(new_op, entry))


_NEW_ALONE = _new_alone()


async def _created_alone(conn: AsyncConnection, kw: SubmitCall) -> Submitted | None:
    """The intent created by one statement (see above); None: decide as a batch of one."""
    intent = kw.intent
    if (intent.idempotency_key is None and not intent.join_identical) or not hot.direct(conn):
        return None  # key-less and joining nothing: its batch path reads nothing, one statement
    try:
        tool, args_digest = _checked(kw)
    except EffectLedgerError:
        return None  # refused: the batch path says why
    if tool.commit_policy == "approval":
        return None
    given, call_key = _names(kw, tool, args_digest)
    op_key = derive_operation_key(tenant=intent.tenant, task_id=intent.task_id,
                                  caller_key=given, operation_id=kw.operation_id)
    new = _new_operation(kw, tool, args_digest, caller_key=given, op_key=op_key,
                         call_key=call_key)
    assert new.command_row is not None
    params = {**{f"op_{k}": v for k, v in new.columns.items()},
              **{f"j_{k}": v for k, v in new.entry.items()},
              **{f"o_{k}": new.command_row[k] for k in _COMMAND_COLUMNS}}
    # Published with the commit, not after it (docs/design.md, "A command published with its
    # commit"): the publisher sends it while this statement runs, and marks its row only once
    # `settle` says the statement wrote it.
    settle = (kw.early(new.command, (new.op.id, new.op.epoch))
              if kw.early is not None and new.command is not None else None)
    try:
        written = bool(await hot.fetch(conn, _NEW_ALONE, params, lockless=True, once=True))
    except BaseException:
        if settle is not None:
            settle(False)  # nothing to mark; had it committed, its lease hands it to the relay
        raise
    if settle is not None:
        crash_point("ledger.intent.after_early_publish")
        settle(written)
    metrics.child(metrics.DB_ALONE, "intent", "written" if written else "declined").inc()
    if not written:
        return None  # the key or the call identity is taken: read it
    note_transitions(conn, [new.entry])
    if new.command is None:
        await notify_outbox(conn)  # left to the relays
    return dataclasses.replace(new.submitted, published=settle is not None)


@dataclass(frozen=True, slots=True)
class SubmitCall(BatchCall[Submitted]):
    """One intent, as group commit batches it."""

    urgent: ClassVar[bool] = True  # an agent holds its request open until this commits

    catalog: Catalog
    intent: SubmitIntent
    subjects: Subjects
    operation_id: str
    outbox_id: str
    now: datetime
    actor: str = "agent"
    # When set, the dispatch command is written already leased to this ledger until then.
    lease_until: datetime | None = None
    # The request's W3C trace context, kept in the dispatch command's outbox row.
    traceparent: str | None = None
    # Hands a new operation's command to the direct publisher before the one statement that
    # writes it is sent (an intent alone only); returns what to call with whether it wrote.
    early: Callable[[OutboxItem, tuple[str, int]], Callable[[bool], None]] | None = None

    @classmethod
    async def many(cls, conn: AsyncConnection, calls: Sequence[SubmitCall]
                   ) -> Sequence[Submitted | Exception]:
        return await _submit(conn, calls)

    async def alone(self, conn: AsyncConnection) -> Submitted | None:
        """A new operation created by one statement (see `_created_alone`)."""
        return await _created_alone(conn, self)


async def submit_intent_txn(conn: AsyncConnection, *, catalog: Catalog, intent: SubmitIntent,
                            subjects: Subjects, operation_id: str, outbox_id: str,
                            now: datetime, actor: str = "agent",
                            lease_until: datetime | None = None,
                            traceparent: str | None = None) -> Submitted:
    return await SubmitCall(catalog, intent, subjects, operation_id, outbox_id, now, actor,
                            lease_until, traceparent).one(conn)
