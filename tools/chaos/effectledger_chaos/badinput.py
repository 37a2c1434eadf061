"""The bad-input batch: hostile bytes at every entry, sent in the middle of the fault phase.

- JetStream: garbage, a JSON list, a wrong schema version, 50,000-deep JSON, invalid UTF-8,
  malformed JSON and oversized payloads on every consumed subject (dispatch commands, outcomes,
  verdicts, webhook evidence, reconcile commands). Each must end as a `dead_letters` row of the
  consumer that met it, after at most `max_deliver` deliveries, and leave no backlog.
- Payloads over NATS's own limits (the stream's max message size, the server's max payload)
  must be refused at publish.
- Request-reply subjects (intents, claims, operation reads): every bad request gets an error
  reply, and the ledger stays up.
- Webhooks: oversized (declared and chunked), slow bodies, invalid UTF-8, deeply nested JSON and
  wrong schemas (validly signed, so they pass the signature check), an unknown provider: each a
  4xx, never a 5xx, and the endpoint keeps answering while a slow body trickles in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import nats
from nats.errors import NoRespondersError
from standardwebhooks import Webhook

from .stack import SUBJECT_PREFIX, WEBHOOK_PROVIDER, Stack

DEEP = b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
OVERSIZED = json.dumps({"type": "x", "pad": "a" * 300_000}).encode()  # > 256 KiB, < 512 KiB


def _wrong_version(kind: str) -> bytes:
    base: dict[str, Any] = {"schema_version": 2, "operation_id": "bad-op", "epoch": 1}
    if kind == "dispatch":
        base.update(type="dispatch_attempt", operation_key="bad-key", tool="idem_readback",
                     arguments={}, arguments_digest="x", catalog_digest="x",
                     contract_revision="x")
    elif kind == "reconcile":
        base.update(type="reconcile_operation", attempt_id="a", operation_key="bad-key",
                    tool="idem_readback", arguments={}, cause="ambiguous",
                    claimed_at="2026-01-01T00:00:00Z", noticed_at="2026-01-01T00:00:00Z")
    elif kind == "verdict":
        base.update(type="verdict_reached", verdict="applied", reconciler_id="x",
                    at="2026-01-01T00:00:00Z")
    elif kind == "webhook":
        base = {"schema_version": 2, "type": "webhook_received", "provider": "sandbox",
                "webhook_id": "x", "event_type": "effect.applied", "outcome": "applied",
                "body_digest": "x", "signed_at": "2026-01-01T00:00:00Z",
                "received_at": "2026-01-01T00:00:00Z"}
    else:
        base.update(type="attempt_succeeded", attempt_id="a", dispatcher_id="d",
                    at="2026-01-01T00:00:00Z", response_digest="x")
    return json.dumps(base).encode()


POISON: dict[str, Callable[[str], bytes]] = {
    "garbage": lambda k: b"\xff\x00garbage",
    "json_list": lambda k: b"[1, 2]",
    "wrong_schema_version": _wrong_version,
    "deep_json": lambda k: DEEP,
    "invalid_utf8": lambda k: b'{"type": "attempt_succeeded", "operation_id": "\xff\xfe"}',
    "malformed_json": lambda k: b'{"broken": ',
    "oversized": lambda k: OVERSIZED,
}
TARGETS: dict[str, tuple[str, str]] = {  # name -> (subject, consumer expected to dead-letter)
    "dispatch": (f"{SUBJECT_PREFIX}.dispatch.v1.idem_readback", "dispatcher"),
    "outcome": (f"{SUBJECT_PREFIX}.ledger.v1.outcome.attempt_succeeded", "ledger-inbox"),
    "verdict": (f"{SUBJECT_PREFIX}.ledger.v1.verdict", "ledger-inbox"),
    "webhook": (f"{SUBJECT_PREFIX}.ledger.v1.webhook", "ledger-inbox"),
    "reconcile": (f"{SUBJECT_PREFIX}.reconcile.v1.ambiguous", "reconciler"),
}
UNAVAILABLE_WAIT_S = 240.0
RPC = {"intents": f"{SUBJECT_PREFIX}.rpc.v1.intents", "claim": f"{SUBJECT_PREFIX}.rpc.v1.claim",
       "operation": f"{SUBJECT_PREFIX}.rpc.v1.operation"}


class BadInput:
    def __init__(self, stack: Stack, seed: int, log: Callable[[str], None]) -> None:
        self.stack = stack
        self.seed = seed
        self.log = log
        self.results: dict[str, Any] = {"ran": False}

    async def run(self) -> dict[str, Any]:
        self.results = {"ran": True, "jetstream": [], "too_large": [], "rpc": [],
                        "webhooks": [], "took_s": {}}
        await asyncio.gather(self._over_nats(), self._timed("webhooks", self._webhooks()))
        return {"jetstream_messages": len(self.results["jetstream"]),
                "rpc_requests": len(self.results["rpc"]),
                "webhooks": len(self.results["webhooks"])}

    async def _timed(self, name: str, work: Any) -> None:
        t = time.monotonic()
        try:
            await work
        finally:
            self.results["took_s"][name] = round(time.monotonic() - t, 2)

    async def _over_nats(self) -> None:
        nc = await self._connect()
        try:
            await self._timed("jetstream", self._jetstream(nc))
            await self._timed("too_large", self._too_large(nc))
            await self._timed("rpc", self._rpc(nc))
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _connect(self) -> Any:
        deadline = time.monotonic() + 60
        while True:
            try:
                return await nats.connect(self.stack.nats_direct, connect_timeout=2,
                                          **self.stack.harness_options,
                                          max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                          error_cb=_quiet)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)  # the broker may be in one of its outages

    async def _jetstream(self, nc: Any) -> None:
        js = nc.jetstream()
        for target, (subject, consumer) in TARGETS.items():
            for name, make in POISON.items():
                msg_id = f"bad-{self.seed}-{target}-{name}"
                entry: dict[str, Any] = {"target": target, "payload": name,
                                         "subject": subject, "consumer": consumer,
                                         "message_id": msg_id, "published": False}
                for _ in range(30):
                    try:
                        await js.publish(subject, make(target), timeout=5,
                                         headers={"Nats-Msg-Id": msg_id})
                        entry["published"] = True
                        break
                    except Exception as exc:
                        entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                        await asyncio.sleep(1.0)  # broker outage: publish when it is back
                self.results["jetstream"].append(entry)

    async def _too_large(self, nc: Any) -> None:
        js = nc.jetstream()
        subject = TARGETS["dispatch"][0]
        for name, size in (("over_stream_max_msg_size", 600_000),
                           ("over_server_max_payload", 2_000_000)):
            entry: dict[str, Any] = {"payload": name, "bytes": size}
            try:
                await js.publish(subject, b"x" * size, timeout=5,
                                 headers={"Nats-Msg-Id": f"bad-{self.seed}-{name}"})
                entry["refused"] = False
            except Exception as exc:
                entry["refused"] = True
                entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
            self.results["too_large"].append(entry)

    async def _rpc(self, nc: Any) -> None:
        payloads = {
            "garbage": b"\xff\x00garbage", "deep_json": DEEP, "invalid_utf8":
            b'{"tool": "\xff\xfe"}', "wrong_schema_version":
            b'{"schema_version": 2, "tool": "idem_readback", "arguments": {}}',
            "oversized": OVERSIZED, "malformed_json": b'{"tool": '}
        for rpc, subject in RPC.items():
            for name, payload in payloads.items():
                entry: dict[str, Any] = {"rpc": rpc, "payload": name}
                silent = 0
                for _ in range(20):
                    try:
                        msg = await nc.request(subject, payload, timeout=3)
                        reply = json.loads(msg.data)
                        entry["error_reply"] = reply.get("ok") is False
                        entry["code"] = (reply.get("error") or {}).get("code")
                        break
                    except NoRespondersError as exc:
                        entry["error_reply"] = False
                        entry["error"] = type(exc).__name__
                        await asyncio.sleep(1.0)  # the ledger is restarting: ask again
                    except Exception as exc:
                        entry["error_reply"] = False
                        entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                        # Silence is the failure looked for only if it persists while the
                        # ledger answers good requests; else it was paused or restarting.
                        if await self._ledger_answers(nc):
                            silent += 1
                            if silent >= 3:
                                break
                        await asyncio.sleep(1.0)
                self.results["rpc"].append(entry)

    async def _ledger_answers(self, nc: Any) -> bool:
        try:
            msg = await nc.request(RPC["operation"], b'{"operation_id": "control-probe"}',
                                   timeout=3)
            return isinstance(json.loads(msg.data), dict)
        except Exception:
            return False

    # -- webhooks -------------------------------------------------------------------------

    def _signed(self, body: bytes) -> dict[str, str]:
        webhook_id = f"bad-input-{self.seed}-{time.monotonic_ns()}"
        now = datetime.now(UTC)
        # A body that is not UTF-8 cannot be signed as text; it is refused before the check.
        sig = Webhook(self.stack.webhook_secret).sign(webhook_id, now,
                                                      body.decode() if _utf8(body) else "")
        return {"webhook-id": webhook_id, "webhook-timestamp": str(int(now.timestamp())),
                "webhook-signature": sig, "content-type": "application/json"}

    async def _webhooks(self) -> None:
        url = self.stack.reconciler_url(0)
        path = f"/v1/webhooks/{WEBHOOK_PROVIDER}"
        cases: list[tuple[str, dict[str, Any]]] = []
        big = b'{"type": "effect.applied", "pad": "' + b"a" * 2_000_000 + b'"}'
        cases.append(("huge_declared", {"content": big}))

        async def chunks() -> Any:
            yield b'{"type": "effect.applied", "pad": "'
            for _ in range(200):
                yield b"a" * 10_000
            yield b'"}'

        cases.append(("huge_chunked", {"content": chunks()}))
        cases.append(("deep_json_signed", {"content": DEEP, "headers": self._signed(DEEP)}))
        bad_utf8 = b'{"type": "effect.applied", "data": {"id": "\xff\xfe"}}'
        cases.append(("invalid_utf8_signed", {"content": bad_utf8,
                                              "headers": self._signed(bad_utf8)}))
        wrong = b'{"type": 5, "data": []}'
        cases.append(("wrong_schema_signed", {"content": wrong, "headers": self._signed(wrong)}))
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            for name, kwargs in cases:
                entry: dict[str, Any] = {"case": name}
                # A reconciler restarted during a broker outage serves HTTP only once it
                # reaches NATS again: wait for it (the long outage lasts 130 s).
                deadline = time.monotonic() + UNAVAILABLE_WAIT_S
                while time.monotonic() < deadline:
                    try:
                        r = await http.post(path, **kwargs)
                        entry["status"] = r.status_code
                        break
                    except httpx.HTTPError as exc:
                        entry["error"] = f"{type(exc).__name__}"
                        await asyncio.sleep(1.0)  # the reconciler may be restarting
                        if name == "huge_chunked":
                            kwargs = {"content": chunks()}
                self.results["webhooks"].append(entry)
            try:
                r = await http.post("/v1/webhooks/no-such-provider", content=b"{}")
                self.results["webhooks"].append({"case": "unknown_provider",
                                                 "status": r.status_code})
            except httpx.HTTPError as exc:
                self.results["webhooks"].append({"case": "unknown_provider",
                                                 "error": type(exc).__name__})
        self.results["webhooks"].append(await self._slow_body_undisturbed(url, path))

    async def _slow_body_undisturbed(self, url: str, path: str) -> dict[str, Any]:
        """The slow-body check, repeated if a fault paused or killed the reconciler meanwhile
        (a frozen process answers nobody; that is the pause fault, not this check)."""
        target = self.stack.services.get("reconciler-1")
        entry: dict[str, Any] = {}
        for attempt in range(1, 5):
            before = ((len(target.incarnations), target.pauses, target.paused)
                      if target is not None else None)
            entry = await self._slow_body(url, path)
            disturbed = target is not None and (
                before != (len(target.incarnations), target.pauses, False) or not target.alive)
            entry["attempt"] = attempt
            if not disturbed:
                return entry
            await asyncio.sleep(2.0)  # let the fault end, then try again
        entry["disturbed_by_faults"] = True
        return entry

    async def _slow_body(self, url: str, path: str) -> dict[str, Any]:
        """A body trickling in over ~4 s; the endpoint must keep serving others meanwhile."""
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"type": "effect.applied", "data": {}}).encode()
        headers = self._signed(body)
        entry: dict[str, Any] = {"case": "slow_body"}
        deadline = time.monotonic() + UNAVAILABLE_WAIT_S
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    return {**entry, "error": type(exc).__name__}
                await asyncio.sleep(1.0)  # the reconciler is restarting
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
        writer.write(head.encode())
        health: list[float] = []
        try:
            async with httpx.AsyncClient(base_url=url, timeout=5) as http:
                step = max(1, len(body) // 6)
                for i in range(0, len(body), step):
                    writer.write(body[i:i + step])
                    await writer.drain()
                    t = time.monotonic()
                    try:
                        await http.get("/healthz")
                        health.append(round(time.monotonic() - t, 3))
                    except httpx.HTTPError:
                        health.append(-1.0)
                    await asyncio.sleep(0.7)  # the trickle
            line = await asyncio.wait_for(reader.readline(), 10)
            entry["status"] = int(line.split()[1]) if line.startswith(b"HTTP/") else None
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            entry["error"] = type(exc).__name__
        finally:
            writer.close()
        entry["health_latencies_s"] = health
        # A server blocked by the trickle would answer nothing until it ends; a loaded machine
        # may be slow once. So: every probe answered, and most of them quickly.
        entry["stayed_responsive"] = (bool(health) and all(h >= 0 for h in health)
                                      and sorted(health)[len(health) // 2] < 1.0)
        return entry


def _utf8(body: bytes) -> bool:
    try:
        body.decode()
        return True
    except UnicodeDecodeError:
        return False


async def _quiet(_: Exception) -> None:
    return None  # broker outages are expected here; nats-py would print tracebacks
