"""The sandbox provider: idempotency, fencing, ground truth and every injected fault.

Logic is tested in-process through httpx's ASGI transport. Behaviour that only exists on a
real socket (a dropped connection, a late apply after a drop, a slow body, a client timeout)
is tested against one real uvicorn server shared by the session.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import pytest_asyncio
from starlette.applications import Starlette

from effectledger_sandbox.app import create_app, sandbox_state
from effectledger_sandbox.responses import ConnectionDropped
from effectledger_sandbox.server import serve

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
IDEM = "/v1/idempotent/effects"
PLAIN = "/v1/plain/effects"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Collect(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def client_for(app: Starlette, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sandbox",
                             **kwargs)


@pytest_asyncio.fixture
async def app() -> Starlette:
    return create_app(api_key=API_KEY)


@pytest_asyncio.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(app, headers=AUTH) as c:
        yield c


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def live_server() -> AsyncIterator[str]:
    """One real uvicorn server on a free port (bound with port 0), for socket behaviour."""
    ready = asyncio.Event()
    bound: list[int] = []
    task = asyncio.create_task(serve("127.0.0.1", 0, api_key=API_KEY, ready=ready,
                                     on_listening=lambda _host, port: bound.append(port)))
    ready_wait = asyncio.create_task(ready.wait())
    await asyncio.wait([task, ready_wait], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # startup failed: surface the error
    assert ready.is_set() and bound, "sandbox server did not start"
    yield f"http://127.0.0.1:{bound[0]}"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest_asyncio.fixture
async def live(live_server: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=live_server, headers=AUTH, timeout=10) as c:
        await c.post("/_reset")
        yield c


async def set_faults(c: httpx.AsyncClient, *faults: dict[str, Any], seed: int | None = None
                     ) -> None:
    r = await c.post("/_faults", json={"faults": list(faults), "seed": seed})
    assert r.status_code == 200, r.text


async def truth(c: httpx.AsyncClient, key: str) -> dict[str, Any]:
    r = await c.get(f"/_truth/{key}")
    assert r.status_code == 200
    data: dict[str, Any] = r.json()
    return data


async def wait_until(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    """Poll `check` until it holds; a deadline, not a fixed sleep, bounds the wait."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.01)


def error_code(r: httpx.Response) -> str:
    code: str = r.json()["error"]["code"]
    return code


# -- auth and plumbing --------------------------------------------------------------------------


