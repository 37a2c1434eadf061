"""The operator console in real Chromium (issue 15), against the real services as processes.

Playwright drives the system's Chromium (Debian's `chromium` package, by its executable path;
never a browser Playwright downloads). Every request any page makes goes through a route
handler that lets loopback through and records and aborts anything else; each test ends by
asserting that list is empty, so a CDN link anywhere in the console or /docs fails it.

The services run on SQLite (to stay quick) with tokens configured: one operator and two agent
tenants. Screenshots go to the test's tmp folder, or to EFFECTLEDGER_CONSOLE_SCREENSHOTS (the
README's pictures in docs/console/ were taken that way).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.cluster import Cluster

CHROMIUM = os.environ.get("EFFECTLEDGER_CHROMIUM") or shutil.which("chromium") or \
    "/usr/bin/chromium"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update",
               "--disable-sync"]
OPERATOR, AGENT_A, AGENT_B = "op-token-alice", "agent-token-a", "agent-token-b"
TOKENS = {"EFFECTLEDGER_OPERATOR_TOKENS": json.dumps({OPERATOR: "alice"}),
          "EFFECTLEDGER_AGENT_TOKENS": json.dumps({AGENT_A: "tenant-a", AGENT_B: "tenant-b"})}
FAST = {"EFFECTLEDGER_ACK_WAIT_S": "3", "EFFECTLEDGER_INBOX_ACK_WAIT_S": "3",
        "EFFECTLEDGER_WEBHOOK_WAIT_S": "1", "EFFECTLEDGER_RECONCILE_DEADLINE_S": "15"}
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}

pytestmark = [pytest.mark.slow,
              pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

try:
    from playwright.async_api import Browser, BrowserContext, Page, Route, async_playwright, expect
    from playwright.async_api import Request as PwRequest
except ImportError:  # pragma: no cover - the test extra installs it
    pytestmark.append(pytest.mark.skip(reason="playwright is not installed: "
                                              "pip install -e '.[test]'"))
else:
    # A shared, busy machine can take seconds to serve a page; waits still end as soon as the
    # condition holds.
    expect.set_options(timeout=15_000)
if not Path(CHROMIUM).exists():
    pytestmark.append(pytest.mark.skip(
        reason=f"no Chromium at {CHROMIUM}: install it with `apt-get install -y chromium` "
               f"(or set EFFECTLEDGER_CHROMIUM); browsers are never downloaded"))


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("EFFECTLEDGER_CONSOLE_SCREENSHOTS") or tmp_path / "shots")
    target.mkdir(parents=True, exist_ok=True)
    return target


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


class Offsite:
    """Every non-loopback request a page tried; each one was aborted."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.all: list[str] = []

    async def guard(self, route: Route, request: PwRequest) -> None:
        url = request.url
        self.all.append(url)
        parts = urlsplit(url)
        if parts.scheme in ("data", "blob", "about") or (parts.hostname or "") in LOOPBACK:
            await route.continue_()
        else:
            self.seen.append(url)
            await route.abort("blockedbyclient")


@pytest.fixture
async def new_context(browser: Browser) -> AsyncIterator[Callable[..., Any]]:
    """`await new_context(width=..., height=...)`: a fresh browser profile whose every request
    passes the loopback guard; the guard's findings are asserted empty at teardown."""
    made: list[tuple[BrowserContext, Offsite]] = []

    async def make(width: int = 1280, height: int = 900) -> tuple[BrowserContext, Offsite]:
        ctx = await browser.new_context(viewport={"width": width, "height": height})
        offsite = Offsite()
        await ctx.route("**/*", offsite.guard)
        made.append((ctx, offsite))
        return ctx, offsite

    yield make
    for ctx, offsite in made:
        await ctx.close()
        assert offsite.seen == [], f"pages requested non-loopback URLs: {offsite.seen}"
        assert offsite.all, "the guard saw no request at all: it would prove nothing"


async def _up(make_cluster: Callable[..., Cluster], *, reconciler: bool = False) -> Cluster:
    c = make_cluster(env={**TOKENS, **FAST})
    await c.start_sandbox()
    await c.start_ledger()
    await c.start_dispatcher()
    if reconciler:
        await c.start_reconciler()
    c.ledger.headers["Authorization"] = f"Bearer {OPERATOR}"  # for the harness's own reads
    return c


async def _submit(c: Cluster, token: str, tool: str, arguments: dict[str, Any],
                  key: str) -> dict[str, Any]:
    resp = await c.ledger.post("/v1/intents", headers={"Authorization": f"Bearer {token}"},
                               json={"tool": tool, "arguments": arguments,
                                     "idempotency_key": key})
    assert resp.status_code == 201, resp.text
    return resp.json()  # type: ignore[no-any-return]


