"""The console's pure parts: ages, summaries, form values, allowed actions, the retry preview,
sessions and the sign-in redirect target."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime
from typing import Any

import pytest

from effectledger_core.catalog import Catalog
from effectledger_core.errors import InvalidRequest
from effectledger_core.recovery import Assessment, Decision, Fact
from effectledger_core.views import OperationView
from effectledger_ledger.auth import Principal
from effectledger_ledger.console import views
from effectledger_ledger.console.sessions import SessionStore, same_secret
from effectledger_ledger.console.signin import safe_next as _safe_next
from tests.support.views import operation_view

TOOL = Catalog.from_mapping(tomllib.loads("""
[tools.pay]
endpoint = "https://provider.test/pay"
effect_class = "non_idempotent"
contract_revision = "r1"
headers = { Authorization = "Bearer ${PAY_KEY}", X-Region = "eu" }

[tools.form]
endpoint = "https://provider.test/form"
body_encoding = "form"
body = { amount = "{args.amount}", ref = "{operation_key}" }
effect_class = "non_idempotent"
contract_revision = "r1"
fencing_header = ""
""")).tools


def op(state: str, epoch: int = 1, **extra: Any) -> OperationView:
    return operation_view(state=state, epoch=epoch, operation_key="ck_1",
                          arguments={"amount": 5}, **extra)


def assessment(decision: Decision) -> Assessment:
    return Assessment(Fact.ACTIVE, decision, "because")


@pytest.mark.parametrize(("seconds", "shown"), [
    (None, "—"), (0, "0 s"), (59.9, "59 s"), (60, "1 min 0 s"), (3599, "59 min 59 s"),
    (3600, "1 h 0 min"), (86399, "23 h 59 min"), (90061, "1 d 1 h")])
def test_age_is_short_and_exact_at_the_unit_boundaries(seconds: float | None,
                                                       shown: str) -> None:
    assert views.age(seconds) == shown


def test_summary_keeps_the_fields_a_reader_scans_for_and_truncates() -> None:
    detail = {"verdict": "undecidable", "reason": "no oracle", "noise": "x", "code": ""}
    assert views.summary(detail) == "verdict: undecidable · reason: no oracle"
    assert views.summary("not a dict") == ""
    assert views.summary({"type": "attempt_failed", "code": "x"}, skip="type") == "code: x"
    long = views.summary({"message": "m" * 500}, limit=20)
    assert len(long) == 20 and long.endswith("…")


def test_times_from_forms_are_utc_and_bad_ones_are_named() -> None:
    assert views.parse_time("2026-12-01T10:00", "from") == datetime(2026, 12, 1, 10,
                                                                     tzinfo=UTC)
    assert views.parse_time("", "from") is None
    with pytest.raises(InvalidRequest, match="to: not a date"):
        views.parse_time("tomorrow", "to")
    assert views.when("2026-12-01T10:00:00.123456+00:00") == "2026-12-01 10:00:00.123 UTC"
    assert views.duration_ms("2026-12-01T10:00:00+00:00", "2026-12-01T10:00:01.5+00:00") \
        == "1500 ms"
    assert views.duration_ms("2026-12-01T10:00:00+00:00", None) == "—"


@pytest.mark.parametrize(("state", "decision", "kinds"), [
    ("awaiting_approval", Decision.NOT_APPLICABLE, ["approve", "cancel"]),
    ("pending", Decision.NOT_APPLICABLE, ["cancel"]),
    ("needs_review", Decision.NEEDS_REVIEW, ["review"]),
    ("failed", Decision.MAY_PREPARE, ["retry"]),
    ("failed", Decision.NOT_APPLICABLE, []),
    ("ambiguous", Decision.MAY_PREPARE, ["retry"]),
    ("in_flight", Decision.NOT_APPLICABLE, []),
    ("succeeded", Decision.REFUSE_COMPLETED, []),
    ("cancelled", Decision.NOT_APPLICABLE, [])])
def test_allowed_actions_follow_the_state_and_the_recovery_decision(
        state: str, decision: Decision, kinds: list[str]) -> None:
    assert [a.kind for a in views.allowed_actions(op(state), assessment(decision))] == kinds


def test_only_operators_and_open_mode_may_act() -> None:
    assert views.can_act(Principal("operator", "alice"))
    assert views.can_act(Principal("open", "bob"))
    assert not views.can_act(Principal("agent", "agent:t", "t"))


def test_retry_preview_shows_key_next_epoch_and_withholds_catalog_header_values() -> None:
    p = views.retry_preview(op("needs_review", epoch=3), TOOL["pay"])
    assert p.next_epoch == 4 and p.method == "POST" and p.endpoint == "https://provider.test/pay"
    assert p.headers["Idempotency-Key"] == "ck_1" and p.headers["Fencing-Token"] == "4"
    assert p.headers["Authorization"] == p.headers["X-Region"] == \
        "(from the catalog; value withheld)"
    assert p.body == {"amount": 5} and not p.body_is_template
    f = views.retry_preview(op("needs_review"), TOOL["form"])
    assert f.body_is_template and f.body == {"amount": "{args.amount}",
                                             "ref": "{operation_key}"}
    assert "Fencing-Token" not in f.headers and f.body_encoding == "form"


def test_sessions_expire_are_bounded_and_drop_at_sign_out() -> None:
    now = [0.0]
    store = SessionStore(ttl_s=10, max_sessions=2, clock=lambda: now[0])
    a = store.create(Principal("operator", "alice"))
    assert store.get(a.id) is a and a.csrf and a.csrf != a.id
    now[0] = 10.0
    assert store.get(a.id) is None  # expired at its deadline, and removed
    b, c, d = (store.create(Principal("operator", n)) for n in "bcd")
    assert store.get(b.id) is None and store.get(c.id) is c and store.get(d.id) is d
    store.drop(c.id)
    assert store.get(c.id) is None and len(store) == 1
    assert store.get(None) is None and store.get("") is None


def test_csrf_comparison_never_matches_an_absent_value() -> None:
    assert same_secret("abc", "abc")
    assert not same_secret("abc", None) and not same_secret("abc", "") \
        and not same_secret("abc", "abd")


@pytest.mark.parametrize(("target", "safe"), [
    ("/console/operations?state=failed", "/console/operations?state=failed"),
    (None, "/console/"), ("https://evil.example/", "/console/"), ("//evil/console/", "/console/"),
    ("/console/\\\\evil", "/console/"), ("/v1/operations", "/console/"),
    ("/console/x?u=http://a", "/console/")])
def test_sign_in_redirects_only_inside_the_console(target: str | None, safe: str) -> None:
    assert _safe_next(target) == safe
