"""Crash point specs: `name[#scope][@n][:stop]`, scoped counting, and clear errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from effectledger_core import crash
from effectledger_core.crash import CrashPointHit, arm, crash_point, disarm_all, parse


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    disarm_all()
    yield
    disarm_all()


def test_a_spec_gives_name_scope_hit_and_mode() -> None:
    assert parse("dispatcher.after_claim") == ("dispatcher.after_claim", None, 1, False)
    assert parse("dispatcher.after_claim#plain_readback@2:stop") == \
        ("dispatcher.after_claim", "plain_readback", 2, True)
    assert parse("ledger.after_intent_commit@3") == ("ledger.after_intent_commit", None, 3,
                                                     False)


@pytest.mark.parametrize("spec, says", [
    ("dispatcher.nowhere", "unknown crash point"),
    ("dispatcher.after_claim:pause", "only mode"),
    ("dispatcher.after_claim@0", "1 or more"),
    ("dispatcher.after_claim@x", "1 or more"),
])
def test_a_bad_spec_is_refused_naming_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse(spec)


def test_a_scoped_point_counts_only_hits_in_its_scope() -> None:
    arm("dispatcher.after_claim", nth=2, scope="plain_readback")
    crash_point("dispatcher.after_claim", scope="idem_readback")
    crash_point("dispatcher.after_claim")  # unscoped hits do not count either
    crash_point("dispatcher.after_claim", scope="plain_readback")  # first hit in scope
    with pytest.raises(CrashPointHit):
        crash_point("dispatcher.after_claim", scope="plain_readback")


def test_an_unscoped_point_counts_every_hit() -> None:
    arm("dispatcher.after_claim", nth=2)
    crash_point("dispatcher.after_claim", scope="idem_readback")
    with pytest.raises(CrashPointHit):
        crash_point("dispatcher.after_claim", scope="plain_readback")


def test_stop_mode_from_the_environment_is_remembered_per_point(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(crash.ENV, "dispatcher.after_claim#plain_readback:stop,"
                                  "dispatcher.before_call@2")
    crash._load_env()
    assert crash._armed == {("dispatcher.after_claim", "plain_readback"): 1,
                            ("dispatcher.before_call", None): 2}
    assert crash._mode_stop == {("dispatcher.after_claim", "plain_readback")}
