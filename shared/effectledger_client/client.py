"""`Client` (sync) and `AsyncClient`: the ledger's HTTP API as typed methods.

Both return the pydantic models of `effectledger_core.views` and raise the typed errors of
`effectledger_client.errors`. A wait is pushed by the ledger (`?wait=`), never polled: `wait`
asks again only when the ledger's own cap on one wait ran out before the caller's timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from effectledger_core.views import (
    Admission,
    Journal,
    OperationPage,
    OperationView,
    Receipt,
    RecoveryView,
    ReviewQueue,
    Stats,
    ToolList,
)

from . import _calls as c
from . import localtokens
from ._aio import AioHttp
from ._calls import Submitted
from .errors import Unavailable

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8600"
# One server-side wait is at most this long; a longer `wait` asks again (the ledger caps it).
MAX_ONE_WAIT_S = 60.0
OnChange = Callable[[OperationView], Any]


def _settings(base_url: str | None, token: str | None) -> tuple[str, dict[str, str]]:
    url = base_url or os.environ.get("EFFECTLEDGER_LEDGER_URL") or DEFAULT_URL
    if token is None:
        token = os.environ.get("EFFECTLEDGER_TOKEN")
    if token is None:  # neither given: the agent token `up` made, for a ledger on loopback
        token = localtokens.find(url)
    return url, ({"Authorization": f"Bearer {token}"} if token else {})


def _unreachable(url: str, exc: Exception) -> Unavailable:
    return Unavailable("unreachable", f"cannot reach the ledger at {url}: {exc}")


class Client:
    """Synchronous client. `Client()` reads EFFECTLEDGER_LEDGER_URL and EFFECTLEDGER_TOKEN
    (else, for a ledger on loopback, the agent token `effectledger up` wrote: localtokens)."""

    def __init__(self, base_url: str | None = None, *, token: str | None = None,
                 timeout_s: float = 10.0, http: httpx.Client | None = None) -> None:
        self.base_url, headers = _settings(base_url, token)
        self.timeout_s = timeout_s
        self._http = http or httpx.Client(base_url=self.base_url, headers=headers,
                                          timeout=timeout_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: c.Call[T], wait_s: float = 0.0) -> T:
        request = call.request(self._http, timeout_s=self.timeout_s, wait_s=wait_s)
        try:
            resp = self._http.send(request)
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url, exc) from exc
        return call.read(c.Answer.of(resp))

    def submit(self, tool: str, arguments: dict[str, Any] | None = None, *,
               idempotency_key: str | None = None, task_id: str | None = None,
               tenant: str | None = None, wait_s: float | None = None,
               join_identical: bool = False, repeat: str | None = None) -> Submitted:
        """Submit an intent; with `wait_s`, answer once it settles or the wait is over.
        `join_identical`: a key-less identical call joins the earlier operation (docs/agents.md,
        "Identical calls"); `repeat` labels a deliberate repeat."""
        return self._send(c.submit(tool, arguments, idempotency_key=idempotency_key,
                                   task_id=task_id, tenant=tenant,
                                   wait_s=min(wait_s or 0, MAX_ONE_WAIT_S),
                                   join_identical=join_identical, repeat=repeat), wait_s or 0)

    def get(self, operation_id: str) -> OperationView:
        return self._send(c.get(operation_id))

    def wait(self, operation_id: str, timeout_s: float, *, on_change: OnChange | None = None,
             current: OperationView | None = None) -> OperationView:
        """The operation once settled (at rest or awaiting approval), else after `timeout_s`
        as it is then (check `.settled`). `on_change` sees every state it passes through.
        `current`: the operation as the caller last saw it (saves a first read)."""
        deadline = time.monotonic() + timeout_s
        op = current or self.get(operation_id)
        while True:
            if on_change is not None:
                on_change(op)
            remaining = deadline - time.monotonic()
            if op.settled or remaining <= 0:
                return op
            one = min(remaining, MAX_ONE_WAIT_S)
            op = self._send(c.get(operation_id, wait_s=one,
                                  changed_from=op.state if on_change else None), one)

    def receipt(self, operation_id: str) -> Receipt:
        return self._send(c.receipt(operation_id))

    def journal(self, operation_id: str) -> Journal:
        return self._send(c.journal(operation_id))

    def recovery(self, operation_id: str) -> RecoveryView:
        return self._send(c.recovery(operation_id))

    def list(self, *, state: str | None = None, limit: int = 100,
             cursor: str | None = None) -> OperationPage:
        return self._send(c.list_operations(state=state, limit=limit, cursor=cursor))

    def approve(self, operation_id: str, *, epoch: int | None = None,
                arguments_digest: str | None = None,
                operator: str | None = None) -> OperationView:
        """Approve exactly the arguments shown (by default: those of the operation now)."""
        if epoch is None or arguments_digest is None:
            op = self.get(operation_id)
            epoch = op.epoch if epoch is None else epoch
            arguments_digest = arguments_digest or op.arguments_digest
        return self._send(c.action(operation_id, "approve", c.operator_body(
            operator, epoch=epoch, arguments_digest=arguments_digest)))

    def reject(self, operation_id: str, *, epoch: int | None = None, reason: str = "",
               operator: str | None = None) -> OperationView:
        epoch = self.get(operation_id).epoch if epoch is None else epoch
        return self._send(c.action(operation_id, "reject", c.operator_body(
            operator, epoch=epoch, reason=reason)))

    def cancel(self, operation_id: str, *, reason: str = "",
               operator: str | None = None) -> OperationView:
        return self._send(c.action(operation_id, "cancel",
                                   c.operator_body(operator, reason=reason)))

    def retry(self, operation_id: str, *, epoch: int | None = None,
              review: str | None = None, evidence_ref: str | None = None,
              operator: str | None = None) -> Admission:
        """Prepare and use one single-use retry plan; a refusal raises `RetryRefused`."""
        body = c.operator_body(operator, epoch=epoch)
        if review is not None:
            body["review"] = c.operator_body(operator, conclusion=review,
                                             evidence_ref=evidence_ref)
        return self._send(c.retry(operation_id, body))

    def use_plan(self, plan_id: str) -> Admission:
        return self._send(c.use_plan(plan_id))

    def review(self, operation_id: str, *, conclusion: str, evidence_ref: str,
               epoch: int | None = None, operator: str | None = None) -> OperationView:
        return self._send(c.action(operation_id, "reviews", c.operator_body(
            operator, conclusion=conclusion, evidence_ref=evidence_ref, epoch=epoch)))

    def review_queue(self, limit: int = 100) -> ReviewQueue:
        return self._send(c.review_queue(limit))

    def tools(self) -> ToolList:
        return self._send(c.tools())

    def stats(self) -> Stats:
        return self._send(c.stats())


class _Httpx:
    """The async client's transport when the caller gives an `httpx.AsyncClient`."""

    errors: tuple[type[Exception], ...] = (httpx.TransportError,)

    def __init__(self, http: httpx.AsyncClient, timeout_s: float) -> None:
        self.http, self.timeout_s = http, timeout_s

    async def send(self, call: c.Call[Any], wait_s: float) -> c.Answer:
        request = call.request(self.http, timeout_s=self.timeout_s, wait_s=wait_s)
        return c.Answer.of(await self.http.send(request))

    async def aclose(self) -> None:
        await self.http.aclose()


