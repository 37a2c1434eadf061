"""The transition applier: the only writer of `operations.state`.

Every state change of an operation goes through here, either one at a time (`apply`, which
checks the guard's row count) or set-based (`Batch`, one statement per kind of change for a
whole group-committed batch, under row locks its caller holds). Both:

- decide the next state with `transition()` of the core table, so an illegal change raises;
- guard the UPDATE with the epoch and the state the decision was made on, and with
  `state IN sources(event)`, so the database enforces the same table a second time;
- write what the transition causes, read from one table, `CAUSES`: the journal entry and the
  outbox effects (a dispatch command for the epoch the operation is now at, a reconcile command
  when it becomes unresolved, answered commands marked consumed, a cancelled operation's
  commands marked obsolete).

What a transition causes depends only on its event: for every event all source states lead to
the same step (tests/unit/test_transitions.py checks this), so the table is keyed by event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.messages import ReconcileOperation
from effectledger_core.states import (
    OUTBOX_LIVE,
    UNRESOLVED,
    Event,
    JournalKind,
    OutboxKind,
    OutboxStatus,
    State,
    Step,
    sources,
    transition,
)
from effectledger_core.subjects import Subjects
from effectledger_obs import metrics

from . import hot
from .common import (
    execute_rows,
    insert_journal,
    journal_row,
    note_transitions,
    notify_outbox,
    on_the_row,
)
from .outbox import dispatch_row
from .rows import JournalRow, OperationRow, Recorded
from .schema import attempts, journal, operations, outbox

K = JournalKind


class Effect(StrEnum):
    """An outbox write a transition causes, besides the state change and its journal entry."""

    DISPATCH = "dispatch"  # a dispatch command for the epoch the operation is now at
    RECONCILE = "reconcile"  # a reconcile command, unless stored evidence settles it at once
    CONSUME_DISPATCH = "consume_dispatch"  # the claim answers this epoch's dispatch command
    CONSUME_RECONCILE = "consume_reconcile"  # a verdict answers this epoch's reconcile command
    OBSOLETE_COMMANDS = "obsolete_commands"  # cancelled: none of its commands is wanted


@dataclass(frozen=True, slots=True)
class Causes:
    kind: JournalKind
    effects: frozenset[Effect] = frozenset()
    # An operator's action that opens an epoch is journaled under the epoch it opens; evidence
    # (outcomes, verdicts) under the epoch it is about.
    journal_new_epoch: bool = False


def _c(kind: JournalKind, *effects: Effect, journal_new_epoch: bool = False) -> Causes:
    return Causes(kind, frozenset(effects), journal_new_epoch)


D, R, CD, CR, OB = (Effect.DISPATCH, Effect.RECONCILE, Effect.CONSUME_DISPATCH,
                    Effect.CONSUME_RECONCILE, Effect.OBSOLETE_COMMANDS)
E = Event

CAUSES: dict[Event, Causes] = {
    E.CLAIM: _c(K.ATTEMPT_CLAIMED, CD),
    E.REQUIRE_APPROVAL: _c(K.APPROVAL_REQUIRED),
    E.APPROVE: _c(K.APPROVED, D),
    E.REJECT: _c(K.APPROVAL_REJECTED, OB),
    E.CANCEL: _c(K.CANCELLED, OB),
    E.OUTCOME_SUCCEEDED: _c(K.OUTCOME_RECORDED),
    E.OUTCOME_FAILED: _c(K.OUTCOME_RECORDED),
    E.OUTCOME_RETRY: _c(K.OUTCOME_RECORDED, D),
    E.OUTCOME_AMBIGUOUS: _c(K.OUTCOME_RECORDED, R),
    E.OUTCOME_ACCEPTED: _c(K.OUTCOME_RECORDED, R),
    # A verdict is journaled as what it says: "not applied" is never journaled as applied.
    E.VERDICT_APPLIED: _c(K.VERDICT_APPLIED, CR),
    E.VERDICT_NOT_APPLIED_RETRY: _c(K.VERDICT_NOT_APPLIED, CR, D),
    E.VERDICT_NOT_APPLIED_FINAL: _c(K.VERDICT_NOT_APPLIED, CR),
    E.VERDICT_UNDECIDABLE: _c(K.VERDICT_UNDECIDABLE, CR),
    E.REVIEW_COMPLETED: _c(K.REVIEW_RECORDED),
    E.REVIEW_NOT_EXECUTED_RETRY: _c(K.REVIEW_RECORDED, D, journal_new_epoch=True),
    E.REVIEW_NOT_EXECUTED_FINAL: _c(K.REVIEW_RECORDED),
    E.REVIEW_UNCERTAIN: _c(K.REVIEW_RECORDED),
    E.PLAN_ADMITTED: _c(K.RETRY_ADMITTED, D, journal_new_epoch=True),
}

# Settles an operation that just became unresolved from evidence stored earlier (a webhook that
# arrived before the outcome); None when nothing does. Injected by resolution.py, which applies
# such evidence through this module in turn.
Settle = Callable[[AsyncConnection, OperationRow], Awaitable[Recorded | None]]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Inputs of the DISPATCH effect."""

    outbox_id: str
    subjects: Subjects
    available_at: datetime | None = None  # a retry's backoff; now when None


