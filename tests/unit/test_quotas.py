"""Per-tenant token buckets and open-operation limits (pure, the clock passed in)."""

from __future__ import annotations

import pytest

from effectledger_core.errors import QuotaExceeded
from effectledger_core.quotas import (
    MAX_TRACKED_TENANTS,
    TenantRates,
    check_open,
    check_rate,
    retry_after_header,
)


def test_a_tenant_gets_its_burst_then_waits_for_the_refill() -> None:
    rates = TenantRates(rate_per_s=2.0, burst=3)
    assert [rates.take("a", 0.0) for _ in range(3)] == [None, None, None]
    assert rates.take("a", 0.0) == pytest.approx(0.5)
    assert rates.take("a", 0.5) is None  # one token back after 1 / rate
    assert rates.take("a", 0.5) == pytest.approx(0.5)


def test_tenants_do_not_share_a_bucket() -> None:
    rates = TenantRates(rate_per_s=1.0)
    assert rates.take("a", 0.0) is None and rates.take("a", 0.0) is not None
    assert rates.take("b", 0.0) is None


def test_a_rate_of_zero_is_off() -> None:
    rates = TenantRates(rate_per_s=0.0)
    assert all(rates.take("a", 0.0) is None for _ in range(1000))


def test_the_refused_rate_says_when_to_come_back() -> None:
    rates = TenantRates(rate_per_s=0.25)
    check_rate(rates, "a", 0.0)
    with pytest.raises(QuotaExceeded) as caught:
        check_rate(rates, "a", 1.0)
    assert caught.value.http_status == 429
    assert caught.value.details == {"limit": "rate", "retry_after_s": 3.0}
    assert retry_after_header(caught.value.details["retry_after_s"]) == "3"
    assert retry_after_header(0.01) == "1"


def test_open_operation_limits_refuse_at_the_limit_and_are_off_at_zero() -> None:
    check_open(0, 10**6, tenant="a", what="in flight", retry_after_s=1)
    check_open(5, 4, tenant="a", what="in flight", retry_after_s=1)
    with pytest.raises(QuotaExceeded) as caught:
        check_open(5, 5, tenant="a", what="awaiting approval", retry_after_s=60)
    assert caught.value.details["limit"] == "awaiting_approval"


def test_the_number_of_tracked_tenants_is_bounded() -> None:
    rates = TenantRates(rate_per_s=1.0)
    for i in range(MAX_TRACKED_TENANTS + 10):
        rates.take(f"t{i}", 0.0)
    assert len(rates.buckets) == MAX_TRACKED_TENANTS
