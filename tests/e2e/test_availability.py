"""The ledger serves whenever its database does: real processes, a private nats-server that is
not running when the services start.

- a ledger started with NATS unreachable listens, reports what is missing, accepts an intent
  with 201; once NATS starts, the relay publishes the command and a dispatcher executes it once;
- the reconciler's webhook endpoint answers 503 with Retry-After at once while NATS is away,
  and stores the same webhook once NATS is back.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from standardwebhooks import Webhook

from effectledger_cli.embedded import free_port, start_nats
from effectledger_core.config import Settings
from tests.support.cluster import Cluster, wait_until

# It times the ledger's answers (an ack within 5 s, a 503 within 2 s): never beside a chaos
# run or a benchmark hogging both cores.
pytestmark = pytest.mark.xdist_group("heavy")


@pytest.fixture
def nats_port() -> int:
    return free_port()


@pytest.fixture
def late_nats(nats_port: int, tmp_path: Path) -> Iterator[Callable[[], None]]:
    """Starts the private nats-server when called (not before); stops it afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        procs.append(start_nats(tmp_path / "nats", nats_port))

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def offline_settings(settings: Settings, nats_port: int) -> Settings:
    return settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{nats_port}"})


async def test_a_ledger_started_without_nats_accepts_an_intent_that_runs_once_nats_is_back(
        offline_settings: Settings, tmp_path: Path, late_nats: Callable[[], None]) -> None:
    cluster = Cluster(offline_settings, tmp_path / "cluster")
    try:
        await cluster.start_sandbox()
        await cluster.start_ledger(ready_path="/readyz", timeout_s=60)
        ready = await cluster.ledger.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["missing"] == ["nats", "relay"]
        assert ready.json()["accepting_intents"] and not ready.json()["relaying"]
        assert (await cluster.ledger.get("/readyz/relay")).status_code == 503

        started = time.monotonic()
        op = await cluster.submit_ok("create_ticket", {"title": "while NATS is down"},
                                     key="avail-1")
        ack_s = time.monotonic() - started
        assert op["state"] == "pending"
        assert ack_s < 5.0, f"the intent took {ack_s:.2f}s to be acknowledged"
        assert (await cluster.operation(op["id"]))["state"] == "pending"  # nothing ran yet

        late_nats()
        await cluster.start_dispatcher()
        done = await cluster.wait_state(op["id"], "succeeded", timeout_s=60)
        assert done["epoch"] == 1
        truth = await cluster.key_truth(done["operation_key"])
        assert (truth["requests"], truth["applied"]) == (1, 1)
        relay = await cluster.ledger.get("/readyz/relay")
        assert relay.status_code == 200 and relay.json()["missing"] == []
    except BaseException:
        print(f"\n===== service logs =====\n{cluster.log_tails(60)}")
        raise
    finally:
        await cluster.aclose()


def _signed(secret: str, body: bytes, webhook_id: str) -> dict[str, str]:
    now = datetime.now(UTC)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(secret).sign(webhook_id, now, body.decode()),
            "content-type": "application/json"}


async def test_the_webhook_endpoint_answers_503_with_retry_after_while_nats_is_down(
        offline_settings: Settings, tmp_path: Path, late_nats: Callable[[], None]) -> None:
    cluster = Cluster(offline_settings, tmp_path / "cluster")
    body = json.dumps({"type": "effect.applied", "data": {
        "id": "eff_1", "idempotency_key": "ck_avail", "fencing_token": 1,
        "final": True}}).encode()
    try:
        proc = cluster._spawn("reconciler", "reconciler", ["reconciler"], cluster._env({
            "EFFECTLEDGER_RECONCILER_HOST": "127.0.0.1",
            "EFFECTLEDGER_RECONCILER_PORT": str(cluster.reconciler_port),
            "EFFECTLEDGER_WEBHOOK_SECRETS": json.dumps({"sandbox": [cluster.webhook_secret]}),
        }, None))
        await wait_until(lambda: b"reconciler listening:" in proc.log.read_bytes()
                         or not proc.alive, 60, what="the reconciler to listen")
        assert proc.alive, cluster.tail(proc)
        async with httpx.AsyncClient(base_url=cluster.reconciler_url, timeout=30) as http:
            started = time.monotonic()
            down = await http.post("/v1/webhooks/sandbox", content=body,
                                   headers=_signed(cluster.webhook_secret, body, "wh_1"))
            answered_s = time.monotonic() - started
            assert down.status_code == 503
            assert down.headers["retry-after"] == "5"
            assert down.json()["error"]["code"] == "broker_unavailable"
            assert answered_s < 2.0, f"the 503 took {answered_s:.2f}s"
            # A forged one is still refused as forged, not as "try later".
            forged = {**_signed(cluster.webhook_secret, body, "wh_2"),
                      "webhook-signature": "v1," + "A" * 44}
            assert (await http.post("/v1/webhooks/sandbox", content=body,
                                    headers=forged)).status_code == 401
            assert (await http.get("/readyz")).status_code == 503

            late_nats()
            await wait_until(lambda: b"reconciler ready:" in proc.log.read_bytes(), 60,
                             what="the reconciler to connect")
            again = await http.post("/v1/webhooks/sandbox", content=body,
                                    headers=_signed(cluster.webhook_secret, body, "wh_1"))
            assert again.status_code == 200 and again.json()["duplicate"] is False
    except BaseException:
        print(f"\n===== service logs =====\n{cluster.log_tails(60)}")
        raise
    finally:
        await cluster.aclose()
