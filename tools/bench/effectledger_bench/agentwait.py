"""Submit-and-wait figures (issue 13): what waiting through the ledger costs an agent.

1. One operation at a time, N times: the bare provider call (the sandbox's idempotent route,
   same headers as the dispatcher sends) and the same call through `effectledger_client`'s
   `submit(..., wait_s=...)`: latency p50/p99 of each and the overhead (difference of the
   percentiles). The same call as an MCP `tools/call` (the official client, `effectledger mcp`
   on stdio), interleaved call by call with the client's submit-and-wait so that both see the
   same load: what the MCP path adds. With DBOS installed (`pip install '.[bench]'`), the same
   figure for DBOS's durable workflow around the same call (`peer_dbos --mode direct
   --concurrency 1`); without it the report says so.
2. W concurrent waiters on one ledger (over NATS, `<prefix>.rpc.v1.operation.wait`), each on
   its own pending operation while no dispatcher runs: the ledger's memory and CPU while they
   wait, its responsiveness meanwhile (GET /healthz and an operation read, p50/p99), and how
   long all waits take to be answered once a dispatcher is started.
3. The latency budget (budget.py): the interleaved client and MCP calls broken into hops,
   each beside its floor measured in the same run; in the JSON document under
   `latency_budget`, as markdown tables on stderr and, with --out, in FILE.md.

    effectledger bench-agent [--n 300] [--waiters 10000] [--out FILE.json]
    (or python -m effectledger_bench.agentwait)

Runs its own PostgreSQL and nats-server (effectledger_bench/stack.py); prints one JSON
document.

The CLI imports this module in every `effectledger` process, the services included, to list
`bench-agent`: its top level stays light, and the harness (httpx, the ledger client, the
stack) is imported by the functions that use it (about 3 MiB of a ledger's resident memory
otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .measure import percentile
from .procs import sample

if TYPE_CHECKING:
    from .stack import Stack


def _ms(values: list[float]) -> dict[str, float | None]:
    return {f"p{p}": (round(v, 2) if (v := percentile(values, p)) is not None else None)
            for p in (50, 99)}


async def bare_calls(stack: Stack, n: int) -> list[float]:
    import httpx

    headers = {"Authorization": f"Bearer {stack.api_key}", "Fencing-Token": "1"}
    lat = []
    async with httpx.AsyncClient(timeout=10) as http:
        for i in range(n):
            t = time.perf_counter()
            resp = await http.post(f"{stack.sandbox_url}/v1/idempotent/effects",
                                   json={"title": f"bare {i}"},
                                   headers={**headers, "Idempotency-Key": f"bare-{i}-{t}"})
            resp.raise_for_status()
            lat.append((time.perf_counter() - t) * 1000)
    return lat


async def submit_and_wait(stack: Stack, n: int, tag: str,
                          hops: list[dict[str, float]] | None = None) -> list[float]:
    """Latencies (ms); with `hops`, also where each operation's time went (budget.py)."""
    from effectledger_client import AsyncClient

    from .stack import TOOL

    lat = []
    async with AsyncClient(stack.ledger_url, token="") as client:
        for i in range(n):
            t, sent = time.perf_counter(), time.time()
            done = await client.submit(TOOL, {"title": f"{tag} {i}"},
                                       idempotency_key=f"{tag}-{i}", wait_s=10)
            answered = time.time()
            if done.operation.state != "succeeded":
                raise RuntimeError(f"operation ended {done.operation.state}")
            lat.append((time.perf_counter() - t) * 1000)
            if hops is not None:
                hops.append(await _hops_of(client, done.operation.id, sent, answered))
    return lat


async def _hops_of(client: Any, operation_id: str, sent: float, answered: float
                   ) -> dict[str, float]:
    from . import budget

    journal = await client.journal(operation_id)
    return budget.hops(sent, answered, [(e.kind, e.at, e.detail) for e in journal.entries])


def _devnull() -> TextIO:
    return open(os.devnull, "w")


