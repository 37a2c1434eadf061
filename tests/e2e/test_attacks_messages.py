"""Forgeries the broker's permissions do not stop, against the real processes: what the ledger,
the dispatcher and the reconciler refuse on their own (defence in depth).

- A dispatch command carrying a pending operation's id and epoch but another tool and other
  arguments (an insider on the bus, or a broker without permissions) never reaches a provider:
  the claim names the command, and the ledger refuses a command that is not its operation's.
- A dispatcher's own credentials cannot claim an operation for another tool, or without saying
  which command it is about to run.
- A validly signed webhook from another provider, and a tokenless "not applied" resent under new
  ids, change nothing; the provider's ground truth shows no duplicate.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import nats
import pytest
from standardwebhooks import Webhook

from effectledger_core.config import Settings
from tests.support.cluster import Cluster, wait_until
from tests.support.natsauth import PrivateBroker, private_broker, speaker


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    # Decided by the services' message handling, the same on both databases (the ledger's
    # checks have integration tests on both); SQLite keeps these processes light.
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


async def _journal_has(cluster: Cluster, op_id: str, kind: str, reason: str) -> None:
    async def found() -> bool:
        return any(e["kind"] == kind and reason in json.dumps(e.get("detail"))
                   for e in await cluster.journal(op_id))

    await wait_until(found, 30, what=f"a {kind} ({reason}) entry for {op_id}")


async def test_a_forged_dispatch_command_for_another_tool_never_reaches_the_provider(
        make_cluster: Callable[..., Cluster], settings: Settings) -> None:
    """The issue's attack: `dispatch.v1.<wire tool>` with the id and epoch of a pending
    ticket. The real command still succeeds; the wire route is never called."""
    c = make_cluster()
    await c.start_sandbox()
    await c.start_ledger()
    op = await c.submit_ok("create_ticket", {"title": "real"})  # pending: no dispatcher yet
    forged = {"schema_version": 1, "type": "dispatch_attempt", "operation_id": op["id"],
              "operation_key": op["operation_key"], "epoch": op["epoch"], "tool": "fast_wire",
              "arguments": {"amount": 1000000}, "arguments_digest": op["arguments_digest"],
              "catalog_digest": "sha256:0", "contract_revision": "2026-11-01"}
    nc = await nats.connect(settings.nats_url)
    try:
        await nc.jetstream().publish(settings.subjects.dispatch("fast_wire"),
                                     json.dumps(forged).encode(),
                                     headers={"Nats-Msg-Id": "forged-" + op["id"]})
    finally:
        await nc.close()
    await c.start_dispatcher()
    done = await c.wait_state(op["id"], ["succeeded", "failed", "ambiguous", "needs_review"],
                              60)
    await _journal_has(c, op["id"], "claim_rejected", "command_mismatch")
    assert done["state"] == "succeeded", done
    truth = await c.truth()
    assert (await c.key_truth(op["operation_key"]))["applied"] == 1
    wire = [r for r in (await c.sandbox.get("/_requests")).json().get("requests", [])
            if "wire" in json.dumps(r)]
    assert wire == [], wire
    assert (truth["total_requests"], truth["total_applied"]) == (1, 1)


@pytest.fixture
async def broker(settings: Settings, tmp_path: Path) -> AsyncIterator[PrivateBroker]:
    with private_broker(tmp_path, settings.subjects) as b:
        yield b


async def test_a_dispatchers_own_credentials_cannot_claim_for_another_command(
        make_cluster: Callable[..., Cluster], broker: PrivateBroker) -> None:
    """A compromised dispatcher may claim on its own subject only, and only for the command the
    ledger holds: another tool is refused (journaled), an unnamed command is an error."""
    c = make_cluster(env={"EFFECTLEDGER_NATS_URL": broker.url})
    await c.start_sandbox()
    await c.start_ledger(env=broker.env("ledger"))
    s = broker.subjects
    async with speaker(broker, "agent-acme") as acme:
        reply = await acme.request(s.rpc_intents_for("acme"),
                                   {"tool": "create_ticket", "arguments": {"title": "t"}})
    assert reply["ok"] is True, reply
    op = reply["operation"]  # pending: no dispatcher runs
    claim = {"schema_version": 1, "type": "claim_attempt", "operation_id": op["id"],
             "epoch": op["epoch"], "attempt_id": "forged", "dispatcher_id": "dispatcher"}
    async with speaker(broker, "dispatcher-dispatcher") as d:
        unnamed = await d.request(s.rpc_claim_by("dispatcher"), claim)
        assert unnamed["ok"] is False and unnamed["error"]["code"] == "invalid_request"
        other = await d.request(s.rpc_claim_by("dispatcher"), {
            **claim, "tool": "fast_wire", "arguments_digest": "sha256:" + "0" * 64})
        assert other["status"] == "command_mismatch", other
    await _journal_has(c, op["id"], "claim_rejected", "command_mismatch")
    now = await c.operation(op["id"])
    assert (now["state"], now["attempts"]) == ("pending", [])
    assert (await c.truth())["total_requests"] == 0


def _signed(secret: str, webhook_id: str, body: str) -> dict[str, str]:
    at = datetime.now(UTC)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(int(at.timestamp())),
            "webhook-signature": Webhook(secret).sign(webhook_id, at, body),
            "content-type": "application/json"}


async def test_another_providers_webhook_and_a_resent_tokenless_one_change_nothing(
        make_cluster: Callable[..., Cluster]) -> None:
    """A webhook-only tool's call is applied but its answer lost (ambiguous). A validly signed
    webhook from provider acme (applied, then not applied) does not speak for it; the
    sandbox's own tokenless "not applied", naming no attempt, resent under new ids, retries
    nothing: the provider applied the effect exactly once."""
    acme = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    c = make_cluster()
    await c.start_sandbox()
    await c.start_ledger()
    await c.start_dispatcher()
    await c.start_reconciler(env={"EFFECTLEDGER_WEBHOOK_SECRETS": json.dumps(
        {"sandbox": [c.webhook_secret], "acme": [acme]})})
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": "plainhooks"}, "action": {"kind": "drop_after_apply"}, "times": 1})
    resp.raise_for_status()
    op = await c.submit_ok("fast_post", {"text": "hello"})
    amb = await c.wait_state(op["id"], "ambiguous", 60)
    key = op["operation_key"]
    url = f"{c.reconciler_url}/v1/webhooks"
    async with httpx.AsyncClient(timeout=30) as client:
        for i, event in enumerate(("effect.not_applied", "effect.applied")):
            body = json.dumps({"type": event, "data": {"idempotency_key": key, "final": True,
                                                       "fencing_token": amb["epoch"]}})
            r = await client.post(f"{url}/acme", content=body,
                                  headers=_signed(acme, f"acme-{i}", body))
            assert r.status_code == 200, r.text
        body = json.dumps({"type": "effect.not_applied",
                           "data": {"idempotency_key": key, "final": True}})
        for i in range(3):  # the same tokenless event under new ids
            r = await client.post(f"{url}/sandbox", content=body,
                                  headers=_signed(c.webhook_secret, f"sbx-{i}", body))
            assert r.status_code == 200, r.text
    await _journal_has(c, op["id"], "webhook_refused", "provider_not_bound")

    async def all_kept() -> bool:
        n = await c.db_scalar("SELECT count(*) FROM webhook_events WHERE applied IS NOT NULL")
        return int(n) == 5

    await wait_until(all_kept, 30, what="all five webhooks to be stored and set aside")
    now = await c.operation(op["id"])
    assert (now["state"], now["epoch"]) == ("ambiguous", amb["epoch"]), now
    assert (await c.key_truth(key))["applied"] == 1
