"""Least privilege on NATS, with real processes: the ledger, a dispatcher, a reconciler and the
sandbox each connect with their own user to a private nats-server configured as
`effectledger up` configures it. Every forgery of issue 11 is tried anonymously, with an
agent's credentials and with another service's; each is refused by NATS (a permissions
violation for exactly that subject) or by the ledger, and the sandbox's ground truth shows no
effect from any of them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.errors import NoServersError

from effectledger_core.config import Settings
from tests.support.cluster import Cluster, wait_until
from tests.support.natsauth import PrivateBroker, private_broker, speaker

NOW = datetime.now(UTC).isoformat()
DISPATCHER, RECONCILER = "dispatcher-dispatcher", "reconciler-reconciler"


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    # Who may say what is decided by the broker and the ledger's message handling, the same on
    # both databases; SQLite keeps this suite's processes light.
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
async def broker(settings: Settings, tmp_path: Path) -> AsyncIterator[PrivateBroker]:
    # "evil" is a dispatcher's user that no running process holds: another service's
    # credentials in an attacker's hands.
    with private_broker(tmp_path, settings.subjects, dispatchers=("dispatcher", "evil")) as b:
        yield b


@pytest.fixture
async def plane(broker: PrivateBroker, make_cluster: Callable[..., Cluster]) -> Cluster:
    """Sandbox, ledger, dispatcher and reconciler, each with only its own NATS user."""
    c = make_cluster(env={"EFFECTLEDGER_NATS_URL": broker.url})
    await c.start_sandbox()
    await c.start_ledger(env=broker.env("ledger"))
    await c.start_dispatcher("dispatcher", env=broker.env(DISPATCHER))
    await c.start_reconciler("reconciler", env=broker.env(RECONCILER))
    return c


def _verdict(op: dict[str, Any], verdict: str) -> dict[str, Any]:
    return {"schema_version": 1, "type": "verdict_reached", "operation_id": op["id"],
            "epoch": op["epoch"], "verdict": verdict, "reconciler_id": "reconciler",
            "evidence": {"schema_version": 1, "source": "readback", "at": NOW}, "at": NOW}


def _webhook(op: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": 1, "type": "webhook_received", "provider": "sandbox",
            "webhook_id": "forged-1", "event_type": "effect.applied",
            "operation_key": op["operation_key"], "outcome": "applied", "final": True,
            "body_digest": "0" * 64, "signed_at": NOW, "received_at": NOW}


def _succeeded(op: dict[str, Any], dispatcher_id: str, attempt_id: str = "forged"
               ) -> dict[str, Any]:
    return {"schema_version": 1, "type": "attempt_succeeded", "operation_id": op["id"],
            "epoch": op["epoch"], "attempt_id": attempt_id, "dispatcher_id": dispatcher_id,
            "at": NOW, "http_status": 200, "response_digest": "0" * 64}


def _dispatch(op: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": 1, "type": "dispatch_attempt", "operation_id": op["id"],
            "operation_key": op["operation_key"], "epoch": op["epoch"], "tool": "fast_wire",
            "arguments": {"amount": 1000000}, "arguments_digest": "0" * 64,
            "catalog_digest": "0" * 64, "contract_revision": "2026-11-01"}


def _claim(op: dict[str, Any], dispatcher_id: str) -> dict[str, Any]:
    return {"schema_version": 1, "type": "claim_attempt", "operation_id": op["id"],
            "epoch": op["epoch"], "attempt_id": "forged-claim", "dispatcher_id": dispatcher_id}


async def _gated(plane: Cluster, broker: PrivateBroker) -> dict[str, Any]:
    """A wire transfer for tenant acme that waits for an operator: the forgeries' target."""
    async with speaker(broker, "agent-acme") as acme:
        reply = await acme.request(broker.subjects.rpc_intents_for("acme"),
                                   {"tool": "fast_wire", "arguments": {"amount": 5}})
    assert reply["ok"] is True, reply
    return await plane.wait_state(reply["operation"]["id"], "awaiting_approval", 30)


async def _unmoved(plane: Cluster, op: dict[str, Any], before: dict[str, Any]) -> None:
    now = await plane.operation(op["id"])
    assert (now["state"], now["epoch"], now["attempts"]) == ("awaiting_approval", op["epoch"], [])
    assert (await plane.key_truth(op["operation_key"]))["applied"] == 0
    truth = await plane.truth()
    assert (truth["total_requests"], truth["total_applied"]) == (
        before["total_requests"], before["total_applied"])