async def _sign_in(page: Page, c: Cluster, token: str, path: str = "/console/") -> None:
    await page.goto(f"{c.ledger_url}{path}")
    await expect(page).to_have_title("Sign in · effectledger console")
    await page.get_by_label("Token").fill(token)
    await page.get_by_role("button", name="Sign in").click()


async def test_operator_approves_the_exact_arguments_and_watches_the_operation_succeed(
        make_cluster: Callable[..., Cluster], new_context: Callable[..., Any],
        shots: Path) -> None:
    c = await _up(make_cluster)
    op = await _submit(c, AGENT_A, "fast_wire", {"amount": 4200, "currency": "EUR",
                                                 "to": "acct-DE89-3704"}, "wire-1")
    assert op["state"] == "awaiting_approval"
    ctx, _ = await new_context()
    page = await ctx.new_page()
    await _sign_in(page, c, OPERATOR)
    await expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    await expect(page.get_by_role("link", name="1 awaiting approval")).to_be_visible()
    await page.screenshot(path=shots / "overview.png", full_page=True)

    await page.get_by_role("link", name="1 awaiting approval").click()
    await page.get_by_role("link", name=op["id"]).click()
    args = page.locator("#arguments")
    await expect(args).to_contain_text('"amount": 4200')
    await expect(args).to_contain_text('"to": "acct-DE89-3704"')
    await expect(page.locator("#digest")).to_have_text(op["arguments_digest"])
    await expect(page.get_by_text("Idempotent, approval-gated")).to_be_visible()
    await page.screenshot(path=shots / "approval.png", full_page=True)

    await page.get_by_role("button", name="Approve these arguments").click()
    await expect(page.get_by_role("status")).to_contain_text("Approved")
    # The operation page reloads by itself as the state moves; no test-side reload.
    await expect(page.locator("#op-state")).to_have_text("succeeded", timeout=30_000)
    timeline = page.locator("ol.timeline")
    await expect(timeline).to_contain_text("approved")
    await expect(timeline).to_contain_text("operator:alice")
    await page.screenshot(path=shots / "operation.png", full_page=True)
    truth = await c.key_truth(op["operation_key"])
    assert truth["applied"] == 1, truth

    # The receipt downloads as JSON.
    async with page.expect_download() as dl:
        await page.get_by_role("link", name="Download the receipt (JSON)").click()
    saved = await (await dl.value).path()
    receipt = json.loads(await asyncio.to_thread(Path(saved).read_text))
    assert receipt["operation_id"] == op["id"] and receipt["state"] == "succeeded"


async def test_a_stale_approval_page_is_refused_with_a_clear_message(
        make_cluster: Callable[..., Cluster], new_context: Callable[..., Any],
        shots: Path) -> None:
    c = await _up(make_cluster)
    op = await _submit(c, AGENT_A, "fast_wire", {"amount": 10, "to": "acct-1"}, "wire-stale")
    ctx, _ = await new_context()
    page = await ctx.new_page()
    await _sign_in(page, c, OPERATOR, f"/console/approvals/{op['id']}")
    await expect(page.locator("#arguments")).to_contain_text('"amount": 10')
    # Meanwhile another operator decides (through the API): this page is now stale.
    other = await c.ledger.post(f"/v1/operations/{op['id']}/reject",
                                json={"epoch": op["epoch"], "reason": "duplicate request"})
    assert other.status_code == 200, other.text
    await page.get_by_role("button", name="Approve these arguments").click()
    await expect(page.get_by_role("alert")).to_contain_text("This page is out of date")
    await expect(page.get_by_role("alert")).to_contain_text("cancelled")
    assert (await c.operation(op["id"]))["state"] == "cancelled"
    assert (await c.truth())["total_requests"] == 0

    # A page whose epoch no longer matches (as after a retry plan) is refused the same way.
    op2 = await _submit(c, AGENT_A, "fast_wire", {"amount": 11, "to": "acct-2"}, "wire-epoch")
    await page.goto(f"{c.ledger_url}/console/approvals/{op2['id']}")
    await page.locator("form[action$='/approve'] input[name=epoch]").evaluate(
        "el => el.value = '7'")
    await page.get_by_role("button", name="Approve these arguments").click()
    await expect(page.get_by_role("alert")).to_contain_text("it showed epoch 7")
    assert (await c.operation(op2["id"]))["state"] == "awaiting_approval"

    # An epoch that is not a number a person would type as one (a superscript two, which
    # Python's isdigit accepts and int refuses) is a clear refusal, not a server error.
    await page.goto(f"{c.ledger_url}/console/approvals/{op2['id']}")
    await page.locator("form[action$='/approve'] input[name=epoch]").evaluate(
        "el => el.value = '\u00b2'")
    await page.get_by_role("button", name="Approve these arguments").click()
    await expect(page.get_by_role("alert")).to_contain_text("must be a whole number of 32 bits")
    await page.screenshot(path=shots / "bad-number.png", full_page=True)
    assert (await c.operation(op2["id"]))["state"] == "awaiting_approval"


