"""The stream topology: infra/nats/streams.json is complete and equal to what the code creates,
files are renamed to a deployment's prefixes, and replicas and placement come from settings."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import RetentionPolicy

from effectledger_bus import topology as topo
from effectledger_bus.streams import stream_problems
from effectledger_core.config import Settings

REPO = Path(__file__).resolve().parents[2]
STREAMS_JSON = REPO / "infra" / "nats" / "streams.json"


@pytest.fixture
def defaults(monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in [n for n in os.environ if n.startswith("EFFECTLEDGER_")]:
        monkeypatch.delenv(name)
    return Settings()


def test_streams_json_is_what_the_code_defines_for_the_default_settings(
        defaults: Settings) -> None:
    assert STREAMS_JSON.read_text() == topo.topology(defaults).to_json(), (
        "regenerate it: effectledger streams show > infra/nats/streams.json")


def test_streams_json_names_every_consumer_of_every_service(defaults: Settings) -> None:
    doc = json.loads(STREAMS_JSON.read_text())
    durables = {(c["stream"], c["config"]["durable_name"], c["config"]["filter_subject"])
                for c in doc["consumers"]}
    assert durables == {("EFFECTS_DISPATCH", "dispatcher", "effects.dispatch.v1.>"),
                        ("EFFECTS_EVENTS", "ledger-inbox", "effects.ledger.v1.>"),
                        ("EFFECTS_EVENTS", "reconciler", "effects.reconcile.v1.>")}


def _fields(cfg: Any) -> dict[str, Any]:
    keep = ("ack_policy", "ack_wait", "max_deliver", "max_ack_pending")
    return {k: getattr(cfg, k) for k in keep}


class _FakeNats:
    """Enough of a nats-py client for the services' consumer builders to record configs."""

    def jetstream(self) -> object:
        return object()


def test_the_consumer_definitions_match_the_services_own(defaults: Settings) -> None:
    from effectledger_dispatcher.app import build_consumer as dispatcher_consumer
    from effectledger_ledger.messaging import build_inbox
    from effectledger_reconciler.app import build_consumer as reconciler_consumer

    class Handles:  # the builders only keep a reference to the handler
        async def handle(self, delivery: object) -> None:
            raise AssertionError("not called")

    wanted = {c.config.durable_name: c for c in topo.topology(defaults).consumers}
    built = [dispatcher_consumer(_FakeNats(), defaults, Handles()),  # type: ignore[arg-type]
             build_inbox(_FakeNats(), defaults, Handles()),  # type: ignore[arg-type]
             reconciler_consumer(_FakeNats(), defaults, Handles())]  # type: ignore[arg-type]
    assert {b.durable for b in built} == set(wanted)
    for consumer in built:
        spec = wanted[consumer.durable]
        assert spec.stream == consumer.stream
        assert spec.config.filter_subject == consumer.subject
        assert _fields(spec.config) == _fields(consumer.config)


def test_a_file_is_renamed_to_the_deployments_prefixes_and_takes_replicas_from_settings(
        defaults: Settings) -> None:
    mine = Settings(subject_prefix="acme.fx", stream_prefix="ACME", stream_replicas=3,
                    stream_placement_cluster="east", stream_placement_tags=["ssd"])
    loaded = topo.load(STREAMS_JSON, mine)
    assert [s.name for s in loaded.streams] == ["ACME_DISPATCH", "ACME_EVENTS"]
    assert loaded.streams[1].subjects == ["acme.fx.ledger.v1.>", "acme.fx.reconcile.v1.>"]
    assert {s.num_replicas for s in loaded.streams} == {3}
    placement = loaded.streams[0].placement
    assert placement is not None and (placement.cluster, placement.tags) == ("east", ["ssd"])
    assert [(c.stream, c.config.filter_subject) for c in loaded.consumers] == [
        ("ACME_DISPATCH", "acme.fx.dispatch.v1.>"), ("ACME_EVENTS", "acme.fx.ledger.v1.>"),
        ("ACME_EVENTS", "acme.fx.reconcile.v1.>")]
    # the same as the code's own definitions for those settings
    assert loaded.to_json() == topo.topology(mine).to_json()


def test_a_file_naming_an_unknown_stream_is_refused_with_the_consumer(
        tmp_path: Path, defaults: Settings) -> None:
    doc = json.loads(STREAMS_JSON.read_text())
    doc["consumers"][0]["stream"] = "EFFECTS_NOPE"
    bad = tmp_path / "streams.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="'dispatcher' names unknown stream 'EFFECTS_NOPE'"):
        topo.load(bad, defaults)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not a stream topology file"):
        topo.load(bad, defaults)


def test_only_subjects_retention_and_message_size_make_a_stream_unusable(
        defaults: Settings) -> None:
    wanted = topo.topology(defaults).streams[1]
    operators = replace(wanted, num_replicas=3, max_age=60.0, duplicate_window=10.0)
    assert stream_problems(operators, wanted) == []
    wider = replace(wanted, subjects=[*(wanted.subjects or []), "other.>"], max_msg_size=-1)
    assert stream_problems(wider, wanted) == []
    broken = replace(wanted, subjects=["effects.ledger.v1.>"], retention=RetentionPolicy.LIMITS,
                     max_msg_size=1024)
    assert stream_problems(broken, wanted) == [
        "does not capture subjects ['effects.reconcile.v1.>']",
        "has retention limits, needs workqueue",
        f"has max_msg_size 1024, needs at least {topo.MAX_MSG_SIZE}"]
