"""The newest 1.x of the official `mcp` client against our server (which runs on the SDK's 2.x):
hosts pin old SDKs for months, and the retry rules must hold for them too. The client runs in a
virtual environment of its own (pip, from the package registry; skipped with the reason when
that cannot be built), the server and the stack are this checkout's processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cluster import Cluster

pytestmark = pytest.mark.slow
MCP_1X = "mcp>=1.30,<2"

# Keyed call; a retry of the same call without the key (a host that restarted and forgot it);
# a deliberate repeat; arguments the schema refuses. 1.x validates each structured result
# against the tool's outputSchema, so a result that breaks its schema fails here too.
CLIENT = r'''
import asyncio, json, sys
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

async def main() -> None:
    cfg = json.loads(sys.argv[1])
    params = StdioServerParameters(command=cfg["python"], args=cfg["args"], env=cfg["env"],
                                   cwd=cfg["cwd"])
    out = {}
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        out["tools"] = sorted(t.name for t in (await s.list_tools()).tools)
        args = {"amount": 9, "currency": "EUR"}
        keyed = await s.call_tool("charge_card", args,
                                  meta={"effectledger/idempotencyKey": "one-x-key-1"})
        retry = await s.call_tool("charge_card", args)
        repeat = await s.call_tool("charge_card", {**args, "repeat": "2"})
        bad = await s.call_tool("charge_card", {"amount": 9})
        out.update(keyed=keyed.structuredContent, retry=retry.structuredContent,
                   repeat=repeat.structuredContent, bad_is_error=bad.isError,
                   bad_text=bad.content[0].text)
    print(json.dumps(out))

asyncio.run(main())
'''


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("mcp-1x")
    venv.create(where, with_pip=True)
    python = where / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", MCP_1X],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.skip(f"could not install {MCP_1X} from the registry: {done.stderr[-500:]}")
    return python


async def _applied(c: Cluster) -> int:
    resp = await c.sandbox.get("/_truth")
    resp.raise_for_status()
    return int(resp.json()["total_applied"])


async def test_the_newest_1x_client_gets_one_effect_from_a_keyless_retry(
        make_cluster: Callable[..., Cluster], client_python: Path) -> None:
    c = make_cluster()
    await c.start()
    applied = await _applied(c)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env["EFFECTLEDGER_LEDGER_URL"] = c.ledger_url
    cfg = {"python": sys.executable, "args": ["-m", "effectledger_cli", "mcp", "--wait", "20"],
           "env": env, "cwd": str(c.workdir)}
    done = await asyncio.to_thread(
        subprocess.run, [str(client_python), "-c", CLIENT, json.dumps(cfg)],
        capture_output=True, text=True, timeout=180, env={"PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "operation_status" in out["tools"] and "charge_card" in out["tools"]
    keyed, retry, repeat = out["keyed"], out["retry"], out["repeat"]
    assert keyed["outcome"] == "succeeded" and keyed["idempotency_key"] == "one-x-key-1"
    assert retry["operation_id"] == keyed["operation_id"] and retry["replayed"] is True
    assert repeat["operation_id"] != keyed["operation_id"] and repeat["replayed"] is False
    assert await _applied(c) == applied + 2  # the keyed call and the deliberate repeat
    assert out["bad_is_error"] is True and "/currency" in out["bad_text"]
