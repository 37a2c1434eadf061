"""Who may say what on NATS: one user per role, with publish/subscribe allow lists.

This module turns the subject prefix, the stream prefix and the deployment's roles into the
`authorization { users: [...] }` block of a nats-server configuration, so that the broker itself
refuses what a role may not say. The message subjects each role may publish come from the
message catalogue (`effectledger_bus.catalogue`: its routes' publishers); the JetStream API each
role needs and the reply inboxes are added here:

- only the ledger publishes dispatch and reconcile commands and answers request-reply
  subjects, and only into the inboxes of the users that may ask (`_INBOX_<user>.>` of each,
  no `allow_responses`: that would let it answer on any reply subject a requester names);
  of the JetStream API it uses what it needs: creating its two streams when missing, reading
  them and its consumers, and its inbox consumer (never deleting or purging a stream);
- a dispatcher publishes outcomes only on its own subject (`<prefix>.ledger.v1.outcome.<id>.…`,
  so the ledger knows the sender from the subject), asks for claims on its own claim subject,
  and reads and acks only its own consumer;
- a reconciler (which also serves the webhook endpoint: it is the webhook ingress) publishes
  verdicts, webhooks and dead letters, reads operations, and reads and acks only its consumer;
- an agent reaches only the request subjects of its own tenant
  (`<prefix>.rpc.v1.tenant.<tenant>.>`: intents, operation reads): the ledger takes the tenant
  from that subject, never from the payload;
- operator tools submit, read and wait (`<prefix>.rpc.v1.operation.wait`) for any tenant on
  the trusted subjects (not on the tenants' own) and inspect (never change) streams;
- `streams` is the apply step that creates and updates streams and consumers.

Every user receives replies on its own inbox prefix (`_INBOX_<user>.`), which the services set
when they connect (`effectledger_bus.connect`): with one shared `_INBOX.>` any user could read
every other user's replies (claim grants, other tenants' intent replies). NATS does not check
a request's reply subject against the requester's rights, so the ledger may still be asked to
answer on a subject it may publish for its own work (the dispatch subject): its code refuses
every reply subject outside the requester's own inbox namespace (`replies.py`).

Credentials are password users in one account, not nkeys or JWTs: nats-py and every service
already take a user and a password (`EFFECTLEDGER_NATS_USER` / `_PASSWORD`), the server needs
no resolver or operator setup, and the embedded default can generate all of it on the fly.
The price is that the server's configuration holds the secrets, so it is written with mode
0600 (or refers to environment variables, `$NAME`, as `infra/` does).

Pure: no I/O; `render` returns the configuration text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from effectledger_core.subjects import Subjects

from . import catalogue
from .catalogue import Role as Role  # defined with the message catalogue, named here too

# A NATS subject token that is also a safe user name: no dots, wildcards or spaces.
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JS_API = "$JS.API"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # Lets a responder publish to the reply subject of a request it received (and only that).
    allow_responses: bool = False


@dataclass(frozen=True)
class Principal:
    """One NATS user: its role, its name (`ledger`, `dispatcher-d1`, `agent-acme`, …) and what
    it may publish and subscribe."""

    role: Role
    user: str
    permissions: Permissions
    scope: str | None = None  # the dispatcher id, reconciler id or tenant it is bound to


@dataclass(frozen=True)
class Credential:
    """A user and its password: what a process connects with."""

    user: str
    password: str = field(repr=False)

    @staticmethod
    def generate(user: str) -> Credential:
        return Credential(user, secrets.token_urlsafe(32))


def token(value: str, what: str) -> str:
    """`value` if it can stand as one subject token and user-name part; ValueError otherwise."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value[:80]!r} cannot name a NATS user or subject token: use "
                         "1-64 characters of A-Z, a-z, 0-9, '_' and '-'")
    return value


def user_name(role: Role, scope: str) -> str:
    """`<role>-<scope>`, without doubling the role (dispatcher id `dispatcher-1` is user
    `dispatcher-1`). Every name starts with its role, so no two roles share a user."""
    token(scope, f"{role.value} id" if role is not Role.AGENT else "tenant")
    return scope if scope.startswith(f"{role.value}-") else f"{role.value}-{scope}"


def inbox_prefix(user: str) -> str:
    """Where `user` receives replies; the services pass it to nats-py as `inbox_prefix`."""
    return f"_INBOX_{user}"


