"""Carrying out the timed faults of a schedule against the running stack.

Each fault runs in its own task at its planned offset, under a lock per target so that two
faults never fight over one process (a later one waits; the record shows when it really
started). Every fault ends by restoring what it broke (restart, SIGCONT, broker and database
back up, proxy healed), and records what it did: the list is the report's fault log and the
basis of the review rate per fault kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import sqlalchemy as sa
from nats.js.errors import NotFoundError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from . import collect
from .config import SYNTHETIC_AFTER_SEND
from .natsconn import connect_quiet
from .procs import Service, process_stopped
from .schedule import Schedule, TimedFault
from .stack import Stack

ARMED_TIMEOUT_S = 10.0  # an armed crash point not reached by then is disarmed (and recorded)
ARMED_CAP_S = 240.0  # ... however long outages keep it from being reached
# ... or sooner, once nothing is left that could reach it (`FaultRunner.quiet`: the workload has
# submitted everything, every operation is at rest, nothing waits in the outbox or the streams)
# and that has held this long. Every point in crash.KNOWN is on an operation's path, so none can
# be reached then. Faults queued on one process are armed late, and waiting out the window only
# made the run longer (9 of the 30 points of the three CI seeds were armed after the workload
# was over, 10 s each). The calm is the quiet period's (runner.py): late webhooks, duplicate
# deliveries and sweeps show up within it.
QUIET_CALM_S = 3.0
QUIET_POLL_S = 0.5
# `pause_before_send` arms only after the broker and the database have been up this long
# (`FaultRunner._wait_steady`), waiting at most the cap.
STEADY_S = 2.0
STEADY_CAP_S = 180.0
_OUTAGES = ("nats_restart", "nats_long_outage", "pg_restart")
# A fault whose moment falls inside a whole-broker or database outage waits for its end (at
# most this long) and then runs with its own deadline whole: injected into an outage, it met
# a broker that was not there and gave up unnoticed (4 of 4 planned `stream_delete` in the
# clustered runs of 600 operations).
RESCHEDULE_CAP_S = 300.0
# The kinds that need the broker or the database to be injected at all. A process fault is
# not among them: a ledger killed inside the long broker outage is a planned case.
RESCHEDULED = frozenset({"stream_delete"})


class Calm:
    """Whether `quiet` has said yes at every look for QUIET_CALM_S (looked at every
    QUIET_POLL_S at most; never, without `quiet`). An armed crash point's wait and the run's
    quiet period (runner.py) both end on it."""

    def __init__(self, quiet: Callable[[], Awaitable[bool]] | None) -> None:
        self.quiet = quiet
        self.since: float | None = None
        self.next_look = 0.0

    async def held(self) -> bool:
        now = time.monotonic()
        if self.quiet is None or now < self.next_look:
            return False
        self.next_look = now + QUIET_POLL_S
        if not await self.quiet():
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= QUIET_CALM_S


class FaultRunner:
    def __init__(self, stack: Stack, schedule: Schedule, log: Callable[[str], None],
                 bad_input: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 attack: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 quiet: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.stack = stack
        self.quiet = quiet
        self.attack = attack
        self.schedule = schedule
        self.log = log
        self.bad_input = bad_input
        self.records: list[dict[str, Any]] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.phase_start = 0.0
        # The sandbox's provider faults as they stood at the end of the fault phase (their
        # `fired` counters; the list is re-posted without the timed holds, which resets them).
        self.provider_faults_at_restore: list[dict[str, Any]] = []
        self.pg_down = False
        # Operation id -> the ledger replica that acknowledged it (the workload fills it): the
        # ledger that commits an intent publishes its dispatch command under a lease.
        self.acked_by: dict[str, str] = {}

    def now(self) -> float:
        return round(time.monotonic() - self.phase_start, 3)

    def start(self, phase_start: float) -> None:
        self.phase_start = phase_start
        for fault in self.schedule.timed:
            self.tasks.append(asyncio.create_task(self._run(fault), name=f"fault-{fault.id}"))

    async def wait(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _run(self, fault: TimedFault) -> None:
        delay = self.phase_start + fault.at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the planned moment
        rec: dict[str, Any] = {"id": fault.id, "kind": fault.kind, "target": fault.target,
                               "params": fault.params, "planned_at": fault.at}
        if fault.kind in RESCHEDULED and self.dependencies_down():
            rec["rescheduled_from"] = self.now()
            await self._until_dependencies_up()
            rec["rescheduled_to"] = self.now()
            self.log(f"fault {fault.kind} on {fault.target}: planned inside an outage at "
                     f"{rec['rescheduled_from']}s, runs at {rec['rescheduled_to']}s")
        handler = getattr(self, f"_{fault.kind}")
        try:
            rec["result"] = await handler(fault, rec)
        except Exception as exc:  # a failing fault is reported, never fatal to the run
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
            self.log(f"fault {fault.kind} on {fault.target} failed: {rec['error']}")
        rec.setdefault("started_at", self.now())
        rec["ended_at"] = self.now()
        self.records.append(rec)

    def _svc(self, name: str) -> Service:
        return self.stack.services[name]

    async def _wait_dead(self, s: Service, timeout_s: float = 15.0) -> bool:
        cur = s.current
        deadline = time.monotonic() + timeout_s
        while cur is not None and cur.alive and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # polling a process that offers no exit event
        if cur is not None and not cur.alive:
            self.stack.record_exit(s)
            return True
        return False

    def dependencies_down(self) -> bool:
        return self.stack.broker_down() or self.pg_down

    def _reachable(self, s: Service) -> bool:
        """Whether an armed process's crash points can be reached now: it is ready, the broker
        and the database are up, and, for any process but a ledger, a ledger is ready. Every
        dispatcher point comes after a claim the ledger grants: while the ledger restarts (two
        to nine seconds each on a loaded host, several times in a row when the schedule queues
        its faults), no command reaches one, and a window counted through that expired with
        nothing tried (the harness-can-fail run without claim-before-call, CI at 02a90b2: all
        five dispatcher points of the run "not reached", so no redelivery reached the provider
        twice and the run proved nothing)."""
        if not s.ready() or self.dependencies_down():
            return False
        return s.kind == "ledger" or any(
            other.ready() for other in self.stack.services.values() if other.kind == "ledger")

    async def _until_dependencies_up(self) -> None:
        cap = time.monotonic() + RESCHEDULE_CAP_S
        while self.dependencies_down() and time.monotonic() < cap:  # noqa: ASYNC110
            await asyncio.sleep(0.1)  # polling: an outage's end signals nothing

    async def _wait_armed(self, s: Service, rec: dict[str, Any]) -> bool:
        """Wait for an armed process to hit its crash point: True if it died.

        The window (ARMED_TIMEOUT_S) counts only while the point can be reached (`_reachable`):
        the process ready, the broker and the database up, and a ledger ready. `rec["died_at"]`
        is the last moment the process was seen alive: it died after it, and the requests it
        held failed after it (the time it was found dead is up to a poll later).
        """
        left, cap = ARMED_TIMEOUT_S, time.monotonic() + ARMED_CAP_S
        calm = Calm(self.quiet)
        # Dead at the first look: last seen alive when it listened (or now, if it never did).
        rec["died_at"] = rec.get("armed_listening_at", self.now())
        while time.monotonic() < cap:
            looked = self.now()
            if not s.alive:
                return await self._wait_dead(s)
            # Taken before the look that found it alive: it died after this moment. (Set before
            # the look, a look that found it dead left the time it was found dead, up to a poll
            # after the death, and the requests the crash broke were counted as refusals.)
            rec["died_at"] = looked
            await asyncio.sleep(0.1)
            if self._reachable(s):
                left -= 0.1
                if left <= 0:
                    return False
            if await calm.held():
                rec["not_reached"] = "nothing left to reach it"
                return False
        return False

    # -- processes ------------------------------------------------------------------------

    async def _kill(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        s = self._svc(f.target)
        async with self.stack.locks[f.target]:
            rec["started_at"] = self.now()
            s.held_down = True
            try:
                killed = s.signal(signal.SIGKILL, "fault:kill")
                await self._wait_dead(s)
                await asyncio.sleep(f.params["down_s"])
                if not s.alive:
                    s.start()
                    await self._note_listening(s, rec)
            finally:
                s.held_down = False
        self.log(f"fault: SIGKILL {f.target}, down {f.params['down_s']}s")
        return {"killed": killed}

    async def _note_listening(self, s: Service, rec: dict[str, Any]) -> None:
        """For the ledger: when the new process listened again (the availability figures
        count the time until then as the restart's, everything after it as the ledger's)."""
        if s.kind != "ledger":
            return
        rec["restarted_at"] = self.now()
        try:
            await s.wait_ready(120)
            rec["listening_at"] = self.now()
        except (RuntimeError, TimeoutError) as exc:
            rec["listening_error"] = str(exc)[:300]

    async def _note_armed_listening(self, s: Service, rec: dict[str, Any]) -> None:
        """For the ledger: when the process armed with a crash point listened (it may reach
        the point first, while starting: then nothing is noted and the whole window counts
        as the fault's)."""
        if s.kind != "ledger":
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            await s.wait_ready(120)
            if s.alive:
                rec["armed_listening_at"] = self.now()

    async def _pause(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        s = self._svc(f.target)
        async with self.stack.locks[f.target]:
            rec["started_at"] = self.now()
            s.held_down = True
            try:
                stopped = s.signal(signal.SIGSTOP, "fault:pause")
                await asyncio.sleep(f.params["seconds"])
            finally:
                s.signal(signal.SIGCONT, "fault:pause")
                s.held_down = False
        self.log(f"fault: SIGSTOP {f.target} for {f.params['seconds']}s")
        return {"stopped": stopped}

    async def _crash_point(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        point = f.params["point"]
        if point == SYNTHETIC_AFTER_SEND:
            return await self._after_send(f, rec)
        s = self._svc(f.target)
        armed = f"{point}@{f.params['nth']}"
        async with self.stack.locks[f.target]:
            rec["started_at"] = self.now()
            s.held_down = True
            try:
                s.signal(signal.SIGKILL, "fault:crash_point_arm")
                await self._wait_dead(s)
                s.start(crash_points=armed)
                await self._note_armed_listening(s, rec)
                # Between the armed process's listening and its death it served as usual: the
                # availability figures hold that time against it, not against the fault.
                hit = await self._wait_armed(s, rec)
                if not hit:
                    rec["died_at"] = self.now()
                    s.signal(signal.SIGKILL, "fault:crash_point_disarm")
                    await self._wait_dead(s)
                code = s.incarnations[-1].popen.returncode
                await asyncio.sleep(f.params["restart_after_s"])
                s.start()
                await self._note_listening(s, rec)
            finally:
                s.held_down = False
        why = f" ({rec['not_reached']})" if "not_reached" in rec else ""
        self.log(f"fault: crash point {armed} on {f.target}: "
                 f"{'hit' if hit else 'not reached' + why}")
        return {"armed": armed, "hit": hit, "exit_code": code}

    async def _pause_before_send(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """Freeze a dispatcher exactly between its claim and its send (the crash point stops
        the process instead of killing it), for longer than the horizon, then let it go on."""
        s = self._svc(f.target)
        armed = f"{f.params['point']}#{f.params['tool']}@{f.params['nth']}:stop"
        async with self.stack.locks[f.target]:
            # Inside the lock: waiting outside it let another fault on this dispatcher take it
            # first and hold it for 40 s, after which the short CI workload had no more
            # commands of the tool to reach the point with.
            await self._wait_steady()
            rec["started_at"] = self.now()
            s.held_down = True
            claims: int | None = None  # counted only when the point was not reached
            try:
                s.signal(signal.SIGKILL, "fault:pause_before_send_arm")
                await self._wait_dead(s)
                armed_from = datetime.now(UTC)
                s.start(crash_points=armed)
                hit = await self._wait_stopped(s)
                if hit:
                    s.paused = True  # so restore() and the memory sampler know
                    rec["stopped_at"] = self.now()
                    await asyncio.sleep(f.params["seconds"])  # the planned length of the pause
                    s.signal(signal.SIGCONT, "fault:pause_before_send")
                else:
                    # Not reached in time: an armed process must not linger into the quiet
                    # period, so it is replaced by an unarmed one.
                    s.signal(signal.SIGKILL, "fault:pause_before_send_disarm")
                    await self._wait_dead(s)
                    claims = await self._claims_since(f.target, f.params["tool"], armed_from)
                    s.start()
            finally:
                s.held_down = False
        if hit:
            self.log(f"fault: {armed} on {f.target}: stopped {f.params['seconds']}s")
            return {"armed": armed, "hit": True}
        self.log(f"fault: {armed} on {f.target}: not reached "
                 f"({claims} claim(s) of its tool while armed)")
        return {"armed": armed, "hit": False, "claims_while_armed": claims}

    async def _claims_since(self, dispatcher: str, tool: str, since: datetime) -> int | None:
        """How many attempts of `tool` `dispatcher` claimed since `since` (its armed process
        was started then and is dead now); None if the database could not say. Fewer than
        the point's hit count: nothing reached the point, so the injector is not at fault
        (metrics.injected counts the fault `untriggered`)."""
        try:
            claimed = await collect.claims_by(self.stack.db_direct, dispatcher, tool)
        except Exception:
            return None
        return sum(1 for at in claimed if at >= since)

    async def _wait_steady(self) -> None:
        """Until the broker and the database have been up for `STEADY_S` (at most
        `STEADY_CAP_S`).

        SIGSTOP freezes the whole dispatcher, so every command it has claimed but not sent
        freezes too: each becomes ambiguous, and those with no readback end in review without
        ever reaching the provider. Armed during a broker outage, the stop came in the
        backlog's burst when the broker returned: 56 of a CI seed's 200 operations were frozen
        that way, among them every operation planned for two webhook faults, which therefore
        never fired. In steady state a dispatcher holds a handful of commands.
        """
        # Up since the end of the last outage (phase-relative), or since the start.
        ends = [float(r["ended_at"]) for r in self.records
                if r["kind"] in _OUTAGES and r.get("ended_at") is not None]
        up_since: float | None = max(ends, default=0.0)
        cap = time.monotonic() + STEADY_CAP_S
        while time.monotonic() < cap:
            if self.dependencies_down():
                up_since = None
            elif up_since is None:
                up_since = self.now()
            elif self.now() - up_since >= STEADY_S:
                return
            await asyncio.sleep(0.1)  # polling: an outage's end signals nothing

    async def _wait_stopped(self, s: Service) -> bool:
        """Wait for an armed process to stop itself (SIGSTOP at its crash point)."""
        left, cap = ARMED_TIMEOUT_S * 3, time.monotonic() + ARMED_CAP_S
        while time.monotonic() < cap:
            pid = s.pid
            if pid is None:
                return False
            if process_stopped(pid):
                return True
            await asyncio.sleep(0.05)  # polling /proc: a stopped process signals nothing
            if s.ready() and not self.dependencies_down():
                left -= 0.05
                if left <= 0:
                    return False
        return False

    async def _after_send(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """Kill the dispatcher whose request the provider is holding (sent, no response)."""
        rec["started_at"] = self.now()
        hold_s = 2.0  # within the provider's horizon (config.Timing)
        async with httpx.AsyncClient(base_url=self.stack.sandbox_url, timeout=10) as sb:
            before = len((await sb.get("/_requests")).json()["requests"])
            await sb.post("/_faults/append", json={
                "match": {}, "action": {"kind": "delay", "seconds": hold_s}, "times": 1})
            left, cap = 20.0, time.monotonic() + ARMED_CAP_S
            key = None
            while left > 0 and time.monotonic() < cap and key is None:
                await asyncio.sleep(0.1)
                if not self.dependencies_down():
                    left -= 0.1
                faults = (await sb.get("/_faults")).json()["faults"]
                mine = [x for x in faults if x["action"]["kind"] == "delay"
                        and x["match"] == {}]
                if mine and mine[-1]["fired"]:
                    entries = (await sb.get("/_requests")).json()["requests"][before:]
                    pending = [e for e in entries if e["outcome"] == "pending"]
                    if pending:
                        key = pending[0]["key"]
            if key is None:
                # It must not hold a request after the phase. Re-posting the list resets
                # the sandbox's `fired` counters, so they are kept here first.
                self.provider_faults_at_restore += await _drop_unfired_holds(sb)
        if key is None:
            return {"hit": False, "reason": "no request was held in time"}
        dispatcher = await self._attempt_dispatcher(key)
        if dispatcher is None or dispatcher not in self.stack.services:
            return {"hit": False, "key": key, "reason": "claiming dispatcher not found"}
        s = self._svc(dispatcher)
        async with self.stack.locks[dispatcher]:
            s.held_down = True
            try:
                s.signal(signal.SIGKILL, "fault:crash_point_after_send")
                await self._wait_dead(s)
                await asyncio.sleep(f.params["restart_after_s"])
                s.start()
            finally:
                s.held_down = False
        self.log(f"fault: crash point {SYNTHETIC_AFTER_SEND}: killed {dispatcher} while the "
                 f"provider held its request")
        return {"hit": True, "key": key, "dispatcher": dispatcher}

    async def _attempt_dispatcher(self, operation_key: str) -> str | None:
        engine = create_async_engine(self.stack.db_direct, poolclass=NullPool)
        try:
            for _ in range(20):
                try:
                    async with engine.connect() as conn:
                        row = (await conn.execute(sa.text(
                            "SELECT a.dispatcher_id FROM attempts a JOIN operations o "
                            "ON o.id = a.operation_id WHERE o.operation_key = :k "
                            "ORDER BY a.epoch DESC LIMIT 1"), {"k": operation_key})).first()
                    if row is not None:
                        return str(row[0])
                except Exception:  # the database may be the one being faulted
                    pass
                await asyncio.sleep(0.1)
            return None
        finally:
            await engine.dispose()

    # -- broker ---------------------------------------------------------------------------

    async def _nats_down(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """The whole broker away: on a cluster every node is killed and restarted together
        (a lost data centre), so the long outage means the same on both shapes."""
        nodes = [n.service for n in self.stack.nats_nodes]
        async with self.stack.locks["broker"]:
            rec["started_at"] = self.now()
            await self._kill_nodes(nodes, f.params["down_s"], f"fault:{f.kind}")
        self.log(f"fault: nats-server{'s' if len(nodes) > 1 else ''} killed, down "
                 f"{f.params['down_s']}s, restarted")
        return {"down_s": f.params["down_s"], "nodes": len(nodes)}

    # -- the cluster ----------------------------------------------------------------------

    async def _nats_node_kill(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """SIGKILL one node, restart it; it must rejoin and catch its streams up."""
        node = next(n for n in self.stack.nats_nodes if n.name == f.target)
        async with self.stack.locks["broker"]:
            rec["started_at"] = self.now()
            await self._kill_nodes([node.service], f.params["down_s"], "fault:nats_node_kill")
            caught_up = await self._caught_up(60)
        self.log(f"fault: node {node.name} killed, down {f.params['down_s']}s; "
                 f"streams current after {caught_up}s")
        return {"node": node.name, "caught_up_s": caught_up}

    async def _stream_leader_kill(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """SIGKILL the node that leads the stream now (as JetStream reports it), restart it."""
        stream = _stream_name(f.target)
        async with self.stack.locks["broker"]:
            rec["started_at"] = self.now()
            leader = await self._leader(stream)
            node = self.stack.node_of_server(leader or "")
            if node is None:
                return {"hit": False, "stream": stream, "reason": f"no leader ({leader})"}
            await self._kill_nodes([node.service], f.params["down_s"],
                                   "fault:stream_leader_kill")
            after = await self._leader(stream)
            caught_up = await self._caught_up(60)
        self.log(f"fault: {stream} leader {leader} ({node.name}) killed; leader now {after}; "
                 f"streams current after {caught_up}s")
        return {"hit": True, "stream": stream, "leader": leader, "node": node.name,
                "leader_after": after, "caught_up_s": caught_up}

    async def _nats_partition(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """Cut every route between one node and its peers (the proxy links hold all bytes),
        then heal. The node stays up and its clients still reach it: a minority of one,
        which must not accept what the majority cannot see."""
        node = next(n for n in self.stack.nats_nodes if n.name == f.target)
        routes = self.stack.partition_routes(node)
        async with self.stack.locks["broker"]:
            rec["started_at"] = self.now()
            before = await self.stack.proxy.command(op="stats")
            healthy = await self._peer_view(node)  # the same view before the cut, to compare
            cut_at = time.monotonic()
            for route in routes:
                await self.stack.proxy.command(op="blackhole", route=route,
                                               seconds=f.params["seconds"], then="resume")
            # Near the end of the cut, as the majority sees the node: its replicas silent.
            await asyncio.sleep(max(0.0, f.params["seconds"] - 1.5))
            seen = await self._peer_view(node)
            await asyncio.sleep(max(0.0, cut_at + f.params["seconds"] - time.monotonic()))
            # The links that carried routes then: evidence that the cut cut something.
            links = sum(1 for r in routes
                        if (before.get("routes", {}).get(r, {}).get("open", 0) or 0) > 0)
            caught_up = await self._caught_up(60)
        self.log(f"fault: {node.name} partitioned from its peers for {f.params['seconds']}s "
                 f"({links}/{len(routes)} links carried routes); streams current after "
                 f"{caught_up}s")
        return {"node": node.name, "routes": routes, "links_with_connections": links,
                "hit": links > 0, "majority_view_before": healthy, "majority_view": seen,
                "caught_up_s": caught_up}

    async def _peer_view(self, node: Any) -> dict[str, Any]:
        """What the other nodes report of `node` in each stream: its replica's `current`,
        `active` (seconds since heard from) and `lag`, or that it leads (a stale leader)."""
        from .stack import NODE_PREFIX, STREAM_PREFIX

        k = self.stack.nats_nodes.index(node)
        me = f"{NODE_PREFIX}-{k + 1}"
        others = [u for i, u in enumerate(self.stack.nats_direct) if i != k]
        out: dict[str, Any] = {}
        try:
            async with _direct(others) as nc:
                js = nc.jetstream(timeout=3)
                for suffix in ("DISPATCH", "EVENTS"):
                    try:
                        c = (await js.stream_info(f"{STREAM_PREFIX}_{suffix}")).cluster
                    except Exception as exc:  # an election in progress is an answer too
                        out[suffix] = {"error": type(exc).__name__}
                        continue
                    if c is None:
                        continue
                    replica = next((r for r in c.replicas or [] if r.name == me), None)
                    out[suffix] = {"leader": c.leader,
                                   "current": getattr(replica, "current", None),
                                   # nats-py keeps it in nanoseconds
                                   "active_s": round(replica.active / 1e9, 2)
                                   if replica is not None and replica.active else None,
                                   "lag": getattr(replica, "lag", None)}
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return out

    async def _kill_nodes(self, nodes: list[Service], down_s: float, reason: str) -> None:
        """SIGKILL these nats-servers together, keep them down `down_s`, restart them."""
        for s in nodes:
            s.held_down = True
        try:
            for s in nodes:
                s.signal(signal.SIGKILL, reason)
            for s in nodes:
                await self._wait_dead(s)
            await asyncio.sleep(down_s)
            for s in nodes:
                s.start()
            await self.stack.wait_nats(30)
        finally:
            for s in nodes:
                s.held_down = False

    async def _leader(self, stream: str) -> str | None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                async with _direct(self.stack.nats_direct) as nc:
                    info = await nc.jetstream().stream_info(stream)
                if info.cluster is not None and info.cluster.leader:
                    return str(info.cluster.leader)
            except Exception:  # no leader during an election: ask again
                pass
            await asyncio.sleep(0.2)  # an election has no event to wait on
        return None

    async def _caught_up(self, timeout_s: float) -> float | None:
        """Seconds until every stream has a leader and every replica is current again (the
        node rejoined and caught up); None if not within `timeout_s`."""
        from .stack import STREAM_PREFIX

        start = time.monotonic()
        streams = [f"{STREAM_PREFIX}_DISPATCH", f"{STREAM_PREFIX}_EVENTS"]
        while time.monotonic() - start < timeout_s:
            try:
                async with _direct(self.stack.nats_direct) as nc:
                    js = nc.jetstream()
                    current = True
                    for name in streams:
                        c = (await js.stream_info(name)).cluster
                        if c is None or not c.leader or any(
                                not r.current or r.offline for r in c.replicas or []):
                            current = False
                if current:
                    return round(time.monotonic() - start, 2)
            except Exception:  # mid-election
                pass
            await asyncio.sleep(0.5)  # replicas catching up have no event to wait on
        return None

    async def _ledger_replica_kill(self, f: TimedFault, rec: dict[str, Any]
                                   ) -> dict[str, Any]:
        """SIGKILL a ledger replica while it holds outbox leases: rows it leased to publish
        (the dispatch command of an intent it committed) and had not marked published. The
        other replica's relay must publish them once the lease runs out, exactly once.

        A direct publish holds its lease for milliseconds, so a lease seen in the database
        may be gone before a kill lands. The replica is frozen (SIGSTOP) the moment one is
        seen; if the row is still leased while it is frozen, it is killed holding it; if not,
        it is let go on and the watch goes on. Past the watch it is killed all the same, and
        the record says it held no lease (`hit` false)."""
        s = self._svc(f.target)
        frozen = 0
        held: list[str] = []
        async with self.stack.locks[f.target]:
            rec["started_at"] = self.now()
            s.held_down = True
            try:
                deadline = time.monotonic() + f.params["wait_for_lease_s"]
                while time.monotonic() < deadline and not held:
                    seen = await self._leases_of(f.target, deadline - time.monotonic())
                    if not seen or not s.alive:
                        break
                    s.signal(signal.SIGSTOP, "fault:ledger_replica_kill")
                    frozen += 1
                    held = await self._still_leased(seen)
                    if not held:
                        s.signal(signal.SIGCONT, "fault:ledger_replica_kill")
                rec["killed_at"] = self.now()
                s.signal(signal.SIGKILL, "fault:ledger_replica_kill")
                s.signal(signal.SIGCONT, "fault:ledger_replica_kill")
                await self._wait_dead(s)
                await asyncio.sleep(f.params["down_s"])
                s.start()
                await self._note_listening(s, rec)
            finally:
                s.held_down = False
        how = f"holding {len(held)} outbox leases" if held else "without a lease caught"
        self.log(f"fault: ledger replica {f.target} killed {how} ({frozen} freezes)")
        return {"hit": bool(held), "leases_held": len(held), "outbox_ids": held[:5],
                "freezes": frozen}

    async def _leases_of(self, ledger: str, timeout_s: float) -> list[str]:
        """Outbox rows under a live lease whose operation `ledger` acknowledged."""
        engine = create_async_engine(self.stack.db_direct, poolclass=NullPool)
        deadline = time.monotonic() + timeout_s
        try:
            async with engine.connect() as conn:
                while time.monotonic() < deadline:
                    try:
                        rows = (await conn.execute(sa.text(
                            "SELECT id, operation_id FROM outbox WHERE status = 'publishing' "
                            "AND lease_until > CURRENT_TIMESTAMP"))).all()
                        await conn.rollback()  # a fresh snapshot for the next look
                    except Exception:  # the database may be the one being faulted
                        return []
                    mine = [str(r[0]) for r in rows if self.acked_by.get(str(r[1])) == ledger]
                    if mine:
                        return mine
                    await asyncio.sleep(0.005)  # a direct publish holds its lease briefly
        except Exception:
            return []
        finally:
            await engine.dispose()
        return []

    async def _still_leased(self, ids: list[str]) -> list[str]:
        if not ids:
            return []
        engine = create_async_engine(self.stack.db_direct, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                rows = (await conn.execute(
                    sa.text("SELECT id FROM outbox WHERE status = 'publishing' AND id IN :ids")
                    .bindparams(sa.bindparam("ids", expanding=True)), {"ids": ids})).all()
            return [str(r[0]) for r in rows]
        except Exception:
            return []
        finally:
            await engine.dispose()

    _nats_restart = _nats_down
    _nats_long_outage = _nats_down

    async def _stream_delete(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """Delete one stored message: JetStream losing an acknowledged message."""
        from .stack import STREAM_PREFIX, SUBJECT_PREFIX

        rec["started_at"] = self.now()
        stream, prefix = {
            "dispatch": (f"{STREAM_PREFIX}_DISPATCH", f"{SUBJECT_PREFIX}.dispatch.v1."),
            "reconcile": (f"{STREAM_PREFIX}_EVENTS", f"{SUBJECT_PREFIX}.reconcile.v1."),
            "outcome": (f"{STREAM_PREFIX}_EVENTS", f"{SUBJECT_PREFIX}.ledger.v1.outcome."),
            "verdict": (f"{STREAM_PREFIX}_EVENTS", f"{SUBJECT_PREFIX}.ledger.v1.verdict"),
        }[f.target]
        deadline = time.monotonic() + 20
        nc = None
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    # Each try is bounded by what is left of the deadline: a connect to a
                    # cluster in trouble took two minutes where the deadline is 20 s.
                    async with asyncio.timeout(left):
                        if nc is None or not nc.is_connected:
                            nc = await connect_quiet(self.stack.nats_direct,
                                                     connect_timeout=2, allow_reconnect=False)
                        found = await _delete_one(nc, stream, prefix)
                    if found is not None:
                        self.log(f"fault: deleted {found['subject']} message seq "
                                 f"{found['seq']} from {stream}")
                        return {"deleted": True, **found}
                except Exception:  # the broker may be down right now; try again
                    nc = None
                await asyncio.sleep(0.03)
        finally:
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()
        return {"deleted": False, "reason": f"no {f.target} message seen in 20s"}

    # -- database -------------------------------------------------------------------------

    async def _pg_restart(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        pg = self.stack.pg
        if pg is None:
            return {"skipped": "no private PostgreSQL"}
        async with self.stack.locks["postgres"]:
            rec["started_at"] = self.now()
            self.pg_down = True
            try:
                await asyncio.to_thread(pg.stop_immediate)
                await asyncio.sleep(f.params["down_s"])
                await asyncio.to_thread(pg.start)
            finally:
                self.pg_down = False
        self.log(f"fault: PostgreSQL stopped -m immediate, down {f.params['down_s']}s")
        return {"down_s": f.params["down_s"]}

    # -- network --------------------------------------------------------------------------

    async def _net_blackhole(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        async with self.stack.locks[f"route:{f.target}"]:
            rec["started_at"] = self.now()
            reply = await self.stack.proxy.command(op="blackhole", route=f.target,
                                                   seconds=f.params["seconds"],
                                                   then=f.params["then"])
            await asyncio.sleep(f.params["seconds"])
        self.log(f"fault: black hole on {f.target} for {f.params['seconds']}s")
        return reply

    async def _net_reset(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        async with self.stack.locks[f"route:{f.target}"]:
            rec["started_at"] = self.now()
            reply = await self.stack.proxy.command(op="reset", route=f.target)
        self.log(f"fault: reset {reply.get('reset')} connections on {f.target}")
        return reply

    async def _net_latency(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        async with self.stack.locks[f"route:{f.target}"]:
            rec["started_at"] = self.now()
            reply = await self.stack.proxy.command(op="latency", route=f.target,
                                                   ms=f.params["ms"],
                                                   seconds=f.params["seconds"])
            await asyncio.sleep(f.params["seconds"])
        self.log(f"fault: +{f.params['ms']}ms latency on {f.target} for "
                 f"{f.params['seconds']}s")
        return reply

    async def _bad_input(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        rec["started_at"] = self.now()
        if self.bad_input is None:
            return {"skipped": True}
        result = await self.bad_input()
        self.log("fault: bad-input batch sent")
        return result

    async def _attacker(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        rec["started_at"] = self.now()
        if self.attack is None:
            return {"skipped": True}
        result = await self.attack()
        self.log(f"fault: attacker round {result.get('round')} on {result.get('targets')} "
                 "operations")
        return result

    # -- the end of the fault phase ------------------------------------------------------

    async def restore(self) -> None:
        """Everything back up: no paused process, broker, database and links healthy."""
        with contextlib.suppress(Exception):
            await self.stack.proxy.command(op="clear")
        for s in self.stack.services.values():
            if s.paused:
                s.signal(signal.SIGCONT, "restore")
        for node in self.stack.nats_nodes:
            if not node.service.alive:
                node.service.start()
        await self.stack.wait_nats(30)
        if self.stack.pg is not None and not await asyncio.to_thread(self.stack.pg.running):
            await asyncio.to_thread(self.stack.pg.start)
        # Per-operation faults stay armed: they belong to their operation's first attempt,
        # which a broker outage may have pushed past the fault phase. Only the timed
        # "after send" holds (which match any request) are removed.
        async with httpx.AsyncClient(base_url=self.stack.sandbox_url, timeout=10) as sb:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                current = (await sb.get("/_faults")).json()
                keep = [{"match": f["match"], "action": f["action"], "times": f["times"],
                         "probability": f["probability"]}
                        for f in current["faults"] if f["match"]]
                self.provider_faults_at_restore += current["faults"]
                await sb.post("/_faults", json={"faults": keep, "seed": current["seed"]})


def _stream_name(target: str) -> str:
    from .stack import STREAM_PREFIX

    return f"{STREAM_PREFIX}_{target.upper()}"


async def _delete_one(nc: Any, stream: str, prefix: str) -> dict[str, Any] | None:
    js = nc.jetstream()
    info = await js.stream_info(stream)
    first, last = info.state.first_seq, info.state.last_seq
    if info.state.messages == 0:
        return None
    for seq in range(max(first, last - 300), last + 1):
        try:
            msg = await js.get_msg(stream, seq)
        except NotFoundError:
            continue
        if not msg.subject.startswith(prefix):
            continue
        if await js.delete_msg(stream, seq):
            headers = msg.headers or {}
            return {"stream": stream, "seq": seq, "subject": msg.subject,
                    "message_id": headers.get("Nats-Msg-Id"),
                    "payload_head": (msg.data or b"")[:200].decode(errors="replace")}
    return None


async def _drop_unfired_holds(sb: httpx.AsyncClient) -> list[dict[str, Any]]:
    """Remove "after send" holds (match-all delays) that never fired; keep everything else.

    Returns the list as it was (with its `fired` counters).
    """
    current = (await sb.get("/_faults")).json()
    keep = [{"match": f["match"], "action": f["action"], "times": f["times"],
             "probability": f["probability"]}
            for f in current["faults"] if f["match"] or f["fired"]]
    await sb.post("/_faults", json={"faults": keep, "seed": current["seed"]})
    return list(current["faults"])


@contextlib.asynccontextmanager
async def _direct(urls: list[str]) -> AsyncIterator[Any]:
    """A short-lived harness connection straight to these nodes (no reconnects: a question
    asked mid-election fails fast and is asked again), always closed."""
    nc = await connect_quiet(urls, connect_timeout=2, allow_reconnect=False)
    try:
        yield nc
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
