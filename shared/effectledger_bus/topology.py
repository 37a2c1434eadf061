"""The JetStream topology (streams and durable consumers), owned by one step.

`effectledger streams apply` (and `effectledger up`, before any service starts) creates or
updates every stream and consumer from these definitions, or from a file in the same format
(`infra/nats/streams.json`, NATS API JSON as `nats stream add --config` reads it, durations in
nanoseconds). It is the only code that changes an existing stream: services only check that
what they need exists and matches (`effectledger_bus.streams`), so a service started without
`EFFECTLEDGER_STREAM_REPLICAS` can no longer reset a three-replica stream to one.

Deployment-specific fields come from configuration, never from the file: the stream and
subject prefixes, the replicas and the placement (cluster, tags) of every stream.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    Placement,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from effectledger_core.config import Settings
from effectledger_core.subjects import Subjects

from . import catalogue
from .catalogue import DISPATCHER, LEDGER_INBOX, RECONCILER

log = logging.getLogger(__name__)

MAX_MSG_SIZE = 512 * 1024  # every message is bounded below this at its entry
DEFAULT = Subjects()
RECONCILER_ACK_WAIT_S = 30.0


@dataclass(frozen=True)
class ConsumerSpec:
    stream: str
    config: ConsumerConfig


@dataclass(frozen=True)
class Topology:
    streams: list[StreamConfig]
    consumers: list[ConsumerSpec]

    def to_json(self) -> str:
        doc = {
            "_comment": "effectledger's JetStream streams and durable consumers with the default "
                        "prefixes, in NATS API JSON (durations in ns). Applied by `effectledger "
                        "streams apply [--file this]`; prefixes, replicas and placement come "
                        "from EFFECTLEDGER_* settings. Checked against the code by "
                        "tests/unit/test_topology.py.",
            "streams": [_clean(s.as_dict()) for s in self.streams],
            "consumers": [{"stream": c.stream, "config": _clean(c.config.as_dict())}
                          for c in self.consumers],
        }
        return json.dumps(doc, indent=2, default=str) + "\n"


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in d.items() if v is not None}


def topology(settings: Settings) -> Topology:
    """The streams and consumers the services need, for these settings."""
    return _configured(_definitions(settings), settings)


def _definitions(settings: Settings) -> Topology:
    subjects = settings.subjects
    storage = StorageType.FILE if settings.stream_storage == "file" else StorageType.MEMORY
    common: dict[str, Any] = dict(
        storage=storage, num_replicas=settings.stream_replicas, max_age=settings.stream_max_age_s,
        duplicate_window=settings.duplicate_window_s, discard=DiscardPolicy.OLD,
        max_msg_size=MAX_MSG_SIZE)
    streams = [
        # Work queue: a dispatch command is removed once a dispatcher acks it.
        StreamConfig(name=subjects.dispatch_stream,
                     subjects=catalogue.stream_subjects(subjects, "DISPATCH"),
                     retention=RetentionPolicy.WORK_QUEUE,
                     description="effectledger dispatch commands (from the ledger outbox)",
                     **common),
        # Also a work queue: the ledger's and the reconciler's consumers filter on disjoint
        # subtrees, and acknowledged events leave no backlog behind.
        StreamConfig(name=subjects.events_stream,
                     subjects=catalogue.stream_subjects(subjects, "EVENTS"),
                     retention=RetentionPolicy.WORK_QUEUE,
                     description="effectledger attempt outcomes, ambiguity notices, dead letters",
                     **common),
    ]
    # What each durable consumer's service needs; which stream and subjects it reads come
    # from the message catalogue.
    delivery: dict[str, dict[str, Any]] = {
        # ack_wait bounds how long a silently dead dispatcher holds a command; live ones send
        # in_progress heartbeats during provider calls.
        DISPATCHER: dict(ack_wait=settings.ack_wait_s, max_deliver=settings.max_deliver,
                         max_ack_pending=max(1024, settings.dispatcher_concurrency * 4)),
        LEDGER_INBOX: dict(ack_wait=settings.inbox_ack_wait_s, max_deliver=settings.max_deliver,
                           max_ack_pending=4096),
        # Unlimited deliveries: how long to keep trying comes from the command's own
        # timestamps (horizon, webhook wait, reconciliation deadline), never from a count.
        RECONCILER: dict(ack_wait=RECONCILER_ACK_WAIT_S, max_deliver=-1, max_ack_pending=4096),
    }
    consumers = [
        ConsumerSpec(catalogue.stream_name(subjects, c), ConsumerConfig(
            durable_name=c.durable,
            filter_subject=catalogue.absolute(subjects, c.filter or c.address),
            ack_policy=AckPolicy.EXPLICIT, **delivery[c.durable or ""]))
        for c in catalogue.durable_consumers()]
    return Topology(streams, consumers)


def load(path: str | Path, settings: Settings) -> Topology:
    """A topology file (the format of `Topology.to_json`, default prefixes), with this
    deployment's prefixes, replicas and placement. ValueError names what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
        streams = [StreamConfig.from_response(dict(s)) for s in doc["streams"]]
        consumers = [ConsumerSpec(c["stream"], ConsumerConfig.from_response(dict(c["config"])))
                     for c in doc["consumers"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a stream topology file: {type(exc).__name__}: {exc}"
                         ) from None
    names = {s.name for s in streams}
    for c in consumers:
        if c.stream not in names:
            raise ValueError(f"{path}: consumer {c.config.durable_name!r} names unknown stream "
                             f"{c.stream!r}")
    return _configured(Topology(streams, consumers), settings, rename=True)


def _configured(topo: Topology, settings: Settings, *, rename: bool = False) -> Topology:
    subjects = settings.subjects
    placement = (Placement(cluster=settings.stream_placement_cluster,
                           tags=list(settings.stream_placement_tags) or None)
                 if settings.stream_placement_cluster or settings.stream_placement_tags
                 else None)

    def stream_name(name: str) -> str:
        return _renamed(name, DEFAULT.stream_prefix, subjects.stream_prefix, "_") if rename \
            else name

    def subject(s: str) -> str:
        return _renamed(s, DEFAULT.prefix, subjects.prefix, ".") if rename else s

    streams = [replace(s, name=stream_name(s.name or ""),
                       subjects=[subject(x) for x in s.subjects or []],
                       num_replicas=settings.stream_replicas, placement=placement)
               for s in topo.streams]
    consumers = [ConsumerSpec(stream_name(c.stream), replace(
        c.config, filter_subject=subject(c.config.filter_subject)
        if c.config.filter_subject else None)) for c in topo.consumers]
    return Topology(streams, consumers)


def _renamed(value: str, old: str, new: str, sep: str) -> str:
    if value == old or value.startswith(old + sep):
        return new + value[len(old):]
    return value


async def apply(js: JetStreamContext, topo: Topology) -> list[str]:
    """Create or update every stream, then every consumer. Returns one line per change."""
    done: list[str] = []
    for cfg in topo.streams:
        name = cfg.name or ""
        try:
            await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(cfg)
            done.append(f"stream {name}: created ({cfg.num_replicas} replicas)")
        else:
            await js.update_stream(cfg)
            done.append(f"stream {name}: updated ({cfg.num_replicas} replicas)")
    for spec in topo.consumers:
        # CONSUMER.CREATE with an existing durable updates the fields NATS allows to change
        # (ack_wait, max_deliver, max_ack_pending); others are refused with the reason.
        await js.add_consumer(spec.stream, config=spec.config)
        done.append(f"consumer {spec.stream}/{spec.config.durable_name}: applied")
    return done