async def _events_stored(broker: PrivateBroker) -> int:
    """How many messages the events stream ever stored (read with the operator's rights)."""
    async with speaker(broker, "operator") as op:
        info = await op.nc.jetstream().stream_info(broker.subjects.events_stream)
    return int(info.state.last_seq)


async def test_the_pipeline_runs_with_each_service_holding_only_its_own_permissions(
        plane: Cluster, broker: PrivateBroker) -> None:
    """An agent's intent on its tenant's subject goes through claim, call and outcome to
    `succeeded` with every service restricted: the allow lists are complete, the outcome's
    request on the dispatcher's own subject included (answered in its own inbox, so nothing
    went to the events stream). The tenant is the subject's; a payload naming another tenant
    is refused by the ledger."""
    s = broker.subjects
    events_before = await _events_stored(broker)
    async with speaker(broker, "agent-acme") as acme:
        reply = await acme.request(s.rpc_intents_for("acme"),
                                   {"tool": "create_ticket", "arguments": {"title": "hi"}})
        assert reply["ok"] is True, reply
        op_id = reply["operation"]["id"]
        done = await plane.wait_state(op_id, "succeeded", 60)
        assert (await plane.key_truth(done["operation_key"]))["applied"] == 1
        rows = await plane.db_rows("SELECT tenant FROM operations WHERE id = :i", i=op_id)
        assert rows == [{"tenant": "acme"}]
        assert await _events_stored(broker) == events_before  # the outcome went by request

        other = await acme.request(s.rpc_intents_for("acme"), {
            "tool": "create_ticket", "arguments": {"title": "x"}, "tenant": "globex"})
        assert other["ok"] is False and other["error"]["code"] == "invalid_request", other
        read = await acme.request(s.rpc_operation_for("acme"), {"operation_id": op_id})
        assert read["ok"] is True and read["operation"]["state"] == "succeeded"
    async with speaker(broker, "agent-globex") as globex:
        # Another tenant's operation reads exactly like a missing one.
        theirs = await globex.request(s.rpc_operation_for("globex"), {"operation_id": op_id})
        missing = await globex.request(s.rpc_operation_for("globex"), {"operation_id": "nope"})
        assert theirs["ok"] is False and theirs["error"]["code"] == "not_found"
        assert theirs["error"]["message"].replace(op_id, "X") == \
            missing["error"]["message"].replace("nope", "X")


async def test_anonymous_and_wrongly_authenticated_clients_cannot_connect(
        broker: PrivateBroker) -> None:
    """No anonymous user exists: without credentials, or with a wrong password, the broker
    refuses the connection, so none of the forgeries can even be sent."""
    for kwargs in ({}, {"user": "ledger", "password": "guess"}):
        with pytest.raises((NoServersError, nats.errors.Error)):
            await nats.connect(broker.url, allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=5, **kwargs)


async def test_every_forgery_with_an_agents_credentials_is_refused_by_nats(
        plane: Cluster, broker: PrivateBroker) -> None:
    """With agent acme's credentials: verdicts, webhooks, outcomes, dispatch commands, claims,
    another tenant's intents, the trusted intent subject, the JetStream API and eavesdropping
    on the whole prefix or on others' replies are all refused by NATS; the gated operation
    does not move and the provider sees nothing."""
    s = broker.subjects
    op = await _gated(plane, broker)
    before = await plane.truth()
    forgeries = [
        (s.verdict, _verdict(op, "applied")), (s.webhook, _webhook(op)),
        (s.outcome("attempt_succeeded"), _succeeded(op, "dispatcher")),
        (s.outcome_by("dispatcher", "attempt_succeeded"), _succeeded(op, "dispatcher")),
        (s.dispatch("fast_wire"), _dispatch(op)),
        (s.rpc_claim, _claim(op, "dispatcher")),
        (s.rpc_claim_by("dispatcher"), _claim(op, "dispatcher")),
        (s.rpc_intents, {"tool": "create_ticket", "arguments": {}, "tenant": "globex"}),
        (s.rpc_intents_for("globex"), {"tool": "create_ticket", "arguments": {}}),
        (s.rpc_operation, {"operation_id": op["id"]}),
        ("$JS.API.STREAM.DELETE." + s.dispatch_stream, {}),
        ("$JS.API.STREAM.INFO." + s.events_stream, {}),
    ]
    async with speaker(broker, "agent-acme") as acme:
        for subject, body in forgeries:
            await acme.publish(subject, body)
            await acme.refused(subject)
        for wide in (f"{s.prefix}.>", "_INBOX.>", "_INBOX_ledger.>", s.dispatch_all):
            await acme.nc.subscribe(wide)
            await acme.refused(wide)
    # What NATS let through (nothing) would have reached the ledger by now; the ledger is
    # still answering, and the operation is where it was.
    await plane.wait_state(op["id"], "awaiting_approval", 5)
    await _unmoved(plane, op, before)


