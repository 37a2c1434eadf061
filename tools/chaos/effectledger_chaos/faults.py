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
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import sqlalchemy as sa
from nats.js.errors import NotFoundError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from .collect import connect_quiet
from .config import SYNTHETIC_AFTER_SEND
from .procs import Service, process_stopped
from .schedule import Schedule, TimedFault
from .stack import Stack

ARMED_TIMEOUT_S = 10.0  # an armed crash point not reached by then is disarmed (and recorded)
ARMED_CAP_S = 240.0  # ... however long outages keep it from being reached


class FaultRunner:
    def __init__(self, stack: Stack, schedule: Schedule, log: Callable[[str], None],
                 bad_input: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 attack: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> None:
        self.stack = stack
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
        return self.stack.nats.service.held_down or self.pg_down

    async def _wait_armed(self, s: Service) -> bool:
        """Wait for an armed process to hit its crash point: True if it died.

        The window (ARMED_TIMEOUT_S) counts only while the process is ready and the broker and
        the database are up; no crash point can be reached during an outage.
        """
        left, cap = ARMED_TIMEOUT_S, time.monotonic() + ARMED_CAP_S
        while time.monotonic() < cap:
            if not s.alive:
                return await self._wait_dead(s)
            await asyncio.sleep(0.1)
            if s.ready() and not self.dependencies_down():
                left -= 0.1
                if left <= 0:
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
                hit = await self._wait_armed(s)
                if not hit:
                    s.signal(signal.SIGKILL, "fault:crash_point_disarm")
                    await self._wait_dead(s)
                code = s.incarnations[-1].popen.returncode
                await asyncio.sleep(f.params["restart_after_s"])
                s.start()
                await self._note_listening(s, rec)
            finally:
                s.held_down = False
        self.log(f"fault: crash point {armed} on {f.target}: {'hit' if hit else 'not reached'}")
        return {"armed": armed, "hit": hit, "exit_code": code}

    async def _pause_before_send(self, f: TimedFault, rec: dict[str, Any]) -> dict[str, Any]:
        """Freeze a dispatcher exactly between its claim and its send (the crash point stops
        the process instead of killing it), for longer than the horizon, then let it go on."""
        s = self._svc(f.target)
        armed = f"{f.params['point']}#{f.params['tool']}@{f.params['nth']}:stop"
        async with self.stack.locks[f.target]:
            rec["started_at"] = self.now()
            s.held_down = True
            try:
                s.signal(signal.SIGKILL, "fault:pause_before_send_arm")
                await self._wait_dead(s)
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
                    s.start()
            finally:
                s.held_down = False
        self.log(f"fault: {armed} on {f.target}: "
                 f"{'stopped ' + str(f.params['seconds']) + 's' if hit else 'not reached'}")
        return {"armed": armed, "hit": hit}

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
        s = self.stack.nats.service
        async with self.stack.locks["nats"]:
            rec["started_at"] = self.now()
            s.held_down = True
            try:
                s.signal(signal.SIGKILL, f"fault:{f.kind}")
                await self._wait_dead(s)
                await asyncio.sleep(f.params["down_s"])
                s.start()
                await self.stack.wait_nats(30)
            finally:
                s.held_down = False
        self.log(f"fault: nats-server killed, down {f.params['down_s']}s, restarted")
        return {"down_s": f.params["down_s"]}

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
            while time.monotonic() < deadline:
                try:
                    if nc is None or not nc.is_connected:
                        nc = await connect_quiet(self.stack.nats_direct, connect_timeout=2,
                                                 allow_reconnect=False)
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
        if not self.stack.nats.service.alive:
            self.stack.nats.service.start()
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