@dataclass(frozen=True, slots=True)
class Reconcile:
    """Inputs of the RECONCILE effect."""

    outbox_id: str
    subjects: Subjects
    attempt_id: str
    cause: str  # ambiguous | accepted
    reason: str
    settle: Settle | None = None


class Change(NamedTuple):
    """One state change, decided on `from_state` at `epoch` of the operation.

    A NamedTuple rather than a frozen dataclass: one is built per claim and per outcome, and
    a frozen dataclass's constructor cost several microseconds of the hot path's budget.
    """

    operation_id: str
    epoch: int
    from_state: State
    event: Event
    at: datetime
    actor: str
    detail: dict[str, Any]
    # Other columns written with the state (last_outcome, evidence, provider_ref, ...).
    values: Mapping[str, Any] = MappingProxyType({})
    # The full row, needed by the DISPATCH and RECONCILE effects (their commands carry it).
    row: OperationRow | None = None
    dispatch: Dispatch | None = None
    reconcile: Reconcile | None = None
    # Overrides the table's journal kind where one event has a more exact name at one site
    # (the sweeper's "outcome presumed lost" is an OUTCOME_AMBIGUOUS nobody reported).
    kind: JournalKind | None = None
    # The W3C context of the request or message that caused the change: its trace and span
    # ids go into the journal entry (common.journal_row).
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    step: Step
    row: OperationRow | None  # the operation after the change, when the change carried it
    settled: Recorded | None = None  # stored evidence resolved it at once (RECONCILE)


class TransitionError(RuntimeError):
    """A change that lacks the inputs its effects need: a programming error, never input."""


_COMMANDS = frozenset(e for e, c in CAUSES.items()
                      if c.effects & {Effect.DISPATCH, Effect.RECONCILE})


def writes_commands(event: Event) -> bool:
    """Whether `event` writes outbox commands (then it goes through `apply`, not `Batch`)."""
    return event in _COMMANDS


def _check(change: Change) -> tuple[Step, Causes]:
    step = transition(change.from_state, change.event)  # IllegalTransition when not allowed
    causes = CAUSES[change.event]
    if Effect.DISPATCH in causes.effects and (change.dispatch is None or change.row is None):
        raise TransitionError(f"{change.event.value} needs the row and a dispatch outbox id")
    if Effect.RECONCILE in causes.effects and (change.reconcile is None or change.row is None):
        raise TransitionError(f"{change.event.value} needs the row and a reconcile command")
    return step, causes


# One statement per (event, other columns), built once: statement construction and cache-key
# computation were a visible share of the ledger's CPU on the hot path.
_STATEMENTS: dict[tuple[Event, tuple[str, ...]], sa.Update] = {}


def _statement(event: Event, columns: tuple[str, ...]) -> sa.Update:
    stmt = _STATEMENTS.get((event, columns))
    if stmt is None:
        step = _STEP[event]
        # The allowed sources are rendered into the SQL (they are enum names, not input), so
        # the statement also runs with executemany, which expanding IN parameters cannot.
        allowed: list[sa.ColumnElement[Any]] = [
            sa.literal_column(f"'{s.value}'") for s in sorted(sources(event))]
        values: dict[str, Any] = {"state": step.to.value, "updated_at": sa.bindparam("b_now")}
        if step.new_epoch:
            values["epoch"] = operations.c.epoch + 1
        values.update({c: sa.bindparam(f"b_{c}") for c in columns})
        stmt = (operations.update()
                .where(operations.c.id == sa.bindparam("b_id"),
                       operations.c.epoch == sa.bindparam("b_epoch"),
                       on_the_row(operations.c.state == sa.bindparam("b_from"),
                                  operations.c.state.in_(allowed)))
                .values(**values))
        _STATEMENTS[(event, columns)] = stmt
    return stmt


