"""Crashes at every named crash point, with real processes killed by SIGKILL.

Each test arms one crash point in one process (`EFFECTLEDGER_CRASH_POINTS`), submits one
intent so the crash hits that operation, restarts the process without crash points, and checks
the ledger's verdict against the sandbox's ground truth. A short ack_wait makes JetStream
redeliver a dead consumer's messages within seconds.
"""

from __future__ import annotations

import signal
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, wait_until

pytestmark = pytest.mark.slow
FAST_REDELIVERY = {"EFFECTLEDGER_ACK_WAIT_S": "3", "EFFECTLEDGER_INBOX_ACK_WAIT_S": "3"}
# A ledger killed between an intent's commit and its command's publish leaves the outbox row
# leased to the direct publisher (10 s by default): the restarted ledger's relay publishes it
# once that lease runs out, and so does one killed after the publish but before the mark (on
# PostgreSQL an intent alone's command went out with its statement: the relay's copy has the
# same message id, which JetStream drops).
SHORT_LEASES = {"EFFECTLEDGER_DIRECT_PUBLISH_LEASE_S": "2", "EFFECTLEDGER_RELAY_LEASE_S": "2"}
# The dispatcher's outcome by request switched off: every outcome goes by the stream.
STREAM_ONLY = {"EFFECTLEDGER_DISPATCHER_OUTCOME_REQUEST_TIMEOUT_S": "0"}
KILLED = -signal.SIGKILL
# create_ticket with a 2 s timeout (catalog.toml): a dispatcher that finds the claim of a dead
# one in flight waits the tool's timeout plus LOST_GRACE_S before it may declare it lost.
CRASH_TOOL = "crash_ticket"


def _kinds(journal: list[dict[str, Any]]) -> Counter[str]:
    return Counter(e["kind"] for e in journal)


async def _stream_drained(c: Cluster, stream: str, timeout_s: float = 60.0) -> None:
    """Wait until a work-queue stream is empty: every message in it has been acked."""
    async def empty() -> bool:
        return await c.stream_messages(stream) == 0

    await wait_until(empty, timeout_s, interval=0.2, what=f"stream {stream} to be drained")


async def _crashed_dispatcher(make_cluster: Any, point: str,
                              env: dict[str, str] | None = None
                              ) -> tuple[Cluster, dict[str, Any]]:
    """Sandbox + ledger + dispatcher d1 armed at `point`; one intent; d1 dies; d2 starts."""
    c: Cluster = make_cluster(env=FAST_REDELIVERY)
    await c.start_sandbox()
    await c.start_ledger()
    await c.start_dispatcher("d1", crash_points=[point], env=env)
    op = await c.submit_ok(CRASH_TOOL, {"title": f"crash at {point}"}, key="crash-op")
    assert await c.wait_exit("d1") == KILLED, c.tail(c.proc("d1"))
    await c.start_dispatcher("d2")
    return c, op


@pytest.mark.parametrize("point", ["dispatcher.after_claim", "dispatcher.before_call"])
async def test_dispatcher_lost_before_the_call_is_ambiguous_and_never_calls(
        make_cluster: Any, point: str) -> None:
    """Claimed, then killed before the request left: the redelivered command is declared
    ambiguous (dispatcher_lost_mid_attempt) and the provider never sees a request."""
    c, op = await _crashed_dispatcher(make_cluster, point)
    final = await c.wait_state(op["id"], "ambiguous", 60)
    await _stream_drained(c, c.settings.subjects.dispatch_stream)

    journal = await c.journal(op["id"])
    claimed = [e for e in journal if e["kind"] == "attempt_claimed"]
    recorded = [e for e in journal if e["kind"] == "outcome_recorded"]
    assert len(claimed) == 1 and claimed[0]["actor"] == "d1"
    assert len(recorded) == 1, journal
    detail = recorded[0]["detail"]
    assert detail["type"] == "outcome_ambiguous"
    assert detail["reason"] == "dispatcher_lost_mid_attempt"
    assert detail["attempt_id"] == claimed[0]["detail"]["attempt_id"]
    assert detail["dispatcher_id"] == "d2"
    assert final["attempts"][0]["status"] == "outcome_ambiguous"

    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 0 and truth["applied"] == 0, truth
    assert (await c.truth())["total_requests"] == 0


