"""The benchmark's no-durability ceiling makes the dispatcher's real provider call from several
processes at once, each call once, against a real sandbox (its ground truth says so)."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx

from effectledger_bench.http_clients import _start_sandbox
from effectledger_bench.peer_direct import run_processes
from effectledger_bench.stack import CATALOG, TOOL


def test_ceiling_processes_apply_every_key_exactly_once_with_the_dispatchers_headers(
        tmp_path: Path) -> None:
    api_key = "sk_bench_" + secrets.token_hex(8)
    proc, base = _start_sandbox(api_key)
    try:
        catalog = tmp_path / "catalog.toml"
        catalog.write_text(CATALOG.format(sandbox=base, timeout_s=2))
        result = run_processes(catalog, TOOL, {"EFFECTLEDGER_SANDBOX_API_KEY": api_key},
                               processes=2, n=40, concurrency=8, prefix="direct-t-")
        truth = httpx.get(f"{base}/_truth", timeout=10).json()["keys"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "error" not in result, result
    assert (result["processes"], result["n"], result["errors"]) == (2, 40, 0)
    assert result["ops_per_s"] > 0
    # 20 measured calls per process plus its warm-up calls, every key applied exactly once,
    # and the fencing token the dispatcher sends reached the provider.
    measured = {k: t for k, t in truth.items() if not k.split("-")[-1].startswith("w")}
    assert len(measured) == 40
    assert all(t["applied"] == 1 and t["requests"] == 1 for t in truth.values())
    assert all(t["fencing_tokens"] == [1] for t in measured.values())