def _first_step(event: Event) -> Step:
    return transition(min(sources(event)), event)


_STEP: dict[Event, Step] = {e: _first_step(e) for e in Event}


_NAME = {s: s.value for s in State}  # faster than the enum's `.value` descriptor


def _params(change: Change) -> dict[str, Any]:
    params = {"b_id": change.operation_id, "b_epoch": change.epoch,
              "b_from": _NAME[change.from_state], "b_now": change.at}
    params.update({f"b_{c}": v for c, v in change.values.items()})
    return params


def _entry(change: Change, step: Step, causes: Causes) -> JournalRow:
    epoch = change.epoch + 1 if step.new_epoch and causes.journal_new_epoch else change.epoch
    return journal_row(operation_id=change.operation_id, at=change.at,
                       kind=change.kind or causes.kind, actor=change.actor, epoch=epoch,
                       from_state=change.from_state, to_state=step.to, detail=change.detail,
                       traceparent=change.traceparent)


def _after(change: Change, step: Step) -> OperationRow | None:
    if change.row is None:
        return None
    epoch = change.epoch + 1 if step.new_epoch else change.epoch
    return change.row.but(state=step.to, epoch=epoch, updated_at=change.at, **change.values)


async def apply(conn: AsyncConnection, change: Change) -> Applied | None:
    """Apply one change with its effects; None (nothing written) when the guard did not hold."""
    step, causes = _check(change)
    updated = await conn.execute(_statement(change.event, tuple(sorted(change.values))),
                                 _params(change))
    if updated.rowcount != 1:
        return None
    await insert_journal(conn, [_entry(change, step, causes)])
    row = _after(change, step)
    await _simple_effects(conn, [(change, causes)])
    settled = None
    if Effect.DISPATCH in causes.effects:
        assert row is not None and change.dispatch is not None
        await _dispatch(conn, row, change.dispatch, change.at)
    if Effect.RECONCILE in causes.effects:
        assert row is not None and change.reconcile is not None
        settled = await _reconcile(conn, row, change.reconcile, change.at)
    return Applied(step, row, settled)


class Batch:
    """Changes decided by one set-based transaction under its row locks, written together.

    `add` checks a change against the table and queues it; `journal` collects the entries in
    decision order, so a caller interleaves its own (rejections) with the transitions'. `write`
    then sends one statement per kind of change. The guards repeat the caller's decisions in
    SQL; under the caller's row locks they cannot fail, so row counts are not read back (the
    driver's executemany does not report them per row). Changes with DISPATCH or RECONCILE
    effects write more than the operation and go through `apply` instead.
    """

    def __init__(self) -> None:
        self.journal: list[JournalRow] = []
        self._updates: dict[tuple[Event, tuple[str, ...]], list[dict[str, Any]]] = {}
        self._effects: list[tuple[Change, Causes]] = []

    def add(self, change: Change) -> Step:
        step, causes = _check(change)
        if writes_commands(change.event):
            raise TransitionError(f"{change.event.value} writes commands: use apply()")
        key = (change.event, tuple(sorted(change.values)))
        self._updates.setdefault(key, []).append(_params(change))
        self.journal.append(_entry(change, step, causes))
        if causes.effects:
            self._effects.append((change, causes))
        return step

    def note(self, entry: JournalRow) -> None:
        """Journal an entry of the caller's (a refusal, a decision) in its place."""
        self.journal.append(entry)

    async def write(self, conn: AsyncConnection) -> None:
        for (event, columns), rows in self._updates.items():
            await execute_rows(conn, _statement(event, columns), rows, row_key=("b_id",))
        await _simple_effects(conn, self._effects)
        await insert_journal(conn, self.journal)
        self._updates, self._effects, self.journal = {}, [], []


async def apply_many(conn: AsyncConnection, changes: Sequence[Change]) -> list[Step]:
    """Set-based form of `apply` for changes without command effects (see `Batch`)."""
    batch = Batch()
    steps = [batch.add(c) for c in changes]
    await batch.write(conn)
    return steps


# ---- one change alone, in one statement -----------------------------------------------------
#
# A call alone in its transaction (one at a time: an agent's call, the idle path) paid four
# round trips for a claim: BEGIN, the locking read, the fused writes, COMMIT. When the
# caller can state its whole decision as a condition on the operation's row (`guard`), the
# change, its journal entry, its simple effects and the caller's own row are one statement
# instead: a data-modifying CTE that moves the operation only where the guard and the
# table's own guard hold, and writes everything else from the row it moved. First in its
# transaction it is a transaction of its own (no BEGIN, no COMMIT: one round trip). Where
# the guard does not hold nothing is written, and the caller decides under its row locks as
# before; the statement never decides anything the locked path would not.

