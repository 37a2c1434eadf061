"""Issue 14 end to end: metrics agree with the ledger's rows, logs are JSON and hold no secrets.

A mixed workload (succeeded, failed, ambiguous then resolved by readback, needs review) runs
through the real processes (sandbox, ledger, dispatcher, reconciler) with JSON logs. Then every
service's `/metrics` is scraped and the counters and gauges are compared with what the ledger's
database says happened; every log line must parse as JSON, and neither the provider key, the
webhook secret nor a canary argument may appear in any log.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from effectledger_cli.embedded import free_port
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.slow,
              pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

FAST = {"EFFECTLEDGER_ACK_WAIT_S": "3", "EFFECTLEDGER_INBOX_ACK_WAIT_S": "3",
        "EFFECTLEDGER_WEBHOOK_WAIT_S": "2", "EFFECTLEDGER_RECONCILE_DEADLINE_S": "15",
        "EFFECTLEDGER_LOG_FORMAT": "json"}
CANARY_ARGUMENT = "canary-argument-5d41402abc4b2a76"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in scraped.items() if n == name and want <= ls)


async def _fault(c: Cluster, route: str, action: dict[str, Any], times: int = 1) -> None:
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": action, "times": times})
    assert resp.status_code == 200, resp.text


async def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(url)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return samples(resp.text)


async def test_metrics_match_the_ledger_rows_after_a_mixed_workload(make_cluster: Any) -> None:
    health_port = free_port()
    c: Cluster = make_cluster(env=FAST)
    await c.start_sandbox()
    await c.start_ledger()
    await c.start_dispatcher(env={"EFFECTLEDGER_DISPATCHER_HEALTH_PORT": str(health_port)})
    await c.start_reconciler()

    # Succeeded: plain calls, one carrying the canary argument.
    ok = [await c.submit_ok("create_ticket", {"title": f"t{i}"}) for i in range(3)]
    ok.append(await c.submit_ok("create_ticket", {"title": CANARY_ARGUMENT}))
    for op in ok:
        await c.wait_state(op["id"], "succeeded", 30)
    # Failed: the provider refuses before doing anything.
    await _fault(c, "plainrb", {"kind": "status_before_apply", "status": 400})
    failed = await c.submit_ok("fast_email", {"to": "refused@example.com"})
    await c.wait_state(failed["id"], "failed", 30)
    # Ambiguous (the answer is lost after the effect), resolved by readback.
    await _fault(c, "idempotentfast", {"kind": "drop_after_apply"})
    readback = await c.submit_ok("fast_ticket", {"title": "lost answer"})
    await c.wait_state(readback["id"], "succeeded", 40)
    # Ambiguous with no oracle at all: needs review.
    await _fault(c, "plainpager", {"kind": "delay", "seconds": 2.5})
    review = await c.submit_ok("fast_page", {"who": "ops"})
    await c.wait_state(review["id"], "needs_review", 40)

    ledger = await _scrape(f"{c.ledger_url}/metrics")
    dispatcher = await _scrape(f"http://127.0.0.1:{health_port}/metrics")
    reconciler = await _scrape(f"{c.reconciler_url}/metrics")

    # Every committed transition, by new state, equals the journal's.
    journal = {r["to_state"]: r["n"] for r in await c.db_rows(
        "SELECT to_state, count(*) AS n FROM journal WHERE to_state IS NOT NULL "
        "GROUP BY to_state")}
    for state, count in journal.items():
        assert total(ledger, "effectledger_transitions_total", to_state=state) == count, state
    states = Counter(op["state"] for op in await c.list_all())
    assert states == {"succeeded": 5, "failed": 1, "needs_review": 1}
    assert total(ledger, "effectledger_transitions_total", to_state="succeeded") == 5
    assert total(ledger, "effectledger_intents_total", result="created") == 7
    assert total(ledger, "effectledger_operation_duration_seconds_count",
                 state="succeeded") == 5
    # Gauges are read from the rows.
    assert total(ledger, "effectledger_review_queue_operations") == 1
    assert total(ledger, "effectledger_operations", state="needs_review") == 1
    assert total(ledger, "effectledger_ambiguous_operations") == 0
    assert total(ledger, "effectledger_outbox_unpublished_rows") == await c.db_scalar(
        "SELECT count(*) FROM outbox WHERE status IN ('pending', 'publishing')")
    # One claim granted and one provider call per attempt row.
    attempts = await c.db_scalar("SELECT count(*) FROM attempts")
    assert total(ledger, "effectledger_claims_total", status="granted") == attempts
    assert total(dispatcher, "effectledger_provider_calls_total") == attempts
    assert total(dispatcher, "effectledger_provider_calls_total",
                 outcome="attempt_failed") == 1
    assert total(dispatcher, "effectledger_dispatcher_claim_replies_total",
                 status="granted") == attempts
    assert total(dispatcher, "effectledger_nats_connected") == 1
    # Every dispatch command was acked once, after its outcome reached the ledger: by request
    # (answered after the ledger's commit) or, unanswered, on the stream through the inbox.
    assert total(dispatcher, "effectledger_messages_handled_total", consumer="dispatcher",
                 result="ack") == attempts
    reported = "effectledger_dispatcher_outcomes_reported_total"
    by_request = total(dispatcher, reported, route="request")
    by_stream = total(dispatcher, reported, route="stream")
    assert by_request + by_stream == attempts and by_request >= 1
    # Each recorded once (a copy after a lost answer would be a duplicate).
    outcomes = "effectledger_outcomes_total"
    assert total(ledger, outcomes) - total(ledger, outcomes, status="duplicate") == attempts
    assert total(ledger, "effectledger_messages_handled_total", consumer="ledger.inbox",
                 result="ack") >= by_stream  # those outcomes, and the reconciler's verdicts
    # The reconciler read the provider back and published the verdicts the ledger took.
    assert total(reconciler, "effectledger_readbacks_total", result="found") >= 1
    assert total(ledger, "effectledger_verdicts_total", verdict="applied",
                 status="applied") == 1

    # Logs: JSON lines, one INFO line per transition, no secret, no argument.
    canaries = [c.api_key, c.webhook_secret, CANARY_ARGUMENT]
    transition_lines = 0
    reconciler_lines: list[dict[str, Any]] = []
    for proc in c.history:
        text = proc.log.read_text()
        for canary in canaries:
            assert canary not in text, f"{proc.name} logged a canary"
        for line in text.splitlines():
            if not line.strip():
                continue
            record = json.loads(line)  # fails the test on any line that is not JSON
            if proc.service == "ledger" and record.get("logger") == \
                    "effectledger.ledger.transitions":
                assert record["operation_id"] and record["epoch"] is not None
                transition_lines += 1
            if record.get("logger") == "effectledger_reconciler.worker":
                reconciler_lines.append(record)
    assert transition_lines == sum(journal.values())
    # Each of the reconciler's decisions (the readback's applied, the oracle-less tool's
    # undecidable) is one INFO line naming the operation, epoch, attempt and tool.
    verdicts = [r for r in reconciler_lines if r["message"].startswith("reconcile: verdict")]
    assert sorted(r["message"].split(":")[1].strip() for r in verdicts) == [
        "verdict applied", "verdict undecidable"], reconciler_lines
    assert all(r["level"] == "INFO" and all(r.get(k) is not None for k in (
        "operation_id", "epoch", "attempt_id", "tool")) for r in verdicts), verdicts
