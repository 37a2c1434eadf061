"""The message contract as an AsyncAPI 3 document, generated from the pydantic models.

`python -m effectledger_bus.asyncapi > docs/asyncapi.json` regenerates the committed copy; a test
fails when the two differ, so the documented contract cannot drift from the code.

Built from the models here rather than by FastStream's generator: declaring the channels on a
FastStream broker gives one merged payload per channel (a request and its replies become one
anonymous union) and a `correlation_id` header that the services, on nats-py, never send. This
document names every message, and the replies of each request-reply subject.
"""

from __future__ import annotations

import json
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
    IntentReply,
    OperationQuery,
    OperationReply,
    OperationWait,
    OutcomeAmbiguous,
    ReconcileOperation,
    SubmitIntent,
    VerdictReached,
    WebhookReceived,
)
from effectledger_core.subjects import Subjects

_CHANNELS: list[tuple[str, str, str, list[type[BaseModel]], str]] = [
    # (channel id, address, action from the ledger's point of view, messages, description)
    ("intents", "rpc_intents", "receive", [SubmitIntent, IntentReply, ErrorReply],
     "Request-reply: agents submit intents. Reply: IntentReply, or ErrorReply for anything the "
     "ledger could not serve."),
    ("intents_tenant", "rpc_intents_for", "receive", [SubmitIntent, IntentReply, ErrorReply],
     "Request-reply: an agent submits intents on its own tenant's subject (NATS permissions "
     "let it publish nowhere else); the ledger takes the tenant from the subject, and refuses "
     "a payload naming another tenant (ErrorReply invalid_request)."),
    ("claim", "rpc_claim", "receive", [ClaimAttempt, ClaimReply, ErrorReply],
     "Request-reply: a dispatcher claims an attempt before calling the provider. Reply: "
     "ClaimReply, or ErrorReply."),
    ("claim_dispatcher", "rpc_claim_by", "receive", [ClaimAttempt, ClaimReply, ErrorReply],
     "Request-reply: a dispatcher's own claim subject; a claim naming another dispatcher is "
     "refused (ErrorReply invalid_request), so the claim's recorded holder is the sender."),
    ("dispatch", "dispatch_all", "send", [DispatchAttempt],
     "JetStream (stream <P>_DISPATCH, work queue): commands relayed from the ledger outbox; "
     "Nats-Msg-Id = outbox id (+ .r<n> for sweeper republishes). Consumer: durable "
     "'dispatcher', explicit acks."),
    ("outcomes", "ledger_all", "receive",
     [AttemptSucceeded, AttemptAccepted, AttemptFailed, OutcomeAmbiguous, VerdictReached,
      WebhookReceived, DeadLetter],
     "JetStream (stream <P>_EVENTS): everything the ledger's inbox consumes. Outcomes from "
     "dispatchers (<prefix>.ledger.v1.outcome.<dispatcher_id>.<type>: one naming another "
     "dispatcher is dead-lettered; Nats-Msg-Id = <type>:<attempt_id>), "
     "verdicts from reconcilers (<prefix>.ledger.v1.verdict, Nats-Msg-Id = "
     "verdict:<op>:<epoch>:<verdict>), verified webhooks (<prefix>.ledger.v1.webhook, "
     "Nats-Msg-Id = webhook:<provider>:<id>) and dead letters (<prefix>.ledger.v1.deadletter). "
     "Consumer: durable 'ledger-inbox', explicit acks."),
    ("reconcile", "ambiguous", "send", [ReconcileOperation],
     "JetStream (stream <P>_EVENTS): reconciliation commands for ambiguous or asynchronously "
     "accepted attempts, from the ledger outbox. Consumer: durable 'reconciler', explicit acks."),
    ("operation", "rpc_operation", "receive", [OperationQuery, OperationReply, ErrorReply],
     "Request-reply, read-only: OperationQuery → OperationReply, or ErrorReply (code "
     "not_found for an unknown operation). Used by reconcilers before deciding."),
    ("operation_tenant", "rpc_operation_for", "receive",
     [OperationQuery, OperationReply, ErrorReply],
     "Request-reply, read-only, on an agent's own tenant's subject: another tenant's "
     "operation reads exactly like a missing one (not_found); no provider reference."),
    ("operation_wait_tenant", "rpc_operation_wait_for", "receive",
     [OperationWait, OperationReply, ErrorReply],
     "Request-reply, read-only, on an agent's own tenant's subject: OperationWait → "
     "OperationReply once the operation is settled or wait_s is over; another tenant's "
     "operation reads exactly like a missing one (not_found)."),
    ("operation_wait", "rpc_operation_wait", "receive", [OperationWait, OperationReply,
                                                          ErrorReply],
     "Request-reply, read-only: OperationWait → OperationReply once the operation is settled "
     "(succeeded, failed, cancelled, needs_review, awaiting_approval) or when wait_s (capped "
     "by the ledger) is over; ErrorReply for bad input or an unknown operation."),
]
# Channels whose last token names the sender, bound by NATS permissions.
_PARAMETER = {"rpc_intents_for": "{tenant}", "rpc_operation_for": "{tenant}",
              "rpc_operation_wait_for": "{tenant}",
              "rpc_claim_by": "{dispatcher_id}"}


def build(subjects: Subjects | None = None) -> dict[str, Any]:
    subjects = subjects or Subjects()
    doc: dict[str, Any] = {
        "asyncapi": "3.0.0",
        "info": {"title": "effectledger message contract", "version": "1",
                 "description": "Subjects are versioned (v1). Every message is JSON with "
                                "schema_version: 1 and rejects unknown fields."},
        "channels": {}, "operations": {}, "components": {"messages": {}, "schemas": {}},
    }
    for cid, attr, action, models, description in _CHANNELS:
        address = getattr(subjects, attr)
        if attr in _PARAMETER:
            address = address(_PARAMETER[attr])
        if attr == "ledger_all":
            address = f"{subjects.prefix}.ledger.v1.>"
        refs = {}
        for model in models:
            name = model.__name__
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for dname, dschema in schema.pop("$defs", {}).items():
                doc["components"]["schemas"][dname] = dschema
            doc["components"]["schemas"][name] = schema
            doc["components"]["messages"][name] = {
                "name": name, "contentType": "application/json",
                "payload": {"$ref": f"#/components/schemas/{name}"}}
            refs[name] = {"$ref": f"#/components/messages/{name}"}
        doc["channels"][cid] = {"address": address, "description": description,
                                "messages": refs}
        doc["operations"][f"ledger_{action}_{cid}"] = {
            "action": action, "channel": {"$ref": f"#/channels/{cid}"}}
    return doc


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
