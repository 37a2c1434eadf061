"""The callers: submit the planned operations and record every action in a history.

History lines are JSON (one per line): `{"t", "wall", "process", "type", "f", "op", ...}` with
`type` one of `invoke` (about to act), `ok` (the ledger acknowledged: the intent is durable),
`fail` (definitely not done: refused, or the connection was never made) and `info` (unknown: a
timeout or a lost answer, so the intent may or may not exist). A caller retries `fail` and `info`
with the same idempotency key, as a careful client would; the checker holds the ledger to every
`ok` and to every operation it knows, whichever way it got there.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import httpx

from .schedule import OpPlan, Schedule

SUBMIT_TIMEOUT_S = 10.0


class History:
    def __init__(self, path: Path, t0: float) -> None:
        self.path = path
        self.t0 = t0
        self._f: IO[str] = open(path, "w")  # closed by close()

    def record(self, process: str, type_: str, f: str, op: int | None = None,
               **value: Any) -> dict[str, Any]:
        entry = {"t": round(time.monotonic() - self.t0, 4), "wall": time.time(),
                 "process": process, "type": type_, "f": f, "op": op, **value}
        self._f.write(json.dumps(entry, default=str) + "\n")
        return entry

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._f.close()


def provider_fault(op: OpPlan, kind: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The sandbox fault (`/_faults/append`) for one per-operation provider fault."""
    match = {"route": op.route, "key": op.operation_key}
    times: int | None = 1
    if kind == "drop_after_apply":
        action: dict[str, Any] = {"kind": "drop_after_apply"}
    elif kind == "late_apply":
        action = {"kind": "late_apply", "seconds": params["seconds"]}
    elif kind == "status_before_apply":
        action = {"kind": "status_before_apply", "status": params["status"]}
        if "retry_after" in params:
            action["retry_after"] = params["retry_after"]
    elif kind == "status_after_apply":
        action = {"kind": "status_after_apply", "status": params["status"]}
    elif kind == "rate_limit_seconds":
        action = {"kind": "rate_limit", "retry_after": str(params["retry_after_s"])}
    elif kind == "rate_limit_date":
        when = datetime.now(UTC) + timedelta(seconds=params["retry_after_in_s"])
        action = {"kind": "rate_limit", "retry_after": email.utils.format_datetime(when,
                                                                                   usegmt=True)}
    elif kind == "slow_body":
        action = {"kind": "slow_body", "seconds": params["seconds"]}
    elif kind == "readback_lag":
        action = {"kind": "readback_lag", "seconds": params["seconds"]}
        times = None  # every readback of this key lags
    else:
        return None
    return {"match": match, "action": action, "times": times}


def webhook_faults(schedule: Schedule) -> list[dict[str, Any]]:
    """The sandbox's webhook delivery faults for the whole run (set once, matched by key)."""
    out: list[dict[str, Any]] = []
    for op in schedule.ops:
        for f in op.faults:
            match = {"route": op.route, "key": op.operation_key}
            if f.kind in ("webhook_duplicate", "webhook_concurrent"):
                out.append({"match": {**match, "type": "effect.applied"},
                            "action": {"kind": "duplicate", "copies": f.params["copies"],
                                       "concurrent": f.params["concurrent"]}, "times": 1})
            elif f.kind == "webhook_reorder":
                out.append({"match": match, "action": {"kind": "reorder",
                                                       "seconds": f.params["seconds"]},
                            "times": 2})
            elif f.kind == "webhook_resign":
                out.append({"match": {**match, "type": "effect.applied"},
                            "action": {"kind": "duplicate", "copies": f.params["copies"],
                                       "concurrent": 1}, "times": 1})
                out.append({"match": {**match, "type": "effect.applied"},
                            "action": {"kind": "resign"}, "times": 1})
    return out


