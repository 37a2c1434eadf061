"""One chaos run, start to finish: start the stack, submit and inject, quiet down, check, report.

```
start stack ─▶ fault phase (workload + timed faults + per-operation faults)
            ─▶ restore (everything back up) ─▶ quiet period (until all at rest, or a limit)
            ─▶ collect (database, provider truth, JetStream, logs) ─▶ check ─▶ report
```
`run_chaos(cfg)` is the importable entry point (tests call it); `effectledger chaos` wraps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats

from . import checker, collect, report
from .attacker import Attacker
from .badinput import BadInput
from .config import ChaosConfig
from .faults import Calm, FaultRunner
from .schedule import Schedule, build
from .stack import SUBJECT_PREFIX, Stack
from .workload import History, Workload, webhook_faults


class Run:
    def __init__(self, cfg: ChaosConfig, *, schedule: Schedule | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.schedule = schedule or build(cfg)
        self._log = log
        self.tmp: Path | None = None
        if cfg.workdir:
            self.workdir = Path(cfg.workdir).resolve()
        else:
            self.tmp = Path(tempfile.mkdtemp(prefix=f"effectledger-chaos-{cfg.seed}-"))
            self.workdir = self.tmp
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.phase = "starting"
        self.startup_s = 0.0

    def log(self, text: str) -> None:
        line = f"[chaos seed={self.cfg.seed} {time.monotonic() - self.t0:7.1f}s] {text}"
        if self._log is not None:
            self._log(line)
        elif self.cfg.progress:
            print(line, file=sys.stderr, flush=True)

    async def run(self) -> dict[str, Any]:
        stack = Stack(self.cfg, self.workdir, log=self.log)
        self.stack = stack
        try:
            return await self._run(stack)
        finally:
            try:
                await asyncio.wait_for(stack.stop(), 60)
            except (Exception, asyncio.CancelledError):
                pass  # whatever happened, nothing we started may outlive the run
            stack.kill_everything()
            stack.cleanup_pg_folder(keep=True)

    async def _run(self, stack: Stack) -> dict[str, Any]:
        self.log(f"starting: {self.cfg.ops} ops, faults: "
                 f"{', '.join(self.cfg.active_faults) or 'none'}; workdir {self.workdir}")
        if self.cfg.skipped_faults:
            self.log(f"skipped (this run has no cluster for them): "
                     f"{', '.join(self.cfg.skipped_faults)}")
        started = time.monotonic()
        await stack.start()
        self.startup_s = time.monotonic() - started
        self.log(f"stack ready in {self.startup_s:.1f}s")
        await self._set_webhook_faults(stack)
        tap = await self._start_tap(stack)
        stack.start_supervisor()
        history = History(self.workdir / "history.jsonl", self.t0)
        phase_start = time.monotonic()
        quiet_deadline = phase_start + self.cfg.fault_phase_s + self.cfg.quiet_max_s
        workload = Workload(self.schedule, stack.ledger_urls, stack.sandbox_url, history,
                            self.cfg.concurrency, give_up_at=quiet_deadline - 20)
        bad = BadInput(stack, self.cfg.seed, self.log)
        attacker = Attacker(stack, self.log)
        faults = FaultRunner(stack, self.schedule, self.log, bad_input=bad.run,
                             attack=attacker.run)
        faults.acked_by = workload.acked_by  # shared: filled as intents are acknowledged
        monitor = asyncio.create_task(self._monitor(stack, workload, faults, phase_start))
        work = asyncio.create_task(workload.run(phase_start))
        # An armed crash point that nothing is left to reach is given up after a calm
        # (faults.py), not its whole window.
        faults.quiet = lambda: self._at_rest(stack, work)
        try:
            settled, quiet_start, quiet_end = await self._phases(
                stack, faults, work, phase_start, quiet_deadline)
        finally:
            for task in (work, monitor):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            history.close()
        self.phase = "checking"
        await stack.stop_supervisor()
        stack_faults = await self._sandbox_faults(stack)
        # Fired counts before the restore re-posted the list, plus those fired since.
        stack_faults["provider"] = (faults.provider_faults_at_restore
                                    + stack_faults.get("provider", []))
        data = await self._collect(stack)
        tap_result = await self._stop_tap(tap)
        # The wall time the fault records' times count from: kept in the report, so the
        # availability figures can be recomputed from the history exactly.
        phase_start_wall = time.time() - (time.monotonic() - phase_start)
        result = checker.check(
            cfg=self.cfg, schedule=self.schedule,
            history=[json.loads(line) for line in
                     (self.workdir / "history.jsonl").read_text().splitlines() if line],
            data=data, fault_records=faults.records, sandbox_faults=stack_faults,
            bad_webhooks=workload.bad_webhooks, bad_input=bad.results, exits=stack.exits,
            services=stack.services, canary_hits=data["canary_hits"] + tap_result["hits"],
            phase_start_wall=phase_start_wall)
        result["timing"] = {"startup_s": round(self.startup_s, 1),
                            "phase_start_wall": round(phase_start_wall, 3),
                            "fault_phase_s": round(quiet_start - phase_start, 1),
                            "quiet_s": round(quiet_end - quiet_start, 1),
                            "settled": settled, "total_s": round(time.monotonic() - self.t0, 1)}
        result["tap"] = {"messages_scanned": tap_result["messages"]}
        out = report.build(self.cfg, self.schedule, result, self.workdir)
        self.log(f"done: invariants {'all zero' if out['invariants_ok'] else 'VIOLATED'}; "
                 f"{'every check passed' if out['ok'] else 'a check FAILED'}")
        return out

    async def _phases(self, stack: Stack, faults: FaultRunner, work: asyncio.Task[None],
                      phase_start: float, quiet_deadline: float
                      ) -> tuple[bool, float, float]:
        """The fault phase, the restore, then the quiet period: (settled, its start, end)."""
        self.phase = "faults"
        faults.start(phase_start)
        await asyncio.sleep(max(0.0, phase_start + self.cfg.fault_phase_s - time.monotonic()))
        await faults.wait()
        await faults.restore()
        self.phase = "quiet"
        quiet_start = time.monotonic()
        self.log(f"faults over after {quiet_start - phase_start:.1f}s; quiet period "
                 f"(at most {self.cfg.quiet_max_s:.0f}s)")
        settled = await self._quiet(stack, work, quiet_deadline)
        quiet_end = time.monotonic()
        for s in stack.services.values():
            s.sample_rss(quiet_end - self.t0)
        return settled, quiet_start, quiet_end

    # -- pieces ---------------------------------------------------------------------------

    async def _set_webhook_faults(self, stack: Stack) -> None:
        import httpx

        faults = webhook_faults(self.schedule)
        async with httpx.AsyncClient(base_url=stack.sandbox_url, timeout=10) as sb:
            (await sb.post("/_faults", json={"faults": [], "seed": self.cfg.seed})
             ).raise_for_status()
            (await sb.post("/_webhooks/faults", json={"faults": faults})).raise_for_status()

    async def _sandbox_faults(self, stack: Stack) -> dict[str, Any]:
        try:
            return {"provider": (await stack.sandbox_get("/_faults"))["faults"],
                    "webhook": (await stack.sandbox_get("/_webhooks/faults"))["faults"]}
        except Exception as exc:
            return {"error": str(exc)}

    async def _start_tap(self, stack: Stack) -> dict[str, Any]:
        """Every message on the run's subjects, scanned for canaries as it passes."""
        state: dict[str, Any] = {"messages": 0, "hits": []}
        canaries = {n: v.encode() for n, v in stack.canaries.items()}

        async def on_msg(msg: Any) -> None:
            state["messages"] += 1
            blob = (msg.data or b"") + json.dumps(msg.headers or {}).encode()
            for name, value in canaries.items():
                if value in blob and len(state["hits"]) < 100:
                    state["hits"].append({"where": f"nats:{msg.subject}", "canary": name})

        async def quiet(*_: Any) -> None:
            return None  # broker outages are the point; nats-py would print tracebacks

        nc = await nats.connect(stack.nats_direct, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.5, error_cb=quiet,
                                disconnected_cb=quiet, reconnected_cb=quiet)
        await nc.subscribe(f"{SUBJECT_PREFIX}.>", cb=on_msg)
        state["nc"] = nc
        return state

    async def _stop_tap(self, tap: dict[str, Any]) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(tap["nc"].close(), 5)
        return {"messages": tap["messages"], "hits": tap["hits"]}

    @staticmethod
    async def _at_rest(stack: Stack, work: asyncio.Task[None]) -> bool:
        """The workload is over, every operation is at rest and nothing is left in flight
        (no outbox row, no message in a stream); False when that cannot be read."""
        if not work.done():
            return False
        try:
            counts = await collect.state_counts(stack.db_direct)
            left = await collect.backlog(stack.db_direct)
            js = await collect.read_jetstream(stack.nats_direct)
        except Exception:
            return False
        queued = sum(s.get("messages", 0) for s in js.values())
        active = sum(n for s, n in counts.items() if s not in collect.AT_REST)
        return active == 0 and not left and queued == 0

    async def _quiet(self, stack: Stack, work: asyncio.Task[None], deadline: float) -> bool:
        """Wait until every operation is at rest and nothing is left in flight."""
        # A short calm: late webhooks, duplicate deliveries and sweeps show up within it.
        calm = Calm(lambda: self._at_rest(stack, work))
        while time.monotonic() < deadline:
            if await calm.held():
                return True
            await asyncio.sleep(1.0)  # polling the database and the broker
        return False

    async def _monitor(self, stack: Stack, workload: Workload, faults: FaultRunner,
                       phase_start: float) -> None:
        while True:
            await asyncio.sleep(self.cfg.progress_interval_s)
            try:
                counts = await asyncio.wait_for(collect.state_counts(stack.db_direct), 3)
                rest = sum(n for s, n in counts.items() if s in collect.AT_REST)
                db = f"at rest {rest}/{sum(counts.values())}"
            except Exception:
                db = "database unreachable"
            self.log(f"{self.phase}: submitted {workload.submitted}/{self.cfg.ops}, "
                     f"acked {len(workload.acked)}, {db}; faults: {len(faults.records)} timed "
                     f"done, {sum(workload.armed.values())} provider armed, "
                     f"{len(workload.bad_webhooks)} bad webhooks sent")
            for s in stack.services.values():
                s.sample_rss(time.monotonic() - phase_start)

    async def _collect(self, stack: Stack) -> dict[str, Any]:
        db = await collect.read_database(stack.db_direct)
        data: dict[str, Any] = {"db": db}
        data["sandbox"] = await collect.read_sandbox(stack)
        try:
            data["jetstream"] = await collect.read_jetstream(stack.nats_direct)
        except Exception as exc:
            data["jetstream"] = {"error": str(exc)}
        tables = ["operations", "attempts", "journal", "outbox", "inbox", "dead_letters",
                  "webhook_events", "reviews", "retry_plans"]
        hits: list[dict[str, Any]] = []
        for name, text in (await collect.dump_text(stack.db_direct, tables)).items():
            hits += collect.scan_text(f"db:{name}", text, stack.canaries)
        hits += collect.scan_text("sandbox:requests", json.dumps(data["sandbox"]["requests"]),
                                  stack.canaries)
        hits += collect.scan_text("sandbox:webhooks", json.dumps(data["sandbox"]["webhooks"]),
                                  stack.canaries)
        logs = sorted(stack.logs.glob("*.log"))
        if stack.pg is not None:
            logs.append(stack.pg.log)
        logs.append(self.workdir / "history.jsonl")
        hits += collect.scan_files(logs, stack.canaries)
        data["canary_hits"] = hits
        data["canary_places"] = len(tables) + len(logs) + 2
        # Everything the checker saw, for a post-mortem of a failed (or surprising) run.
        (self.workdir / "collected.json").write_text(json.dumps(
            {k: v for k, v in data.items() if k != "canary_hits"}, default=str))
        return data


def run_chaos(cfg: ChaosConfig, *, schedule: Schedule | None = None,
              report_path: str | Path | None = None,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one seed; returns the report (and writes it to `report_path` if given)."""
    run = Run(cfg, schedule=schedule, log=log)
    try:
        out = asyncio.run(run.run())
    except BaseException:
        # Interrupted (Ctrl-C) or broken: still leave no process and no cluster behind.
        stack = getattr(run, "stack", None)
        if stack is not None:
            stack.kill_everything()
            stack.cleanup_pg_folder(keep=True)
        raise
    if report_path is not None:
        Path(report_path).write_text(json.dumps(out, indent=2, default=str))
    # A clean run leaves nothing behind; a failed one keeps its logs and history.
    if run.tmp is not None and not cfg.keep_workdir and out.get("ok"):
        shutil.rmtree(run.tmp, ignore_errors=True)
        out["workdir_removed"] = True
    return out