async def test_service_credentials_reach_only_their_own_subjects(
        plane: Cluster, broker: PrivateBroker) -> None:
    """A dispatcher cannot publish verdicts, webhooks, dispatch commands, another dispatcher's
    outcomes or claims, or change streams; a reconciler cannot publish dispatch commands,
    outcomes or claims. An outcome on a dispatcher's own subject that names another dispatcher
    is refused by the ledger (kept as a dead letter), and one for an attempt it does not hold
    is rejected and journaled. Nothing reaches the provider."""
    s = broker.subjects
    op = await _gated(plane, broker)
    before = await plane.truth()
    async with speaker(broker, DISPATCHER) as d:
        for subject, body in [
                (s.verdict, _verdict(op, "applied")), (s.webhook, _webhook(op)),
                (s.dispatch("fast_wire"), _dispatch(op)),
                (s.outcome("attempt_succeeded"), _succeeded(op, "dispatcher")),
                (s.outcome_by("other", "attempt_succeeded"), _succeeded(op, "other")),
                (s.rpc_claim_by("other"), _claim(op, "other")),
                (s.rpc_outcome_by("other"), _succeeded(op, "other")),
                (s.rpc_intents_for("acme"), {"tool": "create_ticket", "arguments": {}}),
                ("$JS.API.STREAM.UPDATE." + s.dispatch_stream, {}),
                ("$JS.API.STREAM.DELETE." + s.events_stream, {})]:
            await d.publish(subject, body)
            await d.refused(subject)
        # Its own subject, another dispatcher's name: the subject is the sender.
        await d.publish(s.outcome_by("dispatcher", "attempt_succeeded"),
                        _succeeded(op, "other"))
        # Its own subject and name, an attempt it does not hold.
        await d.publish(s.outcome_by("dispatcher", "attempt_succeeded"),
                        _succeeded(op, "dispatcher", attempt_id="not-held"))
        # A claim in another dispatcher's name on its own claim subject.
        reply = await d.request(s.rpc_claim_by("dispatcher"), _claim(op, "other"))
        assert reply["ok"] is False and reply["error"]["code"] == "invalid_request", reply
    async with speaker(broker, RECONCILER) as r:
        for subject, body in [
                (s.dispatch("fast_wire"), _dispatch(op)),
                (s.outcome_by("dispatcher", "attempt_succeeded"), _succeeded(op, "dispatcher")),
                (s.rpc_claim_by("dispatcher"), _claim(op, "dispatcher")),
                (s.rpc_outcome_by("dispatcher"), _succeeded(op, "dispatcher")),
                (s.ambiguous, {}), ("$JS.API.STREAM.DELETE." + s.dispatch_stream, {})]:
            await r.publish(subject, body)
            await r.refused(subject)

    async def dead_lettered() -> bool:
        rows = await plane.db_rows("SELECT error FROM dead_letters")
        return any("names dispatcher 'other'" in row["error"] for row in rows)

    await wait_until(dead_lettered, 30, what="the impersonating outcome to be dead-lettered")

    async def rejected() -> bool:
        journal = await plane.journal(op["id"])
        return any(e["kind"] == "outcome_rejected" for e in journal)

    await wait_until(rejected, 30, what="the outcome for an attempt not held to be rejected")
    await _unmoved(plane, op, before)