class AsyncClient:
    """The same methods as `Client`, awaitable. It sends with aiohttp (`_aio`: a quarter of
    httpx's CPU per request); given `http`, an `httpx.AsyncClient` of the caller's own (a
    custom transport, a proxy, an app served in process), it sends with that."""

    def __init__(self, base_url: str | None = None, *, token: str | None = None,
                 timeout_s: float = 10.0, http: httpx.AsyncClient | None = None) -> None:
        self.base_url, headers = _settings(base_url, token)
        self.timeout_s = timeout_s
        self._transport: AioHttp | _Httpx = (
            AioHttp(self.base_url, headers, timeout_s) if http is None
            else _Httpx(http, timeout_s))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def _send(self, call: c.Call[T], wait_s: float = 0.0) -> T:
        try:
            answer = await self._transport.send(call, wait_s)
        except self._transport.errors as exc:
            raise _unreachable(self.base_url, exc) from exc
        return call.read(answer)

    async def submit(self, tool: str, arguments: dict[str, Any] | None = None, *,
                     idempotency_key: str | None = None, task_id: str | None = None,
                     tenant: str | None = None, wait_s: float | None = None,
                     join_identical: bool = False, repeat: str | None = None) -> Submitted:
        return await self._send(c.submit(tool, arguments, idempotency_key=idempotency_key,
                                         task_id=task_id, tenant=tenant,
                                         wait_s=min(wait_s or 0, MAX_ONE_WAIT_S),
                                         join_identical=join_identical, repeat=repeat),
                                wait_s or 0)

    async def get(self, operation_id: str) -> OperationView:
        return await self._send(c.get(operation_id))

    async def wait(self, operation_id: str, timeout_s: float, *,
                   on_change: Callable[[OperationView], Awaitable[Any] | Any] | None = None,
                   current: OperationView | None = None) -> OperationView:
        deadline = time.monotonic() + timeout_s
        op = current or await self.get(operation_id)
        while True:
            if on_change is not None:
                result = on_change(op)
                if isinstance(result, Awaitable):
                    await result
            remaining = deadline - time.monotonic()
            if op.settled or remaining <= 0:
                return op
            one = min(remaining, MAX_ONE_WAIT_S)
            op = await self._send(c.get(operation_id, wait_s=one,
                                        changed_from=op.state if on_change else None), one)

    async def receipt(self, operation_id: str) -> Receipt:
        return await self._send(c.receipt(operation_id))

    async def journal(self, operation_id: str) -> Journal:
        return await self._send(c.journal(operation_id))

    async def recovery(self, operation_id: str) -> RecoveryView:
        return await self._send(c.recovery(operation_id))

    async def list(self, *, state: str | None = None, limit: int = 100,
                   cursor: str | None = None) -> OperationPage:
        return await self._send(c.list_operations(state=state, limit=limit, cursor=cursor))

    async def approve(self, operation_id: str, *, epoch: int | None = None,
                      arguments_digest: str | None = None,
                      operator: str | None = None) -> OperationView:
        if epoch is None or arguments_digest is None:
            op = await self.get(operation_id)
            epoch = op.epoch if epoch is None else epoch
            arguments_digest = arguments_digest or op.arguments_digest
        return await self._send(c.action(operation_id, "approve", c.operator_body(
            operator, epoch=epoch, arguments_digest=arguments_digest)))

    async def reject(self, operation_id: str, *, epoch: int | None = None, reason: str = "",
                     operator: str | None = None) -> OperationView:
        epoch = (await self.get(operation_id)).epoch if epoch is None else epoch
        return await self._send(c.action(operation_id, "reject", c.operator_body(
            operator, epoch=epoch, reason=reason)))

    async def cancel(self, operation_id: str, *, reason: str = "",
                     operator: str | None = None) -> OperationView:
        return await self._send(c.action(operation_id, "cancel",
                                         c.operator_body(operator, reason=reason)))

    async def retry(self, operation_id: str, *, epoch: int | None = None,
                    review: str | None = None, evidence_ref: str | None = None,
                    operator: str | None = None) -> Admission:
        body = c.operator_body(operator, epoch=epoch)
        if review is not None:
            body["review"] = c.operator_body(operator, conclusion=review,
                                             evidence_ref=evidence_ref)
        return await self._send(c.retry(operation_id, body))

    async def use_plan(self, plan_id: str) -> Admission:
        return await self._send(c.use_plan(plan_id))

    async def review(self, operation_id: str, *, conclusion: str, evidence_ref: str,
                     epoch: int | None = None, operator: str | None = None) -> OperationView:
        return await self._send(c.action(operation_id, "reviews", c.operator_body(
            operator, conclusion=conclusion, evidence_ref=evidence_ref, epoch=epoch)))

    async def review_queue(self, limit: int = 100) -> ReviewQueue:
        return await self._send(c.review_queue(limit))

    async def tools(self) -> ToolList:
        return await self._send(c.tools())

    async def stats(self) -> Stats:
        return await self._send(c.stats())
