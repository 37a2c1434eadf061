"""Replies only to inboxes (issue 28): the ledger answers a request only on a reply subject in
the inbox namespace of a user that may send it, decided from the two subjects alone."""

from __future__ import annotations

import pytest

from effectledger_bus.replies import FOREIGN_INBOX, NOT_AN_INBOX, ReplyPolicy
from effectledger_core.subjects import Subjects

S = Subjects("fx", "FX")
STRICT = ReplyPolicy(S, per_user_inboxes=True)
OPEN = ReplyPolicy(S, per_user_inboxes=False)
NON_INBOXES = [S.dispatch("wire_funds"), S.ambiguous, S.verdict, S.webhook,
               S.outcome_by("d1", "attempt_succeeded"), S.deadletter,
               "$JS.API.STREAM.PURGE.FX_DISPATCH", "$JS.API.STREAM.DELETE.FX_EVENTS",
               "$JS.ACK.FX_EVENTS.ledger-inbox.1.2.3.4.5", "_INBOX_agent-acme.>",
               "_INBOX_agent-acme.*", "_INBOX_agent-acme", "_INBOX.", "_INBOX_agent-acme..x",
               "_INBOX_agent-acme.x y", "", "x" * 300, "_INBOX_agent-acme." + "a" * 65]


@pytest.mark.parametrize("reply", NON_INBOXES)
def test_a_reply_subject_that_is_no_inbox_is_refused_with_or_without_users(reply: str) -> None:
    for policy in (STRICT, OPEN):
        assert policy.refusal(S.rpc_intents_for("acme"), reply) == NOT_AN_INBOX
        assert policy.refusal(S.rpc_claim_by("d1"), reply) == NOT_AN_INBOX


def test_a_tenants_requests_are_answered_in_its_agents_inbox_only() -> None:
    subject = S.rpc_intents_for("acme")
    assert STRICT.refusal(subject, "_INBOX_agent-acme.NUID.7") is None
    for other in ("_INBOX_operator.NUID.7", "_INBOX_agent-globex.N.1",
                  "_INBOX_dispatcher-d1.N.1", "_INBOX_ledger.N.1", "_INBOX_reconciler-r1.N.1",
                  "_INBOX.N.1", "_INBOX_agent-acme2.N.1"):
        assert STRICT.refusal(subject, other) == FOREIGN_INBOX, other
    # Without users on the broker there are no namespaces: any inbox will do.
    assert OPEN.refusal(subject, "_INBOX.N.1") is None
    assert OPEN.refusal(subject, "_INBOX_agent-globex.N.1") is None


def test_a_dispatchers_claims_are_answered_in_its_own_inbox() -> None:
    assert STRICT.refusal(S.rpc_claim_by("d1"), "_INBOX_dispatcher-d1.N.1") is None
    assert STRICT.refusal(S.rpc_claim_by("dispatcher-1"), "_INBOX_dispatcher-1.N.1") is None
    # Replicas sharing the one `dispatcher` user claim under their own ids.
    assert STRICT.refusal(S.rpc_claim_by("d1"), "_INBOX_dispatcher.N.1") is None
    assert STRICT.refusal(S.rpc_claim_by("d1"), "_INBOX_dispatcher-d2.N.1") == FOREIGN_INBOX
    assert STRICT.refusal(S.rpc_claim_by("a.b"), "_INBOX_dispatcher-a.N.1") == FOREIGN_INBOX


def test_a_dispatchers_outcomes_by_request_are_answered_in_its_own_inbox() -> None:
    subject = S.rpc_outcome_by("d1")
    assert STRICT.refusal(subject, "_INBOX_dispatcher-d1.N.1") is None
    assert STRICT.refusal(subject, "_INBOX_dispatcher.N.1") is None  # the shared user
    for other in ("_INBOX_dispatcher-d2.N.1", "_INBOX_operator.N.1", "_INBOX_agent-acme.N.1",
                  "_INBOX_reconciler-r1.N.1", "_INBOX.N.1"):
        assert STRICT.refusal(subject, other) == FOREIGN_INBOX, other
    for reply in (S.dispatch("wire_funds"), S.outcome_by("d1", "attempt_succeeded")):
        assert OPEN.refusal(subject, reply) == NOT_AN_INBOX


def test_trusted_subjects_are_answered_in_the_inboxes_of_the_roles_that_may_ask() -> None:
    assert STRICT.refusal(S.rpc_operation, "_INBOX_reconciler-r1.N.1") is None
    assert STRICT.refusal(S.rpc_operation, "_INBOX_operator.N.1") is None
    assert STRICT.refusal(S.rpc_operation, "_INBOX_agent-acme.N.1") == FOREIGN_INBOX
    for subject in (S.rpc_intents, S.rpc_operation_wait):
        assert STRICT.refusal(subject, "_INBOX_operator.N.1") is None
        assert STRICT.refusal(subject, "_INBOX_reconciler-r1.N.1") == FOREIGN_INBOX
        assert STRICT.refusal(subject, "_INBOX_agent-operator.N.1") == FOREIGN_INBOX
