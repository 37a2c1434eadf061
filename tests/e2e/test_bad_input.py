"""Hostile and broken input at every entry: clear errors, no rows, no stuck consumers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import nats

from tests.support.cluster import Cluster, wait_until

# Deep enough to exhaust a recursive JSON parser, far below every size limit (~100 KB).
DEEP_JSON = b'{"tool": "create_ticket", "arguments": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}"


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def _intent(tool: str = "create_ticket", arguments: Any = None, **extra: Any) -> bytes:
    return json.dumps({"tool": tool, "arguments": {} if arguments is None else arguments,
                       **extra}).encode()


async def _chunked_oversize() -> AsyncIterator[bytes]:
    # No Content-Length: the ledger must stop reading as soon as the limit is passed.
    yield b'{"tool": "create_ticket", "arguments": {"x": "'
    for _ in range(40):
        yield b"a" * 10_000
    yield b'"}}'


HTTP_CASES: list[tuple[str, dict[str, Any], int, str]] = [
    ("unknown tool", {"content": _intent("no_such_tool")}, 422, "unknown_tool"),
    ("malformed JSON", {"content": b'{"tool": "create_ticket", '}, 422, "invalid_request"),
    ("not UTF-8", {"content": b"\xff\xfe\x00garbage"}, 422, "invalid_request"),
    ("empty body", {"content": b""}, 422, "invalid_request"),
    ("a JSON list", {"content": b"[1, 2]"}, 422, "invalid_request"),
    ("arguments a list", {"content": _intent(arguments=[1, 2])}, 422, "invalid_request"),
    ("arguments a string", {"content": _intent(arguments="x")}, 422, "invalid_request"),
    ("unknown field", {"content": _intent(bogus=1)}, 422, "invalid_request"),
    ("oversize body", {"content": _intent(arguments={"x": "a" * 300_000})}, 413,
     "payload_too_large"),
    ("oversize arguments", {"content": _intent(arguments={"x": "a" * 70_000})}, 413,
     "payload_too_large"),
    ("nested 40 deep", {"content": _intent(arguments=_nested(40))}, 422, "invalid_arguments"),
    ("nested 50,000 deep", {"content": DEEP_JSON}, 422, "invalid_request"),
    ("NaN argument", {"content": b'{"tool": "create_ticket", "arguments": {"x": NaN}}'}, 422,
     "invalid_arguments"),
    ("empty tool name", {"content": _intent("")}, 422, "invalid_request"),
    ("oversize identifier", {"content": _intent(idempotency_key="k" * 2000)}, 422,
     "invalid_request"),
    # PostgreSQL cannot store U+0000; both backends must refuse it the same clear way.
    ("NUL in an argument", {"content": _intent(arguments={"x": "a\x00b"})}, 422,
     "invalid_arguments"),
    ("NUL in an argument name", {"content": _intent(arguments={"a\x00": 1})}, 422,
     "invalid_arguments"),
    ("NUL in the idempotency key", {"content": _intent(idempotency_key="k\x00")}, 422,
     "invalid_request"),
]


async def test_bad_http_intents_get_stable_json_errors_and_write_nothing(
        cluster: Cluster) -> None:
    """Each bad request gets a JSON error with a stable code and leaves every table as it was."""
    existing = await cluster.submit_ok("create_ticket", {"title": "original"}, key="taken")
    await cluster.wait_state(existing["id"], "succeeded", 30)
    cases = [*HTTP_CASES,
             ("oversize chunked body", {"content": _chunked_oversize()}, 413, "payload_too_large"),
             ("key reused with other arguments",
              {"content": _intent(arguments={"title": "other"}, idempotency_key="taken")}, 409,
              "idempotency_key_conflict")]
    for label, request, status, code in cases:
        before = await cluster.table_counts()
        resp = await cluster.ledger.post("/v1/intents", **request,
                                         headers={"content-type": "application/json"})
        assert resp.status_code == status, (label, resp.status_code, resp.text[:300])
        assert resp.headers["content-type"].startswith("application/json"), label
        error = resp.json()["error"]
        assert error["code"] == code and error["message"], (label, error)
        assert await cluster.table_counts() == before, label

    assert (await cluster.ledger.get("/readyz")).status_code == 200
    good = await cluster.submit_ok("create_ticket", {"title": "after the noise"})
    await cluster.wait_state(good["id"], "succeeded", 30)
    assert (await cluster.stats())["operations"] == {"succeeded": 2}


NATS_CASES: list[tuple[str, bytes, str]] = [
    ("garbage bytes", b"\xff\x00garbage", "poison_message"),
    ("empty payload", b"", "poison_message"),
    ("a JSON list", b"[1]", "poison_message"),
    ("unknown tool", _intent("no_such_tool"), "unknown_tool"),
    ("arguments a list", _intent(arguments=[1]), "poison_message"),
    ("nested 40 deep", _intent(arguments=_nested(40)), "invalid_arguments"),
    ("nested 50,000 deep", DEEP_JSON, "poison_message"),
    ("oversize", _intent(arguments={"x": "a" * 300_000}), "payload_too_large"),
    ("NUL in an argument", _intent(arguments={"x": "\x00"}), "invalid_arguments"),
    ("NUL in the task id", _intent(task_id="t\x00"), "poison_message"),
]


async def test_bad_nats_intents_get_error_replies_and_the_ledger_stays_up(
        cluster: Cluster) -> None:
    """Malformed payloads on the intents subject are answered `{"ok": false, "error": ...}`."""
    subject = cluster.settings.subjects.rpc_intents
    before = await cluster.table_counts()
    nc = await nats.connect(cluster.settings.nats_url)
    try:
        for label, payload, code in NATS_CASES:
            msg = await nc.request(subject, payload, timeout=10)
            reply = json.loads(msg.data)
            assert reply["ok"] is False, (label, reply)
            assert reply["error"]["code"] == code and reply["error"]["message"], (label, reply)
        assert cluster.alive("ledger")
        assert await cluster.table_counts() == before

        msg = await nc.request(subject, _intent(arguments={"title": "fine"}), timeout=10)
        reply = json.loads(msg.data)
        assert reply["ok"] is True, reply
    finally:
        await nc.close()
    await cluster.wait_state(reply["operation"]["id"], "succeeded", 30)


async def _dead_letters(c: Cluster, consumer: str) -> list[dict[str, Any]]:
    return await c.db_rows("SELECT * FROM dead_letters WHERE consumer = :c ORDER BY id",
                           c=consumer)


GARBAGE: list[tuple[str, bytes, dict[str, str] | None]] = [
    ("garbage bytes", b"\xff\x00garbage", None),
    ("a JSON list", b"[]", None),
    ("wrong schema", b'{"type": "dispatch_attempt", "operation_id": 7}', None),
    ("invalid JSON declared as JSON", b'{"broken": ', {"content-type": "application/json"}),
    ("nested 50,000 deep", DEEP_JSON, None),
]


async def test_garbage_on_the_dispatch_stream_is_dead_lettered_and_acked(
        cluster: Cluster) -> None:
    """Poison dispatch commands become dead_letters rows, are acked (the stream drains), never
    reach the provider, and the dispatcher keeps serving good intents."""
    subjects = cluster.settings.subjects
    forged = {"operation_id": "no-such-operation", "operation_key": "forged-key", "epoch": 1,
              "tool": "create_ticket", "arguments": {}, "arguments_digest": "x",
              "catalog_digest": "x", "contract_revision": "x"}
    nc = await nats.connect(cluster.settings.nats_url)
    try:
        js = nc.jetstream()
        for i, (_, payload, headers) in enumerate(GARBAGE):
            await js.publish(subjects.dispatch("create_ticket"), payload,
                             headers={**(headers or {}), "Nats-Msg-Id": f"garbage-{i}"})
        # Well-formed, but for an operation the ledger never accepted: refused at the claim.
        await js.publish(subjects.dispatch("create_ticket"), json.dumps(forged).encode())
    finally:
        await nc.close()

    async def all_dead_lettered() -> list[dict[str, Any]]:
        rows = await _dead_letters(cluster, "dispatcher")
        return rows if len(rows) >= len(GARBAGE) else []

    rows = await wait_until(all_dead_lettered, 60, interval=0.2, what="dead letters")
    assert sorted(r["message_id"] for r in rows) == [f"garbage-{i}" for i in range(len(GARBAGE))]
    assert all(r["error"] and r["subject"] == subjects.dispatch("create_ticket") for r in rows)

    async def drained() -> bool:
        return await cluster.stream_messages(subjects.dispatch_stream) == 0

    await wait_until(drained, 30, interval=0.2, what="the dispatch stream to drain")
    assert await cluster.db_scalar(
        "SELECT count(*) FROM journal WHERE kind = 'dead_lettered'") == len(GARBAGE)
    assert cluster.alive("dispatcher") and cluster.alive("ledger")
    assert (await cluster.truth())["total_requests"] == 0

    good = await cluster.submit_ok("create_ticket", {"title": "still working"})
    await cluster.wait_state(good["id"], "succeeded", 30)
    assert len(await _dead_letters(cluster, "dispatcher")) == len(GARBAGE)


async def test_garbage_outcomes_are_dead_lettered_by_the_ledger_inbox(cluster: Cluster) -> None:
    """Poison messages on the ledger's outcome subjects become dead_letters rows and are acked;
    the inbox keeps recording real outcomes."""
    subjects = cluster.settings.subjects
    nc = await nats.connect(cluster.settings.nats_url)
    try:
        js = nc.jetstream()
        for i, (_, payload, headers) in enumerate(GARBAGE):
            await js.publish(subjects.outcome("x"), payload,
                             headers={**(headers or {}), "Nats-Msg-Id": f"bad-outcome-{i}"})
    finally:
        await nc.close()

    async def all_dead_lettered() -> list[dict[str, Any]]:
        rows = await _dead_letters(cluster, "ledger-inbox")
        return rows if len(rows) >= len(GARBAGE) else []

    rows = await wait_until(all_dead_lettered, 60, interval=0.2, what="dead letters")
    assert sorted(r["message_id"] for r in rows) == sorted(
        f"bad-outcome-{i}" for i in range(len(GARBAGE)))
    assert all(r["subject"] == subjects.outcome("x") for r in rows)

    async def drained() -> bool:
        return await cluster.stream_messages(subjects.events_stream) == 0

    await wait_until(drained, 30, interval=0.2, what="the events stream to drain")
    assert await cluster.db_scalar("SELECT count(*) FROM operations") == 0
    assert cluster.alive("ledger")

    good = await cluster.submit_ok("create_ticket", {"title": "still recording"})
    await cluster.wait_state(good["id"], "succeeded", 30)
    assert len(await _dead_letters(cluster, "ledger-inbox")) == len(GARBAGE)