async def test_dispatcher_lost_after_the_response_is_ambiguous_and_never_calls_twice(
        make_cluster: Any) -> None:
    """The provider applied the effect, the dispatcher died before reporting it: ambiguous,
    and the provider saw exactly one request (no blind retry)."""
    c, op = await _crashed_dispatcher(make_cluster, "dispatcher.after_response")
    await c.wait_state(op["id"], "ambiguous", 60)
    await _stream_drained(c, c.settings.subjects.dispatch_stream)

    recorded = [e for e in await c.journal(op["id"]) if e["kind"] == "outcome_recorded"]
    assert len(recorded) == 1
    assert recorded[0]["detail"]["reason"] == "dispatcher_lost_mid_attempt"
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth


async def test_dispatcher_lost_after_publishing_the_outcome_succeeds_once(
        make_cluster: Any) -> None:
    """Outcome published, command not acked: the redelivery finds the attempt finished and
    only acks; the operation is succeeded with one request and one recorded outcome. (The
    stream path: with the outcome request on, the ledger's answer skips this point.)"""
    c, op = await _crashed_dispatcher(make_cluster, "dispatcher.after_outcome_publish",
                                      env=STREAM_ONLY)
    await c.wait_state(op["id"], "succeeded", 60)
    # The redelivered command is acked by d2 (already claimed, outcome recorded).
    await _stream_drained(c, c.settings.subjects.dispatch_stream)
    await _stream_drained(c, c.settings.subjects.events_stream)

    kinds = _kinds(await c.journal(op["id"]))
    assert kinds == {"intent_accepted": 1, "attempt_claimed": 1, "outcome_recorded": 1}, kinds
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth
    assert await c.stream_stored(c.settings.subjects.events_stream) == 1  # the outcome


async def test_dispatcher_lost_after_the_ledger_committed_its_outcome_succeeds_once(
        make_cluster: Any) -> None:
    """The outcome sent by request and committed, the command not acked: the redelivered
    command's claim is refused (already claimed, outcome recorded), so d2 only acks. One
    request to the provider, one recorded outcome, and no copy of it ever went to the
    stream."""
    c, op = await _crashed_dispatcher(make_cluster, "dispatcher.after_outcome_request")
    await c.wait_state(op["id"], "succeeded", 60)
    await _stream_drained(c, c.settings.subjects.dispatch_stream)

    kinds = _kinds(await c.journal(op["id"]))
    assert kinds == {"intent_accepted": 1, "attempt_claimed": 1, "outcome_recorded": 1}, kinds
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth
    assert await c.stream_stored(c.settings.subjects.events_stream) == 0


async def test_ledger_killed_after_committing_an_intent_still_dispatches_it(
        make_cluster: Any) -> None:
    """The caller gets no answer, but the intent was committed: after a restart it is relayed
    and succeeds once, and resubmitting the same key finds the same operation."""
    c: Cluster = make_cluster(env={**FAST_REDELIVERY, **SHORT_LEASES})
    await c.start_sandbox()
    await c.start_ledger(crash_points=["ledger.after_intent_commit"])
    await c.start_dispatcher()
    with pytest.raises(httpx.TransportError):
        await c.submit("create_ticket", {"title": "committed"}, key="lost-answer")
    assert await c.wait_exit("ledger") == KILLED

    await c.start_ledger()
    again = await c.submit("create_ticket", {"title": "committed"}, key="lost-answer")
    assert again.status_code == 200, again.text  # it existed before this retry
    op = again.json()
    await c.wait_state(op["id"], "succeeded", 60)
    assert len(await c.list_all()) == 1
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth


