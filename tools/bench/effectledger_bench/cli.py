"""`effectledger bench`: throughput, latency and cost against the limit and against peers.

`--quick` proves the harness in under three minutes (small counts, one repetition); the full
run repeats every scenario (`--reps`, at least 3) and writes `results.json`, `report.md` and one
PNG per scale curve into `--out`. `--check` exits non-zero on any lost or duplicated effect
(never on speed). See docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(x.replace("k", "000")) for x in text.split(",") if x.strip()]


def _shares(text: str) -> list[float]:
    """Shares of the max rate, e.g. `0.2,0.35,0.5`: each above 0 and at most 1.5."""
    try:
        shares = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers, e.g. 0.2,0.35,0.5"
                                         ) from exc
    bad = [x for x in shares if not 0 < x <= 1.5]
    if bad or not shares:
        raise argparse.ArgumentTypeError(
            f"{text!r}: each share must be above 0 and at most 1.5 (of the max rate)")
    return sorted(set(shares))


# `effectledger <name> --help` line (entry-point group effectledger.commands)
HELP = "the benchmark: throughput, latency and cost vs the limit and peers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="small counts, one repetition, no profile (< 3 minutes)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 on any lost or duplicated effect (not on speed)")
    p.add_argument("--out", default=None,
                   help="output folder (default: bench-results/<timestamp>)")
    p.add_argument("--database-url", help="use this PostgreSQL (SQLAlchemy URL) instead of a "
                                          "private one (pgbench and DBOS then skipped)")
    p.add_argument("--nats-url", help="use this NATS instead of a private nats-server")
    p.add_argument("--reps", type=int, help="repetitions of each scenario (full: 3)")
    p.add_argument("--duration", type=float, help="seconds of load per phase (full: 20)")
    p.add_argument("--window", type=int, help="closed-loop operations in flight (full: 256)")
    p.add_argument("--dispatchers", type=int, help="dispatcher processes for the headline "
                                                   "scenarios (default 1)")
    p.add_argument("--dispatcher-concurrency", type=int, help="attempts per dispatcher (64)")
    p.add_argument("--backlogs", type=_ints, help="backlog sizes, e.g. 0,10k,100k")
    p.add_argument("--backlog-reps", type=int, help="repetitions of the backlog curve")
    p.add_argument("--replicas", type=_ints, help="dispatcher counts, e.g. 1,2,3")
    p.add_argument("--latencies", type=_ints, help="provider latencies in ms, e.g. 0,10,100")
    p.add_argument("--peer-n", type=int, help="workflows per DBOS repetition (full: 3000)")
    p.add_argument("--pgbench-seconds", type=float)
    p.add_argument("--pgbench-clients", type=_ints, help="e.g. 8,16,32")
    p.add_argument("--no-faults", action="store_true", help="skip the failure-mix scenario")
    p.add_argument("--no-peers", action="store_true",
                   help="skip pgbench, DBOS, Temporal and the ceiling (A/B runs of the pipeline)")
    p.add_argument("--half-rate", type=float,
                   help="ops/s of the `half` scenario instead of half the max rate (A/B runs)")
    p.add_argument("--rates", type=_shares, metavar="SHARES",
                   help="the rate sweep: open loops at these shares of each repetition's max "
                        "rate, e.g. 0.2,0.35,0.5,0.65, each with pgbench paced at the same rate "
                        "(its floor) unless --no-peers")
    p.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an EFFECTLEDGER_* setting for the ledger and dispatchers (repeatable)")
    p.add_argument("--direct-processes", type=_ints,
                   help="process counts tried for the no-durability ceiling (1,2,4)")
    p.add_argument("--peer-concurrency", type=_ints,
                   help="concurrencies tried for DBOS and Temporal (8,16,64)")
    p.add_argument("--observability", action="store_true",
                   help="run the cost-of-observability scenario even with --quick")
    p.add_argument("--no-observability", action="store_true",
                   help="skip the cost-of-observability scenario")
    p.add_argument("--observability-only", action="store_true",
                   help="after the warm-up, run only the cost-of-observability scenario")
    p.add_argument("--observability-rounds", type=int,
                   help="rounds of the cost-of-observability scenario (2)")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    p.add_argument("--profile", action="store_true",
                   help="run the py-spy profile even with --quick")
    p.add_argument("--profile-half", action="store_true",
                   help="profile under open-loop load at the half rate (where an operation "
                        "costs most) instead of closed-loop saturation; implies --profile")
    p.add_argument("--reconciler", action="store_true",
                   help="also run the reconciler service (resolves ambiguous outcomes)")
    p.add_argument("--time-budget", type=float,
                   help="minutes; backlogs above --large-backlog run only if they fit (60)")
    p.add_argument("--large-backlog", type=int,
                   help="backlogs above this run once, last, within the budget (10000)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--render", metavar="DIR",
                   help="only render report.md again from DIR/results.json")


def build_config(args: argparse.Namespace) -> object:
    from .runner import Config

    out = Path(args.out or f"bench-results/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    cfg = Config.quick_defaults(out) if args.quick else Config(out_dir=out)
    overrides = {
        "reps": args.reps, "duration_s": args.duration, "window": args.window,
        "dispatchers": args.dispatchers, "dispatcher_concurrency": args.dispatcher_concurrency,
        "backlogs": args.backlogs, "backlog_reps": args.backlog_reps,
        "replicas": args.replicas, "latencies_ms": args.latencies, "peer_n": args.peer_n,
        "pgbench_s": args.pgbench_seconds, "pgbench_clients": args.pgbench_clients,
        "database_url": args.database_url, "nats_url": args.nats_url,
        "time_budget_s": args.time_budget * 60 if args.time_budget else None,
        "large_backlog": args.large_backlog, "direct_processes": args.direct_processes,
        "peer_concurrencies": args.peer_concurrency, "half_rate": args.half_rate,
        "rate_shares": args.rates,
        "observability_rounds": args.observability_rounds,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(cfg, name, value)
    if args.no_faults:
        cfg.faults = False
    if args.no_peers:
        cfg.peers = False
    for item in args.service_env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("EFFECTLEDGER_"):
            raise SystemExit(f"--service-env {item!r}: expected EFFECTLEDGER_<NAME>=<value>")
        cfg.service_env[name] = value
    if args.observability or args.observability_only:
        cfg.observability = True
    if args.no_observability:
        cfg.observability = False
    if args.observability_only:
        cfg.observability_only = True
    if args.no_profile:
        cfg.profile = False
    elif args.profile or args.profile_half:
        cfg.profile = True
    cfg.profile_half = bool(args.profile_half)
    if args.reconciler:
        cfg.reconciler = True
    if args.no_progress:
        cfg.progress = False
    return cfg


def run(args: argparse.Namespace) -> int:
    from .report import rerender, write
    from .runner import Runner, log

    if args.render:
        print(rerender(Path(args.render)).read_text())
        return 0
    cfg = build_config(args)
    runner = Runner(cfg)  # type: ignore[arg-type]
    try:
        try:
            import uvloop

            results = uvloop.run(runner.run())
        except ImportError:
            results = asyncio.run(runner.run())
    except KeyboardInterrupt:
        log("interrupted; writing what was measured")
        results = runner.results
    finally:
        runner.close()
    report = write(results, runner.cfg.out_dir)
    log(f"report: {report}")
    print(report.read_text())
    effects = results.get("effects") or {}
    if args.check and not effects.get("ok"):
        print("effectledger bench --check: effects check failed (or did not run): "
              f"lost={effects.get('lost')} duplicated={effects.get('duplicated')}",
              file=sys.stderr)
        return 1
    return 0
