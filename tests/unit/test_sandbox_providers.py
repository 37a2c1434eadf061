"""The sandbox's real-provider shapes (issue 12): path-addressed updates read from the raw
path, a search answer listing every effect for a key, and a provider that applies twice."""

from __future__ import annotations

import httpx

from effectledger_sandbox.app import create_app, sandbox_state


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app()),
                             base_url="http://sandbox")


async def test_a_path_addressed_update_records_its_object() -> None:
    async with client() as c:
        r = await c.patch("/v1/plain/objects/cus_42", json={"email": "a@b"},
                          headers={"Idempotency-Key": "k1"})
        assert r.status_code == 201 and r.json()["target"] == "cus_42"


async def test_an_encoded_slash_and_dots_stay_one_object_id() -> None:
    async with client() as c:
        r = await c.post("/v1/plain/objects/a%2F..%2Fb", json={})
        assert r.status_code == 201 and r.json()["target"] == "a/../b"


async def test_an_unencoded_slash_or_dot_segment_is_not_an_object() -> None:
    async with client() as c:
        for path in ("/v1/plain/objects/a/b", "/v1/plain/objects/%2E%2E"):
            r = await c.post(path, json={})
            assert r.status_code == 404, path
        assert sandbox_state(c._transport.app).total_applied == 0  # type: ignore[attr-defined]


async def test_search_lists_every_effect_for_a_key() -> None:
    async with client() as c:
        for _ in range(2):
            await c.post("/v1/plain/effects", json={}, headers={"Idempotency-Key": "k2"})
        r = await c.get("/v1/plain/effects", params={"key": "k2"})
        assert [e["idempotency_key"] for e in r.json()["data"]] == ["k2", "k2"]
        assert (await c.get("/v1/plain/effects", params={"key": "none"})).json() == {"data": []}
        assert (await c.get("/v1/plain/effects")).status_code == 400


async def test_duplicate_apply_fault_applies_one_request_twice() -> None:
    async with client() as c:
        await c.post("/_faults", json=[{"match": {"key": "k3"},
                                        "action": {"kind": "duplicate_apply"}, "times": 1}])
        r = await c.post("/v1/idempotent/effects", json={}, headers={"Idempotency-Key": "k3"})
        assert r.status_code == 201
        assert (await c.get("/_truth/k3")).json()["applied"] == 2
        assert len((await c.get("/v1/idempotent/effects", params={"key": "k3"})).json()[
            "data"]) == 2
