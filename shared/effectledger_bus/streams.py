"""Stream definitions (also described in infra/nats/streams.json and docs/asyncapi.yaml).

Streams are created or updated idempotently at service start. File storage by default: the
dispatch stream is the transport of committed intents, so it should survive a broker restart
(the ledger's sweeper repairs what is lost anyway).
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from effectledger_core.config import Settings


def stream_configs(settings: Settings) -> list[StreamConfig]:
    subjects = settings.subjects
    storage = StorageType.FILE if settings.stream_storage == "file" else StorageType.MEMORY
    common = dict(storage=storage, num_replicas=settings.stream_replicas,
                  max_age=settings.stream_max_age_s, duplicate_window=settings.duplicate_window_s,
                  discard=DiscardPolicy.OLD, max_msg_size=512 * 1024)
    return [
        # Work queue: a dispatch command is removed once a dispatcher acks it.
        StreamConfig(name=subjects.dispatch_stream, subjects=[subjects.dispatch_all],
                     retention=RetentionPolicy.WORK_QUEUE,
                     description="effectledger dispatch commands (from the ledger outbox)",
                     **common),  # type: ignore[arg-type]
        # Also a work queue: the ledger's and the reconciler's consumers filter on disjoint
        # subtrees, and acknowledged events leave no backlog behind.
        StreamConfig(name=subjects.events_stream, subjects=subjects.events_subjects,
                     retention=RetentionPolicy.WORK_QUEUE,
                     description="effectledger attempt outcomes, ambiguity notices, dead letters",
                     **common),  # type: ignore[arg-type]
    ]


async def ensure_streams(js: JetStreamContext, settings: Settings) -> None:
    for cfg in stream_configs(settings):
        try:
            await js.stream_info(cfg.name)  # type: ignore[arg-type]
        except NotFoundError:
            await js.add_stream(cfg)
        else:
            await js.update_stream(cfg)


async def delete_streams(js: JetStreamContext, settings: Settings) -> None:
    for cfg in stream_configs(settings):
        try:
            await js.delete_stream(cfg.name)  # type: ignore[arg-type]
        except NotFoundError:
            pass
