"""The message catalogue: one row per message on the bus, and everything derived from it.

A row says what a message is (its pydantic model), where it travels (its subject, relative to
the subject prefix), who may publish it (a role), who takes it off the bus (a channel: a durable
JetStream consumer, or a request-reply subject the ledger answers) and, for JetStream messages,
its `Nats-Msg-Id`. From these rows come:

- the AsyncAPI document (`effectledger_bus.asyncapi`): one channel per consumer or request
  subject, listing the messages routed to it and the replies to them;
- the message part of every role's NATS permissions (`effectledger_bus.permissions`);
- the streams' subjects and the durable consumers' filters (`effectledger_bus.topology`);
- every message id (`message_id`).

So a new message type is a model in `effectledger_core.messages`, a row here, a handler where it
is consumed and the code that publishes it; the generated files are regenerated.

Subjects are templates. A `{dispatcher_id}` or `{tenant}` token names the sender, and NATS
permissions let each principal publish only under its own (`grant`): the ledger reads the
sender from the subject, never from the payload. Any other placeholder (`{tool}`) is a free
token. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    ClaimAttempt,
    ClaimReply,
    DeadLetter,
    DispatchAttempt,
    ErrorReply,
    Evidence,
    IntentReply,
    OperationQuery,
    OperationReply,
    OperationWait,
    Outcome,
    OutcomeAmbiguous,
    OutcomeRecorded,
    ReconcileOperation,
    SubmitIntent,
    VerdictReached,
    WebhookReceived,
)
from effectledger_core.subjects import Subjects


class Role(StrEnum):
    LEDGER = "ledger"
    DISPATCHER = "dispatcher"
    RECONCILER = "reconciler"
    AGENT = "agent"
    OPERATOR = "operator"
    STREAMS = "streams"


# The subject token that names a principal of each role (the others publish under no name).
SCOPE = {Role.DISPATCHER: "dispatcher_id", Role.AGENT: "tenant"}
# Durable consumer names, shared with the services that consume them.
DISPATCHER, LEDGER_INBOX, RECONCILER = "dispatcher", "ledger-inbox", "reconciler"
# Every request subject lives here, outside every stream's subjects: a stream that captured a
# request would answer it with a publish-ack instead of the ledger's reply.
REQUESTS = "rpc.v1.>"


@dataclass(frozen=True, slots=True)
class Channel:
    """Where messages are taken off the bus: a durable JetStream consumer (`durable`, on the
    stream `<stream prefix>_<stream>`, reading `filter`), or a request subject the ledger
    answers. `address` (relative to the prefix) is what the AsyncAPI document shows."""

    id: str
    address: str
    consumer: Role
    description: str
    durable: str | None = None
    stream: str | None = None
    filter: str | None = None

    @property
    def action(self) -> str:
        """The AsyncAPI action from the ledger's point of view."""
        return "receive" if self.consumer is Role.LEDGER else "send"


@dataclass(frozen=True, slots=True)
class Route:
    """One way a message travels: on `subject` (a template), published by `publishers`, to
    `to`. `grant` is the publish permission when it is deliberately wider than the subject."""

    to: Channel
    subject: str
    publishers: tuple[Role, ...]
    grant: str | None = None


@dataclass(frozen=True, slots=True)
class Row:
    """One message: its model, its routes, and for JetStream messages its `Nats-Msg-Id` (the
    same for every copy of one fact, different between facts: JetStream and the ledger's inbox
    drop a copy by it). A reply has no route of its own: it goes to the asker's inbox, for
    each request in `answers`."""

    model: type[BaseModel]
    routes: tuple[Route, ...] = ()
    msgid: Callable[[Any], str] | None = None
    answers: tuple[type[BaseModel], ...] = ()

    @property
    def channels(self) -> tuple[Channel, ...]:
        return tuple(r.to for r in self.routes)


# --- channels: the consumers and the request subjects ---

_INTENTS = Channel(
    "intents", "rpc.v1.intents", Role.LEDGER,
    "Request-reply: agents submit intents. Reply: IntentReply, or ErrorReply for anything the "
    "ledger could not serve.")
_INTENTS_TENANT = Channel(
    "intents_tenant", "rpc.v1.tenant.{tenant}.intents", Role.LEDGER,
    "Request-reply: an agent submits intents on its own tenant's subject (NATS permissions "
    "let it publish nowhere else); the ledger takes the tenant from the subject, and refuses "
    "a payload naming another tenant (ErrorReply invalid_request).")
