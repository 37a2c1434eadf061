"""The ledger HTTP API's credentials (issue 4): agents submit and read their own tenant's
operations; operators approve, reject, cancel, retry and review. Driven in-process through
httpx.ASGITransport on both databases."""

from __future__ import annotations

import base64
import itertools
import json
import random
import tomllib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from effectledger_core.catalog import Catalog
from effectledger_core.messages import (
    ClaimAttempt,
    OutcomeAmbiguous,
    SubmitIntent,
    VerdictReached,
)
from effectledger_core.retry_policy import RetryBudget
from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.support.ledger import NOW, SUBJECTS

CATALOG = Catalog.from_mapping(tomllib.loads("""
[tools.lookup]
endpoint = "http://provider.test/lookup"
effect_class = "read_only"
contract_revision = "r1"

[tools.email]
endpoint = "http://provider.test/emails"
effect_class = "non_idempotent"
contract_revision = "r1"

[tools.payout]
endpoint = "http://provider.test/payouts"
effect_class = "non_idempotent"
contract_revision = "r1"
commit_policy = "approval"
"""))
AGENT_A, AGENT_B, OPERATOR = "tok-agent-a", "tok-agent-b", "tok-operator-alice"
AGENTS = {AGENT_A: "tenant-a", AGENT_B: "tenant-b"}
OPERATORS = {OPERATOR: "alice"}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _ready() -> dict[str, Any]:
    return {"database": True}


def service(store: Store) -> LedgerService:
    counter = itertools.count(1)
    return LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: NOW,
                         ids=lambda: f"id{next(counter):05d}", rng=random.Random(2),
                         budget=RetryBudget(capacity=1e9, refill_per_s=0.0))


@pytest.fixture
async def svc(store: Store) -> LedgerService:
    return service(store)


