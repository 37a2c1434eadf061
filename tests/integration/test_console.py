"""The operator console (issue 15) in-process: sessions, CSRF, roles, tenant confinement, the
stale-page refusals, reviews with a retry plan, filters and pagination, and /docs without a CDN.
Driven through httpx.ASGITransport on both databases; the browser tests (tests/e2e) cover the
same paths in Chromium against real processes."""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest

from effectledger_core.messages import DeadLetter
from effectledger_core.recovery import Conclusion
from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator
from effectledger_ledger.db import console_reads as cr
from effectledger_ledger.service import LedgerService
from tests.integration.test_api_auth import (
    AGENT_A,
    AGENT_B,
    AGENTS,
    NOW,
    OPERATOR,
    OPERATORS,
    _ready,
    ambiguous,
    auth,
    submit,
)
from tests.integration.test_api_auth import service as make_service

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
async def svc(store: Any) -> LedgerService:
    return make_service(store)


def _client(svc: LedgerService, auth_: Authenticator, base: str = "http://ledger.test"
            ) -> httpx.AsyncClient:
    app = create_app(svc, ready=_ready, auth=auth_)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)


@pytest.fixture
async def api(svc: LedgerService) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(svc, Authenticator(AGENTS, OPERATORS)) as c:
        yield c


@pytest.fixture
async def browser(svc: LedgerService) -> AsyncIterator[httpx.AsyncClient]:
    """A second client on the same app state would share no cookies; this one is the browser."""
    async with _client(svc, Authenticator(AGENTS, OPERATORS)) as c:
        yield c


async def sign_in(c: httpx.AsyncClient, **fields: str) -> httpx.Response:
    page = await c.get("/console/login")
    assert page.status_code == 200, page.text
    token = CSRF.search(page.text)
    assert token is not None
    return await c.post("/console/login", data={"csrf": token.group(1), **fields})


async def csrf_of(c: httpx.AsyncClient, path: str) -> str:
    page = await c.get(path)
    assert page.status_code == 200, page.text
    found = CSRF.search(page.text)
    assert found is not None, page.text
    return found.group(1)


async def gated(api: httpx.AsyncClient, token: str = AGENT_A, **args: Any) -> dict[str, Any]:
    return await submit(api, token, tool="payout", arguments={"amount": 120, "to": "acct-9",
                                                               **args})


# ---- sign-in and sessions ------------------------------------------------------------------