_CLAIM = Channel(
    "claim", "rpc.v1.claim", Role.LEDGER,
    "Request-reply: a dispatcher claims an attempt before calling the provider. Reply: "
    "ClaimReply, or ErrorReply.")
_CLAIM_DISPATCHER = Channel(
    "claim_dispatcher", "rpc.v1.claim.{dispatcher_id}", Role.LEDGER,
    "Request-reply: a dispatcher's own claim subject; a claim naming another dispatcher is "
    "refused (ErrorReply invalid_request), so the claim's recorded holder is the sender.")
_OUTCOME_DISPATCHER = Channel(
    "outcome_dispatcher", "rpc.v1.outcome.{dispatcher_id}", Role.LEDGER,
    "Request-reply: a dispatcher reports an outcome on its own subject, before (and usually "
    "instead of) its JetStream copy; the ledger commits it to its inbox under the id the copy "
    "carries (<type>:<attempt_id>) and only then answers OutcomeRecorded, so a later copy is a "
    "duplicate. An outcome naming another dispatcher is refused (ErrorReply invalid_request) "
    "and dead-lettered. Without an answer the dispatcher publishes the JetStream copy: the "
    "stream remains the guarantee.")
_DISPATCH = Channel(
    "dispatch", "dispatch.v1.>", Role.DISPATCHER,
    "JetStream (stream <P>_DISPATCH, work queue): commands relayed from the ledger outbox; "
    "Nats-Msg-Id = outbox id (+ .r<n> for sweeper republishes). Consumer: durable "
    "'dispatcher', explicit acks.",
    durable=DISPATCHER, stream="DISPATCH", filter="dispatch.v1.>")
_INBOX = Channel(
    "outcomes", "ledger.v1.>", Role.LEDGER,
    "JetStream (stream <P>_EVENTS): everything the ledger's inbox consumes. Outcomes from "
    "dispatchers (<prefix>.ledger.v1.outcome.<dispatcher_id>.<type>: one naming another "
    "dispatcher is dead-lettered; Nats-Msg-Id = <type>:<attempt_id>), "
    "verdicts from reconcilers (<prefix>.ledger.v1.verdict, Nats-Msg-Id = "
    "verdict:<op>:<epoch>:<verdict>), verified webhooks (<prefix>.ledger.v1.webhook, "
    "Nats-Msg-Id = webhook:<provider>:<id>) and dead letters (<prefix>.ledger.v1.deadletter). "
    "Consumer: durable 'ledger-inbox', explicit acks.",
    durable=LEDGER_INBOX, stream="EVENTS", filter="ledger.v1.>")
_RECONCILE = Channel(
    "reconcile", "reconcile.v1.ambiguous", Role.RECONCILER,
    "JetStream (stream <P>_EVENTS): reconciliation commands for ambiguous or asynchronously "
    "accepted attempts, from the ledger outbox. Consumer: durable 'reconciler', explicit acks.",
    durable=RECONCILER, stream="EVENTS", filter="reconcile.v1.>")
_OPERATION = Channel(
    "operation", "rpc.v1.operation", Role.LEDGER,
    "Request-reply, read-only: OperationQuery → OperationReply, or ErrorReply (code "
    "not_found for an unknown operation). Used by reconcilers before deciding.")
_OPERATION_TENANT = Channel(
    "operation_tenant", "rpc.v1.tenant.{tenant}.operation", Role.LEDGER,
    "Request-reply, read-only, on an agent's own tenant's subject: another tenant's "
    "operation reads exactly like a missing one (not_found); no provider reference.")
_OPERATION_WAIT_TENANT = Channel(
    "operation_wait_tenant", "rpc.v1.tenant.{tenant}.wait", Role.LEDGER,
    "Request-reply, read-only, on an agent's own tenant's subject: OperationWait → "
    "OperationReply once the operation is settled or wait_s is over; another tenant's "
    "operation reads exactly like a missing one (not_found).")
_OPERATION_WAIT = Channel(
    "operation_wait", "rpc.v1.operation.wait", Role.LEDGER,
    "Request-reply, read-only: OperationWait → OperationReply once the operation is settled "
    "(succeeded, failed, cancelled, needs_review, awaiting_approval) or when wait_s (capped "
    "by the ledger) is over; ErrorReply for bad input or an unknown operation.")

