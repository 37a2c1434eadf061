"""`EFFECTLEDGER_METRICS=off` turns every metric into a no-op at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from effectledger_obs.metrics import enabled_from_env


def test_metrics_setting_accepts_on_off_and_default() -> None:
    assert enabled_from_env(None) is True
    assert enabled_from_env("on") is True
    assert enabled_from_env(" OFF ") is False


def test_metrics_setting_refuses_unknown_value_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="EFFECTLEDGER_METRICS"):
        enabled_from_env("maybe")


def test_metrics_off_makes_calls_no_ops_and_metrics_page_says_off() -> None:
    code = (
        "from effectledger_obs import metrics\n"
        "from effectledger_obs.http import metrics_response\n"
        "metrics.inc(metrics.INTENTS, 'tool', 'created')\n"
        "metrics.observe(metrics.STAGE_DURATION, 0.1, 'accepted_to_claimed')\n"
        "metrics.RETRY_BUDGET_TOKENS.set_function(lambda: 1.0)\n"
        "metrics.NATS_CONNECTED.set(1)\n"
        "print(metrics_response().body.decode())\n"
    )
    env = {**os.environ, "EFFECTLEDGER_METRICS": "off"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "metrics are off" in out
    assert "effectledger_intents_total" not in out
