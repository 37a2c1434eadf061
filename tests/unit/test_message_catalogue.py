"""The message catalogue is the one table of messages: every message model has exactly one row,
every route is allowed by the derived NATS permissions to its publishers and reachable by its
consumer, and what the services hand-write (subjects, the ledger's inbox) agrees with it."""

from __future__ import annotations

import inspect
import typing

import pytest
from pydantic import BaseModel

from effectledger_bus import catalogue, permissions
from effectledger_bus.catalogue import Role, covers
from effectledger_bus.topology import topology
from effectledger_core import messages
from effectledger_core.config import Settings
from effectledger_core.subjects import Subjects
from effectledger_ledger.messaging import INBOX_HANDLERS

S = Subjects("fx.a", "FX")
# Two principals per scoped role: one's subjects must be refused to the other.
PLANE = permissions.plane(S, dispatchers=["d1", "d2", None], reconcilers=["r1", None],
                          tenants=["acme", "globex"])
NAMES = {"dispatcher_id": "d1", "tenant": "acme", "tool": "wire_funds"}


def _message_models() -> set[type[BaseModel]]:
    """Every public message model defined in effectledger_core.messages."""
    return {obj for name, obj in vars(messages).items()
            if inspect.isclass(obj) and issubclass(obj, messages.Message)
            and obj is not messages.Message and not name.startswith("_")
            and obj.__module__ == messages.__name__}


def _principals(role: Role) -> list[permissions.Principal]:
    return [p for p in PLANE.principals if p.role is role]


def _own(route: catalogue.Route, principal: permissions.Principal) -> str:
    """The route's subject as `principal` sends it: under its own name, if the subject has one."""
    names = dict(NAMES)
    scope_name = catalogue.SCOPE.get(principal.role)
    if scope_name is not None:
        names[scope_name] = principal.scope or "d9"  # a shared user speaks for any id
    return catalogue.absolute(S, route.subject.format(**names))


def test_every_message_model_has_exactly_one_row() -> None:
    rows = [r.model for r in catalogue.ROWS]
    assert len(rows) == len(set(rows)), "a model with two rows"
    assert set(rows) | catalogue.PARTS == _message_models()
    assert not set(rows) & catalogue.PARTS


def test_every_route_is_published_by_its_roles_and_nobody_else() -> None:
    for route in catalogue.routes():
        for principal in PLANE.principals:
            subject = _own(route, principal)
            allowed = any(covers(p, subject) for p in principal.permissions.publish)
            assert allowed == (principal.role in route.publishers), (route.subject,
                                                                     principal.user)


def test_a_scoped_route_is_refused_under_another_principals_name() -> None:
    for route in catalogue.routes():
        for role in route.publishers:
            scope_name = catalogue.SCOPE.get(role)
            if scope_name is None or f"{{{scope_name}}}" not in route.subject:
                continue
            other = catalogue.absolute(S, route.subject.format(**{**NAMES, scope_name: "zz"}))
            for p in _principals(role):
                if p.scope is not None:
                    assert not any(covers(g, other) for g in p.permissions.publish), p.user


def test_every_route_reaches_its_consumer() -> None:
    topo = topology(Settings(subject_prefix=S.prefix, stream_prefix=S.stream_prefix))
    streams = {s.name: s.subjects or [] for s in topo.streams}
    consumers = {c.config.durable_name: c for c in topo.consumers}
    for route in catalogue.routes():
        subject, channel = catalogue.absolute(S, route.subject.format(**NAMES)), route.to
        takers = _principals(channel.consumer)
        if channel.durable is None:  # a request the ledger answers, on core NATS
            for p in takers:
                assert any(covers(g, subject) for g in p.permissions.subscribe), subject
            assert not any(covers(p, subject) for subs in streams.values() for p in subs), (
                f"a stream would answer the request {subject} with a publish-ack")
            continue
        spec = consumers[channel.durable]
        assert any(covers(p, subject) for p in streams[spec.stream]), subject
        assert covers(spec.config.filter_subject or "", subject), subject
        pull = f"$JS.API.CONSUMER.MSG.NEXT.{spec.stream}.{channel.durable}"
        for p in takers:
            assert any(covers(g, pull) for g in p.permissions.publish), p.user


