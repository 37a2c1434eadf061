"""The clustered proving ground's plan, pure: which cluster faults a run's shape carries, their
targets and timing, replay, and what the report makes of several ledger replicas."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from effectledger_chaos.availability import availability
from effectledger_chaos.config import ALL_FAULTS, FAULT_GROUPS, ChaosConfig, parse_faults
from effectledger_chaos.schedule import Schedule, build, ledger_names, nats_names
from effectledger_cli import up_nats

CLUSTER = FAULT_GROUPS["cluster"]
T0 = 1_000_000.0


def cluster_cfg(**kw: Any) -> ChaosConfig:
    base: dict[str, Any] = dict(ops=100, seed=7, ci=True, duration_s=40.0, nats_cluster=3,
                                ledgers=2)
    return ChaosConfig(**{**base, **kw})


def timed_kinds(s: Schedule) -> list[str]:
    return [t.kind for t in s.timed]


def test_the_cluster_group_names_the_four_kinds_and_all_includes_them() -> None:
    assert parse_faults("cluster") == ["nats_node_kill", "nats_partition",
                                       "stream_leader_kill", "ledger_replica_kill"]
    assert set(CLUSTER) <= set(parse_faults("all"))
    assert "nats_partition" not in parse_faults("all,-nats_partition")


def test_a_single_node_run_skips_the_cluster_kinds_and_keeps_its_old_plan() -> None:
    cfg = ChaosConfig(ops=100, seed=3, ci=True, duration_s=40.0)
    assert cfg.skipped_faults == list(CLUSTER)
    assert not set(CLUSTER) & set(cfg.active_faults)
    with_group = build(cfg)
    without = build(ChaosConfig(ops=100, seed=3, ci=True, duration_s=40.0,
                                faults=[k for k in ALL_FAULTS if k not in CLUSTER]))
    assert not set(CLUSTER) & set(timed_kinds(with_group))
    # The cluster kinds draw from their own random stream: a seed's single-node plan is
    # the same whether they were asked for or not.
    assert with_group.to_json() == without.to_json()
    assert cfg.to_json()["faults_skipped"] == list(CLUSTER)


def test_each_cluster_kind_needs_its_own_shape() -> None:
    # Two nodes lose their quorum with one down: the node faults need three.
    two = cluster_cfg(nats_cluster=2, ledgers=1)
    assert two.skipped_faults == list(CLUSTER)
    three = cluster_cfg(ledgers=1)
    assert three.skipped_faults == ["ledger_replica_kill"]
    assert "ledger_replica_kill" not in timed_kinds(build(three))
    ledgers_only = cluster_cfg(nats_cluster=1)
    assert set(timed_kinds(build(ledgers_only))) & set(CLUSTER) == {"ledger_replica_kill"}


def test_a_cluster_plan_has_every_kind_with_valid_targets() -> None:
    cfg = cluster_cfg()
    s = build(cfg)
    counts = s.planned_counts()
    assert all(counts.get(k, 0) >= 1 for k in CLUSTER), counts
    nodes, ledgers = set(nats_names(3)), set(ledger_names(2))
    assert nodes == {"nats", "nats-2", "nats-3"} and ledgers == {"ledger", "ledger-2"}
    for t in s.timed:
        if t.kind in ("nats_node_kill", "nats_partition"):
            assert t.target in nodes
        elif t.kind == "stream_leader_kill":
            assert t.target in ("dispatch", "events")
        elif t.kind == "ledger_replica_kill":
            assert t.target in ledgers and t.params["wait_for_lease_s"] > 0
        if t.kind in CLUSTER:
            assert 0 <= t.at <= cfg.fault_phase_s
    # The existing process faults reach the second replica too; a ledger crash point picks
    # one replica.
    assert any(t.kind == "kill" and t.target == "ledger-2" for t in s.timed)
    points = [t for t in s.timed if t.kind == "crash_point"
              and t.params["point"].startswith("ledger")]
    assert points and all(t.target in ledgers and t.params["nth"] == 1 for t in points)
    assert [t.id for t in s.timed] == list(range(len(s.timed)))
    assert [t.at for t in s.timed] == sorted(t.at for t in s.timed)


def test_node_faults_are_spread_one_at_a_time() -> None:
    cfg = cluster_cfg(duration_s=300.0)  # a full run: two of each
    s = build(cfg)
    node = [t for t in s.timed if t.kind in ("nats_node_kill", "nats_partition",
                                            "stream_leader_kill")]
    assert len(node) == 6
    starts = [t.at for t in node]
    # Each in its own slot of the phase, further apart than any one lasts.
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) > 10.0, starts


def test_same_seed_same_cluster_plan_and_it_replays() -> None:
    a, b = build(cluster_cfg()), build(cluster_cfg())
    assert a.to_json() == b.to_json()
    assert build(cluster_cfg(seed=8)).to_json() != a.to_json()
    assert Schedule.from_json(a.to_json()).to_json() == a.to_json()
    again = ChaosConfig.from_json(cluster_cfg().to_json())
    assert (again.nats_cluster, again.ledgers, again.stream_replicas) == (3, 2, 3)


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="PostgreSQL"):
        cluster_cfg(database="sqlite")
    with pytest.raises(ValueError, match="nats-cluster"):
        cluster_cfg(nats_cluster=6)
    with pytest.raises(ValueError, match="ledgers"):
        cluster_cfg(ledgers=0)
    assert cluster_cfg(nats_cluster=5).stream_replicas == 3


def test_node_config_dials_the_given_route_ports() -> None:
    plan = up_nats.NatsPlan([4001, 4002, 4003], [6001, 6002, 6003])
    default = up_nats.node_config(plan, 0, up_nats.Path("/s"), "")
    assert "name: effectledger-up" in default and "nats://127.0.0.1:6002" in default
    proxied = up_nats.node_config(plan, 1, up_nats.Path("/s"), "", name="chaos-nats",
                                  cluster_name="c", routes=[7001, 7002],
                                  cluster_extra="advertise: 127.0.0.1:9\nno_advertise: true")
    assert "server_name: chaos-nats-2" in proxied and "listen: 127.0.0.1:6002" in proxied
    assert "nats://127.0.0.1:7001" in proxied and "nats://127.0.0.1:6001" not in proxied
    assert "  advertise: 127.0.0.1:9\n  no_advertise: true\n" in proxied


# -- availability with replicas ---------------------------------------------------------------

def submit(op: int, invoke: float, answer: float, kind: str = "ok", ledger: str = "ledger",
           process: str = "c0") -> list[dict[str, Any]]:
    return [{"f": "submit", "type": "invoke", "op": op, "process": process, "ledger": ledger,
             "wall": T0 + invoke},
            {"f": "submit", "type": kind, "op": op, "process": process, "wall": T0 + answer}]


def steady(until: float, ledger: str = "ledger-2", first: int = 0, since: float = 0.0
           ) -> list[dict[str, Any]]:
    out, t, op = [], since, first
    while t < until:
        out += submit(op, t, t + 0.01, ledger=ledger, process="c1")
        t, op = t + 0.2, op + 1
    return out


def test_a_replica_down_excuses_nothing_while_another_serves() -> None:
    kill = [{"kind": "ledger_replica_kill", "target": "ledger", "started_at": 5.0,
             "ended_at": 9.0, "restarted_at": 7.0, "listening_at": 9.0},
            {"kind": "kill", "target": "ledger-2", "started_at": 20.0, "ended_at": 20.5}]
    # The other replica keeps acknowledging: nothing stalls, and the one attempt the dead
    # replica refused is not held against the service (the caller moved on).
    history = steady(30.0) + submit(999, 6.0, 6.001, kind="fail")
    a = availability(history, kill, T0)
    assert a["unavailable_db_up_s"] == 0 and a["refused_db_up"] == 0
    assert [r["fault"] for r in a["ledger_restarts"]] == ["ledger_replica_kill"]
    # A caller stuck 6 s on a replica while nobody acknowledged: counted, the fault on one
    # replica does not excuse it.
    stuck = steady(5.0) + submit(500, 5.0, 11.0, ledger="ledger") \
        + steady(30.0, first=1000, since=11.0)
    b = availability(stuck, kill, T0)
    assert b["unavailable_db_up_s"] > 4.0


def test_a_frozen_replica_is_excused_as_its_callers_wait_for_their_timeout() -> None:
    pause = [{"kind": "pause", "target": "ledger-2", "started_at": 5.0, "ended_at": 9.0}]
    # Every caller stuck on the frozen replica from 5 s until it resumes at 9 s (answering at
    # 9.5 s), nobody acknowledged meanwhile: excused, the pause and the grace after it.
    history = steady(5.0, ledger="ledger") + submit(700, 5.0, 9.5, ledger="ledger-2") \
        + steady(30.0, ledger="ledger", first=1000, since=9.5)
    a = availability(history, pause, T0)
    assert a["stalled_s"] > 3.0 and a["unavailable_db_up_s"] == 0
    # The same stall with a kill instead is counted: a dead replica refuses at once.
    kill = [{**pause[0], "kind": "kill"}]
    assert availability(history, kill, T0)["unavailable_db_up_s"] > 3.0