async def test_v1_without_or_with_wrong_bearer_token_is_401_and_not_counted(app: Starlette
                                                                           ) -> None:
    async with client_for(app) as anon:
        r = await anon.post(IDEM, json={"a": 1}, headers={"Idempotency-Key": "k"})
        assert r.status_code == 401 and error_code(r) == "unauthenticated"
        r = await anon.get(f"{IDEM}/by-key/k", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await anon.post(IDEM, json={"a": 1}, headers={"Idempotency-Key": "k", **AUTH})
        assert r.status_code == 201
        # The harness endpoints need no credentials.
        assert (await anon.get("/healthz")).json() == {"ok": True}
        assert (await anon.get("/_truth")).json()["total_requests"] == 1
        assert (await anon.get("/_faults")).status_code == 200


async def test_without_api_key_v1_is_open() -> None:
    async with client_for(create_app()) as c:
        assert (await c.post(PLAIN, json={})).status_code == 201


async def test_unknown_path_is_a_json_404() -> None:
    async with client_for(create_app()) as c:
        r = await c.get("/nope")
        assert r.status_code == 404 and error_code(r) == "not_found"


async def test_malformed_body_or_fencing_token_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(IDEM, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error_code(r) == "invalid_body"
    r = await client.post(IDEM, json={}, headers={"Idempotency-Key": "k", "Fencing-Token": "x"})
    assert r.status_code == 400 and error_code(r) == "invalid_fencing_token"


# -- idempotency --------------------------------------------------------------------------------


async def test_idempotent_replay_returns_stored_response_without_a_new_effect(
        client: httpx.AsyncClient) -> None:
    first = await client.post(IDEM, json={"amount": 5}, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201
    assert first.headers["X-Request-Id"]
    assert "Idempotent-Replayed" not in first.headers
    assert first.json() == {"id": "eff_1", "idempotency_key": "k1", "status": "applied",
                            "route": "idempotent", "body": {"amount": 5}, "fencing_token": None}
    # Same body with different key order and spacing is still "the same body".
    again = await client.post(IDEM, content=b'{ "amount" : 5 }',
                              headers={"Idempotency-Key": "k1",
                                       "Content-Type": "application/json"})
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert await truth(client, "k1") == {"applied": 1, "requests": 2, "routes": ["idempotent"],
                                         "fencing_tokens": []}


async def test_key_reused_with_a_different_body_is_422_and_not_applied(
        client: httpx.AsyncClient) -> None:
    assert (await client.post(IDEM, json={"amount": 5},
                              headers={"Idempotency-Key": "k"})).status_code == 201
    r = await client.post(IDEM, json={"amount": 6}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 422 and error_code(r) == "idempotency_key_reused"
    assert (await truth(client, "k"))["applied"] == 1


async def test_concurrent_same_key_is_409_request_in_progress_while_first_is_delayed(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"match": {"key": "k"}, "action": {"kind": "delay", "seconds": 0.3},
                              "times": 1})
    a, b = await asyncio.gather(
        client.post(IDEM, json={"n": 1}, headers={"Idempotency-Key": "k"}),
        client.post(IDEM, json={"n": 1}, headers={"Idempotency-Key": "k"}))
    assert sorted([a.status_code, b.status_code]) == [201, 409]
    assert error_code(a if a.status_code == 409 else b) == "request_in_progress"
    assert (await truth(client, "k"))["applied"] == 1
    # Once the first finished, a retry is a plain replay.
    r = await client.post(IDEM, json={"n": 1}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 201 and r.headers["Idempotent-Replayed"] == "true"


async def test_plain_route_applies_every_post_even_with_the_same_key(
        client: httpx.AsyncClient) -> None:
    a = await client.post(PLAIN, json={"to": "x"}, headers={"Idempotency-Key": "k"})
    b = await client.post(PLAIN, json={"to": "x"}, headers={"Idempotency-Key": "k"})
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]
    assert "Idempotent-Replayed" not in b.headers
    assert (await truth(client, "k"))["applied"] == 2
    latest = await client.get(f"{PLAIN}/by-key/k")
    assert latest.status_code == 200 and latest.json()["id"] == b.json()["id"]


async def test_route_idempotency_can_be_configured_explicitly(client: httpx.AsyncClient) -> None:
    r = await client.post("/_config/routes/custom", json={"idempotent": False})
    assert r.json() == {"route": "custom", "idempotent": False}
    for _ in range(2):
        await client.post("/v1/custom/effects", json={}, headers={"Idempotency-Key": "k"})
    assert (await truth(client, "k"))["applied"] == 2
    assert (await client.post("/_config/routes/custom", json={})).status_code == 400


async def test_unconfigured_route_names_default_to_idempotent(client: httpx.AsyncClient) -> None:
    for _ in range(2):
        await client.post("/v1/tickets/effects", json={}, headers={"Idempotency-Key": "k"})
    assert (await truth(client, "k"))["applied"] == 1
    assert (await client.get("/_config/routes/tickets")).json()["idempotent"] is True


async def test_form_body_client_reference_is_the_idempotency_key(
        client: httpx.AsyncClient) -> None:
    form = {"amount": "12", "currency": "eur", "client_reference": "ref-1"}
    first = await client.post(IDEM, data=form)
    assert first.status_code == 201
    assert first.json()["idempotency_key"] == "ref-1"
    assert first.json()["body"] == form
    again = await client.post(IDEM, data=form)
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == first.json()
    changed = await client.post(IDEM, data={**form, "amount": "13"})
    assert changed.status_code == 422
    assert (await client.get(f"{IDEM}/by-key/ref-1")).json()["id"] == first.json()["id"]
    assert (await truth(client, "ref-1"))["applied"] == 1


async def test_idempotency_header_wins_over_client_reference(client: httpx.AsyncClient) -> None:
    r = await client.post(IDEM, json={"client_reference": "body"},
                          headers={"Idempotency-Key": "header"})
    assert r.json()["idempotency_key"] == "header"


async def test_key_is_forgotten_after_the_retention_window() -> None:
    clock = FakeClock()
    app = create_app(retention_s=10, clock=clock)
    async with client_for(app) as c:
        a = await c.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
        clock.now += 9
        assert (await c.post(IDEM, json={}, headers={"Idempotency-Key": "k"})).json() == a.json()
        clock.now += 2
        b = await c.post(IDEM, json={"other": True}, headers={"Idempotency-Key": "k"})
        assert b.status_code == 201 and b.json()["id"] != a.json()["id"]
        assert (await truth(c, "k"))["applied"] == 2


# -- fencing ------------------------------------------------------------------------------------


async def test_lower_fencing_token_is_rejected_409_and_not_applied(
        client: httpx.AsyncClient) -> None:
    def h(token: int) -> dict[str, str]:
        return {"Idempotency-Key": "k", "Fencing-Token": str(token)}

    assert (await client.post(PLAIN, json={}, headers=h(5))).json()["fencing_token"] == 5
    stale = await client.post(PLAIN, json={}, headers=h(3))
    assert stale.status_code == 409 and error_code(stale) == "stale_fencing_token"
    assert (await client.post(PLAIN, json={}, headers=h(5))).status_code == 201  # equal: ok
    assert (await client.post(PLAIN, json={}, headers=h(7))).status_code == 201  # higher: ok
    assert (await client.post(PLAIN, json={}, headers=h(6))).status_code == 409  # 7 is highest
    assert await truth(client, "k") == {"applied": 3, "requests": 5, "routes": ["plain"],
                                        "fencing_tokens": [5, 3, 5, 7, 6]}


async def test_a_nofence_route_applies_a_lower_fencing_token(client: httpx.AsyncClient) -> None:
    """A provider that never checks the token: only the dispatcher's send deadline keeps a
    superseded attempt from applying a second effect there."""
    url = PLAIN.replace("/plain/", "/plainnofence/")
    assert url != PLAIN
    for token in (5, 3):
        r = await client.post(url, json={}, headers={"Idempotency-Key": "k",
                                                     "Fencing-Token": str(token)})
        assert r.status_code == 201
    assert (await truth(client, "k"))["applied"] == 2


async def test_fencing_is_checked_before_an_idempotent_replay(client: httpx.AsyncClient) -> None:
    await client.post(IDEM, json={}, headers={"Idempotency-Key": "k", "Fencing-Token": "2"})
    r = await client.post(IDEM, json={}, headers={"Idempotency-Key": "k", "Fencing-Token": "1"})
    assert r.status_code == 409 and error_code(r) == "stale_fencing_token"
    # Fencing is per route: the same key on another route has its own highest token.
    r = await client.post(PLAIN, json={}, headers={"Idempotency-Key": "k", "Fencing-Token": "1"})
    assert r.status_code == 201


# -- readback, truth, request log, reset --------------------------------------------------------


async def test_readback_by_key_and_by_id_find_the_effect_or_404(
        client: httpx.AsyncClient) -> None:
    assert error_code(await client.get(f"{IDEM}/by-key/k")) == "not_found"
    created = (await client.post(IDEM, json={"x": 1}, headers={"Idempotency-Key": "k"})).json()
    assert (await client.get(f"{IDEM}/by-key/k")).json() == created
    assert (await client.get(f"{IDEM}/{created['id']}")).json() == created
    assert (await client.get(f"{PLAIN}/{created['id']}")).status_code == 404  # other route
    assert (await client.get(f"{IDEM}/eff_999")).status_code == 404


async def test_truth_counts_requests_that_arrived_separately_from_effects_applied(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "rate_limit"}, "times": 1})
    for _ in range(3):
        await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    await client.post(PLAIN, json={})  # no key: counted in the totals only
    body = (await client.get("/_truth")).json()
    assert body == {"keys": {"k": {"applied": 1, "requests": 3, "routes": ["idempotent"],
                                   "fencing_tokens": []}},
                    "total_applied": 2, "total_requests": 4, "forgotten_keys": 0}
    assert await truth(client, "unknown") == {"applied": 0, "requests": 0, "routes": [],
                                              "fencing_tokens": []}


async def test_request_log_records_each_post_with_its_outcome(client: httpx.AsyncClient) -> None:
    await client.post(IDEM, json={}, headers={"Idempotency-Key": "k", "Fencing-Token": "1"})
    await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    await client.post(IDEM, json={}, headers={"Idempotency-Key": "other"})
    log = (await client.get("/_requests", params={"key": "k"})).json()["requests"]
    assert [(e["route"], e["key"], e["fencing_token"], e["outcome"]) for e in log] == [
        ("idempotent", "k", 1, "applied"), ("idempotent", "k", None, "replayed")]
    assert all(isinstance(e["at"], float) for e in log)
    assert len((await client.get("/_requests")).json()["requests"]) == 3


async def test_reset_clears_effects_truth_faults_and_route_config(
        app: Starlette, client: httpx.AsyncClient) -> None:
    await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    await set_faults(client, {"action": {"kind": "rate_limit"}})
    await client.post("/_config/routes/idempotent", json={"idempotent": False})
    assert (await client.post("/_reset")).json() == {"ok": True}
    assert (await client.get("/_truth")).json() == {"keys": {}, "total_applied": 0,
                                                    "total_requests": 0, "forgotten_keys": 0}
    assert (await client.get("/_faults")).json()["faults"] == []
    assert sandbox_state(app).is_idempotent("idempotent")
    assert (await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})).json()["id"] \
        == "eff_1"


