"""Per-tenant quotas: how fast a tenant may submit, and how much of it may be open at once.

Pure: the clock is passed in, counts come from the caller (the ledger reads them from its
database). Every limit is off at 0, which is the embedded default; a deployment with several
tenants sets them (`EFFECTLEDGER_TENANT_*`). A refusal is `QuotaExceeded` (HTTP 429 with
`Retry-After`, or the same error reply over NATS) and nothing is recorded: the caller may send
the same intent again later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import QuotaExceeded

# Token buckets kept in memory; the least recently created go first beyond this many tenants.
MAX_TRACKED_TENANTS = 100_000


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    rate_per_s: float = 0.0  # intents per second per tenant (a token bucket); 0: off
    burst: int = 0  # the bucket's size; 0: one second's worth (at least 1)
    max_in_flight: int = 0  # operations not yet at rest per tenant; 0: off
    max_awaiting_approval: int = 0  # operations waiting for an operator per tenant; 0: off

    @property
    def any(self) -> bool:
        return bool(self.rate_per_s or self.max_in_flight or self.max_awaiting_approval)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass
class TenantRates:
    """A token bucket per tenant. Per ledger replica: N replicas admit up to N times the rate
    in total, so set the rate per replica."""

    rate_per_s: float
    burst: int = 0
    buckets: dict[str, _Bucket] = field(default_factory=dict)

    @property
    def size(self) -> float:
        return float(self.burst) if self.burst > 0 else max(1.0, self.rate_per_s)

    def take(self, tenant: str, now: float) -> float | None:
        """None if `tenant` may submit now (one token taken); else seconds until it may."""
        if self.rate_per_s <= 0:
            return None
        b = self.buckets.get(tenant)
        if b is None:
            if len(self.buckets) >= MAX_TRACKED_TENANTS:
                del self.buckets[next(iter(self.buckets))]
            b = self.buckets[tenant] = _Bucket(self.size, now)
        b.tokens = min(self.size, b.tokens + max(0.0, now - b.at) * self.rate_per_s)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return None
        return (1.0 - b.tokens) / self.rate_per_s


def retry_after_header(seconds: float) -> str:
    """`Retry-After` is whole seconds (RFC 9110), rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


def check_rate(rates: TenantRates, tenant: str, now: float) -> None:
    wait = rates.take(tenant, now)
    if wait is not None:
        raise QuotaExceeded(
            f"tenant {tenant[:200]!r} submits faster than {rates.rate_per_s:g} intents per "
            f"second", limit="rate", retry_after_s=round(wait, 3))


def check_open(limit: int, count: int, *, tenant: str, what: str, retry_after_s: float
               ) -> None:
    """Refuse when `count` operations of the tenant already are `what` and the limit is on."""
    if limit > 0 and count >= limit:
        raise QuotaExceeded(
            f"tenant {tenant[:200]!r} already has {count} operations {what} (limit {limit})",
            limit=what.replace(" ", "_"), retry_after_s=retry_after_s)