@dataclass
class Workload:
    """The callers. With several ledger replicas (`ledger_urls`, by name) each operation
    starts on one (spread by its index) and every retry moves to the next, so a caller
    survives a replica being down as a client behind a load balancer would."""

    schedule: Schedule
    ledger_urls: dict[str, str]
    sandbox_url: str
    history: History
    concurrency: int
    give_up_at: float  # monotonic; callers stop retrying after it
    webhook_provider: str = "sandbox"
    submitted: int = 0
    acked: dict[int, str] = field(default_factory=dict)  # op index -> operation id
    bad_webhooks: list[dict[str, Any]] = field(default_factory=list)
    armed: dict[str, int] = field(default_factory=dict)
    # operation id -> the replica that acknowledged it (the ledger_replica_kill fault reads it)
    acked_by: dict[str, str] = field(default_factory=dict)

    async def run(self, phase_start: float) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        async with contextlib.AsyncExitStack() as stack:
            ledgers = [(name, await stack.enter_async_context(httpx.AsyncClient(
                base_url=url, timeout=SUBMIT_TIMEOUT_S, limits=limits)))
                for name, url in self.ledger_urls.items()]
            sandbox = await stack.enter_async_context(
                httpx.AsyncClient(base_url=self.sandbox_url, timeout=30))
            await asyncio.gather(*(self._op(op, sem, ledgers, sandbox, phase_start)
                                   for op in self.schedule.ops))

    async def _op(self, op: OpPlan, sem: asyncio.Semaphore,
                  ledgers: list[tuple[str, httpx.AsyncClient]],
                  sandbox: httpx.AsyncClient, phase_start: float) -> None:
        delay = phase_start + op.submit_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the planned submission time
        async with sem:
            await self._arm(op, sandbox)
            op_id = await self._submit(op, ledgers)
        if op_id is not None:
            for f in op.faults:
                if f.kind in ("webhook_forged", "webhook_expired"):
                    await self._bad_webhook(op, f.kind, f.params, sandbox)

    async def _arm(self, op: OpPlan, sandbox: httpx.AsyncClient) -> None:
        for f in op.faults:
            fault = provider_fault(op, f.kind, f.params)
            if fault is None:
                continue
            for _ in range(5):
                try:
                    r = await sandbox.post("/_faults/append", json=fault)
                    r.raise_for_status()
                    self.armed[f.kind] = self.armed.get(f.kind, 0) + 1
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.5)  # the sandbox is never faulted; be patient

    async def _submit(self, op: OpPlan, ledgers: list[tuple[str, httpx.AsyncClient]]
                      ) -> str | None:
        body = {"tool": op.tool, "arguments": op.arguments, "idempotency_key": op.caller_key}
        process = f"client-{op.index % self.concurrency}"
        attempt = 0
        self.submitted += 1
        while True:
            attempt += 1
            name, ledger = ledgers[(op.index + attempt - 1) % len(ledgers)]
            self.history.record(process, "invoke", "submit", op.index, key=op.caller_key,
                                tool=op.tool, attempt=attempt, ledger=name)
            try:
                r = await ledger.post("/v1/intents", json=body)
            except httpx.ConnectError as exc:
                self.history.record(process, "fail", "submit", op.index, key=op.caller_key,
                                    error=f"connect: {type(exc).__name__}")
            except httpx.HTTPError as exc:
                self.history.record(process, "info", "submit", op.index, key=op.caller_key,
                                    error=f"{type(exc).__name__}: {str(exc)[:200]}")
            else:
                if r.status_code in (200, 201):
                    data = r.json()
                    self.history.record(process, "ok", "submit", op.index, key=op.caller_key,
                                        operation_id=data["id"], state=data["state"],
                                        created=r.status_code == 201)
                    self.acked[op.index] = data["id"]
                    self.acked_by[str(data["id"])] = name
                    return str(data["id"])
                kind = "info" if r.status_code >= 500 else "fail"
                self.history.record(process, kind, "submit", op.index, key=op.caller_key,
                                    status=r.status_code, error=r.text[:300])
                if kind == "fail" and r.status_code not in (408, 425, 429):
                    return None  # a definitive refusal of a valid intent: the checker shows it
            if time.monotonic() > self.give_up_at:
                self.history.record(process, "info", "give_up", op.index, key=op.caller_key)
                return None
            await asyncio.sleep(min(2.0, 0.25 * attempt))  # caller backoff

    async def _bad_webhook(self, op: OpPlan, kind: str, params: dict[str, Any],
                           sandbox: httpx.AsyncClient) -> None:
        """A forged or expired webhook that lies about the operation, sent via the sandbox."""
        webhook_id = f"bad-{self.schedule.seed}-{op.index}"
        event = "effect.applied" if params["lie"] == "applied" else "effect.not_applied"
        data = {"id": f"eff_forged_{op.index}", "idempotency_key": op.operation_key,
                "fencing_token": 1, "final": True, "route": op.route,
                "status": "applied" if params["lie"] == "applied" else "refused"}
        result: dict[str, Any] = {"status": None}
        while time.monotonic() < self.give_up_at:
            try:
                r = await sandbox.post("/_webhooks/send", json={
                    "type": event, "data": data, "mode": params["mode"],
                    "webhook_id": webhook_id})
                result = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                result = {"status": None, "error": str(exc)[:200]}
            if result.get("status") is not None:
                break
            await asyncio.sleep(1.0)  # the reconcilers may be down: deliver it when they are up
        entry = {"op": op.index, "kind": kind, "mode": params["mode"], "lie": params["lie"],
                 "webhook_id": webhook_id, "status": result.get("status"),
                 "error": result.get("error")}
        self.bad_webhooks.append(entry)
        self.history.record("webhook-forger", "ok" if result.get("status") else "info",
                            "bad_webhook", op.index, **{k: v for k, v in entry.items()
                                                        if k != "op"})