# In this order in the AsyncAPI document; a stream's subjects are its consumers' filters in
# this order.
CHANNELS: tuple[Channel, ...] = (
    _INTENTS, _INTENTS_TENANT, _CLAIM, _CLAIM_DISPATCHER, _OUTCOME_DISPATCHER, _DISPATCH,
    _INBOX, _RECONCILE, _OPERATION, _OPERATION_TENANT, _OPERATION_WAIT_TENANT,
    _OPERATION_WAIT)


# --- message ids ---


def dispatch_id(outbox_id: str, publish_count: int) -> str:
    """A dispatch command's id: its outbox row's, plus `.r<n>` for the n-th sweeper
    republish, which must get through the duplicate window because the first copy was lost.
    (Of the outbox row, not of the command: a relay retry is a copy, a republish is not.)"""
    return outbox_id if publish_count == 0 else f"{outbox_id}.r{publish_count}"


def _outcome_id(o: Outcome) -> str:
    return f"{o.type}:{o.attempt_id}"  # a copy is a dispatcher's republish


def _verdict_id(v: VerdictReached) -> str:
    # Not the reconciler's id: two replicas reaching the same verdict state one fact.
    return f"verdict:{v.operation_id}:{v.epoch}:{v.verdict}"


def _webhook_id(w: WebhookReceived) -> str:
    return f"webhook:{w.provider}:{w.webhook_id}"  # a copy is the provider's redelivery


def _dead_letter_id(d: DeadLetter) -> str:
    # A copy is a retried dead-lettering of the same delivery.
    return f"deadletter:{d.consumer}:{d.message_id or d.subject}:{d.deliveries}"


def _outcome(model: type[BaseModel], kind: str) -> Row:
    # The sender's own subjects: the ledger dead-letters an outcome naming another dispatcher.
    # First by request (answered after the inbox commit), then, unanswered, on the stream;
    # both are committed under the one message id.
    return Row(model, (Route(_OUTCOME_DISPATCHER, "rpc.v1.outcome.{dispatcher_id}",
                             (Role.DISPATCHER,)),
                       Route(_INBOX, f"ledger.v1.outcome.{{dispatcher_id}}.{kind}",
                             (Role.DISPATCHER,))), msgid=_outcome_id)


_AGENT, _OPERATOR = (Role.AGENT,), (Role.OPERATOR,)
_OUTCOMES = (AttemptSucceeded, AttemptAccepted, AttemptFailed, OutcomeAmbiguous)

# One row per message. Within a role, the order of the rows is the order of its permissions.
ROWS: tuple[Row, ...] = (
    Row(SubmitIntent, (Route(_INTENTS, "rpc.v1.intents", _OPERATOR),
                       Route(_INTENTS_TENANT, "rpc.v1.tenant.{tenant}.intents", _AGENT))),
    Row(DispatchAttempt, (Route(_DISPATCH, "dispatch.v1.{tool}", (Role.LEDGER,)),)),
    # The plain claim subject is for trusted in-process callers: no role may publish on it.
    Row(ClaimAttempt, (Route(_CLAIM, "rpc.v1.claim", ()),
                       Route(_CLAIM_DISPATCHER, "rpc.v1.claim.{dispatcher_id}",
                             (Role.DISPATCHER,)))),
    _outcome(AttemptSucceeded, "attempt_succeeded"),
    _outcome(AttemptAccepted, "attempt_accepted"),
    _outcome(AttemptFailed, "attempt_failed"),
    _outcome(OutcomeAmbiguous, "outcome_ambiguous"),
    # The ledger may publish anywhere under reconcile.v1: the reconciler's whole subtree.
    Row(ReconcileOperation, (Route(_RECONCILE, "reconcile.v1.ambiguous", (Role.LEDGER,),
                                   grant="reconcile.v1.>"),)),
    Row(VerdictReached, (Route(_INBOX, "ledger.v1.verdict", (Role.RECONCILER,)),),
        msgid=_verdict_id),
    # The reconciler serves the webhook endpoint: it is the webhook ingress.
    Row(WebhookReceived, (Route(_INBOX, "ledger.v1.webhook", (Role.RECONCILER,)),),
        msgid=_webhook_id),
    Row(DeadLetter, (Route(_INBOX, "ledger.v1.deadletter", (Role.DISPATCHER, Role.RECONCILER)),),
        msgid=_dead_letter_id),
    Row(OperationQuery, (Route(_OPERATION, "rpc.v1.operation", (Role.OPERATOR, Role.RECONCILER)),
                         Route(_OPERATION_TENANT, "rpc.v1.tenant.{tenant}.operation", _AGENT))),
    # The trusted wait (any tenant's operation) is for operator tools only.
    Row(OperationWait, (Route(_OPERATION_WAIT, "rpc.v1.operation.wait", _OPERATOR),
                        Route(_OPERATION_WAIT_TENANT, "rpc.v1.tenant.{tenant}.wait", _AGENT))),
    Row(IntentReply, answers=(SubmitIntent,)),
    Row(ClaimReply, answers=(ClaimAttempt,)),
    Row(OutcomeRecorded, answers=_OUTCOMES),
    Row(OperationReply, answers=(OperationQuery, OperationWait)),
    Row(ErrorReply, answers=(SubmitIntent, ClaimAttempt, *_OUTCOMES, OperationQuery,
                             OperationWait)),
)
# Message models that only travel inside another message (a verdict's evidence).
PARTS: frozenset[type[BaseModel]] = frozenset({Evidence})