@pytest.fixture
async def client(svc: LedgerService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(svc, ready=_ready, auth=Authenticator(AGENTS, OPERATORS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://ledger.test") as c:
        yield c


@pytest.fixture
async def open_client(svc: LedgerService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(svc, ready=_ready, auth=Authenticator({}, {}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://ledger.test") as c:
        yield c


def assert_error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code and isinstance(body["error"]["message"], str)
    assert body["error"]["message"]


async def submit(client: httpx.AsyncClient, token: str, tool: str = "lookup",
                 **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/intents", headers=auth(token),
                              json={"tool": tool, "arguments": {"q": 1}, **body})
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


async def ambiguous(svc: LedgerService, op_id: str, *, undecidable: bool = False) -> None:
    await svc.claim(ClaimAttempt(operation_id=op_id, epoch=1, attempt_id=f"{op_id}-a",
                                 dispatcher_id="d1"))
    await svc.record_outcome(OutcomeAmbiguous(
        operation_id=op_id, epoch=1, attempt_id=f"{op_id}-a", dispatcher_id="d1", at=NOW,
        reason="timeout"), consumer="ledger", message_id=f"m-{op_id}")
    if undecidable:
        await svc.record_verdict(VerdictReached(
            operation_id=op_id, epoch=1, verdict="undecidable", reconciler_id="r1", at=NOW),
            consumer="ledger", message_id=f"v-{op_id}")


READS = ["", "/journal", "/receipt", "/recovery"]


# ---- agents --------------------------------------------------------------------------------


async def test_agent_submits_for_its_tenant_and_reads_its_operations(
        client: httpx.AsyncClient) -> None:
    op = await submit(client, AGENT_A)
    assert op["tenant"] == "tenant-a" and op["state"] == "pending"
    for suffix in READS:
        resp = await client.get(f"/v1/operations/{op['id']}{suffix}", headers=auth(AGENT_A))
        assert resp.status_code == 200, (suffix, resp.text)
    journal = (await client.get(f"/v1/operations/{op['id']}/journal",
                                headers=auth(AGENT_A))).json()
    assert journal["entries"][0]["actor"] == "agent:tenant-a"
    listed = (await client.get("/v1/operations", headers=auth(AGENT_A))).json()
    assert [i["id"] for i in listed["items"]] == [op["id"]]


async def test_agent_naming_its_own_tenant_is_accepted(client: httpx.AsyncClient) -> None:
    op = await submit(client, AGENT_A, tenant="tenant-a")
    assert op["tenant"] == "tenant-a"


async def test_agent_body_naming_another_tenant_is_forbidden(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/intents", headers=auth(AGENT_A),
                             json={"tool": "lookup", "arguments": {}, "tenant": "tenant-b"})
    assert_error(resp, 403, "forbidden")
    listed = (await client.get("/v1/operations", headers=auth(OPERATOR))).json()
    assert listed["items"] == []


async def test_agent_gets_not_found_for_other_tenants_operations(
        client: httpx.AsyncClient) -> None:
    """Another tenant's operation is indistinguishable from a missing one: 404 everywhere,
    and the list does not show it."""
    theirs = await submit(client, AGENT_B)
    for suffix in READS:
        resp = await client.get(f"/v1/operations/{theirs['id']}{suffix}",
                                headers=auth(AGENT_A))
        assert_error(resp, 404, "not_found")
        missing = await client.get(f"/v1/operations/nope{suffix}", headers=auth(AGENT_A))
        assert_error(missing, 404, "not_found")
        # Word for word, once the id itself is set aside.
        assert resp.json()["error"]["message"].replace(theirs["id"], "X") == \
            missing.json()["error"]["message"].replace("nope", "X")
    listed = (await client.get("/v1/operations", headers=auth(AGENT_A))).json()
    assert listed["items"] == []


async def test_agent_cannot_act_as_an_operator(client: httpx.AsyncClient,
                                               svc: LedgerService) -> None:
    """approve / reject / cancel / retry / review / the review queue / using a plan: 403 for
    an agent token, even on its own tenant's operation, and nothing changes."""
    gated = await submit(client, AGENT_A, tool="payout")
    own = await submit(client, AGENT_A)
    await ambiguous(svc, own["id"], undecidable=False)
    attempts = [
        ("post", f"/v1/operations/{gated['id']}/approve",
         {"epoch": 1, "arguments_digest": gated["arguments_digest"]}),
        ("post", f"/v1/operations/{gated['id']}/reject", {"epoch": 1}),
        ("post", f"/v1/operations/{gated['id']}/cancel", {}),
        ("post", f"/v1/operations/{own['id']}/retry", {}),
        ("post", f"/v1/operations/{own['id']}/reviews",
         {"conclusion": "completed", "evidence_ref": "looked"}),
        ("get", "/v1/reviews", None),
        ("post", "/v1/retry-plans/p1/use", None),
    ]
    for method, url, body in attempts:
        resp = await client.request(method, url, headers=auth(AGENT_A), json=body)
        assert_error(resp, 403, "forbidden")
    assert (await svc.operation(gated["id"])).state == "awaiting_approval"
    assert (await svc.operation(own["id"])).state == "ambiguous"


# ---- operators -----------------------------------------------------------------------------


async def test_operator_approves_and_is_journaled_by_token_name(
        client: httpx.AsyncClient, svc: LedgerService) -> None:
    gated = await submit(client, AGENT_A, tool="payout")
    resp = await client.post(f"/v1/operations/{gated['id']}/approve", headers=auth(OPERATOR),
                             json={"epoch": 1, "arguments_digest": gated["arguments_digest"]})
    assert resp.status_code == 200 and resp.json()["state"] == "pending"
    entries = (await client.get(f"/v1/operations/{gated['id']}/journal",
                                headers=auth(OPERATOR))).json()["entries"]
    assert entries[-1]["kind"] == "approved" and entries[-1]["actor"] == "operator:alice"


async def test_operator_stale_approval_is_a_conflict(client: httpx.AsyncClient) -> None:
    gated = await submit(client, AGENT_A, tool="payout")
    resp = await client.post(f"/v1/operations/{gated['id']}/approve", headers=auth(OPERATOR),
                             json={"epoch": 2, "arguments_digest": gated["arguments_digest"]})
    assert_error(resp, 409, "action_rejected")


async def test_operator_rejects_cancels_reads_any_tenant(client: httpx.AsyncClient) -> None:
    gated = await submit(client, AGENT_B, tool="payout")
    pending = await submit(client, AGENT_A)
    resp = await client.post(f"/v1/operations/{gated['id']}/reject", headers=auth(OPERATOR),
                             json={"epoch": 1, "reason": "no"})
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    resp = await client.post(f"/v1/operations/{pending['id']}/cancel", headers=auth(OPERATOR),
                             json={"reason": "not needed"})
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    for op in (gated, pending):
        resp = await client.get(f"/v1/operations/{op['id']}/receipt", headers=auth(OPERATOR))
        assert resp.status_code == 200


async def test_operator_reviews_and_retries(client: httpx.AsyncClient,
                                            svc: LedgerService) -> None:
    """The queue, a not_executed review, then an admitted retry: all with the operator token;
    a retry refused by recovery is a 409 with the typed reason."""
    op = await submit(client, AGENT_A, tool="email")
    await ambiguous(svc, op["id"], undecidable=True)
    queue = await client.get("/v1/reviews", headers=auth(OPERATOR))
    assert [i["operation"]["id"] for i in queue.json()["items"]] == [op["id"]]
    refused = await client.post(f"/v1/operations/{op['id']}/retry", headers=auth(OPERATOR),
                                json={})
    assert_error(refused, 409, "retry_refused")
    assert refused.json()["error"]["details"]["reason"] == "needs_review"
    resp = await client.post(f"/v1/operations/{op['id']}/reviews", headers=auth(OPERATOR),
                             json={"conclusion": "not_executed", "evidence_ref": "INC-1"})
    assert resp.status_code == 200 and resp.json()["state"] == "needs_review"
    resp = await client.post(f"/v1/operations/{op['id']}/retry", headers=auth(OPERATOR),
                             json={"epoch": 1})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["admitted"] and body["operation"]["epoch"] == 2
    again = await client.post(f"/v1/retry-plans/{body['plan_id']}/use", headers=auth(OPERATOR))
    assert_error(again, 409, "retry_refused")


async def test_operator_body_naming_another_operator_is_forbidden(
        client: httpx.AsyncClient, svc: LedgerService) -> None:
    gated = await submit(client, AGENT_A, tool="payout")
    resp = await client.post(f"/v1/operations/{gated['id']}/approve", headers=auth(OPERATOR),
                             json={"epoch": 1, "arguments_digest": gated["arguments_digest"],
                                   "operator": "mallory"})
    assert_error(resp, 403, "forbidden")
    assert (await svc.operation(gated["id"])).state == "awaiting_approval"
    op = await submit(client, AGENT_A, tool="email")
    await ambiguous(svc, op["id"], undecidable=True)
    resp = await client.post(f"/v1/operations/{op['id']}/reviews", headers=auth(OPERATOR),
                             json={"conclusion": "completed", "evidence_ref": "x",
                                   "operator": "mallory"})
    assert_error(resp, 403, "forbidden")
    resp = await client.post(f"/v1/operations/{op['id']}/retry", headers=auth(OPERATOR),
                             json={"review": {"conclusion": "not_executed", "evidence_ref": "x",
                                              "operator": "mallory"}})
    assert_error(resp, 403, "forbidden")
    assert (await svc.operation(op["id"])).state == "needs_review"
    # naming oneself is fine
    resp = await client.post(f"/v1/operations/{gated['id']}/approve", headers=auth(OPERATOR),
                             json={"epoch": 1, "arguments_digest": gated["arguments_digest"],
                                   "operator": "alice"})
    assert resp.status_code == 200


# ---- authentication ------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dG9rOng="},
    {"Authorization": "Bearer "}, {"Authorization": AGENT_A},
], ids=["missing", "unknown", "basic", "empty", "no_scheme"])
async def test_missing_or_unknown_token_is_unauthenticated(client: httpx.AsyncClient,
                                                           headers: dict[str, str]) -> None:
    for method, url, body in [("get", "/v1/operations", None),
                              ("post", "/v1/intents", {"tool": "lookup", "arguments": {}}),
                              ("get", "/v1/operations/x", None), ("get", "/v1/reviews", None),
                              ("get", "/v1/tools", None)]:
        resp = await client.request(method, url, headers=headers, json=body)
        assert_error(resp, 401, "unauthenticated")
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="effectledger"'


async def test_health_and_readiness_need_no_token(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"ok": True}
    ready = (await client.get("/readyz")).json()
    assert ready["ok"] and ready["auth"] == "enabled"


# ---- open mode -----------------------------------------------------------------------------


async def test_without_tokens_the_api_is_open_and_says_so(open_client: httpx.AsyncClient,
                                                          svc: LedgerService) -> None:
    """No tokens configured: no credentials needed, /readyz says auth is disabled, and an
    operator action names its operator in the body (refused without one)."""
    ready = await open_client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["auth"] == "disabled"
    resp = await open_client.post("/v1/intents", json={"tool": "payout", "arguments": {"a": 1},
                                                       "tenant": "anyone"})
    assert resp.status_code == 201
    op = resp.json()
    assert op["tenant"] == "anyone"
    assert (await open_client.get(f"/v1/operations/{op['id']}")).status_code == 200
    nameless = await open_client.post(f"/v1/operations/{op['id']}/approve",
                                      json={"epoch": 1,
                                            "arguments_digest": op["arguments_digest"]})
    assert_error(nameless, 403, "forbidden")
    named = await open_client.post(f"/v1/operations/{op['id']}/approve",
                                   json={"epoch": 1, "arguments_digest": op["arguments_digest"],
                                         "operator": "local-admin"})
    assert named.status_code == 200 and named.json()["state"] == "pending"
    journal = (await svc.journal(op["id"])).entries[-1]
    assert journal.actor == "operator:local-admin"


async def test_invalid_body_is_a_json_error(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/intents", headers=auth(AGENT_A), content=b"{not json")
    assert_error(resp, 422, "invalid_request")
    resp = await client.post("/v1/operations/x/approve", headers=auth(OPERATOR),
                             json={"epoch": "one"})
    assert_error(resp, 422, "invalid_request")


async def test_agent_submission_goes_through_the_same_service(
        client: httpx.AsyncClient, svc: LedgerService) -> None:
    """One effect plane: an HTTP intent is the same operation the service sees."""
    op = await submit(client, AGENT_A)
    direct = await svc.submit(SubmitIntent(tool="lookup", arguments={"q": 1},
                                           tenant="tenant-a"))
    assert direct.operation["id"] != op["id"]
    assert (await svc.operation(op["id"])).arguments_digest == direct.operation[
        "arguments_digest"]


async def test_stats_show_an_agent_only_its_tenants_counts(client: httpx.AsyncClient) -> None:
    """Counts are a read like any other: an agent must not learn other tenants' volumes."""
    await submit(client, AGENT_A)
    await submit(client, AGENT_B)
    await submit(client, AGENT_B)
    mine = (await client.get("/v1/stats", headers=auth(AGENT_A))).json()
    assert mine == {"operations": {"pending": 1}}
    everyone = (await client.get("/v1/stats", headers=auth(OPERATOR))).json()
    assert everyone["operations"] == {"pending": 3} and "outbox" in everyone


def _cursor(value: object) -> str:
    return _raw_b64(json.dumps(value))


def _raw_b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


@pytest.mark.parametrize("cursor", [
    _cursor(["2026-11-30T09:00:00", "id1"]),  # a naive time: no time zone
    _cursor(["2026-11-30T09:00:00+00:00", "id\u0000x"]),
    _cursor(["2026-11-30T09:00:00+00:00", "i" * 65]),
    _cursor(["2026-11-30T09:00:00+00:00", 7]),
    _cursor("[" * 3000 + "]" * 3000),
    _raw_b64("[" * 3000 + "]" * 3000),  # nested 3,000 deep
    "not base64 !",
    "A" * 5000,
])
async def test_every_malformed_cursor_is_a_4xx_before_any_query(
        client: httpx.AsyncClient, cursor: str) -> None:
    resp = await client.get("/v1/operations", params={"cursor": cursor},
                            headers=auth(OPERATOR))
    assert_error(resp, 422, "invalid_request")


async def test_quotas_answer_429_with_retry_after_over_http_and_the_same_error_over_nats(
        store: Store) -> None:
    """Off by default; configured, a tenant over its rate, its in-flight or its
    awaiting-approval bound is refused with nothing recorded, other tenants unaffected."""
    from effectledger_core.quotas import QuotaLimits
    from effectledger_ledger.messaging import Requests

    counter = itertools.count(1)
    limited = LedgerService(store=store, catalog=CATALOG, subjects=SUBJECTS, clock=lambda: NOW,
                            ids=lambda: f"q{next(counter):05d}",
                            quotas=QuotaLimits(rate_per_s=1e-3, burst=3, max_in_flight=100,
                                               max_awaiting_approval=1))
    app = create_app(limited, ready=_ready, auth=Authenticator(AGENTS, OPERATORS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://ledger.test") as c:
        await submit(c, AGENT_A, "payout")  # awaiting approval: the bound of 1 is reached
        refused = await c.post("/v1/intents", headers=auth(AGENT_A),
                               json={"tool": "payout", "arguments": {"q": 2}})
        assert_error(refused, 429, "quota_exceeded")
        assert refused.headers["Retry-After"] == "60"
        assert refused.json()["error"]["details"]["limit"] == "awaiting_approval"
        await submit(c, AGENT_B, "payout")  # another tenant's own bound
        await submit(c, AGENT_A, "lookup")  # third of the burst of 3
        over = await c.post("/v1/intents", headers=auth(AGENT_A),
                            json={"tool": "lookup", "arguments": {"q": 3}})
        assert_error(over, 429, "quota_exceeded")
        assert int(over.headers["Retry-After"]) >= 1
    listed = await limited.list_operations(state=None, limit=100, cursor=None,
                                           tenant="tenant-a")
    assert len(listed.items) == 2  # nothing recorded for the refusals

    reply = json.loads(await Requests(limited).intent(json.dumps(
        {"tool": "lookup", "arguments": {"q": 4}, "tenant": "tenant-a"}).encode()))
    assert reply["ok"] is False and reply["error"]["code"] == "quota_exceeded"
    assert reply["error"]["details"]["retry_after_s"] > 0


@pytest.mark.parametrize("text", ["a\u0000b", "x\ud800y"])
async def test_operator_text_a_database_cannot_hold_is_a_422_and_changes_nothing(
        client: httpx.AsyncClient, text: str) -> None:
    gated = await submit(client, AGENT_A, "payout")
    for path, body in (("reject", {"epoch": 1, "reason": text}),
                       ("cancel", {"reason": text}),
                       ("reject", {"epoch": 1, "operator": text})):
        resp = await client.post(f"/v1/operations/{gated['id']}/{path}",
                                  headers={**auth(OPERATOR), "content-type": "application/json"},
                                  content=json.dumps({k: v for k, v in body.items()}))
        assert_error(resp, 422, "invalid_request")
    now = (await client.get(f"/v1/operations/{gated['id']}", headers=auth(OPERATOR))).json()
    assert now["state"] == "awaiting_approval"
