"""The unsafe switches: one registry, strict parsing, a loud warning, a listing."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from effectledger_core import unsafe
from effectledger_core.unsafe import SKIP_CLAIM, SKIP_WEBHOOK_VERIFICATION, UnsafeSwitch


def test_every_known_switch_is_registered_under_the_unsafe_prefix() -> None:
    assert {s.env for s in unsafe.SWITCHES} == {
        "EFFECTLEDGER_UNSAFE_SKIP_CLAIM", "EFFECTLEDGER_UNSAFE_SKIP_WEBHOOK_VERIFICATION",
        "EFFECTLEDGER_UNSAFE_NATS_WITHOUT_PERMISSIONS", "EFFECTLEDGER_UNSAFE_NO_SEND_DEADLINE",
        "EFFECTLEDGER_UNSAFE_OPEN_API", "EFFECTLEDGER_UNSAFE_OPEN_MCP_HTTP"}
    assert all(s.env.startswith(unsafe.PREFIX) for s in unsafe.SWITCHES)
    with pytest.raises(ValueError, match="must be named"):
        UnsafeSwitch(env="SKIP_CLAIM", service="dispatcher", disables="x")


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_on_values_arm_a_switch(value: str) -> None:
    assert unsafe.armed(SKIP_CLAIM, {SKIP_CLAIM.env: value})


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_off_values_and_absence_leave_it_off(value: str) -> None:
    assert not unsafe.armed(SKIP_CLAIM, {SKIP_CLAIM.env: value})
    assert not unsafe.armed(SKIP_CLAIM, {})


def test_a_value_neither_on_nor_off_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="EFFECTLEDGER_UNSAFE_SKIP_CLAIM='maybe'"):
        unsafe.armed(SKIP_CLAIM, {SKIP_CLAIM.env: "maybe"})


def test_an_unregistered_switch_cannot_be_read() -> None:
    rogue = UnsafeSwitch(env="EFFECTLEDGER_UNSAFE_ROGUE", service="x", disables="y")
    with pytest.raises(ValueError, match="not a registered"):
        unsafe.armed(rogue, {rogue.env: "1"})


def test_check_announces_only_an_armed_switch(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.unsafe")
    with caplog.at_level(logging.WARNING, logger="test.unsafe"):
        assert not unsafe.check(SKIP_CLAIM, {}, log)
        assert caplog.records == []
        assert unsafe.check(SKIP_CLAIM, {SKIP_CLAIM.env: "1"}, log)
    [record] = caplog.records
    assert record.levelno == logging.CRITICAL
    assert record.getMessage().startswith(
        "UNSAFE: EFFECTLEDGER_UNSAFE_SKIP_CLAIM is set, which turns off claim-before-call")
    assert "claim-before-call" in record.getMessage()


def test_the_listing_names_every_switch_its_state_and_strays() -> None:
    text = unsafe.describe({SKIP_WEBHOOK_VERIFICATION.env: "1",
                            "EFFECTLEDGER_UNSAFE_SKIP_CLAIMS": "1"})
    lines = text.splitlines()
    assert any(SKIP_CLAIM.env in line and line.rstrip().endswith("off") for line in lines)
    assert any(SKIP_WEBHOOK_VERIFICATION.env in line and "ARMED" in line for line in lines)
    assert "EFFECTLEDGER_UNSAFE_SKIP_CLAIMS" in lines[-1]
    assert unsafe.armed_switches({SKIP_WEBHOOK_VERIFICATION.env: "1"}) == [
        SKIP_WEBHOOK_VERIFICATION]


def test_the_listing_shows_an_invalid_value_instead_of_failing() -> None:
    assert "INVALID" in unsafe.describe({SKIP_CLAIM.env: "maybe"})


def test_the_cli_lists_the_switches() -> None:
    out = subprocess.run([sys.executable, "-m", "effectledger_cli", "unsafe-switches"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", SKIP_CLAIM.env: "1"})
    assert out.returncode == 0, out.stderr
    assert f"{SKIP_CLAIM.env}  [dispatcher]  ARMED" in out.stdout
    assert f"{SKIP_WEBHOOK_VERIFICATION.env}  [reconciler]  off" in out.stdout


def test_the_services_read_the_switches_through_the_registry() -> None:
    from effectledger_dispatcher.worker import unsafe_skip_claim
    from effectledger_reconciler.app import skip_verification_requested

    assert unsafe_skip_claim({SKIP_CLAIM.env: "1"})
    assert not unsafe_skip_claim({SKIP_WEBHOOK_VERIFICATION.env: "1"})
    with pytest.raises(ValueError):
        skip_verification_requested({SKIP_WEBHOOK_VERIFICATION.env: "perhaps"})