# -- the fault API ------------------------------------------------------------------------------


async def test_faults_can_be_replaced_appended_listed_and_cleared(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "delay", "seconds": 1}}, seed=3)
    r = await client.post("/_faults/append", json={"match": {"route": "plain"},
                                                   "action": {"kind": "drop_after_apply"},
                                                   "times": 2})
    listed = (await client.get("/_faults")).json()
    assert r.json() == listed and listed["seed"] == 3
    assert [f["action"]["kind"] for f in listed["faults"]] == ["delay", "drop_after_apply"]
    assert listed["faults"][1]["match"] == {"route": "plain"} and listed["faults"][1]["times"] == 2
    assert (await client.delete("/_faults")).json()["faults"] == []


@pytest.mark.parametrize("fault", [
    {"action": {"kind": "explode"}},
    {"action": {"kind": "delay"}},
    {"action": {"kind": "status_before_apply", "status": 200}},
    {"action": {"kind": "rate_limit"}, "probability": 2},
    {"action": {"kind": "rate_limit"}, "times": -1},
    {"action": {"kind": "rate_limit"}, "match": {"path": "x"}},
])
async def test_invalid_fault_is_rejected_400(client: httpx.AsyncClient,
                                             fault: dict[str, Any]) -> None:
    r = await client.post("/_faults", json={"faults": [fault]})
    assert r.status_code == 400 and error_code(r) == "invalid_fault"
    assert (await client.post("/_faults/append", json=fault)).status_code == 400


