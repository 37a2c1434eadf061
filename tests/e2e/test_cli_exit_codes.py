"""The CLI on the typed client against a real stack: `submit --wait` exits by how the
operation ended, so scripts and agents can branch without parsing."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

from effectledger_cli.client import (
    EXIT_APPROVAL,
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNKNOWN,
)
from tests.support.cluster import Cluster

pytestmark = pytest.mark.slow


async def _cli(c: Cluster, *args: str) -> tuple[int, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env["EFFECTLEDGER_LEDGER_URL"] = c.ledger_url
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "effectledger_cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, (json.loads(out) if out.strip() else err.decode())


async def _fault(c: Cluster, route: str, action: dict[str, Any]) -> None:
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": action, "times": 1})
    assert resp.status_code == 200, resp.text


async def test_submit_wait_exit_codes(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster()
    await c.start()
    await c.start_reconciler()
    code, op = await _cli(c, "submit", "create_ticket", "--args", '{"title": "ok"}',
                          "--wait", "20")
    assert (code, op["state"]) == (EXIT_OK, "succeeded")

    code, op = await _cli(c, "submit", "fast_wire", "--args", '{"amount": 1}', "--wait", "20")
    assert (code, op["state"]) == (EXIT_APPROVAL, "awaiting_approval")

    await _fault(c, "idempotent", {"kind": "status_before_apply", "status": 400})
    code, op = await _cli(c, "submit", "create_ticket", "--args", '{"title": "refused"}',
                          "--wait", "20")
    assert (code, op["state"]) == (EXIT_FAILED, "failed")

    await _fault(c, "plainpager", {"kind": "drop_after_apply"})
    code, op = await _cli(c, "submit", "fast_page", "--args", '{"text": "?"}', "--wait", "20")
    assert code == EXIT_UNKNOWN and op["state"] in ("ambiguous", "needs_review")

    await _fault(c, "idempotent", {"kind": "delay", "seconds": 3})
    code, op = await _cli(c, "submit", "create_ticket", "--args", '{"title": "slow"}',
                          "--wait", "0.5")
    assert (code, op["state"]) == (EXIT_TIMEOUT, "in_flight")
    code, op = await _cli(c, "show", op["id"], "--wait", "20")
    assert (code, op["state"]) == (EXIT_OK, "succeeded")

    code, err = await _cli(c, "show", "no-such-operation")
    assert code == EXIT_ERROR and "not_found" in err
