"""Hostile bytes at every HTTP route an agent or operator may use (issue 28, "Bytes").

Hypothesis draws a route of the ledger's API and puts arbitrary Unicode (unpaired surrogates,
NUL, right-to-left overrides, non-characters) or arbitrary bytes (overlong and CESU-8 UTF-8,
invalid lead bytes) into its path parameters, its query parameters (cursors included, as raw
text and as base64 JSON documents holding the same), its headers and every field of its JSON
body, as an agent, an operator, a hostile token or none. On SQLite and on PostgreSQL:

- never a 5xx: every refusal is a typed 4xx `{"error": {"code", "message"}}` in JSON;
- a success only where the input is legal (its body is JSON too);
- nothing wedged or half-written: afterwards every operation has its journal, its last
  transition names its state, a pending operation has its dispatch command, and the ledger
  still takes and serves a legal intent.

In-process through httpx's ASGI transport, so no server edge filters anything first (the
uvicorn edge's own defences are tested in test_http_edge.py). Bounded for CI: the example
count is EFFECTLEDGER_HOSTILE_EXAMPLES (default 250 per database).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote_from_bytes

import httpx
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from effectledger_ledger.api import create_app
from effectledger_ledger.auth import Authenticator
from effectledger_ledger.db.schema import journal, operations, outbox
from effectledger_ledger.db.store import Store
from effectledger_ledger.service import LedgerService
from tests.integration.test_api_auth import (
    AGENT_A,
    AGENTS,
    OPERATOR,
    OPERATORS,
    _ready,
    ambiguous,
    service,
)

EXAMPLES = int(os.environ.get("EFFECTLEDGER_HOSTILE_EXAMPLES", "250"))

# Characters no well-behaved client sends: NUL, unpaired surrogates, bidirectional overrides
# and isolates, a byte-order mark, non-characters, the last code point, and URL syntax.
SPECIAL = ["\x00", "\ud800", "\udfff", "\udbff\udc00", "\u202e", "\u202d", "\u2066", "\u200f",
           "\ufeff", "\ufffe", "\uffff", "\U0010ffff", "\x7f", "\x1b", "%", "/", "?", "#", "&",
           "=", "+", "\\", '"', "..", "\r\n"]
# Byte sequences that are not UTF-8: overlong forms of '/' and NUL, CESU-8 surrogates, a code
# point above U+10FFFF, lone continuation and invalid lead bytes, UTF-16 byte-order marks.
BAD_UTF8 = [b"\xc0\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf", b"\xed\xa0\x80",
            b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\x80", b"\xbf", b"\xf8\x88\x80\x80\x80",
            b"\xff\xfe", b"\xfe\xff", b"\x00"]

hostile_text = st.lists(st.one_of(
    st.sampled_from(SPECIAL),
    st.characters(categories=["Cs"]),  # unpaired surrogates
    st.text(max_size=8)), max_size=6).map("".join)  # any code points but surrogates
hostile_bytes = st.lists(st.one_of(st.binary(max_size=6), st.sampled_from(BAD_UTF8)),
                         max_size=5).map(b"".join)


def utf8(text: str) -> bytes:
    # What a careless client puts on the wire for a surrogate: its CESU-8 bytes.
    return text.encode("utf-8", "surrogatepass")


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


# A value for a slot: hostile text (encoded as UTF-8, surrogates as CESU-8) or raw bytes.
wire = st.one_of(hostile_text.map(utf8), hostile_bytes)
# A cursor is base64 JSON `[created_at, id]`: mostly a well-formed document holding hostile
# text (JSON-escaped) or bytes (raw), so the draw gets past base64 and JSON to the checks.
# Times at the edges of what a datetime holds: with an offset, some have no UTC value.
EDGE_TIMES = ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00",
              "9999-12-31T23:59:59.999999+00:00", "2026-02-30T00:00:00+00:00",
              "2026-11-30T25:00:00+00:00", "2026-11-30T09:00:00+24:00"]
cursor = st.one_of(
    hostile_text.map(lambda t: b64(json.dumps(["2026-11-30T09:00:00+00:00", t]).encode())),
    st.sampled_from(EDGE_TIMES).map(lambda t: b64(json.dumps([t, "id00001"]).encode())),
    hostile_bytes.map(lambda b: b64(b'["2026-11-30T09:00:00+00:00", "' + b + b'"]')),
    st.tuples(hostile_text, hostile_text).map(lambda v: b64(json.dumps(list(v)).encode())),
    hostile_bytes.map(b64),
    wire).map(lambda v: v.encode() if isinstance(v, str) else v)
json_value = st.one_of(hostile_text, st.integers(), st.none(), st.booleans(),
                       st.lists(hostile_text, max_size=2),
                       st.dictionaries(hostile_text, hostile_text, max_size=2))


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # `{id}`: an operation or retry-plan id
    query: dict[str, bytes] = field(default_factory=dict)  # name: a legal value
    fields: dict[str, Any] | None = None  # a legal body; None: no body


# Every route of the API an agent or operator may use (the console renders HTML and has its
# own bad-input tests); `fields` hold a legal value that the draw may replace.
ROUTES = [
    Route("POST", "/v1/intents", {"wait": b"0"}, {
        "tool": "lookup", "arguments": {"q": 1}, "idempotency_key": "k1", "task_id": "t1",
        "tenant": "tenant-a"}),
    Route("GET", "/v1/operations/{id}", {"wait": b"1ms", "changed_from": b"pending"}),
    Route("GET", "/v1/operations/{id}/journal"),
    Route("GET", "/v1/operations/{id}/receipt"),
    Route("GET", "/v1/operations/{id}/recovery"),
    Route("GET", "/v1/operations", {"state": b"pending", "limit": b"5", "cursor": b""}),
    Route("POST", "/v1/operations/{id}/approve", {}, {
        "epoch": 1, "arguments_digest": "d", "operator": "alice"}),
    Route("POST", "/v1/operations/{id}/reject", {}, {
        "epoch": 1, "operator": "alice", "reason": "no"}),
    Route("POST", "/v1/operations/{id}/cancel", {}, {"operator": "alice", "reason": "no"}),
    Route("POST", "/v1/operations/{id}/retry", {}, {
        "operator": "alice", "epoch": 1,
        "review": {"conclusion": "not_executed", "evidence_ref": "ticket-1"}}),
    Route("POST", "/v1/operations/{id}/reviews", {}, {
        "conclusion": "not_executed", "evidence_ref": "ticket-1", "operator": "alice",
        "epoch": 1}),
    Route("POST", "/v1/retry-plans/{id}/use"),
    Route("GET", "/v1/reviews", {"limit": b"5"}),
    Route("GET", "/v1/tools"),
    Route("GET", "/v1/stats"),
    Route("GET", "/healthz"),
    Route("GET", "/readyz"),
    Route("GET", "/readyz/relay"),
]

# Submitting (the most fields) and listing (the cursor) are drawn three times as often as any
# other route.
WEIGHTED = [*ROUTES, *[r for r in ROUTES if r.path in ("/v1/intents", "/v1/operations")] * 2]


def bearer(token: bytes) -> bytes:
    return b"Bearer " + token


# Mostly a real token, so the hostile values get past authentication to the routes' code.
credentials = st.integers(0, 9).flatmap(lambda n: (
    st.just(bearer(AGENT_A.encode())) if n < 4
    else st.just(bearer(OPERATOR.encode())) if n < 8
    else wire.map(bearer) if n == 8
    else st.one_of(st.sampled_from([b"", b"Bearer", b"Bearer "]), wire)))


Drawn = tuple[str, str, list[tuple[bytes, bytes]], bytes | None]  # method, path, headers, body


@st.composite
def requests(draw: st.DrawFn, ids: list[str]) -> Drawn:
    route = draw(st.sampled_from(WEIGHTED))
    path = route.path
    if "{id}" in path:
        raw = draw(st.one_of(st.sampled_from(ids).map(str.encode), wire,
                             st.sampled_from(ids).flatmap(
                                 lambda i: wire.map(lambda w: i.encode() + w))))
        path = path.replace("{id}", quote_from_bytes(raw, safe=""))
    params = []
    for name, legal in route.query.items():
        # Absent, legal or hostile: a hostile `state` or `limit` is refused before the cursor
        # is read, so each is hostile only one time in four, the cursor three times in four.
        n = draw(st.integers(0, 3))
        if n == 0:
            continue
        hostile = n > 1 if name == "cursor" else n == 3
        value = draw(cursor if name == "cursor" else wire) if hostile else legal
        params.append(f"{name}={quote_from_bytes(value, safe='')}")
    if params:
        path += "?" + "&".join(params)
    headers = [(b"authorization", draw(credentials))]
    if draw(st.booleans()):
        headers.append((b"traceparent", draw(wire)))  # read by the tracing middleware
    body: bytes | None = None
    if route.fields is not None:
        headers.append((b"content-type", draw(st.one_of(
            st.just(b"application/json"), wire))))
        fields = dict(route.fields)
        for name in list(fields):
            if draw(st.integers(0, 3)) == 0:  # each field hostile one time in four
                fields[name] = draw(json_value)
        if draw(st.booleans()):  # a field nobody asked for
            fields[draw(hostile_text)] = draw(json_value)
        body = draw(st.one_of(
            st.just(json.dumps(fields).encode()),  # surrogates escaped: "\ud800"
            st.just(utf8(json.dumps(fields, ensure_ascii=False))),  # raw CESU-8 bytes
            hostile_bytes))
    return route.method, path, headers, body


AS_AGENT = [(b"authorization", bearer(AGENT_A.encode()))]
# What the draw found on the code before the fix (500s), kept as explicit examples.
FOUND: list[Drawn] = [
    ("GET", "/v1/operations?cursor=" + b64(b'["2026-11-30T09:00:00+00:00", "\\u2066\\ud8a3"]'),
     AS_AGENT, None),  # SQLite and PostgreSQL: an unpaired surrogate in the cursor's id
    ("GET", "/v1/operations?cursor=" + b64(b'["2026-11-30T09:00:00+00:00", "\xed\xa0\x80"]'),
     AS_AGENT, None),  # the same as CESU-8 bytes (json.loads reads them with surrogatepass)
    ("GET", "/v1/operations/%00/journal", AS_AGENT, None),  # PostgreSQL: NUL in an id
    ("GET", "/v1/operations?cursor=" + b64(b'["0001-01-01T00:00:00+14:00", "id00001"]'),
     AS_AGENT, None),  # both: a cursor time with no UTC value
]


def assert_typed(resp: httpx.Response, what: str) -> None:
    assert resp.status_code < 500, f"{what}: {resp.status_code} {resp.text[:300]}"
    if resp.status_code in (307, 308):  # Starlette's trailing-slash redirect, same origin
        assert resp.headers["location"].startswith("http://ledger.test/"), what
        return
    assert resp.headers.get("content-type", "").startswith("application/json"), what
    body = resp.json()
    if resp.status_code >= 400:
        assert set(body) == {"error"}, f"{what}: {body}"
        error = body["error"]
        assert isinstance(error["code"], str) and error["code"], f"{what}: {body}"
        assert isinstance(error["message"], str) and error["message"], f"{what}: {body}"


async def seeded(svc: LedgerService, client: httpx.AsyncClient) -> list[str]:
    """Operations in the states the routes act on: pending, awaiting approval, needs review."""
    ids = []
    for tool in ("lookup", "payout", "email"):
        resp = await client.post("/v1/intents", headers={"authorization": f"Bearer {OPERATOR}"},
                                 json={"tool": tool, "arguments": {"q": 1},
                                       "tenant": "tenant-a"})
        assert resp.status_code == 201, resp.text
        ids.append(resp.json()["id"])
    await ambiguous(svc, ids[2], undecidable=True)
    return ids


async def assert_nothing_half_written(store: Store) -> None:
    async with store.transaction() as conn:
        ops = (await conn.execute(sa.select(operations.c.id, operations.c.state,
                                            operations.c.epoch))).all()
        for op_id, state, epoch in ops:
            entries = (await conn.execute(
                sa.select(journal.c.to_state).where(journal.c.operation_id == op_id)
                .order_by(journal.c.id))).scalars().all()
            assert entries, f"{op_id}: an operation without a journal"
            last = [s for s in entries if s is not None][-1]
            assert last == state, f"{op_id}: state {state}, last transition to {last}"
            if state == "pending":
                command = (await conn.execute(sa.select(outbox.c.id).where(
                    outbox.c.operation_id == op_id, outbox.c.epoch == epoch,
                    outbox.c.kind == "dispatch"))).first()
                assert command is not None, f"{op_id}: pending without its dispatch command"


@pytest.fixture
async def ledger(store: Store) -> AsyncIterator[tuple[LedgerService, httpx.AsyncClient]]:
    svc = service(store)
    app = create_app(svc, ready=_ready, auth=Authenticator(AGENTS, OPERATORS))
    # raise_app_exceptions off: a bug answers 500 like a server would, and the test says so.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://ledger.test") as c:
        yield svc, c


async def test_hostile_bytes_at_every_route_get_a_typed_4xx_and_wedge_nothing(
        ledger: tuple[LedgerService, httpx.AsyncClient], store: Store) -> None:
    svc, client = ledger
    ids = await seeded(svc, client)
    statuses: dict[int, int] = {}

    loop = asyncio.get_running_loop()

    async def send(request: Drawn) -> None:
        method, path, headers, body = request
        resp = await client.request(method, path, headers=headers, content=body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert_typed(resp, f"{method} {path[:120]!r} {headers!r:.200} {body!r:.200}")

    # Hypothesis drives examples synchronously: it runs in a thread and hands each request to
    # this test's event loop, where the app, the store and their connections live.
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(requests(ids))
    def one(request: Drawn) -> None:
        asyncio.run_coroutine_threadsafe(send(request), loop).result()

    for known in FOUND:  # always tried, whatever the draw finds this time
        one = example(known)(one)

    await asyncio.to_thread(one)
    # Both sides were exercised: refusals and legal requests that succeeded.
    assert any(s >= 400 for s in statuses) and any(s < 300 for s in statuses), statuses
    await assert_nothing_half_written(store)
    # The ledger still takes and serves a legal intent.
    ok = await client.post("/v1/intents", headers={"authorization": f"Bearer {AGENT_A}"},
                           json={"tool": "lookup", "arguments": {"after": "fuzz"}})
    assert ok.status_code == 201, ok.text
    read = await client.get(f"/v1/operations/{ok.json()['id']}",
                            headers={"authorization": f"Bearer {AGENT_A}"})
    assert read.status_code == 200 and read.json()["state"] == "pending"


@pytest.mark.parametrize("cursor", [
    b64(b'["2026-11-30T09:00:00+00:00", "\\ud800"]'),  # JSON-escaped lone surrogate
    b64(b'["2026-11-30T09:00:00+00:00", "\xed\xa0\x80"]'),  # its CESU-8 bytes
    b64(b'["2026-11-30T09:00:00+00:00", "\\udfff\\u0000"]'),
    "%ED%A0%80"])
async def test_a_cursor_holding_a_lone_surrogate_is_a_4xx(
        ledger: tuple[LedgerService, httpx.AsyncClient], cursor: str) -> None:
    """The finding: each of these was a 500 on both databases."""
    _, client = ledger
    resp = await client.get(f"/v1/operations?cursor={cursor}",
                            headers={"authorization": f"Bearer {AGENT_A}"})
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"] == {"code": "invalid_request", "message": "malformed cursor"}


async def test_nul_in_an_id_is_a_4xx_without_the_server_edge(
        ledger: tuple[LedgerService, httpx.AsyncClient]) -> None:
    """On PostgreSQL these were 500s when the app ran behind anything but its own uvicorn edge
    (in process, or another ASGI server): the app refuses NUL itself now."""
    _, client = ledger
    for method, path in [("GET", "/v1/operations/op%00x"), ("GET", "/v1/operations/op%00/journal"),
                         ("POST", "/v1/retry-plans/p%00/use"),
                         ("POST", "/v1/operations/op%00/retry")]:
        resp = await client.request(method, path, json={} if method == "POST" else None,
                                    headers={"authorization": f"Bearer {OPERATOR}"})
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["code"] == "invalid_request"


# ---- the console ----------------------------------------------------------------------------

CONSOLE_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
CONSOLE_PAGES = [("/console/", ()), ("/console/overview/cards", ()),
                 ("/console/operations", ("state", "tool", "tenant", "task", "from", "to", "q",
                                          "duplicates", "order", "cursor")),
                 ("/console/operations/{id}", ()), ("/console/operations/{id}/state.json", ()),
                 ("/console/operations/{id}/receipt.json", ()), ("/console/approvals", ()),
                 ("/console/approvals/{id}", ()), ("/console/reviews", ()),
                 ("/console/reviews/{id}", ()), ("/console/pipeline", ()),
                 ("/console/login", ("next", "error"))]
CONSOLE_FORMS = [("/console/operations/{id}/cancel", ("reason",)),
                 ("/console/operations/{id}/retry", ("epoch",)),
                 ("/console/approvals/{id}/approve", ("epoch", "arguments_digest")),
                 ("/console/approvals/{id}/reject", ("epoch", "reason")),
                 ("/console/reviews/{id}", ("epoch", "conclusion", "evidence_ref", "retry"))]


# What the draw found before the fix (500s): a filter time with no UTC value.
CONSOLE_FOUND: list[tuple[str, str, dict[str, bytes]]] = [
    ("GET", "/console/operations?from=0001-01-01T00%3A00%3A00%2B14%3A00", {}),
    ("GET", "/console/operations?to=9999-12-31T23%3A59%3A59-14%3A00", {})]


@st.composite
def console_requests(draw: st.DrawFn, ids: list[str]) -> tuple[str, str, dict[str, bytes]]:
    """(method, path with query, form fields): a page with hostile parameters, or a form
    with hostile fields (the session's CSRF token is added when it is sent)."""
    post = draw(st.booleans())
    # The list (ten filters, the cursor) is drawn as often as all other pages together.
    pages = [*CONSOLE_PAGES, *[CONSOLE_PAGES[2]] * (len(CONSOLE_PAGES) - 1)]
    path, names = draw(st.sampled_from(CONSOLE_FORMS if post else pages))
    if "{id}" in path:
        raw = draw(st.one_of(st.sampled_from(ids).map(str.encode), wire))
        path = path.replace("{id}", quote_from_bytes(raw, safe=""))
    values = {name: draw(st.one_of(
        wire, st.sampled_from(EDGE_TIMES).map(str.encode) if name in ("from", "to") else wire,
        cursor if name == "cursor" else wire, st.just(b"1"))) for name in names
        if draw(st.integers(0, 3)) == 0}  # each one time in four: most draws reach the query
    if post:
        return "POST", path, values
    query = "&".join(f"{k}={quote_from_bytes(v, safe='')}" for k, v in values.items())
    return "GET", path + (f"?{query}" if query else ""), {}


async def test_hostile_bytes_at_every_console_page_and_form_never_get_a_5xx(
        ledger: tuple[LedgerService, httpx.AsyncClient], store: Store) -> None:
    svc, client = ledger
    ids = await seeded(svc, client)
    csrf: dict[str, str] = {}
    for token in (OPERATOR, AGENT_A):  # one session each, in its own cookie jar
        page = await client.get("/console/login")
        found = CONSOLE_CSRF.search(page.text)
        assert found is not None
        resp = await client.post("/console/login", data={"csrf": found.group(1),
                                                          "token": token})
        assert resp.status_code == 303, resp.text
        csrf[token] = client.cookies.pop("effectledger_console")
    loop = asyncio.get_running_loop()
    statuses: dict[int, int] = {}

    async def send(who: str, request: tuple[str, str, dict[str, bytes]]) -> None:
        method, path, fields = request
        session = csrf[who]
        cookies = {"cookie": f"effectledger_console={session}"}
        body = None
        if method == "POST":
            page = await client.get("/console/", headers=cookies)
            token = CONSOLE_CSRF.search(page.text)
            assert token is not None, page.text[:300]
            body = "&".join([f"csrf={token.group(1)}", *(
                f"{k}={quote_from_bytes(v, safe='')}" for k, v in fields.items())]).encode()
        form = {"content-type": "application/x-www-form-urlencoded"} if body is not None else {}
        resp = await client.request(method, path, content=body, headers={**cookies, **form})
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, f"{method} {path[:160]!r} {body!r:.300}: " \
                                       f"{resp.status_code} {resp.text[:300]}"

    @settings(max_examples=EXAMPLES // 2, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from([OPERATOR, AGENT_A]), console_requests(ids))
    def one(who: str, request: tuple[str, str, dict[str, bytes]]) -> None:
        asyncio.run_coroutine_threadsafe(send(who, request), loop).result()

    for known in CONSOLE_FOUND:
        one = example(OPERATOR, known)(one)

    await asyncio.to_thread(one)
    assert any(s >= 400 for s in statuses) and any(s < 400 for s in statuses), statuses
    await assert_nothing_half_written(store)