async def test_fault_match_and_times_limit_which_requests_see_it(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"match": {"route": "idempotent", "key": "a"},
                              "action": {"kind": "status_before_apply", "status": 500},
                              "times": 2})
    assert (await client.post(IDEM, json={}, headers={"Idempotency-Key": "b"})).status_code == 201
    assert (await client.post(PLAIN, json={}, headers={"Idempotency-Key": "a"})).status_code == 201
    codes = [(await client.post(IDEM, json={}, headers={"Idempotency-Key": "a"})).status_code
             for _ in range(3)]
    assert codes == [500, 500, 201]
    fault = (await client.get("/_faults")).json()["faults"][0]
    assert fault["times"] == 0 and fault["fired"] == 2


async def test_fault_probability_is_repeatable_with_a_seed(client: httpx.AsyncClient) -> None:
    async def pattern() -> list[int]:
        await set_faults(client, {"action": {"kind": "status_before_apply", "status": 503},
                                  "probability": 0.5}, seed=42)
        return [(await client.post(PLAIN, json={})).status_code for _ in range(30)]

    first = await pattern()
    assert await pattern() == first
    assert set(first) == {201, 503}


# -- each fault kind ----------------------------------------------------------------------------


async def test_fault_delay_holds_the_request_before_applying(client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "delay", "seconds": 0.5}, "times": 1})
    post = asyncio.create_task(client.post(IDEM, json={}, headers={"Idempotency-Key": "k"}))

    async def arrived() -> bool:
        return bool((await truth(client, "k"))["requests"] == 1)

    await wait_until(arrived)
    assert (await truth(client, "k"))["applied"] == 0 and not post.done()
    assert (await post).status_code == 201
    assert (await truth(client, "k"))["applied"] == 1