async def _commands_in(c: Cluster, stream: str) -> Counter[str]:
    """How many dispatch commands the stream holds for each operation id."""
    import json

    import nats

    nc = await nats.connect(c.settings.nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        found: Counter[str] = Counter()
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            found[json.loads(msg.data or b"{}")["operation_id"]] += 1
        return found
    finally:
        await nc.close()


def _one_statement_intents(c: Cluster) -> None:
    if c.settings.database_url.startswith("sqlite"):
        pytest.skip("an intent alone is one statement, published with it, on PostgreSQL only")


async def test_ledger_killed_with_the_command_out_and_nothing_marked_still_settles_once(
        make_cluster: Any) -> None:
    """The command went out with the intent's statement, the statement committed, and the
    ledger died before it marked anything (`ledger.intent.after_early_publish`). The claim
    waits for the restarted ledger; the row keeps its lease until then; one request in the
    end, and the caller's retry finds the same operation."""
    c: Cluster = make_cluster(env={**FAST_REDELIVERY, **SHORT_LEASES})
    _one_statement_intents(c)
    await c.start_sandbox()
    await c.start_ledger(crash_points=["ledger.intent.after_early_publish"])
    await c.start_dispatcher()
    with pytest.raises(httpx.TransportError):
        await c.submit("create_ticket", {"title": "early"}, key="early-crash")
    assert await c.wait_exit("ledger") == KILLED

    await c.start_ledger()
    again = await c.submit("create_ticket", {"title": "early"}, key="early-crash")
    assert again.status_code == 200, again.text  # committed before the crash
    op = again.json()
    await c.wait_state(op["id"], "succeeded", 60)
    assert len(await c.list_all()) == 1
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth


async def test_a_retried_keys_command_is_refused_at_its_claim_and_leaves_nothing_behind(
        make_cluster: Any) -> None:
    """A retry of a key whose operation exists publishes a command with its statement, which
    then writes nothing: a command for an operation that was never created. Its claim is not
    found three times (asked again after 20 ms and 0.25 s), then it is dropped: one request at
    the provider, nothing left in the dispatch stream."""
    c: Cluster = make_cluster(env=FAST_REDELIVERY)
    _one_statement_intents(c)
    await c.start()
    op = await c.submit_ok("create_ticket", {"title": "retried"}, key="retried-key")
    await c.wait_state(op["id"], "succeeded", 30)
    again = await c.submit("create_ticket", {"title": "retried"}, key="retried-key")
    assert (again.status_code, again.json()["id"]) == (200, op["id"])
    dispatch_stream = c.settings.subjects.dispatch_stream
    assert await c.stream_stored(dispatch_stream) == 2  # the command and the retry's

    async def refused_and_gone() -> bool:
        metrics = (await c.ledger.get("/metrics")).text
        return ('effectledger_claims_total{status="not_found"} 3.0' in metrics
                and await c.stream_messages(dispatch_stream) == 0)

    await wait_until(refused_and_gone, 20, what="the stray refused three times and acked")
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth
    assert len(await c.list_all()) == 1


async def test_relay_killed_after_publishing_republishes_with_the_same_message_id(
        make_cluster: Any) -> None:
    """Published but never marked: after a restart the lease expires and the row is published
    again with the same Nats-Msg-Id, which JetStream deduplicates; one request in the end."""
    c: Cluster = make_cluster(env={**FAST_REDELIVERY, **SHORT_LEASES})
    dispatch_stream = c.settings.subjects.dispatch_stream
    await c.start_sandbox()
    await c.start_ledger(crash_points=["ledger.relay.after_publish"])
    # The relay may die before or after this answer is written; both are fine.
    try:
        await c.submit("create_ticket", {"title": "relayed"}, key="relay-crash")
    except httpx.TransportError:
        pass
    assert await c.wait_exit("ledger") == KILLED
    assert await c.stream_messages(dispatch_stream) == 1

    await c.start_ledger()
    resp = await c.submit("create_ticket", {"title": "relayed"}, key="relay-crash")
    assert resp.status_code == 200, resp.text
    op = resp.json()

    async def republished() -> bool:
        return bool((await c.stats())["outbox"] == {"published": 1})

    # No dispatcher yet: the row leaves "publishing" only by being published again.
    await wait_until(republished, 30, interval=0.1, what="the expired lease to be republished")
    # The duplicate was dropped: the operation's command is in the stream once. (On PostgreSQL
    # the retry's own command went out with its statement, which then found the key taken: a
    # command for an operation never created, which its claims will refuse.)
    commands = await _commands_in(c, dispatch_stream)
    assert commands[op["id"]] == 1, commands
    assert sum(commands.values()) == (1 if c.settings.database_url.startswith("sqlite") else 2)

    await c.start_dispatcher()
    await c.wait_state(op["id"], "succeeded", 60)
    await _stream_drained(c, dispatch_stream)
    kinds = _kinds(await c.journal(op["id"]))
    assert kinds == {"intent_accepted": 1, "attempt_claimed": 1, "outcome_recorded": 1}, kinds
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth


async def test_ledger_killed_after_the_inbox_commit_deduplicates_the_redelivery(
        make_cluster: Any) -> None:
    """The outcome was committed but not acked: after a restart JetStream redelivers it and
    the inbox drops it as a duplicate; one outcome_recorded entry, one request."""
    c: Cluster = make_cluster(env=FAST_REDELIVERY)
    await c.start_sandbox()
    await c.start_ledger(crash_points=["ledger.inbox.after_commit"])
    await c.start_dispatcher()
    op = await c.submit_ok("create_ticket", {"title": "inbox"}, key="inbox-crash")
    assert await c.wait_exit("ledger") == KILLED

    await c.start_ledger()
    await c.wait_state(op["id"], "succeeded", 30)
    # The unacked outcome comes back after the inbox consumer's ack_wait and is acked as a
    # duplicate; the work-queue stream is empty only once that has happened.
    await _stream_drained(c, c.settings.subjects.events_stream, timeout_s=90)
    kinds = _kinds(await c.journal(op["id"]))
    assert kinds == {"intent_accepted": 1, "attempt_claimed": 1, "outcome_recorded": 1}, kinds
    assert await c.db_scalar("SELECT count(*) FROM inbox") == 1
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth


async def test_a_claim_whose_reply_was_lost_is_reasked_by_the_same_attempt(
        make_cluster: Any) -> None:
    """The ledger stalls while a claim is asked (SIGSTOP): the claim is recorded later but its
    replies are lost. The command comes back to the same dispatcher, which asks again with the
    same attempt id, is re-granted, and calls the provider once; nothing turns ambiguous."""
    # The default ack_wait (30 s): the command must come back through the dispatcher's own nak,
    # not through an ack_wait expiring during its claim tries.
    c: Cluster = make_cluster()
    await c.start_sandbox()
    await c.start_ledger()
    op = await c.submit_ok("create_ticket", {"title": "stalled ledger"}, key="stalled")

    async def published() -> bool:
        return bool((await c.stats())["outbox"] == {"published": 1})

    await wait_until(published, 30, what="the dispatch command to be published")
    c.pause("ledger")
    try:
        await c.start_dispatcher(env={"EFFECTLEDGER_CLAIM_TIMEOUT_S": "1"})
        # All three tries of the first claim time out: the dispatcher gives up and naks.
        await wait_until(lambda: c.log_count("dispatcher", f"claim for {op['id']}:") >= 3, 60,
                         what="the dispatcher to give up on its first claim")
    finally:
        c.resume("ledger")  # it now records the claim; the replies go nowhere

    final = await c.wait_state(op["id"], ["succeeded", "ambiguous"], 60)
    journal = await c.journal(op["id"])
    assert final["state"] == "succeeded", journal
    kinds = _kinds(journal)
    assert kinds == {"intent_accepted": 1, "attempt_claimed": 1, "outcome_recorded": 1}, kinds
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth
