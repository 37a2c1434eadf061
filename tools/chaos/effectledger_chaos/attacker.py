"""The attacker: forgeries on the bus during the run, anonymously and with an agent's
credentials, the way issue 11's attacker did it with plain nats-py and the subject table.

Each round picks live operations from the ledger (as an eavesdropper would learn them) and,
once per identity, tries:
- a verdict `applied` and a verdict `not_applied` for each (reconciler id `forged-…`);
- a validly shaped webhook `applied` for its key (webhook id `forged-…`);
- a claim in a made-up dispatcher's name (`forged-dispatcher`, attempt `forged-…`) on the
  plain and on the per-dispatcher claim subject, then that attempt's `AttemptSucceeded`;
- an `AttemptFailed` naming the real attempt that holds the claim (from a made-up sender);
- a `DispatchAttempt` for the operation under a made-up key (`forged-key-…`), which a
  dispatcher would send to the provider as its `Idempotency-Key`;
- intents for another tenant (`forged-tenant`), on the trusted subject and on that tenant's;
- the reply-subject attack (issue 28): legal reads on its own tenant's subject whose reply
  subject is a stream subject (dispatch, reconcile, verdict, outcome) or another user's inbox,
  each for a made-up operation `forged-reply-…` that the answer names, so an answer written
  into a stream ends as a dead letter carrying the mark;
- the unbound-webhook attack (issue 28): a validly signed `effect.applied` for each target's
  key from `partner`, a provider the deployment takes webhooks from but that no tool names
  (webhook id `forged-unbound-…`); it must be refused, never applied.

Every forgery carries the `forged` mark in a field that the ledger or the provider keeps
(journal actor, attempt, webhook id, tenant, idempotency key), so the checker's eleventh
invariant can count, from the final state alone, the forged messages that moved an operation
or reached the provider. What NATS refused (a failed connection, a permissions violation) is
recorded per forgery for the report; it is not what the invariant rests on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime
from typing import Any

import httpx
import nats
from standardwebhooks import Webhook

from effectledger_bus.permissions import inbox_prefix

from .checker import FORGED as MARK
from .checker import REPLY_MARK
from .collect import db_rows
from .stack import ATTACKER_TENANT, PARTNER_PROVIDER, SUBJECTS, WEBHOOK_PROVIDER, Stack

FORGED_DISPATCHER = f"{MARK}-dispatcher"
FORGED_TENANT = f"{MARK}-tenant"
UNBOUND_MARK = f"{MARK}-unbound"
LIVE = ("pending", "in_flight", "ambiguous", "awaiting_confirmation")
TARGETS = 3


def _now() -> str:
    return datetime.now(UTC).isoformat()


class Attacker:
    def __init__(self, stack: Stack, log: Any) -> None:
        self.stack = stack
        self.log = log
        self.rounds = 0
        self.sent = 0

    async def run(self) -> dict[str, Any]:
        """One round: every forgery, once anonymously and once as agent `mallory`."""
        self.rounds += 1
        targets = await self._targets()
        if not targets:
            return {"round": self.rounds, "targets": 0}
        out: dict[str, Any] = {"round": self.rounds, "targets": len(targets)}
        for identity in ("anonymous", "agent"):
            out[identity] = await self._as(identity, targets)
        out["reply_subjects"] = await self._reply_subjects(len(targets))
        out["unbound_webhooks"] = await self._unbound_webhooks(targets)
        return out

    def _agent_options(self) -> dict[str, Any]:
        cred = self.stack.credential(f"agent-{ATTACKER_TENANT}")
        if cred is None:  # an open broker has no users: the agent connects bare
            return {}
        return {"user": cred.user, "password": cred.password,
                "inbox_prefix": inbox_prefix(cred.user).encode()}

    async def _reply_subjects(self, n: int) -> dict[str, Any]:
        """Legal requests with someone else's reply subject: the ledger must answer none."""
        s = SUBJECTS
        replies = [s.dispatch("idem_readback"), s.ambiguous, s.verdict, s.webhook,
                   s.outcome_by("dispatcher-1", "attempt_failed"), s.deadletter,
                   f"_INBOX_dispatcher-1.{MARK}", "_INBOX.forged"]
        try:
            nc = await nats.connect(self.stack.nats.url, connect_timeout=3,
                                    allow_reconnect=False, max_reconnect_attempts=0,
                                    error_cb=_quiet, **self._agent_options())
        except Exception as exc:
            return {"connected": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
        sent = 0
        try:
            for i in range(n):
                for reply in replies:
                    body = {"schema_version": 1,
                            "operation_id": f"{REPLY_MARK}-{self.rounds}-{i}-{sent}"}
                    await nc.publish(s.rpc_operation_for(ATTACKER_TENANT),
                                     json.dumps(body).encode(), reply=reply)
                    sent += 1
                    self.sent += 1
            with contextlib.suppress(Exception):
                await nc.flush(timeout=5)
        except Exception as exc:  # the broker may go down in the middle of a round
            return {"connected": True, "sent": sent, "error": f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        return {"connected": True, "sent": sent}

    async def _unbound_webhooks(self, targets: list[dict[str, Any]]) -> dict[str, Any]:
        """`effect.applied` for each target, validly signed by the unbound partner provider."""
        statuses: list[int | str] = []
        async with httpx.AsyncClient(timeout=5) as http:
            for n, op in enumerate(targets):
                webhook_id = f"{UNBOUND_MARK}-{self.rounds}-{n}"
                body = json.dumps({"type": "effect.applied", "data": {
                    "idempotency_key": op["operation_key"], "final": True}})
                now = datetime.now(UTC)
                headers = {"webhook-id": webhook_id,
                           "webhook-timestamp": str(int(now.timestamp())),
                           "webhook-signature": Webhook(self.stack.partner_secret).sign(
                               webhook_id, now, body),
                           "content-type": "application/json"}
                status: int | str = "not sent"
                for i in range(len(self.stack.reconciler_ports)):  # one may be down
                    try:
                        r = await http.post(f"{self.stack.reconciler_url(i)}/v1/webhooks/"
                                            f"{PARTNER_PROVIDER}", content=body, headers=headers)
                        status = r.status_code
                        break
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                statuses.append(status)
                self.sent += 1
        return {"sent": len(statuses), "statuses": statuses}

    async def _targets(self) -> list[dict[str, Any]]:
        for _ in range(20):
            try:
                rows = await db_rows(self.stack.db_direct, (
                    "SELECT o.id, o.tool, o.state, o.epoch, o.operation_key, a.id AS attempt_id, "
                    "a.dispatcher_id FROM operations o LEFT JOIN attempts a "
                    "ON a.operation_id = o.id AND a.epoch = o.epoch "
                    "ORDER BY o.created_at DESC LIMIT 200"))
                live = [r for r in rows if r["state"] in LIVE]
                return (live or rows)[:TARGETS]
            except Exception:  # the database may be the one being faulted right now
                await asyncio.sleep(0.5)
        return []

    async def _as(self, identity: str, targets: list[dict[str, Any]]) -> dict[str, Any]:
        refusals: list[str] = []

        async def on_error(exc: Exception) -> None:
            refusals.append(str(exc)[:200])

        opts = self._agent_options() if identity == "agent" else {}
        try:
            nc = await nats.connect(self.stack.nats.url, connect_timeout=3,
                                    allow_reconnect=False, max_reconnect_attempts=0,
                                    error_cb=on_error, **opts)
        except Exception as exc:
            return {"connected": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
        sent = 0
        try:
            for n, op in enumerate(targets):
                for subject, body in self._forgeries(op, f"{self.rounds}-{n}"):
                    await self._send(nc, subject, body)
                    sent += 1
            with contextlib.suppress(Exception):
                await nc.flush(timeout=5)
        except Exception as exc:  # the broker may go down in the middle of a round
            return {"connected": True, "sent": sent, "refused": len(refusals),
                    "error": f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        return {"connected": True, "sent": sent, "refused": len(refusals)}

    async def _send(self, nc: Any, subject: str, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.sent += 1
        if subject.startswith(f"{SUBJECTS.prefix}.rpc."):
            # A request, without waiting for the answer (a refused one would only time out):
            # what the ledger did with it is in its rows, which the checker reads.
            await nc.publish(subject, payload, reply=nc.new_inbox())
            return
        await nc.publish(subject, payload,
                         headers={"Nats-Msg-Id": f"{MARK}-{self.rounds}-{self.sent}"})

    def _forgeries(self, op: dict[str, Any], tag: str) -> list[tuple[str, dict[str, Any]]]:
        s, now = SUBJECTS, _now()
        base = {"schema_version": 1, "operation_id": op["id"], "epoch": op["epoch"]}
        attempt = f"{MARK}-attempt-{tag}"
        evidence = {"schema_version": 1, "source": "readback", "at": now}
        outcome = {**base, "attempt_id": attempt, "dispatcher_id": FORGED_DISPATCHER,
                   "at": now, "http_status": 200}
        claim = {**base, "type": "claim_attempt", "attempt_id": attempt,
                 "dispatcher_id": FORGED_DISPATCHER}
        out: list[tuple[str, dict[str, Any]]] = [
            (s.verdict, {**base, "type": "verdict_reached", "verdict": verdict,
                         "evidence": evidence, "reconciler_id": f"{MARK}-reconciler",
                         "at": now})
            for verdict in ("applied", "not_applied")]
        out += [
            (s.webhook, {"schema_version": 1, "type": "webhook_received",
                         "provider": WEBHOOK_PROVIDER, "webhook_id": f"{MARK}-{tag}",
                         "event_type": "effect.applied", "operation_key": op["operation_key"],
                         "outcome": "applied", "final": True, "body_digest": "0" * 64,
                         "signed_at": now, "received_at": now}),
            (s.rpc_claim, claim), (s.rpc_claim_by(FORGED_DISPATCHER), claim),
            (s.outcome("attempt_succeeded"),
             {**outcome, "type": "attempt_succeeded", "response_digest": "0" * 64}),
            (s.outcome_by(FORGED_DISPATCHER, "attempt_succeeded"),
             {**outcome, "type": "attempt_succeeded", "response_digest": "0" * 64}),
            # The same by request (issue 30): committed, if at all, in the same inbox.
            (s.rpc_outcome_by(FORGED_DISPATCHER),
             {**outcome, "type": "attempt_succeeded", "response_digest": "0" * 64}),
            (s.dispatch(op["tool"]),
             {**base, "type": "dispatch_attempt", "operation_key": f"{MARK}-key-{tag}",
              "tool": op["tool"], "arguments": {"amount": 1000000},
              "arguments_digest": "0" * 64, "catalog_digest": "0" * 64,
              "contract_revision": "forged"}),
            (s.rpc_intents, {"schema_version": 1, "tool": op["tool"], "arguments": {},
                             "tenant": FORGED_TENANT, "idempotency_key": f"{MARK}-{tag}"}),
            (s.rpc_intents_for(FORGED_TENANT),
             {"schema_version": 1, "tool": op["tool"], "arguments": {},
              "idempotency_key": f"{MARK}-t-{tag}"}),
        ]
        if op.get("attempt_id"):
            # The eavesdropped claim: the real attempt, reported failed by someone else.
            out.append((s.outcome("attempt_failed"), {
                **base, "type": "attempt_failed", "attempt_id": op["attempt_id"],
                "dispatcher_id": FORGED_DISPATCHER, "at": now, "failure_class": "permanent",
                "code": MARK, "message": MARK, "http_status": 400}))
            # By request on its own subject in another dispatcher's name: refused before any
            # commit, so it cannot take the real attempt's inbox id either.
            out.append((s.rpc_outcome_by(FORGED_DISPATCHER), {
                **base, "type": "attempt_failed", "attempt_id": op["attempt_id"],
                "dispatcher_id": f"{MARK}-holder", "at": now, "failure_class": "permanent",
                "code": MARK, "message": MARK, "http_status": 400}))
        return out


async def _quiet(_: Exception) -> None:
    return None  # refusals and outages are expected; nats-py would print them
