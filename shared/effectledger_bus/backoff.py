"""How long to hold a message back before JetStream delivers it again (a `nak` delay).

One rule for every consumer: doubling from the delivery count, capped. The retry loop is the
broker's redelivery, not a loop in this process, so the count comes from JetStream and survives
a restart of the consumer. This is tenacity's `wait_exponential(multiplier=base, max=cap)`
computed from that count. Pure: no I/O, so pure decision modules may use it.
"""

from __future__ import annotations


def nak_backoff(deliveries: int, *, base_s: float, cap_s: float) -> float:
    """`base_s` after the first delivery, doubling with each further one, never above `cap_s`."""
    exponent = min(max(deliveries, 1) - 1, 32)
    return float(min(cap_s, base_s * 2 ** exponent))
