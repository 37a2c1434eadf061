"""The chaos harness's own parts, fast: the seeded plan, the checker and the fault proxy.

The checker is tested on small hand-made histories so that each invariant is shown to count
what it claims to count (a checker that cannot fail proves nothing); the proxy on a loopback
echo server.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from effectledger_chaos.checker import INVARIANTS, check
from effectledger_chaos.config import ALL_FAULTS, ChaosConfig, parse_faults, parse_tool_mix
from effectledger_chaos.proxy import Proxy, Route
from effectledger_chaos.schedule import Schedule, build
from effectledger_cli.embedded import free_port

# -- the plan ----------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    """Replayable: the plan is a function of the configuration and the seed alone."""
    a = build(ChaosConfig(ops=200, seed=7, ci=True)).to_json()
    b = build(ChaosConfig(ops=200, seed=7, ci=True)).to_json()
    c = build(ChaosConfig(ops=200, seed=8, ci=True)).to_json()
    assert a == b
    assert a != c
    assert Schedule.from_json(json.loads(json.dumps(a))).to_json() == a


def test_a_ci_sized_plan_contains_every_fault_kind() -> None:
    cfg = ChaosConfig(ops=200, seed=1, ci=True)
    plan = build(cfg)
    # Every kind a single-node run can carry; the cluster kinds are skipped on it.
    assert set(plan.planned_counts()) >= set(cfg.active_faults)
    assert set(cfg.active_faults) | set(cfg.skipped_faults) == set(ALL_FAULTS)
    outage = [t for t in plan.timed if t.kind == "nats_long_outage"]
    assert len(outage) == 1 and outage[0].params["down_s"] == 15.0
    full = build(ChaosConfig(ops=200, seed=1))
    assert [t.params["down_s"] for t in full.timed if t.kind == "nats_long_outage"] == [130.0]


def test_lying_webhooks_always_contradict_the_truth() -> None:
    """A forged "applied" goes with a refused request, a forged "not applied" with an applied
    one, so a webhook that gets through is visible as a false verdict too."""
    plan = build(ChaosConfig(ops=400, seed=3))
    for op in plan.ops:
        kinds = {f.kind: f.params for f in op.faults}
        for kind in ("webhook_forged", "webhook_expired"):
            if kind in kinds:
                assert op.type == "c"
                cause = ("status_before_apply" if kinds[kind]["lie"] == "applied"
                         else "drop_after_apply")
                assert cause in kinds, op


def test_fault_and_tool_mix_options() -> None:
    assert parse_faults("all") == list(ALL_FAULTS)
    assert parse_faults("none") == []
    assert parse_faults("network,pg_restart") == ["net_blackhole", "net_reset", "net_latency",
                                                  "pg_restart"]
    assert "nats_long_outage" not in parse_faults("all,-nats_long_outage")
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("meteor")
    assert parse_tool_mix("a=1,d=2") == {"a": 1, "b": 0, "c": 0, "d": 2, "e": 0, "f": 0}
    assert parse_tool_mix("plain_blind=1")["d"] == 1
    with pytest.raises(ValueError):
        parse_tool_mix("a=0")


# -- the checker -------------------------------------------------------------------------

T0 = "2026-01-01T00:00:00+00:00"
T1 = "2026-01-01T00:00:01+00:00"


def _world(cfg: ChaosConfig) -> tuple[Schedule, dict[str, Any], list[dict[str, Any]]]:
    """One type (b) operation that was claimed, applied once and succeeded: all clean."""
    plan = build(cfg)
    op = plan.ops[0]
    plan.ops = [op]
    plan.timed = []
    op.faults = []
    row = {"id": "op1", "tool": op.tool, "state": "succeeded", "epoch": 1,
           "operation_key": op.operation_key, "caller_key": op.caller_key, "created_at": T0,
           "updated_at": T1, "provider_ref": "eff_1", "evidence": None, "last_outcome": None}
    journal = [
        {"id": 1, "operation_id": "op1", "at": T0, "kind": "intent_accepted", "epoch": 1,
         "from_state": None, "to_state": "pending", "actor": "a", "detail": {}},
        {"id": 2, "operation_id": "op1", "at": T0, "kind": "attempt_claimed", "epoch": 1,
         "from_state": "pending", "to_state": "in_flight", "actor": "d",
         "detail": {"attempt_id": "att1"}},
        {"id": 3, "operation_id": "op1", "at": T1, "kind": "outcome_recorded", "epoch": 1,
         "from_state": "in_flight", "to_state": "succeeded", "actor": "d",
         "detail": {"attempt_id": "att1", "type": "attempt_succeeded"}},
    ]
    data = {
        "db": {"operations": [row], "journal": journal,
               "attempts": [{"id": "att1", "operation_id": "op1", "epoch": 1,
                             "dispatcher_id": "d", "status": "attempt_succeeded"}],
               "outbox": [{"kind": "dispatch", "status": "consumed", "n": 1}],
               "dead_letters": [], "webhook_events": [], "reviews": []},
        "sandbox": {"truth": {"keys": {op.operation_key: {
            "applied": 1, "requests": 1, "routes": [op.route], "fencing_tokens": [1]}}},
            "requests": [{"seq": 1, "key": op.operation_key, "fencing_token": 1,
                          "outcome": "applied", "route": op.route}]},
        "jetstream": {"CHAOS_DISPATCH": {"messages": 0, "consumers": {}}},
    }
    history = [
        {"t": 0.0, "wall": 1767225600.0, "process": "c", "type": "invoke", "f": "submit",
         "op": 0},
        {"t": 0.1, "wall": 1767225600.1, "process": "c", "type": "ok", "f": "submit", "op": 0,
         "operation_id": "op1"},
    ]
    return plan, data, history


def _check(plan: Schedule, data: dict[str, Any], history: list[dict[str, Any]],
           **extra: Any) -> dict[str, int]:
    result = check(cfg=ChaosConfig(ops=1, seed=1), schedule=plan, history=history, data=data,
                   fault_records=[], sandbox_faults={}, bad_webhooks=extra.get("bad", []),
                   bad_input={"ran": False}, exits=[], services={},
                   canary_hits=extra.get("canaries", []), phase_start_wall=1767225600.0)
    return {k: v["count"] for k, v in result["invariants"].items()}


def test_a_clean_history_has_every_invariant_at_zero() -> None:
    plan, data, history = _world(ChaosConfig(ops=5, seed=1, tool_mix={"b": 1}))
    assert _check(plan, data, history) == dict.fromkeys(INVARIANTS, 0)


def test_each_invariant_counts_its_violation() -> None:
    cfg = ChaosConfig(ops=5, seed=1, tool_mix={"b": 1})
    key = build(cfg).ops[0].operation_key

    plan, data, history = _world(cfg)
    data["sandbox"]["truth"]["keys"][key]["applied"] = 2
    data["sandbox"]["requests"].append({"seq": 2, "key": key, "fencing_token": 1,
                                        "outcome": "applied", "route": "plainrb"})
    counts = _check(plan, data, history)
    assert counts["duplicate_effects"] == 1 and counts["duplicate_requests_per_epoch"] == 1

    plan, data, history = _world(cfg)
    data["db"]["operations"][0]["state"] = "in_flight"
    data["db"]["journal"].pop()
    counts = _check(plan, data, history)
    assert counts["lost_intents"] == 1 and counts["not_at_rest"] == 1

    plan, data, history = _world(cfg)
    data["sandbox"]["truth"]["keys"][key]["applied"] = 0
    data["sandbox"]["requests"][0]["outcome"] = "rejected:stale_fencing_token"
    assert _check(plan, data, history)["verdicts_contradicting_truth"] == 1

    plan, data, history = _world(cfg)
    data["db"]["journal"][2]["epoch"] = 2  # an outcome accepted for another epoch
    assert _check(plan, data, history)["stale_epoch_writes_accepted"] >= 1

    plan, data, history = _world(cfg)
    data["sandbox"]["requests"] = [
        {"seq": 1, "key": key, "fencing_token": 2, "outcome": "rejected:x", "route": "plainrb"},
        {"seq": 2, "key": key, "fencing_token": 1, "outcome": "applied", "route": "plainrb"}]
    assert _check(plan, data, history)["stale_epoch_writes_accepted"] == 1

    plan, data, history = _world(cfg)
    data["db"]["webhook_events"].append({"webhook_id": "bad-1-0", "applied": None})
    bad = [{"op": 0, "kind": "webhook_forged", "mode": "forged", "lie": "applied",
            "webhook_id": "bad-1-0", "status": 401}]
    assert _check(plan, data, history, bad=bad)["bad_webhook_state_changes"] == 1

    plan, data, history = _world(cfg)
    data["db"]["outbox"].append({"kind": "dispatch", "status": "published", "n": 3})
    data["jetstream"]["CHAOS_DISPATCH"]["messages"] = 2
    assert _check(plan, data, history)["leftover_backlog"] == 2

    plan, data, history = _world(cfg)
    leak = [{"where": "ledger.1.log", "canary": "provider_api_key"}]
    assert _check(plan, data, history, canaries=leak)["canary_leaks"] == 1


def test_each_effective_forgery_is_counted_and_refused_ones_are_not() -> None:
    """Invariant 11: a state change by a forged sender, a granted forged claim, a stored forged
    webhook, an operation in the forged tenant and a request under a forged key each count; a
    forged outcome the ledger rejected (journaled, no state change) does not."""
    plan, data, history = _world(ChaosConfig(ops=5, seed=1, tool_mix={"b": 1}))
    db = data["db"]
    db["journal"].append({"id": 4, "operation_id": "op1", "at": T1, "kind": "outcome_rejected",
                          "epoch": 1, "from_state": "succeeded", "to_state": "succeeded",
                          "actor": "forged-dispatcher", "detail": {}})
    assert _check(plan, data, history)["forged_messages_effective"] == 0
    db["journal"].append({"id": 5, "operation_id": "op1", "at": T1, "kind": "verdict_applied",
                          "epoch": 1, "from_state": "ambiguous", "to_state": "succeeded",
                          "actor": "reconciler:forged-reconciler", "detail": {}})
    db["attempts"].append({"id": "forged-attempt-1-0", "operation_id": "op1", "epoch": 2,
                           "dispatcher_id": "forged-dispatcher", "status": "claimed"})
    db["webhook_events"].append({"webhook_id": "forged-1-0", "operation_id": "op1",
                                 "applied": None})
    db["operations"].append({**db["operations"][0], "id": "op2", "caller_key": None,
                             "tenant": "forged-tenant"})
    data["sandbox"]["requests"].append({"seq": 2, "key": "forged-key-1-0", "fencing_token": 1,
                                        "outcome": "applied", "route": "plainrb"})
    assert _check(plan, data, history)["forged_messages_effective"] == 5
    # Issue 28: an unbound provider's webhook kept but marked refused can never be applied;
    # a ledger answer written into a stream (its dead letter names the reply attack) counts.
    db["webhook_events"].append({"webhook_id": "forged-unbound-1-0", "operation_id": "op1",
                                 "applied": "refused:provider_not_bound"})
    db["dead_letters"].append({"consumer": "dispatcher", "subject": "chaos.dispatch.v1.x",
                               "payload_excerpt": "operation 'forged-reply-1-0-0' not found"})
    assert _check(plan, data, history)["forged_messages_effective"] == 6


def test_an_idempotent_readback_tool_in_review_is_an_unneeded_review() -> None:
    cfg = ChaosConfig(ops=5, seed=1, tool_mix={"a": 1})
    plan, data, history = _world(cfg)
    data["db"]["operations"][0]["state"] = "needs_review"
    data["db"]["journal"][2]["to_state"] = "needs_review"
    assert _check(plan, data, history)["unneeded_reviews"] == 1


# -- the proxy ---------------------------------------------------------------------------


async def _echo_server() -> tuple[asyncio.AbstractServer, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _roundtrip(port: int, payload: bytes = b"ping") -> tuple[bytes, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t = time.monotonic()
    writer.write(payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(1024), 10)
    writer.close()
    return data, time.monotonic() - t


async def test_the_proxy_forwards_and_injects_latency_reset_and_black_holes() -> None:
    server, upstream = await _echo_server()
    listen = free_port()
    proxy = Proxy([Route("echo", listen, [upstream])])
    await proxy.start()
    try:
        assert (await _roundtrip(listen))[0] == b"ping"

        proxy.command({"op": "latency", "route": "echo", "ms": 200, "seconds": 5})
        data, took = await _roundtrip(listen)
        assert data == b"ping" and took >= 0.35  # both directions wait
        proxy.command({"op": "clear"})

        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        writer.write(b"x")
        await reader.read(10)
        assert proxy.command({"op": "reset", "route": "echo"})["reset"] == 1
        with pytest.raises(ConnectionError):
            writer.write(b"y")
            await writer.drain()
            if not await reader.read(10):
                raise ConnectionResetError("closed")

        # A black hole that heals: held bytes flow on afterwards.
        proxy.command({"op": "blackhole", "route": "echo", "seconds": 0.5, "then": "resume"})
        data, took = await _roundtrip(listen)
        assert data == b"ping" and took >= 0.4

        # A black hole that drops: the held connection is reset, nothing comes back.
        proxy.command({"op": "blackhole", "route": "echo", "seconds": 0.5, "then": "reset"})
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            data, _ = await _roundtrip(listen)
            if not data:
                raise ConnectionResetError("closed without an answer")
        assert proxy.command({"op": "stats"})["routes"]["echo"]["held_then_reset"] >= 1
    finally:
        for s in proxy.servers:
            s.close()
        server.close()