async def test_fault_delay_after_apply_applies_before_answering(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "delay_after_apply", "seconds": 0.5}})
    post = asyncio.create_task(client.post(IDEM, json={}, headers={"Idempotency-Key": "k"}))

    async def applied() -> bool:
        return bool((await truth(client, "k"))["applied"] == 1)

    await wait_until(applied)
    assert not post.done()
    assert (await post).status_code == 201


async def test_fault_delay_after_apply_lets_a_client_time_out_after_the_apply(
        live: httpx.AsyncClient) -> None:
    await set_faults(live, {"action": {"kind": "delay_after_apply", "seconds": 1}, "times": 1})
    with pytest.raises(httpx.ReadTimeout):
        await live.post(IDEM, json={}, headers={"Idempotency-Key": "k"}, timeout=0.2)
    assert (await truth(live, "k"))["applied"] == 1
    retry = await live.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"


async def test_fault_status_before_apply_answers_the_status_without_applying(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "status_before_apply", "status": 503,
                                         "retry_after": "3"}, "times": 1})
    r = await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "3"
    assert (await truth(client, "k")) == {"applied": 0, "requests": 1, "routes": ["idempotent"],
                                          "fencing_tokens": []}
    # Nothing was stored for the key, so the retry applies for real.
    r = await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 201 and "Idempotent-Replayed" not in r.headers


async def test_fault_status_after_apply_answers_an_error_but_the_effect_is_applied(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "status_after_apply", "status": 502},
                              "times": 1})
    r = await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 502 and error_code(r) == "injected_fault"
    assert (await truth(client, "k"))["applied"] == 1
    # The stored record is the true outcome: the retry replays the 201.
    retry = await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    assert (await truth(client, "k"))["applied"] == 1


async def test_fault_rate_limit_is_429_with_retry_after_and_not_applied(
        client: httpx.AsyncClient) -> None:
    date = "Wed, 21 Oct 2026 07:28:00 GMT"
    await set_faults(client, {"action": {"kind": "rate_limit", "retry_after": date}})
    r = await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 429 and error_code(r) == "rate_limited"
    assert r.headers["Retry-After"] == date
    await set_faults(client, {"action": {"kind": "rate_limit", "retry_after": "2"}})
    assert (await client.post(IDEM, json={})).headers["Retry-After"] == "2"
    assert (await truth(client, "k"))["applied"] == 0


async def test_fault_readback_lag_hides_effects_younger_than_the_lag() -> None:
    clock = FakeClock()
    app = create_app(clock=clock)
    async with client_for(app) as c:
        await c.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
        await set_faults(c, {"action": {"kind": "readback_lag", "seconds": 5}})
        assert (await c.get(f"{IDEM}/by-key/k")).status_code == 404
        clock.now += 5
        assert (await c.get(f"{IDEM}/by-key/k")).status_code == 200
        # The lag hides only the newest effect, so readback shows the older one meanwhile.
        old = (await c.post(PLAIN, json={}, headers={"Idempotency-Key": "p"})).json()
        clock.now += 10
        await c.post(PLAIN, json={}, headers={"Idempotency-Key": "p"})
        assert (await c.get(f"{PLAIN}/by-key/p")).json() == old