BY_MODEL: dict[type[BaseModel], Row] = {r.model: r for r in ROWS}


def row(message: BaseModel | type[BaseModel]) -> Row:
    """The row of a message or model; KeyError for one the catalogue does not list."""
    return BY_MODEL[message if isinstance(message, type) else type(message)]


def message_id(message: BaseModel) -> str:
    """The `Nats-Msg-Id` to publish `message` under (dispatch commands: `dispatch_id`)."""
    make = row(message).msgid
    if make is None:
        raise ValueError(f"{type(message).__name__} has no message id of its own")
    return make(message)


def absolute(subjects: Subjects, template: str) -> str:
    """A template under this deployment's prefix, placeholders kept."""
    return f"{subjects.prefix}.{template}"


def subject(message: BaseModel, subjects: Subjects, **names: str) -> str:
    """Where to publish `message` (a message with one route), its placeholders filled from
    `names` (the sender's `dispatcher_id`, the `tool`): what a publisher calls."""
    routes = row(message).routes
    if len(routes) != 1:
        raise ValueError(f"{type(message).__name__} travels on {len(routes)} subjects")
    return absolute(subjects, routes[0].subject.format(**names))


def grant(template: str, role: Role, scope: str | None) -> str:
    """The publish permission a principal of `role` bound to `scope` needs for `template`:
    its own name in the sender's token and everything under it (`None`: one user shared by
    every replica, any name); a free placeholder allows any rest of the subject."""
    out = []
    tokens = template.split(".")
    for i, tok in enumerate(tokens):
        if tok.startswith("{"):
            if tok[1:-1] == SCOPE.get(role):
                out.append(scope if scope is not None else "*")
                if i < len(tokens) - 1:
                    out.append(">")
            else:
                out.append(">")
            break
        out.append(tok)
    return ".".join(out)


def publish_grants(role: Role, subjects: Subjects, scope: str | None = None) -> tuple[str, ...]:
    """Every message subject `role` may publish on, once each, in the rows' order."""
    seen: dict[str, None] = {}
    for route in routes():
        if role in route.publishers:
            seen[absolute(subjects, route.grant or grant(route.subject, role, scope))] = None
    return tuple(seen)


def routes() -> Iterator[Route]:
    for r in ROWS:
        yield from r.routes


def durable_consumers() -> tuple[Channel, ...]:
    """The channels read by a durable JetStream consumer."""
    return tuple(c for c in CHANNELS if c.durable is not None)


def consumer(durable: str) -> Channel:
    for c in durable_consumers():
        if c.durable == durable:
            return c
    raise KeyError(durable)


def stream_name(subjects: Subjects, channel: Channel) -> str:
    return f"{subjects.stream_prefix}_{channel.stream}"


def stream_subjects(subjects: Subjects, stream: str) -> list[str]:
    """What stream `<prefix>_<stream>` captures: its consumers' filters."""
    return [absolute(subjects, c.filter or c.address) for c in durable_consumers()
            if c.stream == stream]


def models_to(channel: Channel) -> list[type[BaseModel]]:
    """The messages routed to `channel`, then (on a request subject) the replies to them, in
    the rows' order. A message that is also a request elsewhere (an outcome) has no reply on
    the stream."""
    sent = [r.model for r in ROWS if channel in r.channels]
    if channel.durable is not None:
        return sent
    replies = [r.model for r in ROWS if any(m in r.answers for m in sent)]
    return sent + replies


def covers(pattern: str, subject: str) -> bool:
    """Whether a NATS subject pattern matches `subject` the way nats-server matches them:
    `*` is one token, a final `>` one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)
