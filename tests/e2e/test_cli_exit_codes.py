"""The CLI on the typed client against a real stack: `submit --wait` exits by how the
operation ended, so scripts and agents can branch without parsing."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from effectledger_cli.client import (
    EXIT_APPROVAL,
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_RESEND,
    EXIT_TIMEOUT,
    EXIT_UNKNOWN,
)
from effectledger_cli.embedded import free_port
from tests.support.cluster import Cluster

pytestmark = pytest.mark.slow


async def _cli(c: Cluster, *args: str) -> tuple[int, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "effectledger_cli", *args, env=_env(c),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, (json.loads(out) if out.strip() else err.decode())


def _env(c: Cluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env["EFFECTLEDGER_LEDGER_URL"] = c.ledger_url
    return env


def _cli_on_a_terminal(c: Cluster, *args: str) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; returns its exit code and what the
    terminal showed."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "effectledger_cli", *args], env=_env(c),
                              stdout=subprocess.DEVNULL, stderr=slave, timeout=60)
    finally:
        os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's other end is closed and drained
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return proc.returncode, shown.decode(errors="replace")


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

    # Refused: resending it unchanged is refused again (exit 1), nothing recorded.
    code, err = await _cli(c, "submit", "charge_card", "--args", '{"amount": "x"}')
    assert code == EXIT_ERROR and "/amount" in err and "safe" not in err

    # On a terminal, --wait shows each state as it comes.
    code, shown = await asyncio.to_thread(
        _cli_on_a_terminal, c, "submit", "create_ticket", "--args", '{"title": "tty"}',
        "--wait", "20")
    assert code == EXIT_OK
    states = [line.split()[-1] for line in shown.splitlines() if line.strip()]
    assert states[-1] == "succeeded" and len(states) >= 2, shown


def test_an_unreachable_ledger_exits_7_naming_the_key_to_resend_with() -> None:
    """Not "refused": nothing is known to be recorded, and the same command with the key it
    names is safe to send again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env["EFFECTLEDGER_LEDGER_URL"] = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "effectledger_cli", "submit", "create_ticket",
                           "--args", '{"title": "x"}'], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == EXIT_RESEND, proc.stderr
    assert "unreachable" in proc.stderr and "safe with --key cli-" in proc.stderr
