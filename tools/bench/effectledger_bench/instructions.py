"""Instructions per operation of one service, counted by valgrind: a CPU figure for A/B runs
that the machine's load does not move.

On a shared 2-core machine the CPU a process spends per operation moves by a tenth or more
between runs, with the machine's speed (issue 30, round nine: the same code gave 298 and 377
ops/s in two quick runs). An instruction count does not: callgrind counts what the process
executed, whatever else the machine is doing.

The stack is the benchmark's own (stack.py), with one service (the dispatcher or the ledger)
run under `valgrind --tool=callgrind`. N operations are submitted and awaited, C at a time
(four by default; one is an agent's calls one after another), and the service is stopped;
valgrind reports the instructions it executed. Start-up and shutdown are the same for any N,
so two counts give the figure per operation:

    (instructions at N2 - instructions at N1) / (N2 - N1)

    python -m effectledger_bench.instructions dispatcher [--n 50 250] [--concurrency 4]
                                                         [--out FILE.json]

Under valgrind a service runs 30-60 times slower: the provider's timeout is raised so that no
call ends ambiguous, and the counts include whatever the service's timers do meanwhile (its
loop-lag sampler), so compare figures taken the same way. Needs valgrind on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SERVICES = ("dispatcher", "ledger")
CONCURRENCY = 4
# How many times longer a service under valgrind may take to start, and to stop.
SLOW_START = 10.0
STOP_S = 300.0
COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def collected(log: str) -> int:
    """The instruction count in a callgrind log ("==pid== Collected : N")."""
    found = COLLECTED.findall(log)
    if not found:
        raise RuntimeError(f"no instruction count in valgrind's log:\n{log[-2000:]}")
    return int(found[-1])


def per_operation(counts: dict[int, int]) -> float:
    """Instructions per operation from counts at two or more N (least squares slope)."""
    if len(counts) < 2:
        raise ValueError("counts at two N at least")
    xs, ys = list(counts), list(counts.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        raise ValueError("the N must differ")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def count(service: str, n: int, workdir: Path, concurrency: int = CONCURRENCY) -> int:
    """Instructions `service` executed in a stack that ran `n` operations."""
    from .stack import Stack

    if service not in SERVICES:
        raise ValueError(f"service must be one of {', '.join(SERVICES)}")
    log = workdir / f"callgrind-{service}.log"
    stack = Stack(workdir / "stack", provider_timeout_s=60.0, slow_start=SLOW_START,
                  wrappers={service: ["valgrind", "--tool=callgrind",
                                      "--callgrind-out-file=/dev/null", f"--log-file={log}"]})
    try:
        stack.start()
        asyncio.run(_drive(stack.ledger_url, n, concurrency))
        name = "dispatcher-1" if service == "dispatcher" else "ledger"
        if service == "ledger":
            stack.stop("dispatcher-1")
        stack.stop(name, timeout=STOP_S)
    finally:
        stack.close()
    return collected(log.read_text(errors="replace"))


async def _drive(ledger_url: str, n: int, concurrency: int) -> None:
    from effectledger_client import AsyncClient

    from .stack import TOOL

    tag = f"ins{time.time_ns()}"
    slots = asyncio.Semaphore(concurrency)
    async with AsyncClient(ledger_url, token="") as client:
        async def one(i: int) -> None:
            async with slots:
                done = await client.submit(TOOL, {"title": f"{tag} {i}"},
                                           idempotency_key=f"{tag}-{i}", wait_s=600)
            if done.operation.state != "succeeded":
                raise RuntimeError(f"operation {done.operation.id} ended "
                                   f"{done.operation.state}: {done.operation.last_outcome}")

        await asyncio.gather(*(one(i) for i in range(n)))


def measure(service: str, ns: list[int], concurrency: int = CONCURRENCY) -> dict[str, Any]:
    if len(set(ns)) < 2:
        raise ValueError("--n needs two different counts, e.g. 50 250")
    if concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    counts: dict[int, int] = {}
    for n in ns:
        with tempfile.TemporaryDirectory(prefix="effectledger-instructions-") as tmp:
            counts[n] = count(service, n, Path(tmp), concurrency)
    return {"service": service, "concurrency": concurrency,
            "instructions": {str(n): c for n, c in counts.items()},
            "per_operation": round(per_operation(counts))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m effectledger_bench.instructions",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("service", choices=SERVICES)
    ap.add_argument("--n", type=int, nargs="+", default=[50, 250],
                    help="operations per run, two or more different counts")
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY,
                    help="operations in flight at once (1: one after another)")
    ap.add_argument("--out", type=Path, help="also write the JSON document here")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not on PATH (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    result = measure(args.service, args.n, args.concurrency)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
