"""Hostile bytes on every NATS subject an agent may use (issue 28, item 5), property-based.

A real nats-server with the generated least-privilege users, and the ledger, a dispatcher, a
reconciler and the sandbox as processes, each with its own user. Hypothesis draws requests on
the subjects agent acme's permissions allow (its tenant's intents, operation reads and waits,
and any other subject under its tenant's prefix), with arbitrary bytes, invalid UTF-8,
JSON-escaped lone surrogates, NUL, right-to-left marks, wrong JSON types, huge payloads and
hostile headers (`Nats-Msg-Id`, `traceparent`, …). Every request is answered with a typed
reply (never `internal_error`, never silence) or finds no responder (a subject nobody
serves); nothing crashes; every operation a hostile intent created comes to rest (no wedged
operation, no redelivery loop: the consumers have nothing pending); and a legal intent
afterwards still succeeds. Bounded (examples, sizes, derandomized) to run in CI.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.errors import MaxPayloadError, NoRespondersError

from effectledger_bus import permissions
from effectledger_core.config import Settings
from effectledger_core.subjects import Subjects
from tests.support.cluster import Cluster, wait_until
from tests.support.natsauth import PrivateBroker, Speaker, private_broker, speaker

TENANT = "acme"
OBSERVER = "operator-observer"  # reads consumer positions at the end
EXAMPLES = 70
AT_REST = {"succeeded", "failed", "cancelled", "needs_review", "awaiting_approval"}
# Tools that settle by themselves against the sandbox (fast_wire waits for approval: at rest
# for this purpose); a webhook-only tool would wait for its webhook for minutes.
TOOLS = ["fast_ticket", "charge_card", "fast_wire", "fast_lookup", "fast_email",
         "create_ticket"]


@pytest.fixture
async def broker(settings: Settings, tmp_path: Path) -> AsyncIterator[PrivateBroker]:
    observer = permissions.Principal(permissions.Role.OPERATOR, OBSERVER,
                                     permissions.Permissions(publish=(">",), subscribe=(">",)))
    with private_broker(tmp_path, settings.subjects, tenants=(TENANT,),
                        others=[observer]) as b:
        yield b


@pytest.fixture
async def plane(broker: PrivateBroker, make_cluster: Callable[..., Cluster]) -> Cluster:
    c = make_cluster(env={"EFFECTLEDGER_NATS_URL": broker.url})
    await c.start_sandbox()
    await c.start_ledger(env=broker.env("ledger"))
    await c.start_dispatcher("dispatcher", env=broker.env("dispatcher-dispatcher"))
    await c.start_reconciler("reconciler", env=broker.env("reconciler-reconciler"))
    return c


# -- what an agent may send ----------------------------------------------------------------

def agent_subjects(s: Subjects) -> st.SearchStrategy[str]:
    """Concrete subjects under the agent's publish allow list (read from its permissions):
    the served ones, and any other tail under the same prefix."""
    [pattern] = permissions.agent(s, TENANT).permissions.publish
    assert pattern.endswith(".>")
    head = pattern[:-2]
    intents, reads = s.rpc_intents_for(TENANT), [s.rpc_operation_for(TENANT),
                                                 s.rpc_operation_wait_for(TENANT)]
    # A subject token: no whitespace, dots or wildcards (nats-py sends what it is given).
    token = st.text(st.characters(blacklist_categories=["Cs", "Zs", "Zl", "Zp", "Cc"],
                                  blacklist_characters=".*>"), min_size=1, max_size=12)
    other = st.lists(token, min_size=1, max_size=3).map(lambda t: head + "." + ".".join(t))
    # Intents most (what they admit runs through the whole pipeline), one case in eight on a
    # subject nobody serves.
    kinds = ["intents"] * 4 + ["read"] * 3 + ["other"]
    return st.sampled_from(kinds).flatmap(
        lambda k: st.just(intents) if k == "intents" else
        st.sampled_from(reads) if k == "read" else other)


# Text with what breaks naive handling: NUL, lone surrogates, RTL overrides, controls, and
# characters from every plane.
hostile_char = st.one_of(
    st.sampled_from(["\x00", "\ud800", "\udfff", "\u202e", "\u200f", "\ufeff", "\uffff",
                     "\x7f", "\n", "\\", '"', "\U0001f600", "\u0301"]),
    st.characters())
hostile_text = st.text(hostile_char, max_size=40)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(),
                        st.integers(min_value=2**63, max_value=2**80),
                        st.floats(allow_nan=False), hostile_text)
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(hostile_text, inner, max_size=4)),
    max_leaves=12)


def _dump(value: Any, ascii_only: bool) -> bytes:
    # ensure_ascii writes a lone surrogate as its `\ud800` escape (valid JSON, invalid
    # Unicode); without it the raw surrogate becomes invalid UTF-8.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


intent = st.tuples(st.fixed_dictionaries({
    "tool": st.one_of(st.sampled_from(TOOLS), hostile_text, json_scalar),
    "arguments": st.one_of(st.dictionaries(hostile_text, json_value, max_size=4), json_value),
}, optional={"idempotency_key": st.one_of(hostile_text, json_scalar),
             "schema_version": st.one_of(st.just(1), json_scalar),
             "tenant": st.one_of(st.just(TENANT), hostile_text),
             "metadata": json_value}),
    st.dictionaries(hostile_text, json_value, max_size=2),  # fields nobody declared
).map(lambda parts: {**parts[1], **parts[0]})
# An intent that is well-formed but for its strings: most get admitted (and must then run
# through dispatch and settle), the rest refused with a typed code.
# Any Unicode a JSON text can carry (RTL, combining, astral, controls), without surrogates.
valid_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                     max_size=40)
plausible_intent = st.fixed_dictionaries({
    "tool": st.sampled_from(TOOLS),
    "arguments": st.dictionaries(st.one_of(valid_text, hostile_text),
                                 st.one_of(valid_text, valid_text, hostile_text, json_value),
                                 max_size=4),
}, optional={"idempotency_key": st.one_of(valid_text, hostile_text).filter(bool)})
query = st.fixed_dictionaries({"operation_id": st.one_of(hostile_text, json_scalar)},
                              optional={"wait_s": st.one_of(json_scalar, st.floats())})
_ANY: list[st.SearchStrategy[bytes]] = [
    st.binary(max_size=512),
    hostile_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.tuples(st.one_of(intent, query, json_value), st.booleans()).map(lambda v: _dump(*v)),
    # Huge: past the ledger's message limit, within the broker's.
    st.sampled_from([b"{" + b'"a":' * 50_000 + b"1", b'{"tool": "' + b"x" * 900_000 + b'"}',
                     b"[" * 100_000]),
]


def payload_for(subject: str) -> st.SearchStrategy[bytes]:
    """Anything, or (half the time) what the subject's handler reads, with hostile strings."""
    shaped = plausible_intent if subject.endswith(".intents") else query
    return st.one_of(st.tuples(shaped, st.booleans()).map(lambda v: _dump(*v)),
                     st.sampled_from(range(len(_ANY))).flatmap(lambda i: _ANY[i]))