async def test_review_not_executed_with_evidence_retries_once_and_the_provider_applies_once(
        make_cluster: Callable[..., Cluster], new_context: Callable[..., Any],
        shots: Path) -> None:
    c = await _up(make_cluster, reconciler=True)
    # A 502 before the provider applied anything: the dispatcher cannot know that (ambiguous),
    # and fast_page has no readback and no webhooks, so no machine can decide.
    fault = await c.sandbox.post("/_faults/append", json={
        "match": {"route": "plainpager"}, "action": {"kind": "status_before_apply",
                                                     "status": 502}, "times": 1})
    assert fault.status_code == 200, fault.text
    op = await _submit(c, AGENT_A, "fast_page", {"who": "on-call", "text": "disk full"},
                       "page-1")
    await c.wait_state(op["id"], "needs_review", 40)
    assert (await c.key_truth(op["operation_key"]))["applied"] == 0

    ctx, _ = await new_context()
    page = await ctx.new_page()
    await _sign_in(page, c, OPERATOR)
    await expect(page.get_by_role("link", name="1 awaiting review")).to_be_visible()
    await page.get_by_role("link", name="Reviews").click()
    await page.get_by_role("link", name=f"fast_page · {op['id']}").click()
    await expect(page.get_by_role("heading", name="Evidence collected")).to_be_visible()
    await expect(page.locator("ol.timeline")).to_contain_text("outcome_recorded")
    await page.get_by_role("radio", name=re.compile(r"^not_executed")).check()
    await expect(page.locator("#retry-plan")).to_be_visible()
    await expect(page.locator("#retry-plan")).to_contain_text(op["operation_key"])
    await expect(page.locator("#retry-body")).to_contain_text('"text": "disk full"')
    await page.get_by_label("Evidence reference").fill("PAGER-LOG-4711")
    await page.screenshot(path=shots / "review.png", full_page=True)
    await page.get_by_role("button", name="Record the review").click()
    await expect(page.get_by_role("status").first).to_contain_text("not_executed")
    await expect(page.locator("#op-state")).to_have_text("succeeded", timeout=30_000)
    final = await c.operation(op["id"])
    assert final["epoch"] == 2
    truth = await c.key_truth(op["operation_key"])
    assert truth["applied"] == 1, truth
    kinds = [e["kind"] for e in await c.journal(op["id"])]
    assert "review_recorded" in kinds and "retry_admitted" in kinds, kinds


async def test_agent_cannot_approve_or_review_sees_only_its_tenant_and_csrf_is_required(
        make_cluster: Callable[..., Cluster], new_context: Callable[..., Any]) -> None:
    c = await _up(make_cluster)
    mine = await _submit(c, AGENT_A, "fast_wire", {"amount": 1, "to": "a"}, "mine-1")
    theirs = await _submit(c, AGENT_B, "fast_wire", {"amount": 2, "to": "b"}, "theirs-1")
    ctx, _ = await new_context()
    page = await ctx.new_page()
    await _sign_in(page, c, AGENT_A, "/console/operations")
    await expect(page.get_by_role("link", name=mine["id"])).to_be_visible()
    await expect(page.get_by_role("link", name=theirs["id"])).to_have_count(0)
    await expect(page.get_by_role("navigation", name="Main")).not_to_contain_text("Approvals")
    await page.goto(f"{c.ledger_url}/console/operations/{theirs['id']}")
    await expect(page.get_by_role("heading", name="Not found")).to_be_visible()
    await page.goto(f"{c.ledger_url}/console/approvals/{mine['id']}")
    await expect(page.get_by_role("heading", name="Not allowed")).to_be_visible()
    await page.goto(f"{c.ledger_url}/console/operations/{mine['id']}")
    await expect(page.get_by_text("your token is read-only")).to_be_visible()
    # Even a well-formed post with this session's CSRF token is refused for an agent.
    csrf = await page.locator("input[name=csrf]").first.input_value()
    for path, form in ((f"/console/approvals/{mine['id']}/approve",
                        {"csrf": csrf, "epoch": "1",
                         "arguments_digest": mine["arguments_digest"]}),
                       (f"/console/reviews/{mine['id']}",
                        {"csrf": csrf, "epoch": "1", "conclusion": "completed",
                         "evidence_ref": "x"})):
        resp = await page.request.post(f"{c.ledger_url}{path}", form=form, max_redirects=0)
        assert resp.status == 403, (path, resp.status)
    assert (await c.operation(mine["id"]))["state"] == "awaiting_approval"

    # An operator's session: a post without the CSRF token is refused and changes nothing.
    ctx2, _ = await new_context()
    op_page = await ctx2.new_page()
    await _sign_in(op_page, c, OPERATOR)
    await expect(op_page.get_by_role("heading", name="Overview")).to_be_visible()
    resp = await op_page.request.post(
        f"{c.ledger_url}/console/approvals/{mine['id']}/approve", max_redirects=0,
        form={"epoch": "1", "arguments_digest": mine["arguments_digest"]})
    assert resp.status == 403 and "security token" in await resp.text()
    assert (await c.operation(mine["id"]))["state"] == "awaiting_approval"


