"""The send deadline: no provider request leaves once a fraction of the tool's horizon has passed
since the dispatcher asked for its claim. Pure (the caller passes monotonic times).

Why: the reconciler decides `not_applied` from a readback sent after `claimed_at + horizon_s`
that finds nothing, and a new epoch may then apply the effect. A dispatcher frozen after its
grant (a GC pause, SIGSTOP, an overloaded host) and resumed after that moment must not send
its request any more: on a provider that does not check the fencing token it would be a second
effect. So the dispatcher takes a monotonic timestamp *before* sending the claim request (the
ledger's `claimed_at` is later than that, so the elapsed time is never under-counted) and checks
it again immediately before the request's first byte is written (after any connect or TLS
handshake). Past the deadline it sends nothing and reports the attempt as not sent: a transient
failure that is known not applied, which the ledger's retry policy may retry with the same
operation key.

The fraction leaves the other half of the horizon as margin for what cannot be checked: the
time between the check and the bytes leaving the host (measured by
`python -m effectledger_bench.send_window`), and the provider's own receipt. A pause longer than
that margin, landing exactly after the check, is not prevented; fencing-token providers refuse
such a request, the duplicate audit reports it on the others.
"""

from __future__ import annotations

from dataclasses import dataclass

# The share of the tool's horizon_s within which a claimed attempt may still be sent.
SEND_DEADLINE_FRACTION = 0.5
NOT_SENT_CODE = "send_deadline_passed"


def send_deadline_s(horizon_s: float) -> float:
    return horizon_s * SEND_DEADLINE_FRACTION


@dataclass(frozen=True, slots=True)
class SendWindow:
    """From `started` (monotonic, taken before the claim request) for `limit_s` seconds."""

    started: float
    limit_s: float

    @classmethod
    def for_horizon(cls, started: float, horizon_s: float) -> SendWindow:
        return cls(started, send_deadline_s(horizon_s))

    def elapsed(self, now: float) -> float:
        return now - self.started

    def is_open(self, now: float) -> bool:
        return self.elapsed(now) < self.limit_s

    def explain(self, now: float) -> str:
        return (f"nothing was sent: {self.elapsed(now):.3f}s passed since the claim was "
                f"requested, past the send deadline of {self.limit_s:.3f}s "
                f"({SEND_DEADLINE_FRACTION:g} x the tool's horizon)")
