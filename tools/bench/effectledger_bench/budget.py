"""The latency budget (issue 30): where one operation's time goes, hop by hop, beside each hop's
floor measured on the same machine in the same run.

An operation's critical path, one at a time: HTTP submit, intent commit, command publish and
delivery, claim request and commit, provider call, the outcome's request (issue 30; or, when it
goes unanswered, its publish and delivery), outcome commit, the waiter's wake-up and the HTTP
answer. Four clocks see it, all on this machine:

- the client: when it sent the request and when the answer was back;
- the ledger's journal: `intent_accepted`, `attempt_claimed` and `outcome_recorded` are stamped
  when each transaction is built, just before its commit;
- the dispatcher: the outcome's `at` (the provider call's end) and `duration_ms` (the call).

Six hops lie between these stamps (`HOPS`). Each hop's floor is what the round trips it must
make cost when measured bare (`floors`): a one-row PostgreSQL commit, a NATS request-reply, a
JetStream publish with its ack, an HTTP round trip to the ledger, the provider call. A one-way
message is counted as half a round trip. A hop far above its floor is waiting, not working,
and a regression shows in the hop where it happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .measure import percentile

if TYPE_CHECKING:
    from .stack import Stack

# The floors measured (`floors`), by name.
FLOORS = ("pg_commit", "nats_request_reply", "js_publish_ack", "http_round_trip", "provider_call")


@dataclass(frozen=True)
class Hop:
    name: str
    what: str
    # The floor: each named floor times its weight (0.5: a one-way message).
    floor: tuple[tuple[str, float], ...]


HOPS = (
    Hop("submit_to_intent", "client sends → ledger builds the intent's transaction",
        (("http_round_trip", 0.5),)),
    Hop("intent_to_claim", "intent commit, command publish + ack, delivery to the dispatcher, "
        "claim request → ledger builds the claim's transaction",
        (("pg_commit", 1), ("js_publish_ack", 1), ("nats_request_reply", 1))),
    Hop("claim_to_call", "claim commit, claim reply → dispatcher starts the provider call",
        (("pg_commit", 1), ("nats_request_reply", 0.5))),
    Hop("provider_call", "the provider call, as the dispatcher timed it",
        (("provider_call", 1),)),
    # The outcome goes to the ledger as a request (one way before the transaction; the reply
    # is off the agent's path); only an unanswered one takes the stream's publish and delivery.
    Hop("call_to_outcome", "outcome request to the ledger → ledger builds the outcome's "
        "transaction", (("nats_request_reply", 0.5),)),
    Hop("outcome_to_answer", "outcome commit, the waiter's wake-up, its read, the HTTP answer",
        (("pg_commit", 1), ("http_round_trip", 0.5))),
)


class MissingHop(ValueError):
    """A stamp the budget needs is not in the operation's journal."""


def hops(sent: float, answered: float, journal: list[tuple[str, datetime, dict[str, Any]]]
         ) -> dict[str, float]:
    """One operation's hops in ms, from the client's wall-clock stamps (`sent`, `answered`,
    epoch seconds) and its journal entries as (kind, at, detail). Raises `MissingHop` when a
    stamp is missing: a budget with a hole would blame the neighbouring hop."""
    at: dict[str, datetime] = {}
    detail: dict[str, dict[str, Any]] = {}
    for kind, when, d in journal:
        at.setdefault(kind, when)  # the first of each kind: the operation's first attempt
        detail.setdefault(kind, d)
    missing = {"intent_accepted", "attempt_claimed", "outcome_recorded"} - set(at)
    if missing:
        raise MissingHop(f"journal has no {sorted(missing)}")
    outcome = detail["outcome_recorded"]
    if outcome.get("at") is None or outcome.get("duration_ms") is None:
        raise MissingHop("the outcome carries no dispatcher stamp (at, duration_ms)")
    call_end = datetime.fromisoformat(str(outcome["at"])).timestamp()
    call_ms = float(outcome["duration_ms"])
    intent, claim = at["intent_accepted"].timestamp(), at["attempt_claimed"].timestamp()
    recorded = at["outcome_recorded"].timestamp()
    ms = {
        "submit_to_intent": (intent - sent) * 1000,
        "intent_to_claim": (claim - intent) * 1000,
        "claim_to_call": (call_end - claim) * 1000 - call_ms,
        "provider_call": call_ms,
        "call_to_outcome": (recorded - call_end) * 1000,
        "outcome_to_answer": (answered - recorded) * 1000,
    }
    assert list(ms) == [h.name for h in HOPS]
    return ms


def _pct(values: list[float], p: float) -> float | None:
    v = percentile(values, p)
    return round(v, 2) if v is not None else None


def table(samples: list[dict[str, float]], floors: dict[str, dict[str, float | None]]
          ) -> dict[str, Any]:
    """Per hop: p50 and p99 of its time, its floor (from the floors' p50) and the excess of
    the p50 over the floor; and the totals."""
    rows: dict[str, Any] = {}
    for hop in HOPS:
        values = [s[hop.name] for s in samples]
        floor = sum(w * (floors[f]["p50"] or 0.0) for f, w in hop.floor)
        p50 = _pct(values, 50)
        rows[hop.name] = {"what": hop.what, "p50_ms": p50, "p99_ms": _pct(values, 99),
                          "floor_ms": round(floor, 2),
                          "floor_of": " + ".join(f"{w:g} {f}" for f, w in hop.floor),
                          "over_floor_ms": round(p50 - floor, 2) if p50 is not None else None}
    totals = [sum(s.values()) for s in samples]
    floor_total = sum(r["floor_ms"] for r in rows.values())
    return {"n": len(samples), "hops": rows,
            "total_ms": {"p50": _pct(totals, 50), "p99": _pct(totals, 99)},
            "floor_total_ms": round(floor_total, 2)}