def test_the_ledger_answers_every_asker_in_its_own_inbox() -> None:
    ledger = PLANE.user("ledger").permissions.publish
    for row in catalogue.ROWS:
        for request in row.answers:
            for route in catalogue.row(request).routes:
                for role in route.publishers:
                    for p in _principals(role):
                        inbox = f"{permissions.inbox_prefix(p.user)}.x"
                        assert any(covers(g, inbox) for g in ledger), (row.model, p.user)


def test_every_jetstream_message_has_a_message_id() -> None:
    """Outbox commands take the outbox row's id (`dispatch_id`); everything else its own."""
    for row in catalogue.ROWS:
        jetstream = any(c.durable is not None for c in row.channels)
        from_outbox = all(r.publishers == (Role.LEDGER,) for r in row.routes)
        assert (row.msgid is not None) == (jetstream and not from_outbox), row.model


def test_the_inbox_handles_exactly_what_is_routed_to_it() -> None:
    routed = set(catalogue.models_to(catalogue.consumer(catalogue.LEDGER_INBOX)))
    (union, _field) = typing.get_args(messages.LedgerEvent)
    assert set(typing.get_args(union)) == routed
    assert set(INBOX_HANDLERS) == routed


@pytest.mark.parametrize(("model", "named"), [
    (messages.SubmitIntent, [S.rpc_intents, S.rpc_intents_for("acme")]),
    (messages.DispatchAttempt, [S.dispatch("wire_funds")]),
    (messages.ClaimAttempt, [S.rpc_claim, S.rpc_claim_by("d1")]),
    (messages.AttemptSucceeded,
     [S.rpc_outcome_by("d1"), S.outcome_by("d1", "attempt_succeeded")]),
    (messages.AttemptAccepted,
     [S.rpc_outcome_by("d1"), S.outcome_by("d1", "attempt_accepted")]),
    (messages.AttemptFailed,
     [S.rpc_outcome_by("d1"), S.outcome_by("d1", "attempt_failed")]),
    (messages.OutcomeAmbiguous,
     [S.rpc_outcome_by("d1"), S.outcome_by("d1", "outcome_ambiguous")]),
    (messages.ReconcileOperation, [S.ambiguous]),
    (messages.VerdictReached, [S.verdict]),
    (messages.WebhookReceived, [S.webhook]),
    (messages.DeadLetter, [S.deadletter]),
    (messages.OperationQuery, [S.rpc_operation, S.rpc_operation_for("acme")]),
    (messages.OperationWait, [S.rpc_operation_wait, S.rpc_operation_wait_for("acme")]),
])
def test_the_subjects_the_services_use_are_the_catalogues(
        model: type[BaseModel], named: list[str]) -> None:
    """`Subjects` still names the subjects its callers publish on: it must not drift."""
    routes = catalogue.row(model).routes
    assert [catalogue.absolute(S, r.subject.format(**NAMES)) for r in routes] == named


def test_the_durable_consumers_are_the_services_own() -> None:
    from effectledger_dispatcher.worker import CONSUMER as dispatcher
    from effectledger_ledger.messaging import INBOX_CONSUMER
    from effectledger_reconciler.worker import CONSUMER as reconciler

    durables = {c.durable for c in catalogue.durable_consumers()}
    assert durables == {dispatcher, INBOX_CONSUMER, reconciler}
    assert catalogue.stream_name(S, catalogue.consumer(dispatcher)) == S.dispatch_stream
    assert catalogue.stream_name(S, catalogue.consumer(reconciler)) == S.events_stream


def test_message_ids_and_subjects_come_from_the_row() -> None:
    verdict = messages.VerdictReached(operation_id="op", epoch=3, verdict="applied",
                                      reconciler_id="r1", at="2026-12-01T00:00:00Z")
    assert catalogue.message_id(verdict) == "verdict:op:3:applied"
    assert catalogue.subject(verdict, S) == S.verdict
    with pytest.raises(ValueError, match="no message id"):
        catalogue.message_id(messages.OperationQuery(operation_id="op"))
    with pytest.raises(ValueError, match="2 subjects"):
        catalogue.subject(messages.OperationQuery(operation_id="op"), S)
