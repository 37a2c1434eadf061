"""The pure side of NATS least privilege: which role may publish what, checked by matching
subjects against the generated allow lists the way nats-server does (`*` one token, `>` the
rest), and the configuration text that carries them."""

from __future__ import annotations

import pytest

from effectledger_bus import permissions as perm
from effectledger_bus.catalogue import covers as _matches
from effectledger_core.subjects import Subjects

S = Subjects("fx", "FX")
PLANE = perm.plane(S, dispatchers=["d1", "d2"], reconcilers=["r1"], tenants=["acme", "globex"])


def may_publish(user: str, subject: str) -> bool:
    return any(_matches(p, subject) for p in PLANE.user(user).permissions.publish)


def may_subscribe(user: str, subject: str) -> bool:
    return any(_matches(p, subject) for p in PLANE.user(user).permissions.subscribe)


def publishers(subject: str) -> set[str]:
    return {u for u in PLANE.users if may_publish(u, subject)}


def test_only_the_ledger_publishes_dispatch_and_reconcile_commands() -> None:
    assert publishers(S.dispatch("wire_funds")) == {"ledger"}
    assert publishers(S.ambiguous) == {"ledger"}


def test_only_reconcilers_publish_verdicts_and_webhooks() -> None:
    assert publishers(S.verdict) == {"reconciler-r1"}
    assert publishers(S.webhook) == {"reconciler-r1"}


def test_each_dispatcher_publishes_outcomes_and_claims_only_under_its_own_id() -> None:
    assert publishers(S.outcome_by("d1", "attempt_succeeded")) == {"dispatcher-d1"}
    assert publishers(S.outcome_by("d2", "attempt_failed")) == {"dispatcher-d2"}
    assert publishers(S.outcome("attempt_succeeded")) == set()  # the unbound form: nobody
    assert publishers(S.rpc_claim_by("d1")) == {"dispatcher-d1"}
    assert publishers(S.rpc_claim) == set()
    # Outcomes by request: on the dispatcher's own subject only, and nothing below it.
    assert publishers(S.rpc_outcome_by("d1")) == {"dispatcher-d1"}
    assert publishers(S.rpc_outcome_by("d2")) == {"dispatcher-d2"}
    assert publishers(S.rpc_outcome) == set()
    assert publishers(f"{S.rpc_outcome_by('d1')}.x") == set()


def test_an_agent_reaches_only_its_own_tenants_request_subjects() -> None:
    assert publishers(S.rpc_intents_for("acme")) == {"agent-acme"}
    assert publishers(S.rpc_operation_for("globex")) == {"agent-globex"}
    assert PLANE.user("agent-acme").permissions.publish == (S.tenant_requests("acme"),)
    assert publishers(S.rpc_intents) == {"operator"} and publishers(S.rpc_operation) == {
        "operator", "reconciler-r1"}
    assert not may_subscribe("agent-acme", f"{S.prefix}.ledger.v1.verdict")
    assert not may_subscribe("agent-acme", "_INBOX.x")
    assert not may_subscribe("agent-acme", "_INBOX_agent-globex.x")
    assert may_subscribe("agent-acme", "_INBOX_agent-acme.x")


def test_only_operator_tools_use_the_trusted_wait_agents_wait_on_their_tenant() -> None:
    assert publishers(S.rpc_operation_wait) == {"operator"}
    assert publishers(S.rpc_operation_wait_for("acme")) == {"agent-acme"}


def test_only_the_ledger_and_the_apply_step_change_streams() -> None:
    for stream in (S.dispatch_stream, S.events_stream):
        # The ledger creates its streams when missing (the embedded default), nothing more.
        assert publishers(f"$JS.API.STREAM.CREATE.{stream}") == {"ledger", "streams"}
        for verb in ("UPDATE", "DELETE", "PURGE"):
            assert publishers(f"$JS.API.STREAM.{verb}.{stream}") == {"streams"}, verb
        assert publishers(f"$JS.API.STREAM.MSG.DELETE.{stream}") == {"streams"}
        assert publishers(f"$JS.API.CONSUMER.DELETE.{stream}.dispatcher") == {"streams"}
    assert not may_publish("ledger", "$JS.API.STREAM.CREATE.OTHER")
    # A service reads and acks only its own consumer.
    assert publishers(f"$JS.ACK.{S.dispatch_stream}.dispatcher.1.2.3.4.5") == {
        "dispatcher-d1", "dispatcher-d2"}
    assert publishers(f"$JS.API.CONSUMER.MSG.NEXT.{S.events_stream}.reconciler") == {
        "reconciler-r1", "streams"}
    assert not may_publish("reconciler-r1", f"$JS.API.CONSUMER.MSG.NEXT.{S.events_stream}."
                                            "ledger-inbox")