def markdown(budgets: dict[str, dict[str, Any]], floors: dict[str, dict[str, float | None]]
             ) -> str:
    """The budgets (by path: client, MCP) and the floors as markdown tables."""
    lines = ["| floor | p50 ms | p99 ms |", "|---|---:|---:|"]
    lines += [f"| {name} | {f['p50']} | {f['p99']} |" for name, f in floors.items()]
    for path, budget in budgets.items():
        lines += ["", f"**{path}** (n={budget['n']}; total p50 {budget['total_ms']['p50']} / "
                      f"p99 {budget['total_ms']['p99']} ms, floor {budget['floor_total_ms']} ms)",
                  "", "| hop | p50 ms | p99 ms | floor ms | over floor ms | floor of |",
                  "|---|---:|---:|---:|---:|---|"]
        for name, row in budget["hops"].items():
            lines.append(f"| {name} | {row['p50_ms']} | {row['p99_ms']} | {row['floor_ms']} | "
                         f"{row['over_floor_ms']} | {row['floor_of']} |")
    return "\n".join(lines) + "\n"


# ---- the floors, measured on the same machine in the same run ---------------------------------

def _ms(values: list[float]) -> dict[str, float | None]:
    return {"p50": _pct(values, 50), "p99": _pct(values, 99)}


async def pg_commit(database_url: str, n: int) -> list[float]:
    """A one-row INSERT in its own transaction (a WAL flush per commit, as the ledger's), in a
    table of its own, dropped afterwards."""
    import asyncpg

    dsn = database_url.replace("postgresql+asyncpg", "postgresql")
    table_name = f"effectledger_floor_{time.time_ns()}"
    conn = await asyncpg.connect(dsn)
    lat = []
    try:
        await conn.execute(f"CREATE TABLE {table_name} (id bigint PRIMARY KEY, at float8)")
        for i in range(n + 10):
            t = time.perf_counter()
            await conn.execute(f"INSERT INTO {table_name} VALUES ($1, $2)", i, t)
            if i >= 10:  # warm-up rows not counted
                lat.append((time.perf_counter() - t) * 1000)
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {table_name}")
        await conn.close()
    return lat


async def nats_round_trips(nats_url: str, n: int) -> tuple[list[float], list[float]]:
    """A NATS request-reply between two connections (as dispatcher and ledger), and a JetStream
    publish with its ack on a file-storage stream of its own (deleted afterwards)."""
    import nats
    from nats.errors import NoRespondersError
    from nats.js.api import StorageType, StreamConfig

    tag = f"floor{time.time_ns()}"
    server, client = await nats.connect(nats_url), await nats.connect(nats_url)
    rr, js_lat = [], []
    try:
        async def answer(msg: Any) -> None:
            await msg.respond(msg.data)

        await server.subscribe(f"{tag}.rr", cb=answer)
        await server.flush()
        i = misses = 0
        while i < n + 10:
            t = time.perf_counter()
            try:
                await client.request(f"{tag}.rr", b"x" * 200, timeout=5)
            except NoRespondersError:
                # Seen once on a heavily loaded machine: the server had not yet routed the
                # responder's interest to this connection. Not a sample; ask again.
                misses += 1
                if misses > 50:
                    raise
                await server.flush()
                await client.flush()
                continue
            if i >= 10:
                rr.append((time.perf_counter() - t) * 1000)
            i += 1
        js = client.jetstream()
        stream = tag.upper()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{tag}.js"],
                                         storage=StorageType.FILE))
        try:
            for i in range(n + 10):
                t = time.perf_counter()
                await js.publish(f"{tag}.js", b"x" * 500, headers={"Nats-Msg-Id": f"{tag}-{i}"})
                if i >= 10:
                    js_lat.append((time.perf_counter() - t) * 1000)
        finally:
            await js.delete_stream(stream)
    finally:
        await client.close()
        await server.close()
    return rr, js_lat


async def http_round_trips(url: str, n: int) -> list[float]:
    import httpx

    lat = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for i in range(n + 10):
            t = time.perf_counter()
            (await http.get("/healthz")).raise_for_status()
            if i >= 10:
                lat.append((time.perf_counter() - t) * 1000)
    return lat


async def floors(stack: Stack, n: int, provider_ms: list[float]
                 ) -> dict[str, dict[str, float | None]]:
    assert stack.database_url is not None and stack.nats_url is not None
    rr, js = await nats_round_trips(stack.nats_url, n)
    out = {"pg_commit": _ms(await pg_commit(stack.database_url, n)),
           "nats_request_reply": _ms(rr), "js_publish_ack": _ms(js),
           "http_round_trip": _ms(await http_round_trips(stack.ledger_url, n)),
           "provider_call": _ms(provider_ms)}
    assert tuple(out) == FLOORS
    return out