async def test_sign_in_sets_an_httponly_strict_session_cookie_and_never_the_token(
        browser: httpx.AsyncClient) -> None:
    resp = await sign_in(browser, token=OPERATOR, next="/console/operations")
    assert resp.status_code == 303 and resp.headers["location"] == "/console/operations"
    cookie = next(h for h in resp.headers.get_list("set-cookie")
                  if h.startswith("effectledger_console="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert "Secure" not in cookie  # plain http here; see the TLS test
    assert OPERATOR not in cookie
    page = await browser.get("/console/operations")
    assert page.status_code == 200 and "Operator <strong>alice</strong>" in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["cache-control"] == "no-store"


async def test_session_cookie_is_secure_behind_tls(svc: LedgerService) -> None:
    async with _client(svc, Authenticator(AGENTS, OPERATORS), "https://ledger.test") as c:
        resp = await sign_in(c, token=OPERATOR)
    cookie = next(h for h in resp.headers.get_list("set-cookie")
                  if h.startswith("effectledger_console="))
    assert "Secure" in cookie


async def test_unknown_token_is_refused_with_a_clear_message_and_no_session(
        browser: httpx.AsyncClient) -> None:
    resp = await sign_in(browser, token="not-a-token")
    assert resp.status_code == 401 and "unknown token" in resp.text
    assert "effectledger_console=" not in " ".join(resp.headers.get_list("set-cookie"))
    assert (await browser.get("/console/")).status_code == 303


async def test_pages_without_a_session_redirect_to_sign_in_keeping_the_target(
        browser: httpx.AsyncClient) -> None:
    resp = await browser.get("/console/operations?state=failed")
    assert resp.status_code == 303
    assert resp.headers["location"] == ("/console/login?next=%2Fconsole%2Foperations%3F"
                                        "state%3Dfailed")


async def test_a_form_posted_after_the_session_ended_leads_to_sign_in_and_changes_nothing(
        api: httpx.AsyncClient, browser: httpx.AsyncClient, svc: LedgerService) -> None:
    op = await gated(api)
    resp = await browser.post(f"/console/approvals/{op['id']}/approve", data={
        "csrf": "x", "epoch": "1", "arguments_digest": op["arguments_digest"]})
    assert resp.status_code == 303
    assert resp.headers["location"] == "/console/login?next=%2Fconsole%2F"
    assert (await svc.operation(op["id"])).state == "awaiting_approval"
    fetch = await browser.get("/console/overview/cards", headers={"X-Console-Fetch": "1"})
    assert fetch.status_code == 401  # the page's script reloads into the sign-in page


async def test_unknown_console_paths_get_a_page_not_json(browser: httpx.AsyncClient) -> None:
    await sign_in(browser, token=OPERATOR)
    resp = await browser.get("/console/no-such-page")
    assert resp.status_code == 404 and resp.headers["content-type"].startswith("text/html")
    assert "<h1>Not found</h1>" in resp.text
    missing_op = await browser.get("/console/operations/nope")
    assert missing_op.status_code == 404 and "operation &#39;nope&#39; not found" in missing_op.text


async def test_sign_in_never_redirects_off_the_console(browser: httpx.AsyncClient) -> None:
    for target in ("https://evil.example/", "//evil.example/console/", "/v1/operations"):
        resp = await sign_in(browser, token=OPERATOR, next=target)
        assert resp.headers["location"] == "/console/", target


async def test_sign_out_ends_the_session_at_once(browser: httpx.AsyncClient) -> None:
    await sign_in(browser, token=OPERATOR)
    token = await csrf_of(browser, "/console/")
    cookie = browser.cookies.get("effectledger_console")
    assert (await browser.post("/console/logout", data={"csrf": token})).status_code == 303
    browser.cookies.set("effectledger_console", cookie or "", path="/console")
    assert (await browser.get("/console/")).status_code == 303  # the old cookie is worthless


async def test_signing_in_again_replaces_the_previous_session(
        browser: httpx.AsyncClient) -> None:
    await sign_in(browser, token=OPERATOR)
    first = browser.cookies.get("effectledger_console")
    await sign_in(browser, token=AGENT_A)
    assert browser.cookies.get("effectledger_console") != first
    browser.cookies.set("effectledger_console", first or "", path="/console")
    assert (await browser.get("/console/")).status_code == 303


async def test_open_mode_says_so_on_every_page_and_journals_the_given_name(
        svc: LedgerService) -> None:
    async with _client(svc, Authenticator({}, {})) as c:
        login = await c.get("/console/login")
        assert "Open mode:" in login.text
        for bad in (" ", "x" * 1025):
            refused = await sign_in(c, name=bad)
            assert refused.status_code == 401 and "name" in refused.text
        await sign_in(c, name="bob")
        op = (await c.post("/v1/intents", json={"tool": "payout",
                                                  "arguments": {"amount": 1}})).json()
        for path in ("/console/", "/console/operations", f"/console/operations/{op['id']}",
                     "/console/approvals", f"/console/approvals/{op['id']}", "/console/reviews",
                     "/console/pipeline"):
            page = await c.get(path)
            assert page.status_code == 200 and "Open mode:" in page.text, path
        token = await csrf_of(c, f"/console/approvals/{op['id']}")
        resp = await c.post(f"/console/approvals/{op['id']}/approve", data={
            "csrf": token, "epoch": "1", "arguments_digest": op["arguments_digest"]})
        assert resp.status_code == 303, resp.text
        last = (await svc.journal(op["id"])).entries[-1]
        assert last.kind == "approved" and last.actor == "operator:bob"


# ---- CSRF ----------------------------------------------------------------------------------


async def test_a_form_post_without_the_csrf_token_is_refused_and_changes_nothing(
        api: httpx.AsyncClient, browser: httpx.AsyncClient, svc: LedgerService) -> None:
    op = await gated(api)
    await sign_in(browser, token=OPERATOR)
    form = {"epoch": "1", "arguments_digest": op["arguments_digest"]}
    for csrf in (None, "forged"):
        data = form if csrf is None else {**form, "csrf": csrf}
        resp = await browser.post(f"/console/approvals/{op['id']}/approve", data=data)
        assert resp.status_code == 403 and "security token" in resp.text
    assert (await svc.operation(op["id"])).state == "awaiting_approval"
    # The sign-in form has its own token too.
    resp = await browser.post("/console/login", data={"token": OPERATOR})
    assert resp.status_code == 403


# ---- approvals -----------------------------------------------------------------------------


async def test_approval_page_shows_the_exact_arguments_digest_epoch_and_tool(
        api: httpx.AsyncClient, browser: httpx.AsyncClient) -> None:
    op = await gated(api, memo="<script>alert(1)</script>")
    await sign_in(browser, token=OPERATOR)
    page = await browser.get(f"/console/approvals/{op['id']}")
    assert page.status_code == 200
    assert '&#34;amount&#34;: 120' in page.text or '"amount": 120' in page.text
    assert "<script>alert(1)</script>" not in page.text  # escaped, never executed
    assert op["arguments_digest"] in page.text and "non_idempotent" in page.text
    assert 'name="epoch" value="1"' in page.text


async def test_approve_binds_to_the_page_and_a_stale_page_is_refused(
        api: httpx.AsyncClient, browser: httpx.AsyncClient, svc: LedgerService) -> None:
    op = await gated(api)
    await sign_in(browser, token=OPERATOR)
    token = await csrf_of(browser, f"/console/approvals/{op['id']}")
    url = f"/console/approvals/{op['id']}/approve"
    wrong_epoch = await browser.post(url, data={"csrf": token, "epoch": "2",
                                                "arguments_digest": op["arguments_digest"]})
    assert wrong_epoch.status_code == 409 and "out of date" in wrong_epoch.text
    wrong_args = await browser.post(url, data={"csrf": token, "epoch": "1",
                                               "arguments_digest": "sha256:other"})
    assert wrong_args.status_code == 409 and "arguments it showed" in wrong_args.text
    assert (await svc.operation(op["id"])).state == "awaiting_approval"
    ok = await browser.post(url, data={"csrf": token, "epoch": "1",
                                       "arguments_digest": op["arguments_digest"]})
    assert ok.status_code == 303
    after = await svc.operation(op["id"])
    assert after.state == "pending"
    assert (await svc.journal(op["id"])).entries[-1].actor == "operator:alice"
    again = await browser.post(url, data={"csrf": token, "epoch": "1",
                                          "arguments_digest": op["arguments_digest"]})
    assert again.status_code == 409 and "now pending" in again.text


async def test_reject_needs_a_reason_and_cancels(
        api: httpx.AsyncClient, browser: httpx.AsyncClient, svc: LedgerService) -> None:
    op = await gated(api)
    await sign_in(browser, token=OPERATOR)
    token = await csrf_of(browser, f"/console/approvals/{op['id']}")
    url = f"/console/approvals/{op['id']}/reject"
    missing = await browser.post(url, data={"csrf": token, "epoch": "1", "reason": " "})
    assert missing.status_code == 422 and "reason" in missing.text
    assert (await svc.operation(op["id"])).state == "awaiting_approval"
    ok = await browser.post(url, data={"csrf": token, "epoch": "1", "reason": "wrong account"})
    assert ok.status_code == 303
    assert (await svc.operation(op["id"])).state == "cancelled"


# ---- agents --------------------------------------------------------------------------------


async def test_agent_session_is_read_only_and_sees_only_its_tenant(
        api: httpx.AsyncClient, browser: httpx.AsyncClient, svc: LedgerService) -> None:
    mine = await gated(api, AGENT_A)
    theirs = await gated(api, AGENT_B)
    await sign_in(browser, token=AGENT_A)
    listing = await browser.get("/console/operations")
    assert mine["id"] in listing.text and theirs["id"] not in listing.text
    # A tenant filter in the URL cannot widen an agent's view.
    widened = await browser.get("/console/operations?tenant=tenant-b")
    assert theirs["id"] not in widened.text
    assert (await browser.get(f"/console/operations/{theirs['id']}")).status_code == 404
    detail = await browser.get(f"/console/operations/{mine['id']}")
    assert detail.status_code == 200 and "read-only" in detail.text
    assert "/approve" not in detail.text and 'action="/console/operations' not in detail.text
    overview = await browser.get("/console/")
    assert "outbox unpublished" not in overview.text  # not per tenant: hidden from agents
    for path in (f"/console/approvals/{mine['id']}", "/console/reviews", "/console/pipeline",
                 f"/console/reviews/{mine['id']}"):
        assert (await browser.get(path)).status_code == 403, path
    token = await csrf_of(browser, "/console/")
    approve = await browser.post(f"/console/approvals/{mine['id']}/approve", data={
        "csrf": token, "epoch": "1", "arguments_digest": mine["arguments_digest"]})
    assert approve.status_code == 403
    review = await browser.post(f"/console/reviews/{mine['id']}", data={
        "csrf": token, "epoch": "1", "conclusion": "completed", "evidence_ref": "x"})
    assert review.status_code == 403
    assert (await svc.operation(mine["id"])).state == "awaiting_approval"


# ---- reviews -------------------------------------------------------------------------------


async def test_review_not_executed_with_the_plan_opens_the_next_epoch(
        api: httpx.AsyncClient, browser: httpx.AsyncClient, svc: LedgerService) -> None:
    op = await submit(api, AGENT_A, tool="email")
    await ambiguous(svc, op["id"], undecidable=True)
    assert (await svc.operation(op["id"])).state == "needs_review"
    await sign_in(browser, token=OPERATOR)
    queue = await browser.get("/console/reviews")
    assert op["id"] in queue.text
    page = await browser.get(f"/console/reviews/{op['id']}")
    # The evidence shows the outcome and the verdict as what it was (undecidable).
    assert "outcome_recorded" in page.text and "verdict_undecidable" in page.text
    assert op["operation_key"] in page.text and "epoch <strong>2</strong>" in page.text
    token = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
    url = f"/console/reviews/{op['id']}"
    no_ref = await browser.post(url, data={"csrf": token, "epoch": "1",
                                           "conclusion": "not_executed"})
    assert no_ref.status_code == 422 and "evidence reference is required" in no_ref.text
    stale = await browser.post(url, data={"csrf": token, "epoch": "0", "evidence_ref": "T-1",
                                          "conclusion": "not_executed"})
    assert stale.status_code == 409 and "out of date" in stale.text
    assert (await svc.operation(op["id"])).state == "needs_review"
    ok = await browser.post(url, data={"csrf": token, "epoch": "1", "evidence_ref": "T-1",
                                       "conclusion": Conclusion.NOT_EXECUTED.value,
                                       "retry": "yes"})
    assert ok.status_code == 303
    after = await svc.operation(op["id"])
    assert after.state == "pending" and after.epoch == 2
    kinds = [e.kind for e in (await svc.journal(op["id"])).entries]
    assert kinds[-3:] == ["review_recorded", "retry_planned", "retry_admitted"], kinds
    shown = await browser.get(f"/console/operations/{op['id']}")
    assert "Retry plan" in shown.text and "admitted" in shown.text


# ---- lists and the overview ----------------------------------------------------------------


async def test_list_is_newest_first_with_keyset_pages_and_filters(
        api: httpx.AsyncClient, svc: LedgerService) -> None:
    made = [await submit(api, AGENT_A, idempotency_key=f"order-{i}", arguments={"q": i})
            for i in range(5)]
    await submit(api, AGENT_B, tool="email", idempotency_key="other-1")
    async with svc.store.transaction() as conn:
        seen: list[str] = []
        cursor = None
        while True:
            items, cursor = await cr.list_operations(
                conn, cr.OperationFilter(tenant="tenant-a"), limit=2, cursor=cursor)
            seen += [i["id"] for i in items]
            if cursor is None:
                break
        by_key, _ = await cr.list_operations(conn, cr.OperationFilter(text="der-3"), limit=10,
                                             cursor=None)
        by_tool, _ = await cr.list_operations(conn, cr.OperationFilter(tool="email"),
                                              limit=10, cursor=None)
        percent, _ = await cr.list_operations(conn, cr.OperationFilter(text="%"), limit=10,
                                              cursor=None)
    # The test clock is frozen, so ties on created_at are broken by id, newest (largest) first.
    assert seen == sorted((m["id"] for m in made), reverse=True)
    assert [i["id"] for i in by_key] == [made[3]["id"]]
    assert [i["tenant"] for i in by_tool] == ["tenant-b"]
    assert percent == []  # LIKE wildcards in the text are matched literally


async def test_bad_filters_get_a_clear_error(browser: httpx.AsyncClient) -> None:
    await sign_in(browser, token=OPERATOR)
    for query, words in (("state=bogus", "unknown state"), ("from=yesterday", "not a date"),
                         ("cursor=@@@", "malformed cursor"),
                         ("from=2026-12-02T00:00&to=2026-12-01T00:00", "ends before")):
        resp = await browser.get(f"/console/operations?{query}")
        assert resp.status_code == 422 and words in resp.text, (query, resp.text[:300])


async def test_a_cursor_holding_a_lone_surrogate_or_nul_is_a_clear_error_page(
        browser: httpx.AsyncClient) -> None:
    """Issue 28, "Bytes": the console's cursors were decoded without the API's checks, so an
    unpaired surrogate (escaped, or as CESU-8 bytes) or NUL in the id failed the query."""
    await sign_in(browser, token=OPERATOR)
    for doc in (b'["2026-11-30T09:00:00+00:00", "\\ud800"]',
                b'["2026-11-30T09:00:00+00:00", "\xed\xa0\x80"]',
                b'["2026-11-30T09:00:00+00:00", "a\\u0000"]',
                b'["2026-11-30T09:00:00+00:00", ["nested"]]'):
        cursor = base64.urlsafe_b64encode(doc).decode()
        resp = await browser.get("/console/operations", params={"cursor": cursor})
        assert resp.status_code == 422 and "malformed cursor" in resp.text, (doc, resp.text[:300])


async def test_overview_counts_backlogs_and_links_to_the_lists(
        api: httpx.AsyncClient, browser: httpx.AsyncClient, svc: LedgerService) -> None:
    await gated(api)
    op = await submit(api, AGENT_A, tool="email")
    await ambiguous(svc, op["id"])
    await sign_in(browser, token=OPERATOR)
    cards = await browser.get("/console/overview/cards")
    text = re.sub(r"\s+", " ", cards.text)
    assert re.search(r'figure">1</span> ambiguous backlog', text), text
    assert re.search(r'figure">1</span> awaiting approval', text)
    assert re.search(r'figure">0</span> awaiting review', text)
    assert "/console/operations?duplicates=1" in text and "/console/pipeline#dead-letters" in text
    listed = await browser.get("/console/operations?state=ambiguous&state=awaiting_confirmation")
    assert op["id"] in listed.text


async def test_outbox_lag_counts_due_rows_only_and_dead_letters_are_counted(
        api: httpx.AsyncClient, svc: LedgerService) -> None:
    await submit(api, AGENT_A)  # its dispatch command waits in the outbox (no relay runs here)
    await svc.record_dead_letter(DeadLetter(consumer="ledger-inbox", subject="tst.x",
                                            error="not json", payload_excerpt="{"))
    later = NOW + timedelta(seconds=90)
    async with svc.store.transaction() as conn:
        due = await cr.overview(conn, tenant=None, now=later)
        before_due = await cr.overview(conn, tenant=None, now=NOW - timedelta(seconds=1))
        tenant_view = await cr.overview(conn, tenant="tenant-a", now=later)
    assert due.outbox_unpublished is not None and due.outbox_unpublished.count == 1
    assert due.outbox_unpublished.age_s(later) == 90.0
    assert before_due.outbox_unpublished is not None
    assert before_due.outbox_unpublished.count == 0  # not due yet: waiting, not lagging
    assert due.dead_letters is not None and due.dead_letters.count == 1
    assert due.by_state == {"pending": 1} and tenant_view.by_state == {"pending": 1}
    assert tenant_view.outbox_unpublished is None and tenant_view.dead_letters is None


# ---- /docs without a CDN -------------------------------------------------------------------


async def test_docs_load_swagger_ui_from_the_ledger_itself(api: httpx.AsyncClient) -> None:
    page = await api.get("/docs")
    assert page.status_code == 200
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)""", page.text)
    assert urls and all(u.startswith("/") for u in urls), urls
    assert "cdn" not in page.text.lower()
    for u in urls:
        if u.startswith("/console/static"):
            assert (await api.get(u)).status_code == 200, u
    assert (await api.get("/redoc")).status_code == 404
    assert "/console" not in (await api.get("/openapi.json")).text
    # The API itself is unchanged by the console: still bearer tokens, still JSON errors.
    assert (await api.get("/v1/operations")).status_code == 401
    assert (await api.get("/v1/operations", headers=auth(OPERATOR))).status_code == 200