async def test_fault_drop_after_apply_in_process_raises_connection_dropped(
        client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "drop_after_apply"}, "times": 1})
    with pytest.raises(ConnectionDropped):
        await client.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert (await truth(client, "k"))["applied"] == 1


async def test_fault_drop_after_apply_closes_the_connection_without_any_response(
        live: httpx.AsyncClient) -> None:
    handler = Collect(logging.ERROR)
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        await set_faults(live, {"action": {"kind": "drop_after_apply"}, "times": 1})
        with pytest.raises(httpx.RemoteProtocolError):
            await live.post(IDEM, json={"n": 1}, headers={"Idempotency-Key": "k"})
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert handler.records == []  # no "Exception in ASGI application", no 500
    assert (await truth(live, "k"))["applied"] == 1
    readback = await live.get(f"{IDEM}/by-key/k")
    retry = await live.post(IDEM, json={"n": 1}, headers={"Idempotency-Key": "k"})
    assert retry.status_code == 201 and retry.json() == readback.json()
    assert (await truth(live, "k"))["applied"] == 1


async def test_fault_late_apply_drops_now_and_applies_in_the_background(
        live: httpx.AsyncClient) -> None:
    await set_faults(live, {"action": {"kind": "late_apply", "seconds": 1}, "times": 1})
    with pytest.raises(httpx.RemoteProtocolError):
        await live.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert (await live.get(f"{IDEM}/by-key/k")).status_code == 404
    assert (await truth(live, "k"))["applied"] == 0
    # The provider is still working on the key: a retry now is told so, not re-applied.
    r = await live.post(IDEM, json={}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 409 and error_code(r) == "request_in_progress"

    async def applied() -> bool:
        return bool((await truth(live, "k"))["applied"] == 1)

    await wait_until(applied)
    assert (await live.get(f"{IDEM}/by-key/k")).status_code == 200
    log = (await live.get("/_requests", params={"key": "k"})).json()["requests"]
    assert log[0]["outcome"] == "late_apply:applied"


async def test_reset_cancels_a_pending_late_apply(app: Starlette,
                                                  client: httpx.AsyncClient) -> None:
    await set_faults(client, {"action": {"kind": "late_apply", "seconds": 30}})
    with pytest.raises(ConnectionDropped):
        await client.post(PLAIN, json={}, headers={"Idempotency-Key": "k"})
    pending = set(app.state.background_tasks)
    assert len(pending) == 1
    await client.post("/_reset")
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert [type(r) for r in results] == [asyncio.CancelledError]
    assert (await truth(client, "k"))["applied"] == 0


async def test_fault_slow_body_sends_headers_then_streams_the_body_slowly(
        live: httpx.AsyncClient) -> None:
    await set_faults(live, {"action": {"kind": "slow_body", "seconds": 0.5}})
    chunks: list[bytes] = []
    async with live.stream("POST", IDEM, json={"pad": "x" * 100},
                           headers={"Idempotency-Key": "k"}) as r:
        assert r.status_code == 201
        async for chunk in r.aiter_raw():
            chunks.append(chunk)
    assert len(chunks) > 1
    assert httpx.Response(201, content=b"".join(chunks)).json()["idempotency_key"] == "k"
    assert (await truth(live, "k"))["applied"] == 1


# -- the command line ---------------------------------------------------------------------------


async def test_python_m_serves_on_the_requested_port_and_stops_on_sigint() -> None:
    env = {**os.environ, "EFFECTLEDGER_SANDBOX_API_KEY": "from-env"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "effectledger_sandbox", "--port", "0",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=20)).decode()
        assert line.startswith("effectledger sandbox listening on http://127.0.0.1:"), line
        base = line.rsplit(" ", 1)[1].strip()
        async with httpx.AsyncClient(base_url=base) as c:
            assert (await c.get("/healthz")).json() == {"ok": True}
            assert (await c.post(PLAIN, json={})).status_code == 401
            ok = await c.post(PLAIN, json={}, headers={"Authorization": "Bearer from-env"})
            assert ok.status_code == 201
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