async def test_another_dispatcher_cannot_fail_an_attempt_in_flight(
        plane: Cluster, broker: PrivateBroker) -> None:
    """The issue's eavesdropped claim: while the provider holds the real request, a dispatcher
    that does not hold the claim reports the real attempt failed, on the stream and by request
    (issue 30). On the holder's subjects NATS refuses it; in the holder's name on its own
    subjects the ledger dead-letters it (by request: refused with an error reply, committed
    nothing); in its own name the ledger rejects it (not_the_claim_holder, journaled; by
    request the answer says so, after the commit). The real outcome then lands: the operation
    succeeds, applied exactly once."""
    s = broker.subjects
    held = await plane.sandbox.post("/_faults/append", json={
        "match": {"route": "idempotent"}, "action": {"kind": "delay", "seconds": 4},
        "times": 1})
    assert held.status_code == 200, held.text
    async with speaker(broker, "agent-acme") as acme:
        reply = await acme.request(s.rpc_intents_for("acme"),
                                   {"tool": "create_ticket", "arguments": {"title": "held"}})
    op_id = reply["operation"]["id"]

    async def in_flight() -> dict[str, Any] | None:
        op = await plane.operation(op_id)
        return op if op["state"] == "in_flight" and op["attempts"] else None

    op = await wait_until(in_flight, 30, what="the attempt to be in flight")
    attempt = op["attempts"][-1]["id"]

    def failed(dispatcher_id: str) -> dict[str, Any]:
        return {"schema_version": 1, "type": "attempt_failed", "operation_id": op_id,
                "epoch": op["epoch"], "attempt_id": attempt, "dispatcher_id": dispatcher_id,
                "at": NOW, "failure_class": "permanent", "code": "forged",
                "message": "forged", "http_status": 400}

    async with speaker(broker, "dispatcher-evil") as evil:
        await evil.publish(s.outcome_by("dispatcher", "attempt_failed"), failed("dispatcher"))
        await evil.refused(s.outcome_by("dispatcher", "attempt_failed"))
        await evil.publish(s.outcome_by("evil", "attempt_failed"), failed("dispatcher"))
        await evil.publish(s.outcome_by("evil", "attempt_failed"), failed("evil"))
        # The same by request: on the holder's request subject NATS refuses the publish.
        await evil.publish(s.rpc_outcome_by("dispatcher"), failed("dispatcher"))
        await evil.refused(s.rpc_outcome_by("dispatcher"))
        forged = await evil.request(s.rpc_outcome_by("evil"),
                                    {**failed("dispatcher"), "code": "forged_by_request"})
        assert forged["ok"] is False, forged
        assert (forged["error"]["code"], forged["error"]["retryable"]) == \
            ("invalid_request", False), forged
        own = await evil.request(s.rpc_outcome_by("evil"), failed("evil"))
        # Committed (its inbox id is the stream copy's: a duplicate of the one sent above),
        # and rejected there: the evil dispatcher does not hold the claim.
        assert own["ok"] is True and own["status"] in ("rejected", "duplicate"), own
        assert own["message_id"] == f"attempt_failed:{attempt}", own

    async def not_the_holder() -> bool:
        journal = await plane.journal(op_id)
        return any(e["kind"] == "outcome_rejected"
                   and e["detail"].get("reason") == "not_the_claim_holder" for e in journal)

    await wait_until(not_the_holder, 30, what="the other dispatcher's outcome to be rejected")
    done = await plane.wait_state(op_id, ["succeeded", "failed"], 60)
    assert done["state"] == "succeeded"
    assert (await plane.key_truth(done["operation_key"]))["applied"] == 1
    letters = await plane.db_rows("SELECT subject, error FROM dead_letters")
    assert any("names dispatcher 'dispatcher'" in row["error"] for row in letters), letters
    assert any(row["subject"] == s.rpc_outcome_by("evil")
               and "names dispatcher 'dispatcher'" in row["error"] for row in letters), letters


def test_credential_files_are_private(broker: PrivateBroker) -> None:
    """The server configuration and every user's credential file are mode 0600 in a 0700
    folder; an agent's file names its subjects."""
    folder = broker.files.folder
    assert folder.stat().st_mode & 0o777 == 0o700
    for f in folder.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600, f
    doc = json.loads(broker.files.credential_file("agent-acme").read_text())
    assert doc["user"] == "agent-acme" and doc["role"] == "agent"
    assert doc["intents_subject"] == broker.subjects.rpc_intents_for("acme")
