"""`effectledger up` as a supervisor: a child that dies is named and started again.

The others keep serving meanwhile, as they would in a deployment where one process (or one
node of a NATS cluster) is lost: the services reconnect to a restarted nats-server, the
ledger's outbox keeps every command until it is published, and a redelivered dispatch command
finds its claim. Restarts back off (0.5 s, 1 s, 2 s, … up to 10 s), and a child that dies more
than `max_restarts` times within `window_s` is a crash loop: `up` names it and exits non-zero
instead of restarting it for ever.

`tick` is called by `up`'s supervision loop; it takes the clock and the output as parameters so
that a test can drive it with a fake clock and fake children.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from .children import Child

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0


class CrashLoop(Exception):
    """A child died too often: the message names it (one paragraph, with its log's tail)."""


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 60.0

    def backoff_s(self, recent: int) -> float:
        """The wait before the `recent`-th restart within the window (1, 2, ...)."""
        return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, recent - 1)))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with {code}"


@dataclass
class Supervisor:
    procs: dict[str, Child]  # updated in place: `up`'s stop takes the restarted children
    respawn: Callable[[Child], Child]
    policy: RestartPolicy = RestartPolicy()
    clock: Callable[[], float] = time.monotonic
    out: TextIO = sys.stdout
    deaths: dict[str, list[float]] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)  # name -> when to restart

    def tick(self) -> None:
        now = self.clock()
        for name, child in list(self.procs.items()):
            if name in self.pending:
                if now >= self.pending[name]:
                    del self.pending[name]
                    self.procs[name] = self.respawn(child)
                    self._say(f"up: {name} restarted (pid {self.procs[name].proc.pid})")
                continue
            code = child.proc.poll()
            if code is None:
                continue
            recent = [t for t in self.deaths.get(name, []) if now - t < self.policy.window_s]
            recent.append(now)
            self.deaths[name] = recent
            if len(recent) > self.policy.max_restarts:
                raise CrashLoop(
                    f"effectledger up: {name} {describe_exit(code)} and died {len(recent)} "
                    f"times within {self.policy.window_s:.0f}s (at most "
                    f"{self.policy.max_restarts} restarts); stopping everything. Last lines "
                    f"of {child.log}:\n"
                    + "\n".join("  " + line for line in child.tail().splitlines()))
            wait = self.policy.backoff_s(len(recent))
            self.pending[name] = now + wait
            self._say(f"up: {name} {describe_exit(code)}; restarting it in {wait:.1f}s "
                      f"(restart {len(recent)} of at most {self.policy.max_restarts} within "
                      f"{self.policy.window_s:.0f}s; log: {child.log})")

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def run(sup: Supervisor, period_s: float = 0.2) -> None:
    """Supervise until a stop signal (raised by StopSignals) or a crash loop (CrashLoop)."""
    while True:
        sup.tick()
        time.sleep(period_s)  # supervision period: children offer no death notification

