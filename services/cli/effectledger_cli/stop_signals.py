"""Stop signals for `effectledger up`: the first SIGINT, SIGTERM or SIGHUP becomes `Stopped`
in the main flow, so the ordered stop runs in one place (a `finally`), whatever `up` was doing.

SIGTERM is what `timeout`, IDE stop buttons, `docker stop` and supervisors send, SIGHUP what a
closed terminal sends, and SIGINT may come from a script without job control to `up` alone:
all three must stop every child, not only `up`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """Raised by the first stop signal (a BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """Turns the first stop signal into `Stopped`, except inside `held()` (while a child is
    being spawned, so that none can start without being recorded for the stop); a signal
    arriving there is raised when the section ends. Later signals are ignored: the stop is
    under way."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._held = 0

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    @staticmethod
    def ignore() -> None:
        """While stopping: a second Ctrl-C must not cut the ordered stop short."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signum
        if not self._held:
            raise Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if self.received is not None and not self._held:
            raise Stopped(self.received)
