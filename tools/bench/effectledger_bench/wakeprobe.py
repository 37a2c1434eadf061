"""What one wake-up of an otherwise idle process costs on this machine, in CPU microseconds.

A process that sleeps until its next message and is then woken pays for the wake-up itself
(the scheduler, and on a virtual machine the exit from the idle vCPU and cold caches), and that
cost is charged to it as CPU time. A busy process finds its next message already waiting and
pays nothing of the kind. The probe is the services' situation with nothing else in it: an
event loop (uvloop, as the services run) reading one-byte messages that another process writes
to a socket at a fixed rate, doing the same small piece of work for each. It reports the
reader's CPU time per message at each rate; the benchmark puts it in the report beside each
service's wake-ups per operation (`procs`), which is where the difference between the cost per
operation at half rate and at saturation comes from.

    python -m effectledger_bench.wakeprobe [RATE ...]   # one line per rate
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from typing import Any, cast

RATES = (20000, 2000, 500, 150, 50)  # messages per second
SECONDS = 1.0  # per rate


def _write_at(sock: socket.socket, rate: float, n: int) -> None:
    """The writer (a forked child): one byte every 1/rate seconds, n of them."""
    gap, due = 1.0 / rate, time.perf_counter()
    for _ in range(n):
        due += gap
        left = due - time.perf_counter()
        if left > 0:
            time.sleep(left)
        sock.send(b"x")


# A message's worth of work, the same at every rate: decode, hash and re-encode a document
# the size of a dispatch command (about 20 µs on the 2-core Xeon VM the benchmark ran on).
_DOC = json.dumps({"operation_id": "0" * 32, "tool": "sandbox.effect", "epoch": 1,
                   "arguments": {f"k{i}": "v" * 24 for i in range(40)}})


def _work() -> None:
    doc = json.loads(_DOC)
    hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class _Reader(asyncio.Protocol):
    def __init__(self, n: int, done: asyncio.Future[None]) -> None:
        self.left, self.done = n, done

    def data_received(self, data: bytes) -> None:
        for _ in data:
            _work()
        self.left -= len(data)
        if self.left <= 0 and not self.done.done():
            self.done.set_result(None)


async def _read(sock: socket.socket, n: int) -> tuple[float, int]:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.connect_accepted_socket(lambda: _Reader(n, done), sock)
    cpu0, sleeps0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    await done
    cpu, sleeps = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    transport.close()
    return cpu - cpu0, sleeps - sleeps0


def hot() -> float:
    """CPU microseconds of one message's work in a tight loop: what it costs with warm caches."""
    best = float("inf")
    for _ in range(5):
        cpu0 = time.process_time()
        for _ in range(2000):
            _work()
        best = min(best, time.process_time() - cpu0)
    return 1e6 * best / 2000


def probe(rate: float, seconds: float = SECONDS) -> tuple[float, float]:
    """CPU microseconds an event loop spends per message when messages come `rate` a second,
    and its wake-ups (voluntary context switches) per message."""
    n = max(10, int(rate * seconds))
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            ours.close()
            _write_at(theirs, rate, n)
        finally:
            os._exit(0)
    theirs.close()
    try:
        run = asyncio.run
        with contextlib.suppress(ImportError):
            import uvloop

            run = uvloop.run
        cpu, sleeps = run(_read(ours, n))
    finally:
        os.waitpid(pid, 0)
    return 1e6 * cpu / n, sleeps / n


def measure(rates: tuple[int, ...] = RATES) -> dict[str, Any]:
    """The probe in a fresh process (the caller's own threads and loop stay out of it)."""
    out = subprocess.run([sys.executable, "-m", __name__, "--json", *map(str, rates)],
                         capture_output=True, text=True, timeout=60 + 2 * len(rates) * SECONDS)
    if out.returncode != 0:
        raise RuntimeError(f"wake-up probe failed: {out.stderr.strip()[-300:]}")
    return cast(dict[str, Any], json.loads(out.stdout))


def run_probe(rates: tuple[int, ...]) -> dict[str, Any]:
    rows = {}
    for r in rates:
        cpu_us, wakeups = probe(r)
        rows[str(r)] = {"cpu_us_per_message": round(cpu_us, 1),
                        "wakeups_per_message": round(wakeups, 2)}
    return {"work_us_hot": round(hot(), 1), "rates": rows}


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    rates = tuple(int(a) for a in argv if a != "--json") or RATES
    result = run_probe(rates)
    if as_json:
        print(json.dumps(result))
        return 0
    print(f"one message's work in a tight loop: {result['work_us_hot']:.1f} µs of CPU")
    for r, row in result["rates"].items():
        print(f"{r:>6} messages/s: {row['cpu_us_per_message']:7.1f} µs of CPU per message, "
              f"{row['wakeups_per_message']:.2f} wake-ups per message")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