# What a caller adds to the statement: its own writes (as CTEs) and the statement's last part,
# whose rows the statement returns (none when nothing was written).
Then = tuple[Sequence[sa.CTE], sa.Select[Any] | sa.UpdateBase]


def alone_statement(event: Event, *, guard: Sequence[sa.ColumnElement[bool]],
                    then: Callable[[sa.CTE], Then],
                    columns: tuple[str, ...] = ()) -> sa.Select[Any] | sa.UpdateBase:
    """`event`'s change of one operation as one statement, written only where `guard` holds.

    `then(moved)`: the caller's own writes, each conditioned on `moved` (the moved
    operation's row, every column as the change left it), and the statement's last part: a
    RETURNING write or a SELECT, whose rows the statement returns, none when nothing was
    written. `columns`: the other columns the change writes (its `values`). Parameters:
    `_params`' (`b_*`), the journal entry's (`j_*`), the guard's and the caller's. Built
    once per caller.
    """
    causes = CAUSES[event]
    if writes_commands(event) or causes.effects - {Effect.CONSUME_DISPATCH}:
        raise TransitionError(f"{event.value} writes more than one statement may")
    moved = (_statement(event, tuple(sorted(columns))).where(*guard)
             .returning(*operations.c).cte("moved"))
    entry = (journal.insert().from_select(
        ["operation_id", *_JOURNAL_PARAMS],
        sa.select(moved.c.id, *(sa.bindparam(f"j_{c}", type_=journal.c[c].type)
                               for c in _JOURNAL_PARAMS)))
        .cte("entry"))
    ctes = [moved, entry]
    if Effect.CONSUME_DISPATCH in causes.effects:
        ctes.append(_CONSUME_DISPATCH.where(sa.select(moved.c.id).exists()).cte("consumed"))
    writes, last = then(moved)
    return last.add_cte(*ctes, *writes)


_JOURNAL_PARAMS = ("at", "kind", "actor", "epoch", "from_state", "to_state", "detail")


async def apply_alone(conn: AsyncConnection, change: Change,
                      stmt: sa.Select[Any] | sa.UpdateBase, params: Mapping[str, Any]
                      ) -> tuple[Step, Sequence[Mapping[str, Any]]] | None:
    """Apply `change` with `stmt` (built by `alone_statement` for its event) and the caller's
    `params`: the step and the statement's rows; None when nothing was written: the guard
    did not hold, a unique key stopped it (first in its transaction), or the store has no
    such statement (SQLite, which has no data-modifying CTEs), and the caller decides under
    its locks instead."""
    if not hot.direct(conn):
        return None
    step, causes = _check(change)
    entry = _entry(change, step, causes)
    values = {**_params(change), **{f"j_{c}": entry[c] for c in _JOURNAL_PARAMS},  # type: ignore[literal-required]
              **params}
    first = hot.nothing_sent(conn)
    try:
        rows = await hot.fetch(conn, stmt, values, lockless=True, once=True)
    except IntegrityError:
        if not first:
            raise  # inside a transaction: it is aborted, and the batch is replayed
        # A row committed between the statement's snapshot and its INSERT (an attempt, an
        # inbox row: the unique key held); as its own transaction it left nothing behind.
        rows = []
    metrics.child(metrics.DB_ALONE, _ALONE_NAME.get(change.event, change.event.value),
                  "written" if rows else "declined").inc()
    if not rows:
        return None
    note_transitions(conn, [entry])
    return step, rows


_ALONE_NAME = {Event.CLAIM: "claim", Event.OUTCOME_SUCCEEDED: "outcome"}


# ---- the effects ----------------------------------------------------------------------------

# Not a change of state: a newer identical operation takes the call identity over
# (db/intents.py) and the older one lets go of it. Here because this module is the only one
# that updates `operations` (tests/unit/test_transitions.py).
RELEASE_CALL_IDENTITY = operations.update().where(
    operations.c.id == sa.bindparam("holder_id"),
    operations.c.call_key == sa.bindparam("held")).values(call_key=None)
_INSERT_OUTBOX = outbox.insert()


_LIVE = sorted(s.value for s in OUTBOX_LIVE)


