"""Provider calls: exactly one HTTP attempt, classified without guessing; and readback.

A timeout is not a failure: the provider may have applied the effect and lost the answer. So an
outcome is `AttemptFailed` only when it is known that nothing was applied (a definitive refusal,
or the request never left this process); whenever it may have been applied it is
`OutcomeAmbiguous` and goes to reconciliation.

Classification. What an HTTP status means is decided by the adapter
(`adapters.classify_http` by default), whose status → failure-class table is
`effectledger_core.failures.HTTP_STATUS_CLASSES`; a 2xx is `AttemptSucceeded` (or
`AttemptAccepted`), a 409 under our own idempotency key and any other 5xx are `OutcomeAmbiguous`.
What happens without a usable status line is decided here:

| what happened                                  | outcome                                   |
|------------------------------------------------|-------------------------------------------|
| 2xx whose body cannot be read fully            | OutcomeAmbiguous invalid_response         |
| refused / DNS / connect timeout                | AttemptFailed transient connect_failed    |
| no pooled connection became free               | AttemptFailed transient pool_timeout      |
| timeout after connecting (read or deadline)    | OutcomeAmbiguous timeout                  |
| connection lost after connecting               | OutcomeAmbiguous connection_lost          |
| request cannot be built (template, env var)    | AttemptFailed invalid_argument,           |
|                                                | code request_build_failed                 |
| `before_write` refused (the send deadline)     | AttemptFailed transient, its code         |

The HTTP client is aiohttp (`session.ProviderSession`); adapters still build `httpx.Request`
values and read `httpx.Response` values, which are plain data here and never sent by httpx.

`code` is the provider's JSON `error.code` if given, else `http_<status>`. Messages are bounded
and scrubbed of every value the request carried in its headers (credentials).
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
import httpx

from effectledger_core.catalog import ENV_REF, Tool
from effectledger_core.failures import Failure, Idempotency
from effectledger_core.ids import Clock, utcnow
from effectledger_core.limits import MAX_HTTP_BODY_BYTES, MAX_PROVIDER_REF_BYTES
from effectledger_core.messages import (
    AttemptAccepted,
    AttemptFailed,
    AttemptSucceeded,
    DispatchAttempt,
    FailureClass,
    Outcome,
    OutcomeAmbiguous,
    storable,
)
from effectledger_core.readbacks import ReadbackResult
from effectledger_core.results import ProviderResult, keep_result
from effectledger_obs import tracing

from .adapters import Classified, ProviderAdapter, load_adapter
from .session import CONNECT_SHARE, PoolTimeout, ProviderClient, ProviderSession

__all__ = ["CONNECT_SHARE", "PER_CLIENT", "ProviderClient", "ProviderSession", "ReadbackResult",
           "SendRefused", "call_provider", "make_client", "make_clients", "parse_retry_after",
           "readback"]

MAX_MESSAGE_CHARS = 1000
MAX_CODE_CHARS = 128
_NOT_SECRET = frozenset({"host", "content-type", "content-length", "accept", "accept-encoding",
                         "connection", "user-agent", "transfer-encoding"})


# Calls in flight on one of `make_clients`' pools before the next pool takes the next call.
PER_CLIENT = 8


def make_client(max_connections: int = 200) -> ProviderSession:
    """A client for provider calls: bounded pool, no redirects followed, no transport retries
    (all set in `session.ProviderSession`)."""
    return ProviderSession(max_connections=max_connections)


def make_clients(max_connections: int, per_client: int = PER_CLIENT) -> list[ProviderSession]:
    """Several small clients to spread a dispatcher's calls over (first with room: see
    `effectledger_dispatcher.ports.HttpProviderCaller`).

    Introduced for httpcore, which checked every pooled connection on every request; aiohttp
    does not, but small pools still keep one slow provider's connections from filling a single
    pool that every call waits on. Together they allow `max_connections`.
    """
    shards = max(1, -(-max_connections // per_client))
    return [make_client(max_connections=per_client * 2) for _ in range(shards)]


def parse_retry_after(value: str, now: datetime) -> float | None:
    """Seconds to wait from a `Retry-After` value (delta-seconds or HTTP-date); None if invalid.

    An HTTP-date is taken relative to `now` (the injected clock); a time in the past gives 0.
    """
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        if now.tzinfo is None:
            now = now.replace(tzinfo=UTC)
        seconds = (when - now).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


class _Body:
    """Digests every byte received; keeps a bounded prefix for reading the answer."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.prefix = bytearray()
        self.size = 0

    async def read(self, chunks: AsyncIterator[bytes]) -> None:
        # Every byte is digested (the evidence), but only MAX_HTTP_BODY_BYTES are kept: a
        # larger answer is read to its end within the deadline and reported as too large.
        async for chunk in chunks:
            self._hash.update(chunk)
            self.size += len(chunk)
            room = MAX_HTTP_BODY_BYTES - len(self.prefix)
            if room > 0:
                self.prefix += chunk[:room]

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


