"""`effectledger chaos`: the proving ground from the command line.

    effectledger chaos --ops 200 --seed 1 --seeds 3 --ci --report chaos.json
    effectledger chaos --nats-cluster 3 --ledgers 2 --ops 600 --seeds 2   # on a cluster

Several seeds run one after another (`--seeds N` runs seeds S, S+1, ...); the exit status is 0
only if every invariant of every seed is zero (and the bad-input batch passed, and no service
exited on its own). `--replay REPORT` reruns the configuration and the exact fault schedule of a
report (one seed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .config import (
    ALL_FAULTS,
    DEFAULT_TOOL_MIX_TEXT,
    FAULT_GROUPS,
    ChaosConfig,
    parse_faults,
    parse_tool_mix,
)

# `effectledger <name> --help` line (entry-point group effectledger.commands)
HELP = "the proving ground: a seeded fault-injection run against real processes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Seeded fault injection against the real services as processes (own "
                     "nats-server and PostgreSQL), then the ten invariants of the proving "
                     "ground. Exit 0 only if all are zero.")
    p.add_argument("--ops", type=int, default=200, help="operations per seed (default 200)")
    p.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    p.add_argument("--seeds", type=int, default=1, help="how many seeds, from --seed")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent callers (default 8)")
    p.add_argument("--duration", type=float, default=None,
                   help="fault phase in seconds (default max(30, ops/6))")
    p.add_argument("--faults", default="all",
                   help="comma list of kinds or groups; '-kind' removes one. Groups: all, "
                        f"none, {', '.join(FAULT_GROUPS)}. Kinds: {', '.join(ALL_FAULTS)}")
    p.add_argument("--tool-mix", default=DEFAULT_TOOL_MIX_TEXT,
                   help="weights of the tool types: a idempotent+readback, b non-idempotent+"
                        "readback, c non-idempotent+webhooks, d non-idempotent, no oracle, "
                        "e non-idempotent addressed by path + search readback, f "
                        "non-idempotent + native (Stripe-signed) webhooks")
    p.add_argument("--database", choices=["postgres", "sqlite"], default="postgres",
                   help="ledger database: a private PostgreSQL cluster (default) or SQLite")
    p.add_argument("--database-url", help="use this PostgreSQL instead of a private one "
                                          "(no database faults then)")
    p.add_argument("--dispatchers", type=int, default=3, help="dispatcher replicas (1-3)")
    p.add_argument("--reconcilers", type=int, default=2, help="reconciler replicas (1-2)")
    p.add_argument("--nats-cluster", type=int, default=1,
                   help="nats-server nodes clustered on loopback, streams at R=min(N,3) "
                        "(default 1; 3 for the cluster faults)")
    p.add_argument("--ledgers", type=int, default=1,
                   help="ledger replicas sharing the database (default 1; 2 for "
                        "ledger_replica_kill; several need PostgreSQL)")
    p.add_argument("--ci", action="store_true",
                   help="CI sizing: the long broker outage is 15 s instead of 130 s")
    p.add_argument("--long-outage", type=float, default=None,
                   help="seconds the broker stays down in the long outage")
    p.add_argument("--quiet-max", type=float, default=150.0,
                   help="longest quiet period after the faults (default 150 s)")
    p.add_argument("--report", help="write the JSON report here (several seeds: a list)")
    p.add_argument("--workdir", help="keep logs, history and data here")
    p.add_argument("--keep", action="store_true", help="keep the work folder of passing runs")
    p.add_argument("--replay", help="rerun the configuration and schedule of a report")
    p.add_argument("--unsafe-skip-claim", action="store_true",
                   help="TEST ONLY: dispatchers call the provider even when already claimed")
    p.add_argument("--unsafe-skip-webhook-verification", action="store_true",
                   help="TEST ONLY: reconcilers accept unsigned and forged webhooks")
    p.add_argument("--unsafe-no-send-deadline", action="store_true",
                   help="TEST ONLY: dispatchers send however long ago their claim was asked")
    p.add_argument("--unsafe-nats-without-permissions", action="store_true",
                   help="TEST ONLY: the broker runs without users or permissions, so the "
                        "attacker's forgeries reach the services")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress lines")


def config_from_args(args: argparse.Namespace, seed: int) -> ChaosConfig:
    return ChaosConfig(
        ops=args.ops, seed=seed, concurrency=args.concurrency, duration_s=args.duration,
        faults=parse_faults(args.faults), tool_mix=parse_tool_mix(args.tool_mix),
        database=args.database, database_url=args.database_url,
        dispatchers=args.dispatchers, reconcilers=args.reconcilers,
        nats_cluster=args.nats_cluster, ledgers=args.ledgers, ci=args.ci,
        long_outage_s=args.long_outage, quiet_max_s=args.quiet_max,
        unsafe_skip_claim=args.unsafe_skip_claim,
        unsafe_skip_webhook_verification=args.unsafe_skip_webhook_verification,
        unsafe_no_send_deadline=args.unsafe_no_send_deadline,
        unsafe_nats_without_permissions=args.unsafe_nats_without_permissions,
        progress=args.progress, keep_workdir=args.keep,
        workdir=(str(Path(args.workdir) / f"seed-{seed}") if args.workdir else None))


def run(args: argparse.Namespace) -> int:
    from .report import table
    from .runner import run_chaos
    from .schedule import Schedule

    reports: list[dict[str, Any]] = []
    if args.replay:
        old = json.loads(Path(args.replay).read_text())
        old = old[0] if isinstance(old, list) else old
        cfg = ChaosConfig.from_json(old["config"])
        cfg.progress = args.progress
        cfg.workdir = args.workdir
        reports.append(run_chaos(cfg, schedule=Schedule.from_json(old["schedule"])))
    else:
        try:
            configs = [config_from_args(args, args.seed + i) for i in range(args.seeds)]
        except ValueError as exc:
            print(f"effectledger chaos: {exc}", file=sys.stderr)
            return 2
        for cfg in configs:
            reports.append(run_chaos(cfg))
    if args.report:
        Path(args.report).write_text(json.dumps(reports[0] if len(reports) == 1 else reports,
                                                indent=2, default=str))
    print(table(reports))
    for r in reports:
        if not r["ok"]:
            print(f"\nseed {r['seed']}: FAILED; logs and history in {r['workdir']}",
                  file=sys.stderr)
            for name, v in r["invariants"].items():
                if v["count"]:
                    print(f"  {name}: {v['count']}: {json.dumps(v['examples'][:3])[:800]}",
                          file=sys.stderr)
            if r["bad_input"].get("ran") and not r["bad_input"]["ok"]:
                print(f"  bad input: {json.dumps(r['bad_input']['checks'])}", file=sys.stderr)
            if r.get("faults_never_injected"):
                print(f"  planned but never injected: {', '.join(r['faults_never_injected'])}",
                      file=sys.stderr)
            for e in r["process_exits"]["unexpected"][:3]:
                print(f"  unexpected exit: {e['service']} ({e['exit_code']})", file=sys.stderr)
    return 0 if all(r["ok"] for r in reports) else 1
