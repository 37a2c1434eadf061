"""Typed rows passed between the transaction functions.

An operation read from the database travels as `OperationRow`, not as a dict keyed by column
names: a misspelt column is a type error, and the state is a `State`, not a string. The HTTP API
keeps its JSON shape: `as_dict()` gives exactly the column mapping the API always returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NamedTuple, TypedDict

from effectledger_core.states import State


class OperationRow(NamedTuple):
    """One row of `operations`.

    A NamedTuple (immutable, typed) rather than a frozen dataclass: every intent builds one,
    and a frozen dataclass of twenty fields costs about 3 us to construct, a NamedTuple 0.6.
    """

    id: str
    tenant: str
    task_id: str | None
    caller_key: str | None
    operation_key: str
    tool: str
    arguments: dict[str, Any]
    arguments_digest: str
    tool_digest: str
    contract_revision: str
    effect_class: str
    commit_policy: str
    state: State
    epoch: int
    created_at: datetime
    updated_at: datetime
    provider_ref: str | None = None
    response_digest: str | None = None
    last_outcome: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    call_key: str | None = None  # the call identity it holds (identical.py), if any

    @classmethod
    def of(cls, row: Mapping[Any, Any]) -> OperationRow:
        """From a result mapping (or a dict of column values)."""
        values: dict[str, Any] = {f: row.get(f) for f in cls._fields}
        values["state"] = State(row["state"])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The column mapping, states as their stored names (the API's JSON shape)."""
        out = self._asdict()
        out["state"] = self.state.value
        return out

    def but(self, **changes: Any) -> OperationRow:
        """A copy with `changes` (column values) applied."""
        return self._replace(**changes)


class JournalRow(TypedDict):
    """One row of `journal` as inserted (the id is the database's)."""

    operation_id: str | None
    at: datetime
    kind: str
    actor: str
    epoch: int | None
    from_state: str | None
    to_state: str | None
    detail: dict[str, Any]


class DuplicateFound(NamedTuple):
    """A duplicate a transaction recorded, to be announced after its commit."""

    operation_id: str
    tool: str
    matches: int


@dataclass(frozen=True)
class Recorded:
    """What became of an outcome, verdict or webhook."""

    status: Literal["applied", "duplicate", "rejected", "kept"]
    to_state: str | None = None
    reason: str | None = None
    # A duplicate to announce after the commit: a note for the caller, not part of what
    # became of the message (so not compared or shown).
    duplicate: DuplicateFound | None = field(default=None, repr=False, compare=False)
    # The operation's view as the change left it, as rows of its read (`reads.view_of`), when
    # the transaction returned them (a success alone, one statement): a waiter it wakes
    # answers with it instead of reading it. Rows, not the view: nobody may be waiting.
    view_rows: Sequence[Mapping[str, Any]] | None = field(default=None, repr=False,
                                                          compare=False)