@dataclass
class _Exchange:
    request: httpx.Request
    status: int | None = None  # set as soon as the status line arrived
    headers: httpx.Headers = field(default_factory=httpx.Headers)
    body: _Body = field(default_factory=_Body)
    error: Exception | None = None

    def buffered(self) -> httpx.Response:
        """The answer with its (bounded, decoded) body in memory, for adapters to read."""
        assert self.status is not None
        drop = {"content-encoding", "content-length", "transfer-encoding"}
        headers = [(k, v) for k, v in self.headers.multi_items() if k.lower() not in drop]
        return httpx.Response(self.status, headers=headers, content=bytes(self.body.prefix),
                              request=self.request)


async def _exchange(client: ProviderClient, request: httpx.Request,
                    timeout_s: float, before_write: Callable[[], None] | None = None
                    ) -> _Exchange:
    """Send `request` once and read the whole answer, all within `timeout_s`."""
    ex = _Exchange(request)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.send(request, timeout_s, before_write) as answer:
                ex.status, ex.headers = answer.status, answer.headers
                await ex.body.read(answer.chunks)
    except Exception as exc:  # every failure is classified by the caller, none escapes
        ex.error = exc
    return ex


class SendRefused(Exception):
    """Raised by a `before_write` hook: do not write the request; nothing was sent."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if not text and isinstance(exc, TimeoutError):
        text = "the overall deadline passed"
    return type(exc).__name__ + (f": {text}" if text else "")


def _send_error(exc: Exception) -> Classified:
    """Classify a failure that happened before any status line arrived.

    The question is whether the request may have been sent. aiohttp raises
    `ClientConnectorError` (refused, DNS, TLS: subclasses included) and `ConnectionTimeoutError`
    only while getting a connection, before `before_write` and before any byte; every other
    error (a reset, a read timeout, a closed connection, the overall deadline) may come after
    the request left, so it is ambiguous.
    """
    text = _describe(exc)
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return Classified("failed", failure_class=FailureClass.TRANSIENT, code="connect_failed",
                          message=f"could not connect, nothing was sent: {text}")
    if isinstance(exc, PoolTimeout):
        return Classified("failed", failure_class=FailureClass.TRANSIENT, code="pool_timeout",
                          message=f"no connection became free, nothing was sent: {text}")
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return Classified("failed", failure_class=FailureClass.INVALID_ARGUMENT,
                          code="request_build_failed", message=text)
    if isinstance(exc, TimeoutError):  # SocketTimeoutError (a read) or the overall deadline
        return Classified("ambiguous", reason="timeout",
                          message=f"no answer within the deadline: {text}")
    return Classified("ambiguous", reason="connection_lost",
                      message=f"the connection failed after the request may have been sent: {text}")


def _secrets(tool: Tool, request: httpx.Request | None, env: Mapping[str, str]) -> list[str]:
    """Every value the request's headers carry (or the catalog's would) that could be a secret."""
    dispatcher_set = {h.lower() for h in (tool.idempotency_header, tool.fencing_header) if h}
    values: set[str] = set()
    for name, value in request.headers.multi_items() if request is not None else ():
        if name.lower() in _NOT_SECRET or name.lower() in dispatcher_set:
            continue
        values.add(value)
        values.add(value.partition(" ")[2].strip())  # the token of "Bearer <token>"
    for template in tool.headers.values():
        values.update(env[m.group(1)] for m in ENV_REF.finditer(template) if m.group(1) in env)
    return sorted((v for v in values if len(v) >= 4), key=len, reverse=True)


def _clean(text: str, secrets: Sequence[str], limit: int) -> str:
    for secret in secrets:  # longest first, so a token inside a header value goes too
        text = text.replace(secret, "[redacted]")
    return storable(text)[:limit]


def _clean_ref(ref: str | None, secrets: Sequence[str]) -> str | None:
    """A provider reference is provider text like any other: a provider echoing the API key in
    its `id` or `X-Request-Id` must not put it into the journal and the receipt."""
    return _clean(ref, secrets, MAX_PROVIDER_REF_BYTES) if ref else None


async def call_provider(
    client: ProviderClient, tool: Tool, cmd: DispatchAttempt, *, attempt_id: str,
    dispatcher_id: str, env: Mapping[str, str], clock: Clock = utcnow,
    adapter: ProviderAdapter | None = None, on_sent: Callable[[], None] | None = None,
    before_write: Callable[[], None] | None = None,
) -> Outcome:
    """Make exactly one attempt of `cmd` against the provider and classify the result.

    `on_sent` runs right before the request is handed to the HTTP client (the dispatcher's crash
    point);
    what it raises propagates. `before_write` runs later, immediately before the request's
    first byte is written to the connection (after any connect and TLS handshake; for a request
    with a body it runs twice, the second time as the body is written); if it raises
    `SendRefused`, nothing is sent and the outcome is a transient `AttemptFailed` with its code
    (the dispatcher's send deadline). Cancellation propagates too. Everything else becomes an
    outcome.
    """
    started = time.monotonic()

    def outcome(c: Classified, *, status: int | None = None, digest: str | None = None,
                secrets: Sequence[str] = ()) -> Outcome:
        return _to_outcome(c, cmd=cmd, attempt_id=attempt_id, dispatcher_id=dispatcher_id,
                           at=clock(), status=status, digest=digest, secrets=secrets,
                           duration_ms=(time.monotonic() - started) * 1000)

    try:
        adapter = adapter or load_adapter(tool)
        request = adapter.build_request(tool, cmd, env)
    except Exception as exc:  # TemplateError; CatalogError (env var, adapter); adapter bugs
        return outcome(Classified("failed", failure_class=FailureClass.INVALID_ARGUMENT,
                                  code="request_build_failed",
                                  message=f"nothing was sent: {_describe(exc)}"),
                       secrets=_secrets(tool, None, env))
    secrets = _secrets(tool, request, env)
    tracing.inject(request.headers)  # W3C traceparent for the provider, when tracing is on
    if on_sent is not None:
        on_sent()
    started = time.monotonic()
    ex = await _exchange(client, request, tool.timeout_s, before_write)
    if ex.status is None:
        assert ex.error is not None
        if isinstance(ex.error, SendRefused):
            return outcome(Classified("failed", failure_class=FailureClass.TRANSIENT,
                                      code=ex.error.code, message=ex.error.message),
                           secrets=secrets)
        return outcome(_send_error(ex.error), secrets=secrets)
    status = ex.status
    if ex.error is not None and 200 <= status < 300:
        return outcome(Classified("ambiguous", reason="invalid_response", message=(
            f"HTTP {status} arrived but its body could not be read: {_describe(ex.error)}")),
            status=status, secrets=secrets)
    # Any other status line is the provider's decision, even if its body broke off.
    try:
        classified = adapter.classify(tool, ex.buffered())
    except Exception as exc:
        classified = Classified("ambiguous", reason="invalid_response",
                                message=f"the adapter could not classify: {_describe(exc)}")
    digest = ex.body.digest if ex.error is None else None
    kept = _kept(tool, ex, secrets) if classified.kind == "succeeded" and digest else None
    return _to_outcome(classified, cmd=cmd, attempt_id=attempt_id, dispatcher_id=dispatcher_id,
                       at=clock(), status=status, digest=digest, secrets=secrets,
                       duration_ms=(time.monotonic() - started) * 1000, result=kept)


def _kept(tool: Tool, ex: _Exchange, secrets: Sequence[str]) -> ProviderResult | None:
    """The provider's answer as the agent gets it: bounded per tool, scrubbed, narrowed."""
    if tool.max_result_bytes <= 0 or ex.status is None:
        return None
    if ex.body.size > len(ex.body.prefix):  # only a prefix was kept: the answer is not whole
        return ProviderResult(kind="text", omitted="too_large", bytes=ex.body.size)
    return keep_result(bytes(ex.body.prefix), ex.headers.get("content-type"),
                       limit=tool.max_result_bytes, path=tool.result_path, secrets=secrets)


def _to_outcome(c: Classified, *, cmd: DispatchAttempt, attempt_id: str, dispatcher_id: str,
                at: datetime, status: int | None, digest: str | None, secrets: Sequence[str],
                duration_ms: float, result: ProviderResult | None = None) -> Outcome:
    ref = _clean_ref(c.provider_ref, secrets)
    common: dict[str, Any] = dict(
        operation_id=cmd.operation_id, epoch=cmd.epoch, attempt_id=attempt_id,
        dispatcher_id=dispatcher_id, at=at, http_status=status, provider_ref=ref,
        duration_ms=duration_ms)
    message = _clean(c.message, secrets, MAX_MESSAGE_CHARS)
    if c.kind == "succeeded" and digest is not None:
        return AttemptSucceeded(**common, response_digest=digest, result=result)
    if c.kind == "accepted" and digest is not None:
        return AttemptAccepted(**common, response_digest=digest)
    if c.kind == "failed" and c.failure_class is not None:
        retry_after_s = c.retry_after_s
        if retry_after_s is None and c.retry_after is not None:
            retry_after_s = parse_retry_after(c.retry_after, at)
        code = _clean(c.code or (f"http_{status}" if status else "unknown"), secrets,
                      MAX_CODE_CHARS)
        # Every "failed" classification means the provider refused before applying anything,
        # so this attempt states that sending it again is safe (the class decides if useful).
        failure = Failure(c.failure_class, code, message, retry_after_s=retry_after_s,
                          idempotency=Idempotency.YES)
        return AttemptFailed(
            **common, failure_class=c.failure_class, message=message, code=code,
            retry_after_s=retry_after_s, response_digest=digest,
            idempotency=failure.idempotency.value, guidance=failure.guidance()[:1000])
    if c.kind == "ambiguous" and c.reason is not None:
        return OutcomeAmbiguous(**common, reason=c.reason, message=message)
    return OutcomeAmbiguous(**common, reason="invalid_response", message=_clean(
        f"the adapter's classification {c.kind!r} is incomplete or lacks the body: {c.message}",
        secrets, MAX_MESSAGE_CHARS))


async def readback(
    client: ProviderClient, tool: Tool, operation_key: str, operation_id: str,
    arguments: dict[str, Any], env: Mapping[str, str], adapter: ProviderAdapter | None = None,
) -> ReadbackResult:
    """Ask the provider whether the operation's effect exists (one request, `tool.timeout_s`)."""
    try:
        adapter = adapter or load_adapter(tool)
        request = adapter.build_readback(tool, operation_key, operation_id, arguments, env)
    except Exception as exc:
        return ReadbackResult(None, None, None, None, _clean(
            f"readback_build_failed: {_describe(exc)}", _secrets(tool, None, env),
            MAX_MESSAGE_CHARS))
    if request is None:
        return ReadbackResult(None, None, None, None, "the tool has no readback")
    secrets = _secrets(tool, request, env)
    ex = await _exchange(client, request, tool.timeout_s)
    status = ex.status
    if ex.error is not None:
        return ReadbackResult(None, None, None, status,
                              _clean(_describe(ex.error), secrets, MAX_MESSAGE_CHARS))
    try:
        result = adapter.readback_found(tool, ex.buffered())
    except Exception as exc:
        return ReadbackResult(None, None, ex.body.digest, status, _clean(
            f"the adapter could not read the answer: {_describe(exc)}", secrets,
            MAX_MESSAGE_CHARS))
    ref = _clean_ref(result.provider_ref, secrets)
    refs = tuple(dict.fromkeys(r for r in (_clean_ref(x, secrets) for x in result.provider_refs)
                               if r is not None))
    error = _clean(result.error, secrets, MAX_MESSAGE_CHARS) if result.error else None
    # A readback that found the effect answers what the lost response would have: keep it.
    kept = _kept(tool, ex, secrets) if result.found is True else None
    # The digest is of every byte received, whatever the adapter computed from its bounded view.
    return replace(result, provider_ref=ref, evidence_digest=ex.body.digest, http_status=status,
                   error=error, result=kept, provider_refs=refs)