def test_only_the_ledger_answers_requests_and_only_into_the_requesters_inboxes() -> None:
    # No `allow_responses`: it would let the ledger publish on any reply subject it is given.
    assert not any(p.permissions.allow_responses for p in PLANE.principals)
    assert {u for u in PLANE.users if may_subscribe(u, S.rpc_claim_by("d1"))} == {"ledger"}
    for user in ("agent-acme", "agent-globex", "dispatcher-d1", "reconciler-r1", "operator"):
        assert may_publish("ledger", f"_INBOX_{user}.nuid.1"), user
    for reply in ("_INBOX.nuid.1", "_INBOX_streams.x", "_INBOX_ledger.x", S.verdict,
                  S.webhook, S.outcome_by("d1", "attempt_succeeded"), S.rpc_intents_for("acme")):
        assert not may_publish("ledger", reply), reply


def test_further_users_are_answered_in_their_own_inbox() -> None:
    harness = perm.Principal(perm.Role.OPERATOR, "operator-harness",
                             perm.Permissions(publish=(">",), subscribe=(">",)))
    plane = perm.plane(S, dispatchers=[], reconcilers=[], tenants=[], others=[harness])
    assert "_INBOX_operator-harness.>" in plane.user("ledger").permissions.publish


def test_ids_that_cannot_be_one_subject_token_are_refused_with_the_reason() -> None:
    for bad in ("a.b", "a*", "a>", "has space", "", "x" * 65):
        with pytest.raises(ValueError, match="cannot name a NATS user"):
            perm.agent(S, bad)
    with pytest.raises(ValueError, match="named twice"):
        perm.plane(S, dispatchers=["d1", "d1"], reconcilers=[], tenants=[])


def test_the_configuration_names_every_user_with_its_password_and_no_anonymous_one() -> None:
    passwords: dict[str, str | perm.EnvRef] = {u: f"pw-{u}" for u in PLANE.users}
    passwords["ledger"] = perm.EnvRef("NATS_LEDGER_PASSWORD")
    text = perm.server_config(PLANE, passwords, host="127.0.0.1", port=4222, store_dir="/d",
                              tls=perm.Tls("c.pem", "k.pem", "ca.pem", verify_clients=True))
    assert "password: $NATS_LEDGER_PASSWORD" in text
    assert '"pw-agent-acme"' in text and '"$JS.API.>"' in text
    assert "verify: true" in text and "no_auth_user" not in text
    assert text.count("user: ") == len(PLANE.users)
    with pytest.raises(ValueError, match="no password"):
        perm.render(PLANE, {"ledger": "x"})


def test_the_sender_is_read_back_from_the_subject() -> None:
    assert S.outcome_sender(S.outcome_by("d1", "attempt_failed")) == "d1"
    assert S.outcome_sender(S.outcome("attempt_failed")) is None
    assert S.tenant_of(S.rpc_intents_for("acme")) == "acme"
    assert S.tenant_of(S.rpc_operation_for("acme")) == "acme"
    assert S.tenant_of(S.rpc_intents) is None and S.tenant_of(f"{S.prefix}.rpc.v1.tenant.x") is None
    assert S.rpc_tail(S.rpc_claim_by("d1"), S.rpc_claim) == "d1"
    assert S.rpc_tail(S.rpc_outcome_by("d1"), S.rpc_outcome) == "d1"


def test_replicas_sharing_a_user_keep_every_boundary_but_speaking_for_each_other() -> None:
    """`None`: one `dispatcher` / `reconciler` user for all replicas (what a Deployment with
    one Secret can do). It may claim and report under any dispatcher id, and nothing more."""
    shared = perm.plane(S, dispatchers=[None], reconcilers=[None], tenants=["acme"])
    d = shared.user("dispatcher").permissions
    assert d.publish[:3] == (S.rpc_claim_by("*"), S.rpc_outcome_by("*"), S.outcomes_of("*"))
    assert not any(_matches(p, S.verdict) or _matches(p, S.dispatch("x")) for p in d.publish)
    assert shared.user("reconciler").permissions.subscribe == ("_INBOX_reconciler.>",)
    assert perm.user_name(perm.Role.DISPATCHER, "dispatcher-1") == "dispatcher-1"
    assert perm.user_name(perm.Role.RECONCILER, "dispatcher-1") == "reconciler-dispatcher-1"


def test_passwords_can_come_from_the_servers_environment() -> None:
    refs = perm.env_refs(PLANE)
    assert refs["agent-acme"] == perm.EnvRef("NATS_AGENT_ACME_PASSWORD")
    assert refs["dispatcher-d1"] == perm.EnvRef("NATS_DISPATCHER_D1_PASSWORD")
    with pytest.raises(ValueError, match="not usable"):
        perm.EnvRef("lower-case")
    clash = perm.plane(S, dispatchers=[], reconcilers=[], tenants=["Acme", "acme"])
    with pytest.raises(ValueError, match="would share"):
        perm.env_refs(clash)