# What nats-py can put on the wire: names are HTTP tokens, values UTF-8 (it turns CR and LF
# into spaces, so a value cannot end the header line).
header_value = st.text(st.characters(blacklist_categories=["Cs"]), max_size=60)
headers = st.one_of(st.none(), st.dictionaries(
    st.one_of(st.sampled_from(["Nats-Msg-Id", "traceparent", "tracestate", "baggage",
                               "Nats-Expected-Stream", "Nats-Expected-Last-Msg-Id"]),
              st.from_regex(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,20}", fullmatch=True)),
    header_value, max_size=4))


async def _one(acme: Speaker, subject: str, data: bytes, hdrs: dict[str, str] | None,
               accepted: list[str], served: set[str]) -> None:
    try:
        msg = await acme.nc.request(subject, data, timeout=10, headers=hdrs)
    except NoRespondersError:
        assert subject not in served, f"the ledger stopped serving {subject}"
        return  # a subject nobody serves: nothing happens
    except MaxPayloadError:
        return  # the client refuses to send it: nothing reached anybody
    reply = json.loads(msg.data)
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
    if reply["ok"]:
        op = reply["operation"]
        if subject.endswith(".intents"):
            accepted.append(op["id"])
        return
    code = reply["error"]["code"]
    assert isinstance(code, str) and code != "internal_error", (subject, data[:200], reply)


async def test_hostile_requests_on_every_agent_subject_are_refused_typed_and_nothing_wedges(
        plane: Cluster, broker: PrivateBroker) -> None:
    s = broker.subjects
    loop = asyncio.get_running_loop()
    accepted: list[str] = []
    served = {s.rpc_intents_for(TENANT), s.rpc_operation_for(TENANT),
              s.rpc_operation_wait_for(TENANT)}
    async with speaker(broker, f"agent-{TENANT}") as acme:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=agent_subjects(s).flatmap(lambda subj: st.tuples(
            st.just(subj), payload_for(subj))), hdrs=headers)
        def property_(case: tuple[str, bytes], hdrs: dict[str, str] | None) -> None:
            subject, data = case
            # Hypothesis runs in a worker thread; each case on the test's own event loop.
            asyncio.run_coroutine_threadsafe(
                _one(acme, subject, data, hdrs, accepted, served), loop).result(timeout=60)

        await asyncio.to_thread(property_)
        # Nothing crashed, and a legal intent afterwards still goes all the way.
        for name in ("ledger", "dispatcher", "reconciler"):
            assert plane.alive(name), plane.log_tails()
        legal = await acme.request(s.rpc_intents_for(TENANT),
                                   {"tool": "fast_ticket", "arguments": {"n": 1}})
        assert legal["ok"] is True, legal
        await plane.wait_state(legal["operation"]["id"], "succeeded", 60)

    # Every operation a hostile intent created came to rest: nothing wedged.
    async def all_at_rest() -> bool:
        states = [(await plane.operation(op_id))["state"] for op_id in accepted]
        return all(state in AT_REST for state in states)

    await wait_until(all_at_rest, 90, what=f"{len(accepted)} hostile operations to come to rest")
    # No redelivery loop: no consumer holds anything unacknowledged or undelivered.
    observer = broker.files.credentials[OBSERVER]
    nc = await nats.connect(broker.url, user=observer.user, password=observer.password,
                            inbox_prefix=permissions.inbox_prefix(OBSERVER).encode())
    try:
        js = nc.jetstream()

        async def drained() -> bool:
            for stream, consumer in ((s.dispatch_stream, "dispatcher"),
                                     (s.events_stream, "ledger-inbox"),
                                     (s.events_stream, "reconciler")):
                info = await js.consumer_info(stream, consumer)
                if info.num_pending or info.num_ack_pending:
                    return False
            return True

        await wait_until(drained, 60, what="every consumer to have nothing pending")
    finally:
        await nc.close()