async def _simple_effects(conn: AsyncConnection, items: Sequence[tuple[Change, Causes]]
                          ) -> None:
    consume: list[dict[str, Any]] = []
    for change, causes in items:
        if Effect.CONSUME_DISPATCH in causes.effects:
            consume.append({"b_id": change.operation_id, "b_epoch": change.epoch})
        if Effect.CONSUME_RECONCILE in causes.effects:
            # Whatever its status, as a claim consumes its dispatch command: a webhook can
            # settle the operation while the command's publish is still in flight, and a row
            # marked published after that had nothing left to answer it but the sweeper's
            # reconcile horizon (15 minutes by default). The relay's mark only moves rows
            # still `publishing`, so it leaves this one alone; a copy already out is answered
            # by the epoch fence in the reconciler, as before.
            await conn.execute(outbox.update().where(
                outbox.c.operation_id == change.operation_id, outbox.c.epoch == change.epoch,
                outbox.c.kind == OutboxKind.RECONCILE.value,
                on_the_row(outbox.c.status.in_(_LIVE)))
                .values(status=OutboxStatus.CONSUMED.value))
        if Effect.OBSOLETE_COMMANDS in causes.effects:
            await conn.execute(outbox.update().where(
                outbox.c.operation_id == change.operation_id,
                on_the_row(outbox.c.status.in_(_LIVE)))
                .values(status=OutboxStatus.OBSOLETE.value))
    await execute_rows(conn, _CONSUME_DISPATCH, consume, row_key=("b_id", "b_epoch"))


# A claim consumes its epoch's dispatch command whatever its status (the relay may not even
# have marked it published yet: the dispatcher can be faster than the publish-ack).
_CONSUME_DISPATCH = (outbox.update()
                     .where(outbox.c.operation_id == sa.bindparam("b_id"),
                            outbox.c.epoch == sa.bindparam("b_epoch"),
                            outbox.c.kind == OutboxKind.DISPATCH.value)
                     .values(status=OutboxStatus.CONSUMED.value))


async def _dispatch(conn: AsyncConnection, row: OperationRow, d: Dispatch, now: datetime
                    ) -> None:
    command = dispatch_row(row, subjects=d.subjects, outbox_id=d.outbox_id, now=now)
    if d.available_at is not None:
        command["available_at"] = d.available_at  # the relay publishes it once it is due
    await conn.execute(_INSERT_OUTBOX, command)
    await notify_outbox(conn)


async def _reconcile(conn: AsyncConnection, row: OperationRow, r: Reconcile, now: datetime
                     ) -> Recorded | None:
    """Queue a ReconcileOperation: ambiguity never goes back to dispatch."""
    if r.settle is not None:
        settled = await r.settle(conn, row)
        if settled is not None:
            return settled
    claimed_at = (await conn.execute(
        sa.select(attempts.c.claimed_at).where(attempts.c.id == r.attempt_id))).scalar() or now
    cmd = ReconcileOperation(
        operation_id=row.id, epoch=row.epoch, attempt_id=r.attempt_id,
        operation_key=row.operation_key, tool=row.tool, arguments=row.arguments,
        cause=r.cause, reason=r.reason[:1000], claimed_at=claimed_at, noticed_at=now,
        provider_ref=row.provider_ref)
    await conn.execute(_INSERT_OUTBOX, dict(
        id=r.outbox_id, operation_id=row.id, epoch=row.epoch, kind=OutboxKind.RECONCILE.value,
        subject=r.subjects.ambiguous, payload=cmd.model_dump_json(),
        status=OutboxStatus.PENDING.value, created_at=now, available_at=now, publish_count=0))
    await notify_outbox(conn)
    return None


assert set(CAUSES) == set(Event), "every event says what it causes"
assert all(step.to in UNRESOLVED for e, step in _STEP.items()
           if Effect.RECONCILE in CAUSES[e].effects)


async def annotate(conn: AsyncConnection, operation_id: str, *, state: State,
                   evidence: dict[str, Any], at: datetime) -> bool:
    """Replace the evidence of an operation that is (and stays) in `state`; no transition.

    The one write here that changes no state: a finding about an operation at rest (the
    duplicate audit's mark on a succeeded operation, an operator closing it). The state is the
    guard, never the target. False if the operation is no longer in `state`.
    """
    updated = await conn.execute(
        operations.update().where(operations.c.id == operation_id,
                                  on_the_row(operations.c.state == state.value))
        .values(evidence=evidence, updated_at=at))
    return bool(updated.rowcount == 1)