def _consumer_api(stream: str, durable: str) -> list[str]:
    """The JetStream API a pull consumer `durable` of `stream` needs: look it up, create it if
    it is missing, fetch, and ack."""
    return [f"{JS_API}.CONSUMER.INFO.{stream}.{durable}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}.>",
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>"]


def _stream_lookup(s: Subjects) -> list[str]:
    # Services check at start that their streams exist; reading a stream's info changes nothing.
    return [f"{JS_API}.STREAM.INFO.{s.dispatch_stream}", f"{JS_API}.STREAM.INFO.{s.events_stream}"]


def _ledger_jetstream(s: Subjects, inbox_consumer: str) -> list[str]:
    """The JetStream API the ledger uses: its streams created when missing and read
    (`streams.ensure_streams`, the sweeper's `stream_info`), every consumer's position read
    (the sweeper's ack floors), and its inbox consumer. Not `$JS.API.>`: a stolen ledger
    credential, or a reply subject slipped past its code, could then delete or purge a
    stream."""
    out = []
    for stream in (s.dispatch_stream, s.events_stream):
        out += [f"{JS_API}.STREAM.INFO.{stream}", f"{JS_API}.STREAM.CREATE.{stream}",
                f"{JS_API}.CONSUMER.INFO.{stream}.*"]
    return out + _consumer_api(s.events_stream, inbox_consumer)


def ledger(s: Subjects, *, inbox_consumer: str = "ledger-inbox",
           requesters: Iterable[str] = ()) -> Principal:
    """`requesters`: the users whose requests the ledger answers, each in its own inbox."""
    user = "ledger"
    return Principal(Role.LEDGER, user, Permissions(
        publish=(*catalogue.publish_grants(Role.LEDGER, s),
                 *_ledger_jetstream(s, inbox_consumer),
                 *(f"{inbox_prefix(u)}.>" for u in requesters)),
        subscribe=(catalogue.absolute(s, catalogue.REQUESTS), f"{inbox_prefix(user)}.>")))


def dispatcher(s: Subjects, dispatcher_id: str | None, *,
               consumer: str = "dispatcher") -> Principal:
    """One dispatcher's user. `None`: one user shared by every replica (user `dispatcher`),
    for deployments that cannot give each replica its own credentials; it may publish under
    any dispatcher id, so one replica could then speak for another (the ledger still accepts
    an outcome only for the attempt that holds the claim)."""
    user = "dispatcher" if dispatcher_id is None else user_name(Role.DISPATCHER, dispatcher_id)
    return Principal(Role.DISPATCHER, user, Permissions(
        publish=(*catalogue.publish_grants(Role.DISPATCHER, s, dispatcher_id),
                 *_stream_lookup(s), *_consumer_api(s.dispatch_stream, consumer)),
        subscribe=(f"{inbox_prefix(user)}.>",)), scope=dispatcher_id)


def reconciler(s: Subjects, reconciler_id: str | None, *,
               consumer: str = "reconciler") -> Principal:
    """One reconciler's user; `None`: one user shared by every replica (`reconciler`)."""
    user = "reconciler" if reconciler_id is None else user_name(Role.RECONCILER, reconciler_id)
    return Principal(Role.RECONCILER, user, Permissions(
        publish=(*catalogue.publish_grants(Role.RECONCILER, s),
                 *_stream_lookup(s), *_consumer_api(s.events_stream, consumer)),
        subscribe=(f"{inbox_prefix(user)}.>",)), scope=reconciler_id)


def agent(s: Subjects, tenant: str) -> Principal:
    user = f"agent-{token(tenant, 'tenant')}"  # a tenant named agent-x is still agent-agent-x
    return Principal(Role.AGENT, user, Permissions(
        publish=catalogue.publish_grants(Role.AGENT, s, tenant),
        subscribe=(f"{inbox_prefix(user)}.>",)), scope=tenant)


def operator(s: Subjects) -> Principal:
    user = "operator"
    return Principal(Role.OPERATOR, user, Permissions(
        # the trusted wait (any tenant's operation) is for operator tools only: an agent
        # waits on its own tenant's subject, under tenant_requests. Not the tenants'
        # subjects: the ledger answers those only in that tenant's agent's inbox, so an
        # agent cannot have its answers written into the operator's (replies.py).
        publish=(*catalogue.publish_grants(Role.OPERATOR, s),
                 f"{JS_API}.INFO",
                 f"{JS_API}.STREAM.NAMES", f"{JS_API}.STREAM.INFO.*", f"{JS_API}.CONSUMER.INFO.*.*",
                 f"{JS_API}.CONSUMER.NAMES.*", f"{JS_API}.CONSUMER.LIST.*"),
        subscribe=(f"{inbox_prefix(user)}.>",)))


def streams(s: Subjects) -> Principal:
    """The apply step: owns stream and consumer configuration, sends no message."""
    user = "streams"
    return Principal(Role.STREAMS, user, Permissions(
        publish=(f"{JS_API}.>",), subscribe=(f"{inbox_prefix(user)}.>",)))


@dataclass(frozen=True)
class Plane:
    """Every principal of one deployment."""

    principals: tuple[Principal, ...]

    def __post_init__(self) -> None:
        users = [p.user for p in self.principals]
        dupes = sorted({u for u in users if users.count(u) > 1})
        if dupes:
            raise ValueError(f"NATS users named twice: {dupes}")

    def user(self, name: str) -> Principal:
        for p in self.principals:
            if p.user == name:
                return p
        raise KeyError(name)

    @property
    def users(self) -> list[str]:
        return [p.user for p in self.principals]


def plane(s: Subjects, *, dispatchers: Iterable[str | None],
          reconcilers: Iterable[str | None],
          tenants: Iterable[str], with_operator: bool = True,
          with_streams: bool = True, others: Iterable[Principal] = ()) -> Plane:
    """`others`: further users (a test harness), whose requests the ledger answers too."""
    principals = [dispatcher(s, d) for d in dispatchers]
    principals += [reconciler(s, r) for r in reconcilers]
    principals += [agent(s, t) for t in tenants]
    if with_operator:
        principals.append(operator(s))
    if with_streams:
        principals.append(streams(s))
    principals += others
    # The ledger answers every user that sends requests: all but the apply step.
    asking = [p.user for p in principals if p.role is not Role.STREAMS]
    return Plane((ledger(s, requesters=asking), *principals))


@dataclass(frozen=True)
class EnvRef:
    """A password the nats-server reads from its environment (`$NAME` in the configuration)."""

    name: str

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Z][A-Z0-9_]*$", self.name):
            raise ValueError(f"environment variable name {self.name!r} is not usable in a "
                             "nats-server configuration")


