"""The transition applier's table and its claim to be the only writer of `operations.state`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from effectledger_core.states import (
    UNRESOLVED,
    Event,
    JournalKind,
    State,
    sources,
    transition,
)
from effectledger_ledger.db import transitions
from effectledger_ledger.db.transitions import CAUSES, Effect

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [ROOT / "services", ROOT / "shared"]
APPLIER = ROOT / "services/ledger/effectledger_ledger/db/transitions.py"


def test_every_event_says_what_it_causes() -> None:
    assert set(CAUSES) == set(Event)


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_all_sources_of_an_event_lead_to_the_same_step(event: Event) -> None:
    """The applier keys effects and statements by event; that is sound only if the step does
    not depend on which allowed state the operation was in."""
    steps = {transition(s, event) for s in sources(event)}
    assert len(steps) == 1, steps


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_effects_follow_the_target_state(event: Event) -> None:
    """A dispatch command exactly when the operation becomes pending, a reconcile command
    exactly when it becomes unresolved, obsolete commands exactly when it is cancelled."""
    step = transition(min(sources(event)), event)
    effects = CAUSES[event].effects
    assert (Effect.DISPATCH in effects) == (step.to is State.PENDING)
    assert (Effect.RECONCILE in effects) == (step.to in UNRESOLVED)
    assert (Effect.OBSOLETE_COMMANDS in effects) == (step.to is State.CANCELLED)
    assert (Effect.CONSUME_DISPATCH in effects) == (event is Event.CLAIM)


def test_verdicts_are_journaled_as_what_they_say() -> None:
    kinds = {e: CAUSES[e].kind for e in Event if e.value.startswith("verdict_")}
    assert kinds == {
        Event.VERDICT_APPLIED: JournalKind.VERDICT_APPLIED,
        Event.VERDICT_NOT_APPLIED_RETRY: JournalKind.VERDICT_NOT_APPLIED,
        Event.VERDICT_NOT_APPLIED_FINAL: JournalKind.VERDICT_NOT_APPLIED,
        Event.VERDICT_UNDECIDABLE: JournalKind.VERDICT_UNDECIDABLE,
    }


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_the_guard_is_built_from_the_table(event: Event) -> None:
    """The UPDATE allows exactly `sources(event)` and writes the table's target state."""
    sql = str(transitions._statement(event, ()).compile())
    allowed = set(re.findall(r"'(\w+)'", sql.split("WHERE", 1)[1]))
    assert allowed == {s.value for s in sources(event)}
    step = transition(min(sources(event)), event)
    assert ("epoch=(operations.epoch + :epoch_1)" in sql) == step.new_epoch


def _writes_operations(tree: ast.AST) -> list[int]:
    """Lines that build an UPDATE of the operations table (Core or text SQL)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            # operations.update()
            if (isinstance(f, ast.Attribute) and f.attr == "update"
                    and isinstance(f.value, ast.Name) and f.value.id == "operations"):
                lines.append(node.lineno)
            # sa.update(operations) / update(operations)
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if (name == "update" and node.args and isinstance(node.args[0], ast.Name)
                    and node.args[0].id == "operations"):
                lines.append(node.lineno)
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and re.search(r"\bupdate\s+operations\b", node.value, re.IGNORECASE)):
            lines.append(node.lineno)
    return lines


def test_only_the_applier_writes_operation_state() -> None:
    """grep-like, over the product's source: no module but db/transitions.py updates the
    operations table (intents insert new operations in their first state; that is no change
    of state)."""
    offenders = {}
    for root in PRODUCT:
        for path in root.rglob("*.py"):
            if path == APPLIER or "migrations" in path.parts:
                continue
            lines = _writes_operations(ast.parse(path.read_text(), str(path)))
            if lines:
                offenders[str(path.relative_to(ROOT))] = lines
    assert offenders == {}
    assert _writes_operations(ast.parse(APPLIER.read_text())), "the scan finds the applier"


def test_the_scan_finds_a_hand_written_state_update() -> None:
    """The scan above cannot pass vacuously: each way of writing the UPDATE is found."""
    for source in ("operations.update().values(state='failed')",
                   "sa.update(operations).values(state='failed')",
                   "conn.execute(text('UPDATE operations SET state = :s'))"):
        assert _writes_operations(ast.parse(source)), source
