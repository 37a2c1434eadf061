"""Issue 14 end to end: one operation, one trace, across processes and a ledger restart.

The services write their spans to files (`EFFECTLEDGER_TRACES_FILE`, the OTLP-less exporter).
The test sends the intent with its own W3C `traceparent`; the ledger is killed right after
the intent's commit (before it publishes), so the dispatch command is published by the relay
of the next ledger process, from the trace context kept in the outbox row. The relay's
publish, the dispatcher's consumption, claim and provider call, and the ledger's handling of
the outcome (its request, issue 30; or the inbox's delivery, with the request off) must all be
in the test's trace, in that order, and the provider must have received the trace context
with the request. The operation's journal entries (intent, claim, outcome, and for an
ambiguous operation the reconciler's verdict) carry the trace id, and the span id of the
ledger span that handled what caused them.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def journal_traces(entries: list[dict[str, Any]]) -> dict[str, tuple[str | None, str | None]]:
    """(trace id, span id) of each kind of entry (the last entry of a kind)."""
    return {e["kind"]: (e["detail"].get("trace_id"), e["detail"].get("span_id"))
            for e in entries}


def span_id(span: dict[str, Any]) -> str:
    return str(span["context"]["span_id"]).removeprefix("0x")


def in_trace(found: list[dict[str, Any]], trace_id: str) -> list[dict[str, Any]]:
    return sorted((s for s in found if s["context"]["trace_id"] == f"0x{trace_id}"),
                  key=lambda s: s["start_time"])


@pytest.mark.parametrize("route", ["request", "stream"])
async def test_one_operation_is_one_trace_across_a_ledger_restart(
        make_cluster: Any, tmp_path: Path, route: str) -> None:
    """`route`: the outcome by request, or (the request off) on the stream via the inbox."""
    files = {name: tmp_path / f"{name}.spans.jsonl"
             for name in ("ledger1", "ledger2", "dispatcher")}
    c: Cluster = make_cluster(env={"EFFECTLEDGER_DIRECT_PUBLISH_LEASE_S": "1"})
    await c.start_sandbox()
    await c.start_ledger(crash_points=["ledger.after_intent_commit"],
                         env={"EFFECTLEDGER_TRACES_FILE": str(files["ledger1"])})
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    with pytest.raises(httpx.TransportError):  # the ledger dies before it answers
        await c.ledger.post("/v1/intents", json={"tool": "create_ticket",
                                                 "arguments": {"title": "traced"}},
                            headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    await c.wait_exit("ledger")
    await c.start_ledger(env={"EFFECTLEDGER_TRACES_FILE": str(files["ledger2"])})
    await c.start_dispatcher(env={
        "EFFECTLEDGER_TRACES_FILE": str(files["dispatcher"]),
        "EFFECTLEDGER_DISPATCHER_OUTCOME_REQUEST_TIMEOUT_S": "2" if route == "request" else "0"})

    async def succeeded() -> bool:
        ops = await c.list_all("succeeded")
        return len(ops) == 1

    await wait_until(succeeded, 60, interval=0.2, what="the operation to succeed")
    ledger = in_trace(spans(files["ledger2"]), trace_id)
    dispatcher = in_trace(spans(files["dispatcher"]), trace_id)
    names = [s["name"] for s in ledger]
    handled = "serve" if route == "request" else "consume"
    assert [n.split(" ")[0] for n in names] == ["publish", "serve", handled], names
    publish, serve_claim, inbox = ledger
    assert publish["name"] == "publish dispatch"
    assert ".claim" in serve_claim["name"], names  # the claim request, served in the trace
    if route == "request":
        assert ".rpc.v1.outcome." in inbox["name"], names  # the outcome's request, likewise
    else:
        assert inbox["name"] == "consume ledger.inbox", names
    assert publish["parent_id"] is not None  # the request's span, from the outbox row
    assert publish["resource"]["attributes"]["service.name"] == "effectledger-ledger"
    names = [s["name"] for s in dispatcher]
    assert names == ["consume dispatcher", "claim", "provider call"], names
    consume, claim, call = dispatcher
    assert consume["parent_id"] == publish["context"]["span_id"]
    assert claim["parent_id"] == call["parent_id"] == consume["context"]["span_id"]
    assert serve_claim["parent_id"] == claim["context"]["span_id"]
    if route == "request":  # asked while the dispatcher handled the command
        assert inbox["parent_id"] == consume["context"]["span_id"]
    assert call["attributes"]["effectledger.tool"] == "create_ticket"
    assert call["attributes"]["effectledger.outcome"] == "attempt_succeeded"
    # In order: the relay's publish, the claim, the provider call, the outcome's commit.
    assert (publish["start_time"] <= consume["start_time"] <= claim["start_time"]
            <= call["start_time"] <= inbox["start_time"])
    # The provider received the trace context with the request.
    [request] = (await c.sandbox.get("/_requests")).json()["requests"]
    assert request["traceparent"].split("-")[1] == trace_id, request
    # The journal names the same trace: the intent (the first ledger's request span, which
    # died with it), the claim and the outcome (the spans that handled them).
    [op] = await c.list_all("succeeded")
    entries = journal_traces(await c.journal(op["id"]))
    assert entries["intent_accepted"][0] == trace_id, entries
    assert entries["attempt_claimed"] == (trace_id, span_id(serve_claim)), entries
    assert entries["outcome_recorded"] == (trace_id, span_id(inbox)), entries


async def test_an_ambiguous_operations_trace_includes_the_reconcilers_readback(
        make_cluster: Any, tmp_path: Path) -> None:
    """The provider applies the effect and the answer is lost: the outcome is ambiguous, the
    reconcile command (relay-published from the outbox) carries the trace on, and the
    reconciler's consumption and readback are in the operation's trace.

    The relay's poll is slowed so that it publishes the reconcile command only when the inbox
    wakes it, after storing the trace context on the row (a poll in between would publish it
    without one: the context is kept best effort, after the outcome's commit)."""
    files = {name: tmp_path / f"{name}.spans.jsonl"
             for name in ("ledger", "dispatcher", "reconciler")}
    c: Cluster = make_cluster(env={"EFFECTLEDGER_WEBHOOK_WAIT_S": "1",
                                   "EFFECTLEDGER_RELAY_POLL_INTERVAL_S": "30"})
    await c.start_sandbox()
    await c.start_ledger(env={"EFFECTLEDGER_TRACES_FILE": str(files["ledger"])})
    await c.start_dispatcher(env={"EFFECTLEDGER_TRACES_FILE": str(files["dispatcher"])})
    await c.start_reconciler(env={"EFFECTLEDGER_TRACES_FILE": str(files["reconciler"])})
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": "idempotentfast"}, "action": {"kind": "drop_after_apply"},
        "times": 1})
    assert resp.status_code == 200, resp.text
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    resp = await c.ledger.post("/v1/intents", json={"tool": "fast_ticket",
                                                    "arguments": {"title": "lost answer"}},
                               headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert resp.status_code == 201, resp.text
    final = await c.wait_state(resp.json()["id"], "succeeded", 40)
    assert final["evidence"]["source"] == "readback", final

    reconciler = in_trace(spans(files["reconciler"]), trace_id)
    names = [s["name"] for s in reconciler]
    assert "consume reconciler" in names and "readback" in names, names
    dispatcher = [s["name"] for s in in_trace(spans(files["dispatcher"]), trace_id)]
    assert "provider call" in dispatcher, dispatcher
    ledger_spans = in_trace(spans(files["ledger"]), trace_id)
    ledger = [s["name"] for s in ledger_spans]
    assert ledger[0] == "POST /v1/intents" and "publish reconcile" in ledger, ledger
    # Intent, claim, the ambiguous outcome and the reconciler's verdict: all journaled with
    # the operation's trace id, each with the span id of a ledger span of that trace.
    entries = journal_traces(await c.journal(resp.json()["id"]))
    ledger_span_ids = {span_id(s) for s in ledger_spans}
    for kind in ("intent_accepted", "attempt_claimed", "outcome_recorded", "verdict_applied"):
        assert entries[kind][0] == trace_id, (kind, entries)
        assert entries[kind][1] in ledger_span_ids, (kind, entries, ledger)