async def test_pages_work_by_keyboard_at_phone_width_with_labels_and_docs_stay_local(
        make_cluster: Callable[..., Cluster], new_context: Callable[..., Any],
        shots: Path) -> None:
    c = await _up(make_cluster)
    op = await _submit(c, AGENT_A, "fast_wire", {"amount": 3, "to": "acct-3",
                                                 "memo": "x" * 300}, "phone-1")
    ctx, offsite = await new_context(width=390, height=844)
    page = await ctx.new_page()
    # Keyboard only: the skip link comes first, then the home link, then the token field;
    # Enter submits.
    await page.goto(f"{c.ledger_url}/console/")
    await page.keyboard.press("Tab")
    await expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    await page.keyboard.press("Tab")
    await expect(page.get_by_role("link", name="effectledger")).to_be_focused()
    await page.keyboard.press("Tab")
    await expect(page.get_by_label("Token")).to_be_focused()
    await page.keyboard.type(OPERATOR)
    await page.keyboard.press("Enter")
    await expect(page.get_by_role("heading", name="Overview")).to_be_visible()

    for path in ("/console/", "/console/operations", f"/console/operations/{op['id']}",
                 f"/console/approvals/{op['id']}", "/console/approvals", "/console/reviews",
                 "/console/pipeline"):
        await page.goto(f"{c.ledger_url}{path}")
        unlabelled = await page.evaluate("""() => [...document.querySelectorAll(
              'input:not([type=hidden]), select, textarea, button')]
            .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                          && !(el.tagName === 'BUTTON' && el.textContent.trim()))
            .map(el => el.outerHTML)""")
        assert unlabelled == [], (path, unlabelled)
        # Nothing wider than the screen except inside a scroll box (tables, <pre>).
        wide = await page.evaluate("""() => [...document.querySelectorAll('body *')]
            .filter(el => el.getBoundingClientRect().right > window.innerWidth + 1
                          && !el.closest('.scroll, pre'))
            .map(el => el.tagName + '.' + el.className + ': ' + el.textContent.slice(0, 60))""")
        overflow = await page.evaluate(
            "() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0 and wide == [], (path, overflow, wide[:5])
        assert await page.locator("main h1").count() == 1, path

    # Approve by keyboard: focus the button and press Enter.
    await page.goto(f"{c.ledger_url}/console/approvals/{op['id']}")
    await page.screenshot(path=shots / "approval-phone.png", full_page=True)
    await page.get_by_role("button", name="Approve these arguments").focus()
    await page.keyboard.press("Enter")
    await expect(page.get_by_role("status")).to_contain_text("Approved")

    # /docs renders the API from the ledger's own copy of Swagger UI.
    await page.goto(f"{c.ledger_url}/docs")
    await expect(page.locator(".swagger-ui .info .title")).to_contain_text("effectledger ledger",
                                                                           timeout=15_000)
    await expect(page.locator(".opblock").first).to_be_visible()
    assert any(u.endswith("/console/static/swagger/swagger-ui-bundle.js") for u in offsite.all)

    # The guard itself can fail a test: a request off the machine is caught and aborted.
    blocked = await page.evaluate(
        "() => fetch('https://cdn.example.com/x.js').then(() => 'loaded', () => 'blocked')")
    assert blocked == "blocked"
    assert offsite.seen == ["https://cdn.example.com/x.js"]
    offsite.seen.clear()


async def test_overview_refreshes_by_itself(
        make_cluster: Callable[..., Cluster], new_context: Callable[..., Any]) -> None:
    c = await _up(make_cluster)
    ctx, _ = await new_context()
    page = await ctx.new_page()
    await _sign_in(page, c, OPERATOR)
    await expect(page.get_by_role("link", name="0 awaiting approval")).to_be_visible()
    await _submit(c, AGENT_B, "fast_wire", {"amount": 5, "to": "acct-5"}, "refresh-1")
    # No reload from the test: the page's own refresh must bring the new figure.
    await expect(page.get_by_role("link", name="1 awaiting approval")).to_be_visible(
        timeout=15_000)

