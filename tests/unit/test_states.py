"""The operation state machine: the table, exhaustively, and properties."""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from effectledger_core.states import (
    ACTIVE,
    AT_REST,
    OUTBOX_LIVE,
    TABLE,
    TERMINAL,
    UNDECIDED,
    UNRESOLVED,
    Event,
    IllegalTransition,
    OutboxStatus,
    State,
    Step,
    sources,
    transition,
)

S, E = State, Event
ALL_PAIRS = list(itertools.product(State, Event))

# The design's table, written out independently of the module, so an edit to either shows up.
EXPECTED: dict[tuple[State, Event], Step] = {
    (S.PENDING, E.CLAIM): Step(S.IN_FLIGHT),
    (S.PENDING, E.REQUIRE_APPROVAL): Step(S.AWAITING_APPROVAL),
    (S.PENDING, E.CANCEL): Step(S.CANCELLED),
    (S.AWAITING_APPROVAL, E.APPROVE): Step(S.PENDING),
    (S.AWAITING_APPROVAL, E.REJECT): Step(S.CANCELLED),
    (S.AWAITING_APPROVAL, E.CANCEL): Step(S.CANCELLED),
    (S.IN_FLIGHT, E.OUTCOME_SUCCEEDED): Step(S.SUCCEEDED),
    (S.IN_FLIGHT, E.OUTCOME_FAILED): Step(S.FAILED),
    (S.IN_FLIGHT, E.OUTCOME_RETRY): Step(S.PENDING, new_epoch=True),
    (S.IN_FLIGHT, E.OUTCOME_AMBIGUOUS): Step(S.AMBIGUOUS),
    (S.IN_FLIGHT, E.OUTCOME_ACCEPTED): Step(S.AWAITING_CONFIRMATION),
    (S.AMBIGUOUS, E.OUTCOME_SUCCEEDED): Step(S.SUCCEEDED),
    (S.AMBIGUOUS, E.VERDICT_APPLIED): Step(S.SUCCEEDED),
    (S.AMBIGUOUS, E.VERDICT_NOT_APPLIED_RETRY): Step(S.PENDING, new_epoch=True),
    (S.AMBIGUOUS, E.VERDICT_NOT_APPLIED_FINAL): Step(S.FAILED),
    (S.AMBIGUOUS, E.VERDICT_UNDECIDABLE): Step(S.NEEDS_REVIEW),
    (S.AWAITING_CONFIRMATION, E.VERDICT_APPLIED): Step(S.SUCCEEDED),
    (S.AWAITING_CONFIRMATION, E.VERDICT_NOT_APPLIED_RETRY): Step(S.PENDING, new_epoch=True),
    (S.AWAITING_CONFIRMATION, E.VERDICT_NOT_APPLIED_FINAL): Step(S.FAILED),
    (S.AWAITING_CONFIRMATION, E.VERDICT_UNDECIDABLE): Step(S.NEEDS_REVIEW),
    (S.NEEDS_REVIEW, E.REVIEW_COMPLETED): Step(S.SUCCEEDED),
    (S.NEEDS_REVIEW, E.REVIEW_NOT_EXECUTED_RETRY): Step(S.PENDING, new_epoch=True),
    (S.NEEDS_REVIEW, E.REVIEW_NOT_EXECUTED_FINAL): Step(S.FAILED),
    (S.NEEDS_REVIEW, E.REVIEW_UNCERTAIN): Step(S.NEEDS_REVIEW),
    # An operator's admitted single-use retry plan.
    (S.AMBIGUOUS, E.PLAN_ADMITTED): Step(S.PENDING, new_epoch=True),
    (S.NEEDS_REVIEW, E.PLAN_ADMITTED): Step(S.PENDING, new_epoch=True),
    (S.FAILED, E.PLAN_ADMITTED): Step(S.PENDING, new_epoch=True),
}
RETRY_EVENTS = {E.OUTCOME_RETRY, E.VERDICT_NOT_APPLIED_RETRY, E.REVIEW_NOT_EXECUTED_RETRY,
                E.PLAN_ADMITTED}
# Events that come from automation (dispatcher, reconciler, policy), not an operator's plan.
AUTOMATIC_EVENTS = [e for e in Event if e is not E.PLAN_ADMITTED]
# Final even for operators: nothing ever leaves these.
SEALED = frozenset({S.SUCCEEDED, S.CANCELLED})


def test_table_is_exactly_the_designed_table() -> None:
    """The module's table has precisely the designed entries, no more and no fewer."""
    assert TABLE == EXPECTED


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS, ids=lambda v: v.value)
def test_every_pair_is_either_the_tables_step_or_illegal(state: State, event: Event) -> None:
    """Allowed pairs return the designed step; every other pair raises IllegalTransition."""
    if (state, event) in EXPECTED:
        assert transition(state, event) == EXPECTED[(state, event)]
    else:
        with pytest.raises(IllegalTransition) as info:
            transition(state, event)
        assert info.value.state is state and info.value.event is event
        assert state.value in str(info.value) and event.value in str(info.value)


@pytest.mark.parametrize("state", sorted(SEALED), ids=lambda s: s.value)
def test_succeeded_and_cancelled_accept_no_event(state: State) -> None:
    """succeeded and cancelled are final for everyone: every event is illegal there."""
    for event in Event:
        with pytest.raises(IllegalTransition):
            transition(state, event)


