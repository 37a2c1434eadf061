"""The proving ground on a cluster, CI-sized: one seed, three nats-servers and two ledgers,
every cluster fault kind.

Three nats-server processes from the wheel, clustered over loopback routes that each run
through the chaos proxy, streams at R3, the product's users and permissions; two ledger
replicas sharing one private PostgreSQL; callers spread across them. The faults: one node
SIGKILLed and restarted (it must rejoin and catch up), one node cut off from its peers and
healed, the leader of a stream SIGKILLed, a ledger replica SIGKILLed while it holds outbox
leases. Every invariant must stay zero and the intake must never stall while the database is
up. Short on purpose (100 operations, a 45 s fault phase): CI runs it on 2 cores.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from effectledger_chaos import ChaosConfig, run_chaos
from effectledger_chaos.config import FAULT_GROUPS
from effectledger_chaos.procs import database_choice
from effectledger_chaos.report import table

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("heavy"), pytest.mark.timeout(600)]
SEED = 1
OPS = 100
DURATION_S = 45.0
SILENT_S = 3.0  # raft heartbeats every second: three missed is no accident


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if database_choice() != "postgres":
        pytest.skip("two ledger replicas need a private PostgreSQL (initdb/pg_ctl not found)")
    workdir = tmp_path_factory.mktemp("chaos-cluster")
    cfg = ChaosConfig(ops=OPS, seed=SEED, ci=True, duration_s=DURATION_S, nats_cluster=3,
                      ledgers=2, faults=list(FAULT_GROUPS["cluster"]), quiet_max_s=120.0,
                      workdir=str(workdir / "run"), progress=True, progress_interval_s=15.0)
    out: dict[str, Any] = run_chaos(cfg, report_path=workdir / "report.json")
    print("\n" + table([out]))
    return out


def _explain(report: dict[str, Any]) -> str:
    bad = {k: v for k, v in report["invariants"].items() if v["count"]}
    return (f"logs: {report['workdir']}:\n"
            + json.dumps(bad, indent=1, default=str)[:6000])


def test_every_invariant_is_zero(report: dict[str, Any]) -> None:
    assert report["invariants_ok"], _explain(report)
    assert not report["process_exits"]["unexpected"], report["process_exits"]["unexpected"]


def test_every_cluster_fault_kind_was_injected(report: dict[str, Any]) -> None:
    """Really done, not only planned: the partition cut links that carried routes, the
    leader was found and killed, the replica died holding a lease."""
    injected = report["faults_injected"]
    missing = [k for k in FAULT_GROUPS["cluster"]
               if injected.get(k, {}).get("injected", 0) < 1]
    assert not missing, json.dumps(report["fault_log"], indent=1, default=str)[:4000]


def test_killed_nodes_rejoin_and_catch_up(report: dict[str, Any]) -> None:
    """After each node fault every stream has a leader and every replica is current."""
    node_faults = [r for r in report["fault_log"]
                   if r["kind"] in ("nats_node_kill", "nats_partition", "stream_leader_kill")]
    assert node_faults
    for r in node_faults:
        assert "error" not in r, r
        assert r["result"]["caught_up_s"] is not None, r


def _saw_it(node: str, before: Any, during: Any) -> bool:
    """One stream's evidence that the cut reached JetStream: the cut node's replica reported
    not current or silent for several heartbeats, or its leadership taken over by another
    node (when the cut node led the stream, its own answer names no replica of itself, and
    the stream's new leader is the sign that the others stopped hearing it)."""
    if not isinstance(during, dict):
        return False
    if during.get("current") is False or (during.get("active_s") or 0) >= SILENT_S:
        return True
    led_before = isinstance(before, dict) and str(before.get("leader") or "").endswith(node)
    return led_before and not str(during.get("leader") or "").endswith(node)


def test_the_majority_saw_the_partitioned_node_fall_behind(report: dict[str, Any]) -> None:
    """Near the end of the cut the other nodes show, for some stream, the cut node's replica
    not current, not heard from for several raft heartbeats (an idle stream has no lag to
    show), or its leadership taken over: the partition cut JetStream's traffic, not only some
    sockets."""
    partitions = [r for r in report["fault_log"] if r["kind"] == "nats_partition"]
    assert partitions
    for r in partitions:
        node = r["target"]
        before = r["result"].get("majority_view_before") or {}
        view = r["result"]["majority_view"]
        assert any(_saw_it(node, before.get(stream), v) for stream, v in view.items()), r


def test_the_intake_never_stalled_while_the_database_was_up(report: dict[str, Any]) -> None:
    a = report["metrics"]["availability"]
    assert a["ran"] and a["unavailable_db_up_s"] == 0, json.dumps(a, indent=1)[:3000]
    assert a["refused_db_up"] == 0, a


def test_the_report_gives_time_to_rest_per_cluster_fault(report: dict[str, Any]) -> None:
    by_fault = report["metrics"]["time_to_rest_by_fault_s"]
    for kind in FAULT_GROUPS["cluster"]:
        assert by_fault[kind]["n"] > 0 and by_fault[kind]["p99"] is not None, by_fault
    assert report["config"]["stream_replicas"] == 3
    assert report["config"]["faults_skipped"] == []
