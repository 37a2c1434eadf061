"""The chain's floor (`effectledger_bench.skeleton`) really makes the chain's hops: each call is
committed, claimed and reported through real PostgreSQL and JetStream and reaches a real
sandbox once, with the dispatcher's headers; a second claim on a claimed call is refused."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from datetime import datetime
from pathlib import Path

import aiohttp
import nats
import pytest

from effectledger_bench import budget
from effectledger_bench.http_clients import _start_sandbox
from effectledger_bench.skeleton import STREAM, Skeleton, call
from effectledger_cli.embedded import free_port
from tests.support.servers import unique_prefix


@pytest.mark.asyncio
async def test_skeleton_calls_commit_claim_and_reach_the_provider_once_each(
        pg_url: str, nats_url: str, tmp_path: Path) -> None:
    api_key = "sk_bench_" + secrets.token_hex(8)
    prefix = unique_prefix()[0]
    proc, base = _start_sandbox(api_key)
    skeleton = Skeleton(database_url=pg_url, nats_url=nats_url, provider_url=base,
                        api_key=api_key, port=free_port(), logs=tmp_path, prefix=prefix)
    nc = await nats.connect(nats_url)
    try:
        await asyncio.to_thread(skeleton.start)
        async with aiohttp.ClientSession(skeleton.url) as http:
            answers, times = [], []
            for i in range(5):
                sent = time.time()
                answers.append(await call(http, "/", f"{prefix}-{i}", {"title": f"skeleton {i}"}))
                times.append((sent, time.time()))
        # The claim is the ledger's guard, not a formality: a claimed call is not claimed again.
        again = await nc.request(f"{prefix}.claim", json.dumps(
            {"id": answers[0]["id"], "holder": "someone-else"}).encode(), timeout=5)
        async with aiohttp.ClientSession() as plain, plain.get(f"{base}/_truth") as resp:
            truth = (await resp.json())["keys"]
    finally:
        await asyncio.to_thread(skeleton.close)
        await nc.jetstream().delete_stream(f"{STREAM}_{prefix}".upper())
        await nc.close()
        proc.terminate()
        proc.wait(timeout=30)
    assert [a["state"] for a in answers] == ["succeeded"] * 5
    assert all(a["result"] for a in answers)  # the provider's own answer came back
    assert json.loads(again.data) == {"granted": False}
    # Its stamps make the same six hops as the ledger's journal does (budget.py), in order.
    for answer, (sent, answered) in zip(answers, times, strict=True):
        journal = [(kind, datetime.fromisoformat(at), detail)
                   for kind, at, detail in answer["journal"]]
        assert [kind for kind, _, _ in journal] == [
            "intent_accepted", "attempt_claimed", "outcome_recorded"]
        ms = budget.hops(sent, answered, journal)
        assert ms["provider_call"] > 0 and all(v > -1 for v in ms.values()), ms
        assert sum(ms.values()) == pytest.approx((answered - sent) * 1000, abs=0.01)
    ids = {a["id"] for a in answers}
    assert set(truth) == ids  # keyed by operation, as the dispatcher keys its calls
    assert all(t["applied"] == 1 and t["requests"] == 1 and t["fencing_tokens"] == [1]
               for t in truth.values())


def test_a_skeleton_that_cannot_start_says_where_to_look(tmp_path: Path) -> None:
    skeleton = Skeleton(database_url="postgresql+asyncpg://nobody@127.0.0.1:1/none",
                        nats_url="nats://127.0.0.1:1", provider_url="http://127.0.0.1:1",
                        api_key="", port=free_port(), logs=tmp_path)
    try:
        with pytest.raises(RuntimeError, match="skeleton ledger exited"):
            skeleton.start(timeout_s=30)
    finally:
        skeleton.close()
    assert (tmp_path / "skeleton-ledger.log").read_text()  # the reason is in its log
