"""The sandbox forgets its oldest keys past a bound, so a long demo's memory stays flat."""

from __future__ import annotations

import pytest

from effectledger_sandbox.state import SandboxState


def run(state: SandboxState, route: str, key: str | None) -> None:
    state.arrive(route, key, None)
    state.apply(route, key, {"k": key}, None)


def test_past_the_bound_the_oldest_key_and_its_effects_are_forgotten() -> None:
    """Three keys kept at most: the fourth makes the first go, with its effect, record and
    truth; the totals still count it and `forgotten_keys` says one went."""
    state = SandboxState(max_keys=3)
    for key in ("k1", "k2", "k3", "k4"):
        assert state.claim("tickets", key, "digest")[1] is None
        run(state, "tickets", key)

    truth = state.truth_json()
    assert sorted(truth["keys"]) == ["k2", "k3", "k4"]
    assert truth["total_applied"] == 4 and truth["forgotten_keys"] == 1
    assert state.readback("tickets", "k1") is None and state.readback("tickets", "k4")
    assert ("tickets", "k1") not in state.records
    assert len(state.effects) == 3


def test_unkeyed_effects_are_bounded_too() -> None:
    state = SandboxState(max_keys=2)
    for _ in range(5):
        run(state, "plain", None)
    assert len(state.effects) == 2 and state.total_applied == 5
    assert sorted(state.effects) == ["eff_4", "eff_5"]


def test_memory_stays_flat_over_many_keys() -> None:
    """10,000 operations through a bound of 100 keep 100 keys' state, not 10,000."""
    state = SandboxState(max_keys=100)
    for i in range(10_000):
        run(state, "tickets", f"key-{i}")
    assert len(state.truth) == len(state.by_key) == len(state.effects) == 100
    assert state.forgotten_keys == 9_900


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        SandboxState(max_keys=0)