@pytest.mark.parametrize("state", sorted(TERMINAL), ids=lambda s: s.value)
def test_terminal_states_accept_no_automatic_event(state: State) -> None:
    """No dispatcher, reconciler or policy event moves a terminal state."""
    for event in AUTOMATIC_EVENTS:
        with pytest.raises(IllegalTransition):
            transition(state, event)


def test_failed_reopens_only_through_an_admitted_plan_with_a_new_epoch() -> None:
    """The one way out of failed is an operator's admitted plan, as a new dispatch decision."""
    leaving = {e: step for (s, e), step in TABLE.items() if s is S.FAILED}
    assert leaving == {E.PLAN_ADMITTED: Step(S.PENDING, new_epoch=True)}


def test_terminal_and_at_rest_sets() -> None:
    """TERMINAL is exactly succeeded/failed/cancelled; AT_REST adds only needs_review."""
    assert {S.SUCCEEDED, S.FAILED, S.CANCELLED} == TERMINAL
    assert AT_REST == TERMINAL | {S.NEEDS_REVIEW}


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_sources_is_the_set_of_states_with_a_table_entry(event: Event) -> None:
    """sources(event), the guarded UPDATE's `state IN (...)`, matches the table exactly."""
    expected = {s for s in State if (s, event) in EXPECTED}
    assert sources(event) == expected
    assert expected, f"event {event.value} is never allowed anywhere"


def test_every_state_is_reachable_from_pending() -> None:
    """A breadth-first search over the table from pending visits every state."""
    seen, queue = {S.PENDING}, deque([S.PENDING])
    while queue:
        cur = queue.popleft()
        for (frm, _event), step in TABLE.items():
            if frm is cur and step.to not in seen:
                seen.add(step.to)
                queue.append(step.to)
    assert seen == set(State)


def test_every_non_terminal_state_can_reach_a_terminal_state() -> None:
    """No active state is a trap: each has a path to some terminal state."""
    for start in set(State) - TERMINAL:
        seen, queue = {start}, deque([start])
        while queue:
            cur = queue.popleft()
            for (frm, _e), step in TABLE.items():
                if frm is cur and step.to not in seen:
                    seen.add(step.to)
                    queue.append(step.to)
        assert seen & TERMINAL, start


def test_new_epoch_only_on_retry_like_events_and_always_back_to_pending() -> None:
    """Only the retry events open a new dispatch decision, and they all lead to pending."""
    for (state, event), step in TABLE.items():
        assert step.new_epoch == (event in RETRY_EVENTS), (state, event)
        if step.new_epoch:
            assert step.to is S.PENDING


def test_ambiguous_never_goes_straight_back_to_dispatch() -> None:
    """Ambiguity firewall: nothing takes ambiguous to in_flight, or to pending without epoch+1."""
    for (state, _event), step in TABLE.items():
        if state is S.AMBIGUOUS:
            assert step.to is not S.IN_FLIGHT
            if step.to is S.PENDING:
                assert step.new_epoch


@given(st.lists(st.sampled_from(AUTOMATIC_EVENTS), max_size=80))
def test_random_automatic_events_never_leave_a_terminal_state(events: list[Event]) -> None:
    """From pending, any sequence of automatic events: once terminal, always that state."""
    state, entered = S.PENDING, None
    for event in events:
        try:
            step = transition(state, event)
        except IllegalTransition:
            continue
        assert state not in TERMINAL, f"left terminal {state.value} on {event.value}"
        state = step.to
        entered = entered or (state if state in TERMINAL else None)
    if entered is not None:
        assert state is entered


@given(st.lists(st.sampled_from(list(Event)), max_size=80))
def test_random_events_never_leave_succeeded_or_cancelled(events: list[Event]) -> None:
    """Including operators' plans, no event sequence leaves succeeded or cancelled, and every
    epoch increase lands in pending."""
    state, entered = S.PENDING, None
    for event in events:
        try:
            step = transition(state, event)
        except IllegalTransition:
            continue
        assert state not in SEALED, f"left {state.value} on {event.value}"
        if step.new_epoch:
            assert step.to is S.PENDING
        state = step.to
        entered = entered or (state if state in SEALED else None)
    if entered is not None:
        assert state is entered


@given(st.lists(st.sampled_from(list(Event)), max_size=80))
def test_once_succeeded_every_further_event_is_illegal(events: list[Event]) -> None:
    """A succeeded operation accepts nothing more, whatever arrives afterwards."""
    state = transition(transition(S.PENDING, E.CLAIM).to, E.OUTCOME_SUCCEEDED).to
    assert state is S.SUCCEEDED
    for event in events:
        with pytest.raises(IllegalTransition):
            transition(state, event)


def test_named_sets_partition_the_states_as_documented() -> None:
    """ACTIVE is everything not terminal; it splits into UNDECIDED, UNRESOLVED and needs_review;
    OUTBOX_LIVE is every outbox status a consumer may still receive."""
    assert ACTIVE == set(State) - TERMINAL
    assert UNRESOLVED == {S.AMBIGUOUS, S.AWAITING_CONFIRMATION}
    assert UNDECIDED == {S.PENDING, S.AWAITING_APPROVAL, S.IN_FLIGHT}
    assert UNDECIDED | UNRESOLVED | {S.NEEDS_REVIEW} == ACTIVE
    assert not UNDECIDED & UNRESOLVED
    assert OUTBOX_LIVE == {OutboxStatus.PENDING, OutboxStatus.PUBLISHING, OutboxStatus.PUBLISHED}
