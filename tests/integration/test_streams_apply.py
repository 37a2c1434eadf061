"""Streams owned by one step, on a real NATS: `apply` creates and updates, services only check.

Each test has its own stream and subject prefixes; its streams are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import RetentionPolicy
from nats.js.errors import NotFoundError

from effectledger_bus import topology as topo
from effectledger_bus.streams import StreamMissing, _transient, delete_streams, ensure_streams
from effectledger_core.config import Settings
from effectledger_core.errors import ConfigError
from tests.support.servers import unique_prefix

pytestmark = pytest.mark.nats
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def base(nats_url: str) -> Settings:
    subject_prefix, stream_prefix = unique_prefix()
    return Settings(nats_url=nats_url, subject_prefix=subject_prefix,
                    stream_prefix=stream_prefix, stream_storage="memory")


@pytest.fixture
async def nc(base: Settings) -> AsyncIterator[NatsClient]:
    client = await nats.connect(base.nats_url)
    yield client
    await delete_streams(client.jetstream(), base)
    await client.close()


async def test_apply_creates_every_stream_and_consumer_and_a_second_apply_updates(
        nc: NatsClient, base: Settings) -> None:
    js = nc.jetstream()
    first = await topo.apply(js, topo.topology(base))
    assert [line.split(":")[1].strip() for line in first[:2]] == ["created (1 replicas)"] * 2
    for spec in topo.topology(base).consumers:
        info = await js.consumer_info(spec.stream, spec.config.durable_name or "")
        assert info.config.filter_subject == spec.config.filter_subject
        assert info.config.ack_wait == spec.config.ack_wait
    longer = base.model_copy(update={"stream_max_age_s": 3600.0, "ack_wait_s": 90.0})
    await topo.apply(js, topo.topology(longer))
    stream = await js.stream_info(longer.subjects.dispatch_stream)
    assert stream.config.max_age == 3600.0
    consumer = await js.consumer_info(longer.subjects.dispatch_stream, topo.DISPATCHER)
    assert consumer.config.ack_wait == 90.0  # the apply step changes consumers too


async def test_a_service_check_never_changes_limits_the_apply_step_set(
        nc: NatsClient, base: Settings) -> None:
    js = nc.jetstream()
    operator = base.model_copy(update={"stream_max_age_s": 3600.0, "duplicate_window_s": 30.0})
    await topo.apply(js, topo.topology(operator))
    await ensure_streams(js, base)  # a service started with other (default) settings
    for name in (base.subjects.dispatch_stream, base.subjects.events_stream):
        cfg = (await js.stream_info(name)).config
        assert (cfg.max_age, cfg.duplicate_window) == (3600.0, 30.0)


async def test_a_service_that_may_not_create_streams_waits_for_the_apply_step(
        nc: NatsClient, base: Settings) -> None:
    strict = base.model_copy(update={"streams_create_missing": False})
    found_missing = asyncio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "StreamMissing" in record.getMessage():
                found_missing.set()

    handler = Seen()
    logging.getLogger("effectledger_bus.streams").addHandler(handler)
    try:
        waiting = asyncio.create_task(ensure_streams(nc.jetstream(), strict))
        await asyncio.wait_for(found_missing.wait(), 30)  # it saw the stream missing...
    finally:
        logging.getLogger("effectledger_bus.streams").removeHandler(handler)
    assert not waiting.done()  # ...and neither gave up nor created it
    with pytest.raises(NotFoundError):
        await nc.jetstream().stream_info(base.subjects.dispatch_stream)
    await topo.apply(nc.jetstream(), topo.topology(base))
    await asyncio.wait_for(waiting, 30)  # and now proceeds


def test_a_missing_stream_is_waited_for_not_a_failure() -> None:
    assert _transient(StreamMissing("JetStream stream X does not exist yet"))
    assert not _transient(ConfigError("JetStream stream X has retention limits"))


async def test_a_stream_with_the_wrong_retention_fails_the_service_start_in_one_line(
        nc: NatsClient, base: Settings) -> None:
    js = nc.jetstream()
    wanted = topo.topology(base).streams[0]
    await js.add_stream(replace(wanted, retention=RetentionPolicy.LIMITS))
    with pytest.raises(ConfigError) as info:
        await ensure_streams(js, base)
    assert info.value.message == (
        f"JetStream stream {wanted.name} has retention limits, needs workqueue: fix it with "
        "`effectledger streams apply`")


async def test_the_cli_applies_infra_streams_json_with_the_configured_prefixes(
        nc: NatsClient, base: Settings) -> None:
    env = {**os.environ, "EFFECTLEDGER_SUBJECT_PREFIX": base.subject_prefix,
           "EFFECTLEDGER_STREAM_PREFIX": base.stream_prefix,
           "EFFECTLEDGER_STREAM_STORAGE": "memory", "EFFECTLEDGER_NATS_URL": base.nats_url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "effectledger_cli", "streams", "apply", "--file",
        str(REPO / "infra" / "nats" / "streams.json"), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().splitlines() == [
        f"stream {base.stream_prefix}_DISPATCH: created (1 replicas)",
        f"stream {base.stream_prefix}_EVENTS: created (1 replicas)",
        f"consumer {base.stream_prefix}_DISPATCH/dispatcher: applied",
        f"consumer {base.stream_prefix}_EVENTS/ledger-inbox: applied",
        f"consumer {base.stream_prefix}_EVENTS/reconciler: applied"]
    info = await nc.jetstream().stream_info(base.subjects.events_stream)
    assert info.config.subjects == base.subjects.events_subjects
