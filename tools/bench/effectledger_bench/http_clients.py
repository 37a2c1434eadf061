"""Microbenchmark: httpx (the provider client until issue 17) against aiohttp on the same calls.

`python -m effectledger_bench.http_clients` starts a sandbox (or uses `--url`) and makes the
benchmark's provider call — `POST /v1/idempotent/effects` with a JSON body, a bearer key,
`Idempotency-Key` and `Fencing-Token` — `--n` times per round, `--concurrency` at a time, with
each client configured the way the dispatcher needs it: a bounded pool spread over small
pools, idle connections expiring after 2 s, redirects off, no transport retries, a connect
timeout apart from the overall deadline, and the body streamed into a bounded buffer with a
digest of every byte (what `effectledger_providers.calls` does). Rounds alternate between the
clients (A, B, A, B, …) so both see the same machine.

The figure that matters is the client process's CPU per call (`process_time`), since the
provider (one sandbox process) bounds the calls per second on a small machine. It prints one
line per round and a JSON summary. `product` is the product's whole provider call (adapter,
`call_provider`, the dispatcher's pools) over whatever client it uses. The httpx side is
configured as the provider client was before the switch (`effectledger_providers.session` is
the aiohttp client the product uses now).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from effectledger_core.limits import MAX_HTTP_BODY_BYTES

PER_CLIENT = 8  # make_clients' pool size per shard, used for both clients
TIMEOUT_S = 2.0  # the benchmark tool's timeout_s
CONNECT_SHARE = 0.8

Call = Callable[[str], Awaitable[bool]]


def _headers(api_key: str, key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}", "Fencing-Token": "1", "Idempotency-Key": key}


async def httpx_client(url: str, api_key: str, concurrency: int) -> tuple[Call, Any]:
    # The provider client as it was on httpx: small pools, 2 s keep-alive, no retries.
    shards = max(1, -(-max(16, concurrency * 2) // PER_CLIENT))
    limits = httpx.Limits(max_connections=PER_CLIENT * 2, max_keepalive_connections=PER_CLIENT * 2,
                          keepalive_expiry=2.0)
    clients = [httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0, limits=limits),
                                 follow_redirects=False, timeout=httpx.Timeout(10.0))
               for _ in range(shards)]
    turn = 0

    async def call(key: str) -> bool:
        nonlocal turn
        turn = (turn + 1) % len(clients)
        client = clients[turn]
        request = client.build_request("POST", url, json={"title": key},
                                       headers=_headers(api_key, key))
        request.extensions["timeout"] = httpx.Timeout(
            TIMEOUT_S, connect=TIMEOUT_S * CONNECT_SHARE,
            pool=TIMEOUT_S * CONNECT_SHARE).as_dict()
        digest, body = hashlib.sha256(), bytearray()
        async with asyncio.timeout(TIMEOUT_S):
            resp = await client.send(request, stream=True, follow_redirects=False)
            try:
                async for chunk in resp.aiter_bytes():
                    digest.update(chunk)
                    body += chunk[:MAX_HTTP_BODY_BYTES - len(body)]
            finally:
                await resp.aclose()
        return 200 <= resp.status_code < 300

    async def close() -> None:
        for c in clients:
            await c.aclose()

    return call, close


async def aiohttp_client(url: str, api_key: str, concurrency: int) -> tuple[Call, Any]:
    import aiohttp

    shards = max(1, -(-max(16, concurrency * 2) // PER_CLIENT))
    sessions = [aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=PER_CLIENT * 2, keepalive_timeout=2.0),
        timeout=aiohttp.ClientTimeout(total=TIMEOUT_S, connect=TIMEOUT_S * CONNECT_SHARE),
        auto_decompress=True) for _ in range(shards)]
    turn = 0

    async def call(key: str) -> bool:
        nonlocal turn
        turn = (turn + 1) % len(sessions)
        digest, body = hashlib.sha256(), bytearray()
        async with sessions[turn].post(url, json={"title": key}, headers=_headers(api_key, key),
                                       allow_redirects=False) as resp:
            async for chunk in resp.content.iter_any():
                digest.update(chunk)
                body += chunk[:MAX_HTTP_BODY_BYTES - len(body)]
            status: int = resp.status
            return 200 <= status < 300

    async def close() -> None:
        for s in sessions:
            await s.close()

    return call, close


async def product_client(url: str, api_key: str, concurrency: int) -> tuple[Call, Any]:
    """The product's whole call path: the dispatcher's caller and pools, the declarative
    adapter building the request, `call_provider` sending it and classifying the answer."""
    from effectledger_core.catalog import Tool
    from effectledger_core.digest import digest
    from effectledger_core.messages import AttemptSucceeded, DispatchAttempt
    from effectledger_dispatcher.ports import HttpProviderCaller
    from effectledger_providers.calls import make_clients

    tool = Tool.model_validate({
        "name": "bench", "endpoint": url, "contract_revision": "r1", "timeout_s": TIMEOUT_S,
        "headers": {"Authorization": "Bearer ${BENCH_API_KEY}"}})
    caller = HttpProviderCaller(make_clients(max(16, concurrency * 2)),
                                env={"BENCH_API_KEY": api_key})

    async def call(key: str) -> bool:
        arguments = {"title": key}
        cmd = DispatchAttempt(operation_id=key, operation_key=key, epoch=1, tool=tool.name,
                              arguments=arguments, arguments_digest=digest(arguments),
                              catalog_digest="sha256:bench", contract_revision="r1")
        out = await caller(tool, cmd, attempt_id=key, dispatcher_id="bench",
                           on_sent=lambda: None)
        return isinstance(out, AttemptSucceeded)

    return call, caller.aclose


CLIENTS = {"httpx": httpx_client, "aiohttp": aiohttp_client, "product": product_client}


async def one_round(name: str, url: str, api_key: str, *, n: int, concurrency: int,
                    prefix: str) -> dict[str, Any]:
    call, close = await CLIENTS[name](url, api_key, concurrency)
    gate = asyncio.Semaphore(concurrency)
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        async with gate:
            try:
                ok = await call(f"{prefix}{i}")
            except Exception:
                ok = False
            errors += not ok

    try:
        await asyncio.gather(*(one(i) for i in range(min(50, n))))  # warm the pools
        errors = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(50, 50 + n)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        await close()
    return {"client": name, "n": n, "errors": errors, "ops_per_s": round(n / wall, 1),
            "client_cpu_ms_per_call": round(1000 * cpu / n, 3)}


def _start_sandbox(api_key: str) -> tuple[subprocess.Popen[bytes], str]:
    from effectledger_cli.embedded import free_port

    port = free_port()
    env = {**os.environ, "EFFECTLEDGER_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "effectledger_cli", "sandbox", "--port",
                             str(port), "--api-key", api_key], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # polling the sandbox's start-up, not synchronising work
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the sandbox did not start")
        time.sleep(0.2)


async def _main(args: argparse.Namespace, url: str, api_key: str) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    run = secrets.token_hex(3)
    for r in range(args.rounds):
        names = list(CLIENTS)
        for name in names if r % 2 == 0 else names[::-1]:
            res = await one_round(name, url, api_key, n=args.n, concurrency=args.concurrency,
                                  prefix=f"http-{run}-{name}-{r}-")
            print(json.dumps(res), flush=True)
            rounds.append(res)
    summary: dict[str, Any] = {}
    for name in CLIENTS:
        mine = [x for x in rounds if x["client"] == name]
        summary[name] = {
            "client_cpu_ms_per_call_median": round(statistics.median(
                x["client_cpu_ms_per_call"] for x in mine), 3),
            "ops_per_s_median": round(statistics.median(x["ops_per_s"] for x in mine), 1),
            "errors": sum(x["errors"] for x in mine)}
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running sandbox's base URL (default: start one)")
    ap.add_argument("--api-key", help="its API key (with --url)")
    ap.add_argument("--n", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per client, alternating")
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args(argv)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("http_clients: aiohttp is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
        return 2
    proc = None
    api_key = args.api_key or "sk_bench_" + secrets.token_hex(12)
    base = args.url
    if base is None:
        proc, base = _start_sandbox(api_key)
    try:
        import uvloop
    except ImportError:
        runner: Callable[..., Any] = asyncio.run
    else:
        runner = uvloop.run
    try:
        summary = runner(_main(args, f"{base}/v1/idempotent/effects", api_key))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