async def client_vs_mcp(stack: Stack, n: int, hops: dict[str, list[dict[str, float]]]
                        ) -> tuple[list[float], list[float], list[float]]:
    """Latencies (ms) of the client's submit-and-wait (keyed), the same without a key joining
    identical calls (what the MCP server asks the ledger for), and an MCP tools/call of the
    same tool, one of each per round so that all see the same machine load. `hops` gets each
    counted keyed call's hops under "client" and each MCP call's under "mcp" (budget.py)."""
    from mcp import ClientSession, StdioServerParameters, stdio_client

    from effectledger_client import AsyncClient

    from .stack import TOOL

    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "effectledger_cli", "mcp", "--ledger-url",
                                      stack.ledger_url, "--wait", "10"], env=env)
    direct: list[float] = []
    joining: list[float] = []
    over_mcp: list[float] = []
    tag = f"mcp{time.time_ns()}"
    with _devnull() as quiet:
        async with AsyncClient(stack.ledger_url, token="") as client, \
                stdio_client(params, errlog=quiet) as (read, write), \
                ClientSession(read, write) as mcp:
            await mcp.initialize()
            for i in range(-20, n):  # 20 warm-up rounds, not counted
                t, sent = time.perf_counter(), time.time()
                done = await client.submit(TOOL, {"title": f"{tag} c{i}"},
                                           idempotency_key=f"{tag}-c{i}", wait_s=10)
                took, answered = (time.perf_counter() - t) * 1000, time.time()
                keyed = (done.operation.id, sent, answered)
                if done.operation.state != "succeeded":
                    raise RuntimeError(f"operation ended {done.operation.state}")
                t = time.perf_counter()
                done = await client.submit(TOOL, {"title": f"{tag} j{i}"},
                                           join_identical=True, wait_s=10)
                took_join = (time.perf_counter() - t) * 1000
                if done.operation.state != "succeeded":
                    raise RuntimeError(f"operation ended {done.operation.state}")
                t, sent = time.perf_counter(), time.time()
                result = await mcp.call_tool(TOOL, {"title": f"{tag} m{i}"})
                took_mcp, answered = (time.perf_counter() - t) * 1000, time.time()
                data = result.structured_content or {}
                if data.get("outcome") != "succeeded":
                    raise RuntimeError(f"MCP call ended {data.get('state')}")
                if i >= 0:
                    direct.append(took)
                    joining.append(took_join)
                    over_mcp.append(took_mcp)
                    # Journals read after the round's timed calls, so they cost none of them.
                    hops["client"].append(await _hops_of(client, *keyed))
                    hops["mcp"].append(await _hops_of(client, str(data["operation_id"]),
                                                      sent, answered))
    return direct, joining, over_mcp


