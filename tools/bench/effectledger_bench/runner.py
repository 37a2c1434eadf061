"""The benchmark run: scenarios, repetitions interleaved round-robin, and the effect check.

Every repetition runs each scenario once, in the same order, so that effectledger and its peers
see the same machine conditions within a repetition (the machine may be shared); the report
gives min / median / max over repetitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from . import pauses, peer_direct, peers, wakeprobe
from . import profile as prof
from .load import LoadGenerator, LoadResult, Progress
from .measure import (
    all_ops,
    check_effects,
    count_moving,
    fetch_ops,
    latency_stats,
    stage_latencies,
)
from .pg import PgCounters, log_since, log_size, read_counters, slow_statements, wal_commit_records
from .procs import CpuSample, machine_shares, machine_ticks, sample, schedstat_kept, self_cpu
from .sqlcapture import extract, pgbench_script
from .stack import TOOL, Stack

# The counts a phase reports per operation and process (CpuSample's fields), with the digits
# each is rounded to: wake-ups and writes are several per operation, preemptions often fewer.
COUNTS = {"wakeups": 1, "writes": 1, "preemptions": 2}

PEER_PREFIXES = ("direct-", "dbos-", "temporal-")


@dataclass
class Config:
    out_dir: Path
    quick: bool = False
    reps: int = 3
    duration_s: float = 20.0
    window: int = 0  # 0: probe for the smallest window that reaches the best throughput
    dispatchers: int = 1
    dispatcher_concurrency: int = 64
    backlogs: list[int] = field(default_factory=lambda: [0, 10_000, 100_000])
    backlog_reps: int | None = None  # default: reps
    replicas: list[int] = field(default_factory=lambda: [1, 2, 3])
    latencies_ms: list[int] = field(default_factory=lambda: [0, 10, 100])
    peer_n: int = 2000
    # Settings each peer is tried at in the first repetition; later repetitions use the best
    # (a ratio must not come from a handicapped peer). The ceiling runs 1, 2, … processes, each
    # with a dispatcher's concurrency and pools; DBOS and Temporal try these concurrencies.
    direct_processes: list[int] = field(default_factory=lambda: [1, 2, 4])
    peer_concurrencies: list[int] = field(default_factory=lambda: [8, 16, 64])
    temporal: bool = True
    peers: bool = True
    half_rate: float | None = None  # a fixed rate for `half` (A/B runs); default max / 2
    # The rate sweep (`rate`): open loops at these shares of each repetition's max rate, each
    # with its floor (pgbench paced at the same rate) right after it; none by default.
    rate_shares: list[float] = field(default_factory=list)
    # EFFECTLEDGER_* settings for the ledger and the dispatchers (A/B runs of a setting).
    service_env: dict[str, str] = field(default_factory=dict)
    pgbench_s: float = 10.0
    pgbench_clients: list[int] = field(default_factory=lambda: [8, 16, 32])
    faults: bool = True
    # The cost of metrics and tracing: the saturated phase per setting (obscost.SETTINGS),
    # alternated `observability_rounds` times; `observability_only` skips everything else.
    observability: bool = True
    observability_rounds: int = 2
    observability_only: bool = False
    profile: bool = True
    profile_s: float = 15.0
    profile_half: bool = False  # profile at the half rate (open loop), not at saturation
    reconciler: bool = False
    database_url: str | None = None
    nats_url: str | None = None
    provider_timeout_s: float = 2.0
    progress: bool = True
    seed: int = 7
    # Backlogs larger than `large_backlog` run once, in the last repetition, and only if the
    # estimated time (from the measured max rate) fits in what is left of `time_budget_s`.
    large_backlog: int = 10_000
    time_budget_s: float = 3600.0

    @classmethod
    def quick_defaults(cls, out_dir: Path) -> Config:
        return cls(out_dir=out_dir, quick=True, reps=1, duration_s=5.0, window=32,
                   backlogs=[0, 300], replicas=[1, 2], latencies_ms=[0, 10], peer_n=300,
                   direct_processes=[1, 2], peer_concurrencies=[16], pgbench_s=4.0,
                   pgbench_clients=[16], profile=False, observability=False)


def log(msg: str) -> None:
    import sys

    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Runner:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        work = cfg.out_dir / "work"
        if work.exists():  # a previous run's servers are stopped; its data is not reused
            import shutil

            shutil.rmtree(work)
        self.stack = Stack(cfg.out_dir / "work", database_url=cfg.database_url,
                           nats_url=cfg.nats_url, provider_timeout_s=cfg.provider_timeout_s,
                           ledger_env=dict(cfg.service_env),
                           dispatcher_env={"EFFECTLEDGER_DISPATCHER_CONCURRENCY":
                                           str(cfg.dispatcher_concurrency),
                                           **cfg.service_env})
        self.results: dict[str, Any] = {"phases": [], "peers": [], "errors": []}
        self.submitted_ids: list[str] = []
        self.peak: dict[str, CpuSample] = {}
        self.tag_seq = 0
        self.peer_best: dict[str, dict[int, float]] = {}  # peer -> setting -> best ops/s

    # -- infrastructure helpers ----------------------------------------------------------

    @property
    def dsn(self) -> str:
        assert self.stack.database_url is not None
        return self.stack.database_url.replace("postgresql+asyncpg://", "postgresql://")

    def counters(self) -> PgCounters | None:
        pg = self.stack.pg
        if pg is None:
            return None
        return read_counters(pg.dsn("postgres"), self.stack.db_name, pg.bin("psql"))

    def tag(self, name: str) -> str:
        self.tag_seq += 1
        return f"{name}-{self.tag_seq}"

    async def set_latency(self, ms: int, *, failure_mix: bool = False) -> None:
        faults: list[dict[str, Any]] = []
        if failure_mix:
            # 1 % transient (503 before apply, Retry-After: 0): the ledger's retry policy
            # schedules a new epoch; 1 % timeouts: a delay beyond the tool's timeout, so the
            # dispatcher gives up and the outcome is ambiguous (the sandbox still applies).
            faults.append({"action": {"kind": "status_before_apply", "status": 503,
                                      "retry_after": "0"}, "probability": 0.01})
            faults.append({"action": {"kind": "delay",
                                      "seconds": self.cfg.provider_timeout_s + 1.0},
                           "probability": 0.0101})
        if ms:
            faults.append({"action": {"kind": "delay", "seconds": ms / 1000}})
        async with httpx.AsyncClient(base_url=self.stack.sandbox_url, timeout=10) as c:
            resp = await c.post("/_faults", json={"faults": faults, "seed": self.cfg.seed})
            resp.raise_for_status()

    async def wait_rest(self, tags: list[str], limit_s: float) -> int:
        conn = await asyncpg.connect(self.dsn)
        prog = Progress("settle", self.cfg.progress)
        try:
            deadline = time.monotonic() + limit_s
            while True:
                moving = await count_moving(conn, tags)
                if moving == 0:
                    return 0
                prog.show(f"{moving} operations still moving")
                if time.monotonic() > deadline:
                    log(f"{moving} operations still moving after {limit_s:.0f} s")
                    return moving
                dead = self.stack.check_alive()
                if dead:
                    raise RuntimeError(f"processes died: {dead}")
                await asyncio.sleep(0.25)  # polling the ledger database for completion
        finally:
            prog.done()
            await conn.close()

    def remember_peaks(self, samples: dict[str, CpuSample]) -> None:
        for name, s in samples.items():
            old = self.peak.get(name)
            if old is None or s.hwm_bytes > old.hwm_bytes:
                self.peak[name] = s

    # -- one measured phase --------------------------------------------------------------

    async def phase(self, scenario: str, params: dict[str, Any], tags: list[str], body: Any,
                    *, rep: int, settle_s: float = 300.0) -> dict[str, Any]:
        log(f"{scenario} {params} (rep {rep + 1})")
        c0, me0, t0 = self.counters(), self_cpu(), time.monotonic()
        own0, m0 = sample(os.getpid()), machine_ticks()  # the load generator's counts
        pg_log = self.stack.pg.log if self.stack.pg is not None else None
        log0 = log_size(pg_log) if pg_log is not None else 0
        s0, r0 = self.stack.samples_by_pid(), len(self.stack.retired)
        stalls0 = await pauses.scrape(self.stack.ledger_url)
        dstalls0 = await pauses.scrape_many(self.stack.dispatcher_metrics())
        loads: list[LoadResult] = await body()
        moving = await self.wait_rest(tags, settle_s)
        t1 = time.monotonic()
        s1, me1, c1 = self.stack.samples_by_pid(), self_cpu(), self.counters()
        own1, m1 = sample(os.getpid()), machine_ticks()
        self.remember_peaks({name: smp for (name, _pid), (_k, smp) in s1.items()})
        for ld in loads:
            self.submitted_ids.extend(ld.op_ids)
        rows = await fetch_ops(self.dsn, tags)
        stats = latency_stats(rows)
        stages = await stage_latencies(self.dsn, tags)
        stalls = pauses.delta(stalls0, await pauses.scrape(self.stack.ledger_url))
        dstalls = pauses.delta_many(dstalls0,
                                    await pauses.scrape_many(self.stack.dispatcher_metrics()))
        n = max(1, stats["operations"])
        cpu: dict[str, float] = {}
        kernel: dict[str, float] = {}
        runq: dict[str, float] = {}  # seconds ready to run, waiting for a CPU
        # Per process kind: how often it was woken, wrote and was preempted (CpuSample's).
        counts: dict[str, dict[str, int]] = {name: {} for name in COUNTS}
        ended = [((name, pid), (kind, smp)) for name, pid, kind, smp in self.stack.retired[r0:]]
        for key, (kind, smp) in [*s1.items(), *ended]:
            b = s0[key][1] if key in s0 else None  # started during the phase: count it all
            cpu[kind] = cpu.get(kind, 0.0) + (smp.cpu_s - (b.cpu_s if b else 0.0))
            kernel[kind] = kernel.get(kind, 0.0) + (smp.sys_s - (b.sys_s if b else 0.0))
            # A thread that ended takes its wait with it: never count a negative difference.
            runq[kind] = runq.get(kind, 0.0) + max(
                0.0, smp.runq_wait_s - (b.runq_wait_s if b else 0.0))
            # A PostgreSQL backend that ended during the phase takes its counts with it.
            for name, by_kind in counts.items():
                by_kind[kind] = by_kind.get(kind, 0) + max(
                    0, getattr(smp, name) - (getattr(b, name) if b else 0))
        cpu["loadgen"] = me1 - me0
        assert own0 is not None and own1 is not None  # this process: never gone
        for name, by_kind in counts.items():
            by_kind["loadgen"] = getattr(own1, name) - getattr(own0, name)
        runq["loadgen"] = max(0.0, own1.runq_wait_s - own0.runq_wait_s)
        system = sum(v for k, v in cpu.items()
                     if k in ("ledger", "dispatcher", "nats", "postgres", "reconciler"))
        pg: dict[str, Any] = {}
        if c0 is not None and c1 is not None and self.stack.pg is not None:
            d = c0.delta(c1)
            wal_commits = wal_commit_records(self.stack.pg.bin("pg_waldump"),
                                             self.stack.pg.data / "pg_wal", c0.lsn, c1.lsn)
            pg = {"xact_commit_per_op": round(d["xact_commit"] / n, 2),
                  "wal_commits_per_op": (round(wal_commits / n, 2)
                                         if wal_commits is not None else None),
                  "wal_bytes_per_op": round(d["wal_bytes"] / n),
                  "checkpoints": d["checkpoints"]}
            if pg_log is not None:
                pg["slow"] = slow_statements(log_since(pg_log, log0))
        result = {
            "scenario": scenario, "params": params, "rep": rep, "tags": tags,
            "wall_s": round(t1 - t0, 2), "still_moving": moving, **stats, "stages_ms": stages,
            "ledger_stalls": stalls, "dispatcher_stalls": dstalls,
            "machine_cpu_share": machine_shares(m0, m1),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "cpu_ms_per_op": {k: round(1000 * v / n, 3) for k, v in sorted(cpu.items())},
            "system_cpu_ms_per_op": round(1000 * system / n, 3),
            "kernel_share": {k: round(kernel[k] / cpu[k], 2) for k in kernel if cpu.get(k)},
            **{f"{name}_per_op": {k: round(v / n, COUNTS[name]) for k, v in sorted(by_kind.items())}
               for name, by_kind in counts.items()},
            **({"runq_wait_ms_per_op": {k: round(1000 * v / n, 3)
                                        for k, v in sorted(runq.items())}}
               if schedstat_kept() else {}),
            "rss_mib": {name: round(smp.rss_bytes / 2**20, 1)
                        for (name, _pid), (_k, smp) in s1.items()},
            "pg": pg, "load": [ld.to_json() for ld in loads],
        }
        writer = (stalls or {}).get("writer")
        load_s = sum(ld.wall_s for ld in loads)
        if writer and load_s > 0:
            # Busy seconds per second of offered load (settling left out): near the number of
            # writers, they were the queue (the express lane, beside them, adds to it).
            writer["busy_share"] = round(writer["busy_s"] / load_s, 3)
        lat = stats.get("latency_ms", {})
        log(f"  -> {stats['succeeded']}/{stats['operations']} succeeded, "
            f"{stats.get('ops_per_s')} ops/s, p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms, "
            f"system CPU {result['system_cpu_ms_per_op']} ms/op")
        self.results["phases"].append(result)
        self.save()
        return result

    # -- scenarios -----------------------------------------------------------------------

    async def closed(self, lg: LoadGenerator, scenario: str, params: dict[str, Any],
                     rep: int) -> dict[str, Any]:
        tag = self.tag(scenario)

        async def body() -> list[LoadResult]:
            return [await lg.closed_loop(tag, self.cfg.window, self.cfg.duration_s)]

        return await self.phase(scenario, params, [tag], body, rep=rep)

    async def open(self, lg: LoadGenerator, scenario: str, params: dict[str, Any], rate: float,
                   rep: int) -> dict[str, Any]:
        tag = self.tag(scenario)

        async def body() -> list[LoadResult]:
            return [await lg.open_loop(tag, rate, self.cfg.duration_s)]

        return await self.phase(scenario, {**params, "rate": round(rate, 1)}, [tag], body,
                                rep=rep)

    async def backlog(self, lg: LoadGenerator, size: int, rate: float, rep: int
                      ) -> dict[str, Any]:
        qtag, ltag = self.tag(f"backlog{size}-queued"), self.tag(f"backlog{size}-load")
        n_disp = self.cfg.dispatchers

        async def body() -> list[LoadResult]:
            loads = []
            if size:
                self.stack.scale_dispatchers(0)  # queue with nobody consuming
                loads.append(await lg.burst(qtag, size))
                # Let the relay publish the whole backlog before consumers start.
                await asyncio.sleep(1.0)  # not synchronisation: the drain is measured anyway
                self.stack.scale_dispatchers(n_disp)
            loads.append(await lg.open_loop(ltag, rate, self.cfg.duration_s))
            return loads

        res = await self.phase("backlog", {"backlog": size, "rate": round(rate, 1)},
                               [qtag, ltag], body, rep=rep, settle_s=max(300.0, size / 20))
        # The latency of the operations offered at the rate (behind the backlog), separately.
        load_rows = await fetch_ops(self.dsn, [ltag])
        res["load_ops"] = latency_stats(load_rows)
        self.save()
        return res

    async def sweep_point(self, lg: LoadGenerator, share: float, max_rate: float, rep: int
                          ) -> dict[str, Any]:
        """One point of the rate sweep: an open loop at `share` of this repetition's max rate,
        then (with peers, on the private cluster) pgbench paced at the same rate on the same
        disk, the latency nothing on our side could go under at that rate (`floor_ms`)."""
        cfg = self.cfg
        rate = max(5.0, max_rate * share)
        res = await self.open(lg, "rate", {"share": share, "dispatchers": cfg.dispatchers},
                              rate, rep)
        if cfg.peers:
            floor = await self.paced_floor(rate, f"pgbench-rate-r{rep}-{share}")
            if floor is not None:
                res["floor_ms"] = floor.get("latency_ms") or {"error": floor.get("error")}
                self.save()
        return res

    async def paced_floor(self, rate: float, log_name: str) -> dict[str, Any] | None:
        """pgbench replaying one operation's SQL at `rate` for a phase's duration on the
        private cluster (`peers.pgbench_paced`), its log under `log_name`; None without one."""
        st, cfg = self.stack, self.cfg
        if st.pg is None or self.pgbench_script is None:
            return None
        return await asyncio.to_thread(
            peers.pgbench_paced, st.pg.bin("pgbench"), st.pg.dsn("pgbench_limit"),
            self.pgbench_script, rate=rate, clients=max(cfg.pgbench_clients),
            seconds=cfg.duration_s, log_dir=st.workdir / log_name)

    async def run_peers(self, rep: int, max_rate: float | None, half_rate: float) -> None:
        st, cfg = self.stack, self.cfg
        endpoint = f"{st.sandbox_url}/v1/idempotent/effects"
        await self.set_latency(0)
        if st.pg is not None and self.pgbench_script is not None:
            # First, so that it sees the machine the `half` phase just saw.
            log(f"peer: pgbench paced at the half rate ({half_rate:.1f}/s), "
                f"{max(cfg.pgbench_clients)} clients, rep {rep + 1}")
            r = await self.paced_floor(half_rate, f"pgbench-paced-r{rep}")
            assert r is not None  # the cluster and the script are there
            self.add_peer("pgbench_paced", rep, r)
        assert st.catalog_path is not None
        for procs in self.peer_settings("no_durability", cfg.direct_processes, rep):
            log(f"peer: no durability ({procs} process(es), the dispatcher's client) "
                f"rep {rep + 1}")
            r = await asyncio.to_thread(
                peer_direct.run_processes, st.catalog_path, TOOL,
                # At least 1500 calls: at the provider's rate a smaller run lasts well under
                # a second, too short for a rate.
                {"EFFECTLEDGER_SANDBOX_API_KEY": st.api_key}, processes=procs,
                n=max(cfg.peer_n, 1500),
                concurrency=cfg.dispatcher_concurrency, prefix=f"direct-r{rep}-{procs}-")
            self.add_peer("no_durability", rep, r, setting=procs)
        if st.pg is not None:
            for mode in ("direct", "queue"):
                for conc in self.peer_settings(f"dbos_{mode}", cfg.peer_concurrencies, rep):
                    log(f"peer: DBOS {mode}, concurrency {conc}, rep {rep + 1}")
                    r = await asyncio.to_thread(
                        peers.dbos, st.pg.dsn("dbos_bench"), endpoint, st.api_key, mode=mode,
                        n=cfg.peer_n, concurrency=conc, prefix=f"dbos-{mode}-r{rep}-{conc}-")
                    self.add_peer(f"dbos_{mode}", rep, r, setting=conc)
        if cfg.temporal:
            for mode in ("activity", "local"):
                for conc in self.peer_settings(f"temporal_{mode}", cfg.peer_concurrencies, rep):
                    what = "local activity" if mode == "local" else "activity"
                    log(f"peer: Temporal ({what}), concurrency {conc}, rep {rep + 1}")
                    r = await asyncio.to_thread(
                        peers.temporal, st.workdir / f"temporal-r{rep}-{mode}-{conc}", endpoint,
                        st.api_key, mode=mode, n=cfg.peer_n, concurrency=conc,
                        prefix=f"temporal-{mode}-r{rep}-{conc}-")
                    self.add_peer(f"temporal_{mode}", rep, r, setting=conc)
        if st.pg is not None and self.pgbench_script is not None:
            clients = self.pgbench_clients_for(rep)
            for c in clients:
                log(f"peer: pgbench limit, {c} clients, rep {rep + 1}")
                r = await asyncio.to_thread(
                    peers.pgbench, st.pg.bin("pgbench"), st.pg.dsn("pgbench_limit"),
                    self.pgbench_script, clients=c, seconds=cfg.pgbench_s)
                self.add_peer("pgbench_limit", rep, r)
                if "ops_per_s" in r:
                    self.pgbench_best[c] = max(self.pgbench_best.get(c, 0.0),
                                               r["ops_per_s"])

    def peer_settings(self, name: str, options: list[int], rep: int) -> list[int]:
        # The first repetition tries every setting; later ones the best seen so far.
        best = self.peer_best.get(name)
        if rep == 0 or not best:
            return options
        return [max(best, key=lambda k: best[k])]

    def pgbench_clients_for(self, rep: int) -> list[int]:
        # The first repetition tries each client count; later ones use the best of them.
        if rep == 0 or not self.pgbench_best:
            return self.cfg.pgbench_clients
        return [max(self.pgbench_best, key=lambda c: self.pgbench_best[c])]

    def add_peer(self, name: str, rep: int, r: dict[str, Any],
                 setting: int | None = None) -> None:
        log(f"  -> {name}: {r.get('ops_per_s')} ops/s {r.get('error', '')[:300]}")
        self.results["peers"].append({"peer": name, "rep": rep, **r})
        if setting is not None and r.get("ops_per_s") is not None:
            best = self.peer_best.setdefault(name, {})
            best[setting] = max(best.get(setting, 0.0), float(r["ops_per_s"]))
        self.save()

    async def probe_window(self, lg: LoadGenerator) -> int:
        """The closed loop's window: the smallest that reaches 95 % of the best throughput.

        A larger window only adds queueing (Little's law: latency = window / throughput).
        """
        probes: dict[int, float] = {}
        seconds = 3.0 if self.cfg.quick else 6.0
        # Every window is tried: throughput can be flat at small windows and still grow at
        # large ones, where the relay and the inbox consumer work in bigger batches.
        for w in (8, 32, 128, 256, 512):
            tag = self.tag(f"probe{w}")
            await lg.closed_loop(tag, w, seconds)
            await self.wait_rest([tag], 120)
            rows = await fetch_ops(self.dsn, [tag])
            probes[w] = latency_stats(rows).get("ops_per_s") or 0.0
        best = max(probes.values())
        window = min(w for w, v in probes.items() if v >= 0.95 * best)
        self.results["window_probe"] = {"outcomes_per_s": {str(k): round(v, 1)
                                                           for k, v in probes.items()},
                                        "chosen": window}
        log(f"closed-loop window: {window} (probes {self.results['window_probe']})")
        return window

    # -- SQL capture for pgbench ---------------------------------------------------------

    async def capture_sql(self, lg: LoadGenerator, n: int = 3) -> None:
        self.pgbench_script: Path | None = None
        self.pgbench_best: dict[int, float] = {}
        pg = self.stack.pg
        if pg is None:
            log("pgbench: skipped (an external database was given)")
            return
        log("capturing the SQL of one operation (log_statement=all, operations one at a time)")
        pg.set_system(log_statement="all", log_line_prefix="%m [%p] %x ")
        start = pg.log.stat().st_size
        tags, ids = [], []
        try:
            await asyncio.sleep(0.3)  # let every backend see the reloaded configuration
            for i in range(n):
                tag = self.tag("capture")
                r = LoadResult(tag, "capture")
                await lg.submit(tag, i, r, track=False)
                tags.append(tag)
                ids.extend(r.op_ids)
                await self.wait_rest([tag], 30)
                await asyncio.sleep(0.2)  # the commit is logged after the state is visible
        finally:
            pg.set_system(log_statement="none")
        self.submitted_ids.extend(ids)
        text = await asyncio.to_thread(_read_from, pg.log, start)
        got = extract(text, ids)
        per_op = got.per_op
        if not per_op or not per_op[0][1]:
            self.results["errors"].append("SQL capture found no transactions")
            return
        _op_id, txns, op_ids = per_op[0]
        replacements = {f"'{tags[0]}-0'": "'cap-:client_id-:n'"}
        script = pgbench_script(txns, op_ids, replacements)
        path = self.cfg.out_dir / "pgbench_one_operation.sql"
        path.write_text(script)
        self.pgbench_script = path
        self.results["sql_capture"] = {
            "operations_captured": len(per_op), "consistent_shape": got.consistent,
            "transactions_per_op": len(txns),
            "statements_per_op": sum(len(t.statements) for t in txns)
            + 2 * sum(1 for t in txns if t.preping),
            "shape": got.shapes[0] if got.shapes else [],
            "script": str(path)}
        # pgbench runs against its own database with the ledger's schema (same migrations).
        pg.psql('CREATE DATABASE "pgbench_limit"')
        proc = await asyncio.create_subprocess_exec(
            *self._migrate_cmd(pg.url("pgbench_limit")),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            self.results["errors"].append(f"pgbench schema: {err.decode()[-500:]}")
            self.pgbench_script = None
        log(f"  -> {len(txns)} transactions per operation; script {path}")

    @staticmethod
    def _migrate_cmd(url: str) -> list[str]:
        import sys

        code = ("import asyncio,sys\n"
                "from effectledger_ledger.db.store import Store\n"
                "from effectledger_ledger.migrate import upgrade\n"
                "async def m():\n"
                "    s = Store(sys.argv[1])\n"
                "    try: await upgrade(s)\n"
                "    finally: await s.close()\n"
                "asyncio.run(m())\n")
        return [sys.executable, "-c", code, url]

    # -- profiling -----------------------------------------------------------------------

    async def run_profile(self, lg: LoadGenerator, rate: float | None = None) -> None:
        """py-spy on the ledger, the dispatcher and the sandbox while load runs: closed-loop
        saturation, or an open loop at `rate` (the half rate, with --profile-half)."""
        out: dict[str, Any] = {}
        targets = {n: s for n, s in self.stack.services.items()
                   if s.kind in ("ledger", "dispatcher", "sandbox")}
        seconds = self.cfg.profile_s
        procs = {}
        for name, svc in targets.items():
            p = prof.start(svc.pid, self.cfg.out_dir / f"profile-{name}.txt", seconds)
            if p is not None:
                procs[name] = p
        if not procs:
            self.results["profile"] = {"error": "py-spy not available"}
            return
        tag = self.tag("profile")
        if rate is None:
            log(f"profiling {sorted(procs)} for {seconds:.0f} s under closed-loop load")
            await lg.closed_loop(tag, self.cfg.window, seconds + 1)
        else:
            log(f"profiling {sorted(procs)} for {seconds:.0f} s at {rate:.0f} ops/s")
            await lg.open_loop(tag, rate, seconds + 1)
        self.results["profile_load"] = ("closed-loop load" if rate is None
                                        else f"open loop at {rate:.1f} ops/s")
        for name, p in procs.items():
            try:
                await asyncio.to_thread(p.wait, 60)
            except Exception:
                p.kill()
            summary = prof.summarise(self.cfg.out_dir / f"profile-{name}.txt")
            summary["busy_pct"] = (round(100 * summary["samples"] / (seconds * 67), 1)
                                   if "samples" in summary else None)
            out[name] = summary
        await self.wait_rest([tag], 120)
        self.results["profile"] = out
        self.save()

    # -- the whole run -------------------------------------------------------------------

    def save(self) -> None:
        path = self.cfg.out_dir / "results.json"
        path.write_text(json.dumps(self.results, indent=1, default=str))

    async def run(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.stack
        from .procs import machine

        self.results["config"] = {k: (str(v) if isinstance(v, Path) else v)
                                  for k, v in asdict(cfg).items()}
        self.results["machine"] = machine()
        try:  # before anything of ours runs: the machine's own price of a wake-up
            self.results["wakeup_cost"] = await asyncio.to_thread(wakeprobe.measure)
        except (RuntimeError, OSError, ValueError) as exc:
            self.results["wakeup_cost"] = {"error": str(exc)[:300]}
        self.results["started_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.results["git"] = _git()
        log(f"starting PostgreSQL, nats-server, sandbox, ledger, {cfg.dispatchers} dispatcher(s)"
            f" in {st.workdir}")
        st.start(dispatchers=cfg.dispatchers)
        if cfg.reconciler:
            self.start_reconciler()
        from .pg import describe

        self.results["postgres"] = describe(st.pg, st.database_url)
        self.results["launcher"] = st.launcher()
        if st.launcher() != "effectledger_cli":
            self.results["errors"].append(
                "`python -m effectledger_cli --help` failed at the start of the run; the "
                "services were started with effectledger_bench.launch (same settings, same "
                "serve functions)")
        if st.pg is not None:
            st.pg.psql('CREATE DATABASE "dbos_bench"')
        t_start = time.monotonic()
        assert st.nats_url is not None
        async with LoadGenerator(st.nats_url, st.subject_prefix, progress=cfg.progress) as lg:
            await self.set_latency(0)
            log("warm-up (not measured)")
            warm = self.tag("warmup")
            await lg.closed_loop(warm, cfg.window, 3.0 if cfg.quick else 8.0)
            await self.wait_rest([warm], 120)
            await self.capture_sql(lg)
            if cfg.window <= 0:
                cfg.window = await self.probe_window(lg)
            backlog_reps = cfg.backlog_reps if cfg.backlog_reps is not None else cfg.reps
            last_half, last_max = 25.0, 50.0
            for rep in range(0 if cfg.observability_only else cfg.reps):
                log(f"=== repetition {rep + 1}/{cfg.reps}")
                st.scale_dispatchers(cfg.dispatchers)
                await self.set_latency(0)
                top = await self.closed(lg, "max", {"dispatchers": cfg.dispatchers}, rep)
                max_rate = top.get("ops_per_s") or 50.0
                half = cfg.half_rate or max(5.0, max_rate / 2)
                await self.open(lg, "half", {"dispatchers": cfg.dispatchers}, half, rep)
                if cfg.peers:
                    await self.run_peers(rep, max_rate, half)
                for share in cfg.rate_shares:
                    await self.sweep_point(lg, share, max_rate, rep)
                for n in cfg.replicas:
                    st.scale_dispatchers(n)
                    await self.closed(lg, "replicas", {"dispatchers": n}, rep)
                st.scale_dispatchers(cfg.dispatchers)
                for ms in cfg.latencies_ms:
                    await self.set_latency(ms)
                    await self.closed(lg, "latency", {"latency_ms": ms,
                                                      "dispatchers": cfg.dispatchers}, rep)
                await self.set_latency(0)
                if rep < backlog_reps:
                    for size in cfg.backlogs:
                        if size <= cfg.large_backlog:
                            await self.backlog(lg, size, half, rep)
                last_half, last_max = half, max_rate
                if cfg.faults:
                    await self.set_latency(0, failure_mix=True)
                    await self.open(lg, "failure_mix", {"transient": 0.01, "timeouts": 0.01},
                                    half, rep)
                    await self.set_latency(0)
            if cfg.observability or cfg.observability_only:
                await self.run_observability(lg)
            if cfg.profile and not cfg.observability_only:
                await self.run_profile(lg, last_half if cfg.profile_half else None)
            for size in (b for b in cfg.backlogs
                         if b > cfg.large_backlog and not cfg.observability_only):
                # queueing at ~2.5x and draining at ~1x the max rate, plus the offered load
                estimate = size / (2.5 * last_max) + size / last_max + 2 * cfg.duration_s
                left = cfg.time_budget_s - (time.monotonic() - t_start)
                if estimate > left:
                    note = (f"backlog {size}: skipped, estimated {estimate / 60:.0f} min at "
                            f"{last_max:.0f} ops/s > {left / 60:.0f} min left of the budget")
                    log(note)
                    self.results["errors"].append(note)
                    continue
                await self.backlog(lg, size, last_half, cfg.reps - 1)
        self.results["duration_s"] = round(time.monotonic() - t_start, 1)
        await self.final_check()
        self.results["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.save()
        return self.results

    async def run_observability(self, lg: LoadGenerator) -> None:
        """The saturated closed loop once per setting, settings alternated in each round (in
        reverse order every other round) so drift on a shared machine spreads over all of
        them; the ledger and the dispatchers
        restart with each setting (metrics are switched at start-up)."""
        from . import obscost

        st, cfg = self.stack, self.cfg
        base_ledger, base_disp = dict(st.ledger_env), dict(st.dispatcher_env)
        await self.set_latency(0)
        try:
            for rnd in range(cfg.observability_rounds):
                for name in obscost.round_order(rnd):
                    env = obscost.setting_env(name, cfg.out_dir)
                    st.ledger_env = {**base_ledger, **env}
                    st.dispatcher_env = {**base_disp, **env}
                    self._restart_pipeline()
                    await self._settle_after_restart(lg)
                    await self.closed(lg, obscost.SCENARIO,
                                      {"setting": name, "dispatchers": cfg.dispatchers}, rnd)
        finally:
            st.ledger_env, st.dispatcher_env = base_ledger, base_disp
            self._restart_pipeline()

    async def _settle_after_restart(self, lg: LoadGenerator) -> None:
        """A short unmeasured load after a restart, finished before the measured phase.

        Without it, half the phases of a run on a loaded machine measured a first window of
        operations stuck for 5 to 12 s after the restart (32 operations at 3 to 6 ops/s, 70 ms
        of CPU per operation: start-up work divided by a handful of operations), which says
        nothing about what a setting costs while running."""
        warm = self.tag("observability-warmup")
        await lg.closed_loop(warm, self.cfg.window, 2.0)
        await self.wait_rest([warm], 120)

    def _restart_pipeline(self) -> None:
        st = self.stack
        st.scale_dispatchers(0)
        st.stop("ledger")
        st.start_ledger()
        st.scale_dispatchers(self.cfg.dispatchers)

    def start_reconciler(self) -> None:
        from effectledger_cli.embedded import free_port

        st = self.stack
        env = st.env({"EFFECTLEDGER_RECONCILER_PORT": str(free_port())})
        svc = st._spawn("reconciler", "reconciler", ["reconciler"], env)
        time.sleep(3.0)  # the reconciler has no readiness signal the harness relies on
        if not svc.alive:
            self.results["errors"].append("reconciler exited at start; run without it")
            st.services.pop("reconciler", None)

    async def final_check(self) -> None:
        st = self.stack
        samples = st.samples()
        self.remember_peaks(samples)
        for name, _pid, _kind, smp in st.retired:
            self.remember_peaks({name: smp})
        self.results["peak_rss_mib"] = {n: round(s.hwm_bytes / 2**20, 1)
                                        for n, s in sorted(self.peak.items())}
        async with httpx.AsyncClient(base_url=st.sandbox_url, timeout=120) as c:
            truth = (await c.get("/_truth")).json()
        ops = await all_ops(self.dsn)
        self.results["effects"] = check_effects(ops, truth, self.submitted_ids,
                                                peer_prefixes=PEER_PREFIXES)
        self.results["dead_processes"] = st.check_alive()
        brief = {k: v for k, v in self.results["effects"].items() if k != "examples"}
        log(f"effects: {json.dumps(brief)}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stack.close()


def _read_from(path: Path, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def _git() -> dict[str, Any]:
    import subprocess

    root = Path(__file__).resolve().parents[3]  # tools/bench/effectledger_bench/runner.py
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "services", "shared"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"commit": head, "product_code_modified_in_worktree": bool(dirty)}