def _quote(value: str) -> str:
    # NATS configuration accepts JSON strings; quoting keeps `$JS.API.>` a literal subject.
    return json.dumps(value)


def _subjects(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(_quote(v) for v in values) + "]"


def env_refs(plane_: Plane) -> dict[str, str | EnvRef]:
    """Every user's password as `$NATS_<USER>_PASSWORD` (e.g. `$NATS_AGENT_ACME_PASSWORD`),
    for a configuration the server completes from its environment."""
    refs: dict[str, str | EnvRef] = {}
    taken: dict[str, str] = {}
    for u in plane_.users:
        name = "NATS_" + u.upper().replace("-", "_") + "_PASSWORD"
        if name in taken:  # `Acme` and `acme`, or `a-b` and `a_b`
            raise ValueError(f"users {taken[name]!r} and {u!r} would share ${name}")
        taken[name] = u
        refs[u] = EnvRef(name)
    return refs


def render(plane_: Plane, passwords: Mapping[str, str | EnvRef]) -> str:
    """The `authorization` block: every principal with its password (a literal, or `$NAME`)
    and its permissions. No user has more than its allow lists; there is no anonymous user."""
    missing = [u for u in plane_.users if u not in passwords]
    if missing:
        raise ValueError(f"no password for NATS users {missing}")
    lines = ["authorization {", "  users: ["]
    for p in plane_.principals:
        pw = passwords[p.user]
        pw_text = f"${pw.name}" if isinstance(pw, EnvRef) else _quote(pw)
        perm = p.permissions
        lines += [
            "    {",
            f"      user: {_quote(p.user)}",
            f"      password: {pw_text}",
            "      permissions: {",
            f"        publish: {{ allow: {_subjects(perm.publish)} }}",
            f"        subscribe: {{ allow: {_subjects(perm.subscribe)} }}",
        ]
        if perm.allow_responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Tls:
    """Server-side TLS: certificate, key, and (for client certificates) the CA to verify."""

    cert_file: str
    key_file: str
    ca_file: str | None = None
    verify_clients: bool = False


def server_config(plane_: Plane, passwords: Mapping[str, str | EnvRef], *, host: str,
                  port: int, store_dir: str, tls: Tls | None = None) -> str:
    """A whole single-node nats-server configuration with JetStream and this plane's users."""
    lines = [f"host: {_quote(host)}", f"port: {port}",
             f"jetstream {{ store_dir: {_quote(store_dir)} }}"]
    if tls is not None:
        lines.append("tls {")
        lines += [f"  cert_file: {_quote(tls.cert_file)}", f"  key_file: {_quote(tls.key_file)}"]
        if tls.ca_file:
            lines.append(f"  ca_file: {_quote(tls.ca_file)}")
        if tls.verify_clients:
            lines.append("  verify: true")
        lines.append("}")
    return "\n".join(lines) + "\n" + render(plane_, passwords)