async def skeleton_vs_ours(stack: Stack, n: int,
                           hops: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """Our submit-and-wait and the skeleton's call (skeleton.py: the same hops, none of our
    logic), interleaved call by call so both see the same machine; with each process's CPU
    and, with `hops`, where each skeleton call's time went (budget.py, from its stamps)."""
    import aiohttp

    from effectledger_cli.embedded import free_port
    from effectledger_client import AsyncClient

    from . import budget
    from .skeleton import Skeleton, call
    from .stack import TOOL

    assert stack.database_url and stack.nats_url
    skeleton = Skeleton(database_url=stack.database_url, nats_url=stack.nats_url,
                        provider_url=stack.sandbox_url, api_key=stack.api_key,
                        port=free_port(), logs=stack.logs, prefix=f"{stack.subject_prefix}skel")
    ours, skel = [], []
    try:
        await asyncio.to_thread(skeleton.start)  # inside: one that fails half-started is stopped
        pids = {name: stack.services[name].pid for name in ("ledger", "dispatcher-1")}
        pids.update(skeleton.pids())
        async with AsyncClient(stack.ledger_url, token="") as client, \
                aiohttp.ClientSession(f"{skeleton.url}") as http:
            async def one(i: int, tag: str) -> tuple[float, float]:
                t = time.perf_counter()
                done = await client.submit(TOOL, {"title": f"{tag} {i}"},
                                           idempotency_key=f"{tag}-ours-{i}", wait_s=10)
                if done.operation.state != "succeeded":
                    raise RuntimeError(f"operation ended {done.operation.state}")
                u, sent = time.perf_counter(), time.time()
                body = await call(http, "/", f"{tag}-skeleton-{i}", {"title": f"{tag} {i}"})
                v, answered = time.perf_counter(), time.time()
                if hops is not None and tag.endswith("run"):
                    hops.append(budget.hops(sent, answered, [
                        (kind, datetime.fromisoformat(at), detail)
                        for kind, at, detail in body["journal"]]))
                return (u - t) * 1000, (v - u) * 1000

            for i in range(30):
                await one(i, "skeleton-warm")
            before = {name: sample(pid) for name, pid in pids.items()}
            for i in range(n):
                a, b = await one(i, "skeleton-run")
                ours.append(a)
                skel.append(b)
            after = {name: sample(pid) for name, pid in pids.items()}
    finally:
        await asyncio.to_thread(skeleton.close)
    o, k = _ms(ours), _ms(skel)
    cpu = {name: round((after[name].cpu_s - before[name].cpu_s) * 1000 / n, 2)  # type: ignore[union-attr]
           for name in pids if before.get(name) and after.get(name)}
    return {"n": n, "ours_ms": o, "skeleton_ms": k,
            "ours_over_skeleton_ms": {p: round((o[p] or 0) - (k[p] or 0), 2) for p in o},
            "cpu_ms_per_call": cpu}


def skeleton_markdown(figures: dict[str, Any]) -> str:
    """The skeleton's figures as a table for a reader (empty when it did not run)."""
    if "ours_ms" not in figures:
        return f"\n**The chain's floor (skeleton)**: not measured: {figures.get('error')}\n"
    o, k, d = figures["ours_ms"], figures["skeleton_ms"], figures["ours_over_skeleton_ms"]
    cpu = figures.get("cpu_ms_per_call", {})
    lines = [f"\n**The chain's floor** (skeleton.py: the same hops, none of our logic; "
             f"n={figures['n']}, interleaved)\n",
             "| | p50 ms | p99 ms | CPU ms/call (ledger / dispatcher) |",
             "|---|---:|---:|---|",
             f"| ours | {o['p50']} | {o['p99']} | {cpu.get('ledger')} / "
             f"{cpu.get('dispatcher-1')} |",
             f"| skeleton | {k['p50']} | {k['p99']} | {cpu.get('skeleton-ledger')} / "
             f"{cpu.get('skeleton-dispatcher')} |",
             f"| ours - skeleton | {d['p50']} | {d['p99']} | |"]
    return "\n".join(lines) + "\n"


def dbos_figures(stack: Stack, n: int) -> dict[str, Any] | None:
    try:
        import dbos  # noqa: F401
    except ImportError:
        return None
    assert stack.database_url is not None
    url = stack.database_url.replace("+asyncpg", "")
    out = subprocess.run(
        [sys.executable, "-m", "effectledger_bench.peer_dbos", "--db-url", url,
         "--endpoint", f"{stack.sandbox_url}/v1/idempotent/effects", "--api-key",
         stack.api_key, "--mode", "direct", "--n", str(n), "--concurrency", "1",
         "--prefix", f"dbos{time.time_ns()}-", "--warmup", "20"],
        capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr[-500:]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


async def waiters(stack: Stack, count: int, wait_s: float) -> dict[str, Any]:
    import httpx
    import nats

    from .stack import TOOL

    assert stack.nats_url is not None
    prefix = stack.subject_prefix
    nc = await nats.connect(stack.nats_url, pending_size=256 * 1024 * 1024)
    try:
        gate = asyncio.Semaphore(200)

        async def submit(i: int) -> str:
            async with gate:
                body = {"tool": TOOL, "arguments": {"title": f"w{i}"}, "idempotency_key": f"w{i}"}
                msg = await nc.request(f"{prefix}.rpc.v1.intents", json.dumps(body).encode(),
                                       timeout=60)
                return str(json.loads(msg.data)["operation"]["id"])

        ids = await asyncio.gather(*(submit(i) for i in range(count)))
        ledger = stack.services["ledger"].pid
        idle_cpu = await _cpu_percent(ledger, 5.0)  # the ledger with no waiter, for reference
        before = sample(ledger)
        t0 = time.perf_counter()

        async def wait(op_id: str) -> tuple[float, str]:
            msg = await nc.request(f"{prefix}.rpc.v1.operation.wait",
                                   json.dumps({"operation_id": op_id,
                                               "wait_s": wait_s}).encode(), timeout=wait_s + 30)
            return time.perf_counter(), str(json.loads(msg.data)["operation"]["state"])

        tasks = [asyncio.create_task(wait(i)) for i in ids]
        async with httpx.AsyncClient(base_url=stack.ledger_url, timeout=10) as http:
            # All waits registered: the ledger's own count is not exported, so give the
            # requests a moment to arrive, then measure a fixed window while they wait.
            await asyncio.sleep(3.0)  # a measurement window, not synchronisation
            holding = sample(ledger)
            holding_cpu = await _cpu_percent(ledger, 5.0)
            probes: list[float] = []
            for _ in range(40):
                t = time.perf_counter()
                (await http.get("/healthz")).raise_for_status()
                (await http.get(f"/v1/operations/{ids[0]}")).raise_for_status()
                probes.append((time.perf_counter() - t) * 1000 / 2)
                await asyncio.sleep(0.1)  # spacing the probes over the window
        pending_after_window = sum(1 for t in tasks if not t.done())
        started = time.perf_counter()
        stack.start_dispatcher(1)
        answers = await asyncio.gather(*tasks)
        drained = max(a[0] for a in answers) - started
        states: dict[str, int] = {}
        for _, s in answers:
            states[s] = states.get(s, 0) + 1
        after = sample(ledger)
    finally:
        await nc.close()
    assert before and holding and after
    per_waiter = (holding.rss_bytes - before.rss_bytes) / count
    return {
        "waiters": count, "still_waiting_after_window": pending_after_window,
        "ledger_rss_mb": {"before": round(before.rss_bytes / 2**20, 1),
                          "holding": round(holding.rss_bytes / 2**20, 1),
                          "after": round(after.rss_bytes / 2**20, 1)},
        "rss_per_waiter_bytes": round(per_waiter),
        "register_cpu_s": round(holding.cpu_s - before.cpu_s, 3),
        "ledger_cpu_percent": {"no_waiters": idle_cpu, "holding_waiters": holding_cpu},
        "probe_latency_ms_while_holding": _ms(probes),
        "all_answered_after_dispatcher_start_s": round(drained, 2),
        "answered_states": states, "setup_s": round(started - t0, 1),
    }


async def _cpu_percent(pid: int, window_s: float) -> float:
    first = sample(pid)
    t = time.perf_counter()
    await asyncio.sleep(window_s)  # the measurement window itself
    last = sample(pid)
    assert first and last
    return round(100 * (last.cpu_s - first.cpu_s) / (time.perf_counter() - t), 1)


CLAIMS = "effectledger_claims_total"
CLAIMS_ASKED_AGAIN = "effectledger_claims_asked_again_total"


async def claims_by_status(stack: Stack, replicas: Sequence[str] = (), *,
                           family: str = CLAIMS) -> dict[str, int] | None:
    """The ledgers' claims so far by reply status (summed over the replicas). Every call here
    has a key of its own, so a `not_found` is a claim decided before its intent's statement
    had committed (a 20 ms nak for the dispatcher: docs/design.md, "A command published with
    its commit")."""
    from .pauses import scrape

    out: dict[str, int] = {}
    for url in (stack.ledger_url, *replicas):
        got = await scrape(url, (family,))
        if got is None:
            return None
        for (name, labels), v in got.items():
            if name == family:
                status = dict(labels)["status"]
                out[status] = out.get(status, 0) + round(v)
    return dict(sorted(out.items()))


async def measure(stack: Stack, n: int, count: int, replicas: Sequence[str] = ()
                  ) -> dict[str, Any]:
    """`replicas`: the URLs of ledger replicas beside the first (every call goes to the first)."""
    from . import budget

    await submit_and_wait(stack, 30, "warm")
    await bare_calls(stack, 30)
    bare = await bare_calls(stack, n)
    sw = await submit_and_wait(stack, n, "run")
    b, s = _ms(bare), _ms(sw)
    result: dict[str, Any] = {
        "n": n, "bare_provider_ms": b, "submit_and_wait_ms": s,
        "overhead_ms": {k: round((s[k] or 0) - (b[k] or 0), 2) for k in b}}
    hops: dict[str, list[dict[str, float]]] = {"client": [], "mcp": []}
    direct, joining, over_mcp = await client_vs_mcp(stack, n, hops)
    c, j, m = _ms(direct), _ms(joining), _ms(over_mcp)
    result["mcp"] = {
        "interleaved_submit_and_wait_ms": c, "submit_and_wait_joining_ms": j,
        "tools_call_ms": m,
        "mcp_over_client_ms": {k: round((m[k] or 0) - (c[k] or 0), 2) for k in c},
        # What the MCP layer itself adds (protocol, stdio, the server), the ledger's rule for
        # identical calls apart.
        "mcp_over_joining_client_ms": {k: round((m[k] or 0) - (j[k] or 0), 2) for k in c},
        "target": "tools_call p50 <= submit_and_wait p50 + 2 ms"}
    # After 90 + 4 n operations, one at a time (the warm-up, the run, and three per round of
    # `client_vs_mcp`, 20 rounds of its warm-up included).
    result["claims"] = await claims_by_status(stack, replicas)
    # Of those, not found at first and asked again by the ledger (another replica's intent).
    result["claims_asked_again"] = await claims_by_status(stack, replicas,
                                                          family=CLAIMS_ASKED_AGAIN)
    result["ledgers"] = 1 + len(replicas)
    # The chain's own floor (skeleton.py), interleaved with ours; its hops go in the budget.
    try:
        result["skeleton"] = await skeleton_vs_ours(stack, n, hops.setdefault("skeleton", []))
    except Exception as exc:  # e.g. a NATS of the user's whose permissions refuse it
        result["skeleton"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    # The floors right after the operations they explain, on the same stack (budget.py).
    floors = await budget.floors(stack, min(n, 200), await bare_calls(stack, min(n, 200)))
    budgets = {path: budget.table(samples, floors) for path, samples in hops.items() if samples}
    result["latency_budget"] = {"floors_ms": floors, **budgets,
                                "markdown": budget.markdown(budgets, floors)}
    peer = dbos_figures(stack, n)
    if peer is not None and "latency_ms" in peer:
        lat = peer["latency_ms"]
        result["dbos_ms"] = {k: lat[k] for k in ("p50", "p99")}
        result["dbos_overhead_ms"] = {k: round(lat[k] - (b[k] or 0), 2) for k in ("p50", "p99")}
    else:
        result["dbos"] = peer or "not installed (pip install '.[bench]')"
    if count > 0:
        stack.stop("dispatcher-1")
        result["waiters"] = await waiters(stack, count, wait_s=600)
    return result


HELP = "the agent's figures: submit-and-wait overhead (vs DBOS) and W concurrent waiters"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n", type=int, default=300, help="sequential operations per figure")
    ap.add_argument("--waiters", type=int, default=10000, help="concurrent waiters (0: skip)")
    ap.add_argument("--database-url", help="use this PostgreSQL (default: a private one)")
    ap.add_argument("--nats-url", help="use this NATS (default: a private nats-server)")
    ap.add_argument("--out", type=Path, help="also write the JSON document here")
    ap.add_argument("--ledgers", type=int, default=1, choices=range(1, 6), metavar="N",
                    help="ledger replicas on the one database (default 1; the Kubernetes "
                         "base runs 2): the calls go to the first, any may settle them")


def run(args: argparse.Namespace) -> int:
    from .stack import Stack

    with tempfile.TemporaryDirectory(prefix="effectledger-agentwait-") as tmp:
        # Waits longer than the default cap (60 s): the drain of W operations may take longer.
        stack = Stack(Path(tmp), database_url=args.database_url, nats_url=args.nats_url,
                      ledger_env={"EFFECTLEDGER_WAIT_MAX_S": "900"})
        try:
            stack.start(dispatchers=1)
            replicas = [stack.start_replica(i) for i in range(2, args.ledgers + 1)]
            result = asyncio.run(measure(stack, args.n, args.waiters, replicas))
        finally:
            stack.close()
    text = json.dumps(result, indent=2)
    print(text)
    # The budget as tables for a reader (stdout stays one JSON document).
    table = result["latency_budget"]["markdown"] + skeleton_markdown(result.get("skeleton", {}))
    print(table, file=sys.stderr)
    if args.out:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".md").write_text("# Latency budget\n\n" + table)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m effectledger_bench.agentwait", description=HELP)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
