"""How long after the send-deadline check a provider request's first byte arrives.

The dispatcher checks its send deadline immediately before aiohttp writes the request
(`effectledger_providers.calls`, `before_write`). A pause that lands after that check still
sends; this measures the window it must land in: from the check to the moment a local server
reads the first byte of the request, with the production client (`make_client`) and the real
`call_provider`, one call at a time and under concurrency (an event loop that is busy makes the
window longer). Both clocks are this process's monotonic clock.

    python -m effectledger_bench.send_window [--calls 2000] [--concurrency 1,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from effectledger_core.catalog import Tool
from effectledger_core.messages import DispatchAttempt
from effectledger_providers.calls import call_provider, make_client

_RESPONSE = b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _measure(calls: int, concurrency: int) -> dict[str, Any]:
    arrivals: dict[str, float] = {}
    handlers: set[asyncio.Task[Any]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                first = await reader.read(1)
                if not first:
                    return
                now = time.monotonic()
                head = first + await reader.readuntil(b"\r\n\r\n")
                key = next(line.split(b":", 1)[1].strip().decode()
                           for line in head.split(b"\r\n")
                           if line.lower().startswith(b"idempotency-key:"))
                arrivals[key] = now
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(_RESPONSE)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tool = Tool.model_validate({"name": "t", "endpoint": f"http://127.0.0.1:{port}/v1/x",
                                "contract_revision": "1", "timeout_s": 10})
    checks: dict[str, float] = {}
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, client: Any) -> None:
        key = f"ck_{concurrency}_{i}"
        cmd = DispatchAttempt(operation_id=f"op{i}", operation_key=key, epoch=1, tool="t",
                              arguments={"n": i}, arguments_digest="sha256:a",
                              catalog_digest="sha256:c", contract_revision="1")

        def before_write() -> None:
            checks[key] = time.monotonic()

        async with sem:
            await call_provider(client, tool, cmd, attempt_id=f"a{i}", dispatcher_id="bench",
                                env={}, before_write=before_write)

    async with make_client() as client:
        await asyncio.gather(*(one(i, client) for i in range(calls)))
    # The client closed its connections: every handler reads EOF and ends.
    await asyncio.wait_for(asyncio.gather(*handlers), 30)
    server.close()
    windows_us = [(arrivals[k] - checks[k]) * 1e6 for k in checks if k in arrivals]
    return {"concurrency": concurrency, "calls": len(windows_us),
            "p50_us": round(_percentile(windows_us, 0.5), 1),
            "p99_us": round(_percentile(windows_us, 0.99), 1),
            "max_us": round(max(windows_us), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m effectledger_bench.send_window",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--concurrency", default="1,32")
    args = p.parse_args(argv)
    for c in (int(x) for x in args.concurrency.split(",")):
        result = asyncio.run(_measure(args.calls, c))
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
