"""Provider adapters: how one tool's request is built and its answers are read.

Most providers are described fully by their catalog entry and served by `DeclarativeAdapter`.
A provider the TOML cannot express (request signing, odd status conventions, a readback that
needs two calls) gets an adapter, named in the catalog as `adapter = "package.module:Factory"`
or by the name of an entry point in the `effectledger.adapters` group. `Factory()` must return an
object with the four methods of `ProviderAdapter`.

Adapters only build requests and read responses; they never send anything. `calls.py` sends
exactly one request, digests the bytes it received, removes secrets from
messages, and turns a `Classified` into the outcome message. An adapter's `classify` therefore
decides only *what the answer means*, and must say "ambiguous" whenever the answer does not
prove whether the effect was applied.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import metadata
from typing import Any, Literal, Protocol, runtime_checkable

import httpx

from effectledger_core import urltemplate
from effectledger_core.catalog import TemplateError, Tool, render, resolve_env
from effectledger_core.errors import CatalogError
from effectledger_core.failures import classify_http_status
from effectledger_core.messages import DispatchAttempt, FailureClass
from effectledger_core.readbacks import ReadbackResult as ReadbackResult  # adapters return it
from effectledger_core.readbacks import read_answer

ENTRY_POINT_GROUP = "effectledger.adapters"
AmbiguousReason = Literal["timeout", "connection_lost", "server_error", "invalid_response",
                          "request_in_progress"]


@dataclass(frozen=True)
class Classified:
    """The meaning of one provider answer, before the dispatcher adds the envelope.

    `retry_after` is the raw `Retry-After` header value; the dispatcher resolves it against its
    injected clock. An adapter that computes the delay itself sets `retry_after_s` instead.
    """

    kind: Literal["succeeded", "accepted", "failed", "ambiguous"]
    provider_ref: str | None = None
    failure_class: FailureClass | None = None  # required when kind == "failed"
    code: str = ""
    message: str = ""
    retry_after: str | None = None
    retry_after_s: float | None = None
    reason: AmbiguousReason | None = None  # required when kind == "ambiguous"


@runtime_checkable
class ProviderAdapter(Protocol):
    def build_request(self, tool: Tool, cmd: DispatchAttempt,
                      env: Mapping[str, str]) -> httpx.Request:
        """The one request for this attempt. Raise (TemplateError, CatalogError) if impossible."""
        ...

    def classify(self, tool: Tool, response: httpx.Response) -> Classified:
        """What the answer means. `response.content` holds the (bounded) body."""
        ...

    def build_readback(self, tool: Tool, operation_key: str, operation_id: str,
                       arguments: dict[str, Any], env: Mapping[str, str]) -> httpx.Request | None:
        """A request asking the provider whether the effect exists; None if it cannot say."""
        ...

    def readback_found(self, tool: Tool, response: httpx.Response) -> ReadbackResult:
        """Whether the readback answer shows the effect."""
        ...


# --- reading provider answers, shared by the declarative adapter and custom ones ---

def parse_json(content: bytes) -> tuple[bool, Any]:
    """(True, value) if the body is JSON, else (False, None)."""
    if not content:
        return False, None
    try:
        return True, json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return False, None


def provider_ref_of(body: Any, headers: httpx.Headers) -> str | None:
    """The provider's reference for this answer: the JSON `id`, else the `X-Request-Id` header."""
    if isinstance(body, dict):
        ref = body.get("id")
        if isinstance(ref, str | int) and not isinstance(ref, bool) and str(ref):
            return str(ref)
    return headers.get("x-request-id") or None


def _error_field(body: Any, name: str) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    value = err.get(name) if isinstance(err, dict) else None
    return value if isinstance(value, str) and value else None


def error_message(response: httpx.Response, body: Any) -> str:
    """`HTTP <status>` plus the provider's own explanation, if it gave one."""
    text = _error_field(body, "message")
    if text is None and isinstance(body, dict):
        for key in ("message", "error", "detail"):
            if isinstance(body.get(key), str):
                text = body[key]
                break
    if text is None and body is None and response.content:
        text = " ".join(response.content[:400].decode("utf-8", "replace").split())
    return f"HTTP {response.status_code}" + (f": {text}" if text else "")


def classify_http(tool: Tool, response: httpx.Response) -> Classified:
    """The default reading of an HTTP answer: the status table of `effectledger_core.failures`
    plus the two rules it cannot hold (a 409 under our own key, and 5xx "may have applied")."""
    status = response.status_code
    _, body = parse_json(response.content)
    ref = provider_ref_of(body, response.headers)
    if 200 <= status < 300:
        accepted = status == 202 and tool.capabilities.async_acceptance
        return Classified("accepted" if accepted else "succeeded", provider_ref=ref)
    message = error_message(response, body)
    provider_code = _error_field(body, "code")
    code = provider_code or f"http_{status}"
    if status == 409:
        code = "conflict" + (f":{provider_code}" if provider_code else "")
        if provider_code != "stale_fencing_token" and tool.idempotency_header:
            # With our key sent, a conflict usually means an earlier attempt under the same
            # key is still being processed: that attempt may apply, so nothing is settled.
            return Classified("ambiguous", provider_ref=ref, reason="request_in_progress",
                              message=message)
    retry_after = response.headers.get("retry-after")
    failure_class = classify_http_status(status, retry_after=retry_after is not None)
    if failure_class is not None:
        # Only a rate limit or an overloaded 503 names when to come back.
        return Classified("failed", provider_ref=ref, failure_class=failure_class, code=code,
                          message=message,
                          retry_after=retry_after if status in (429, 503) else None)
    if 500 <= status < 600:
        return Classified("ambiguous", provider_ref=ref, reason="server_error",
                          message=message + " (the provider may have applied the effect)")
    # 1xx, 3xx (redirects are not followed: a 303 after a POST can mean "done, see there"),
    # and non-standard codes prove nothing either way.
    return Classified("ambiguous", provider_ref=ref, reason="invalid_response",
                      message=f"unexpected HTTP status {status}")


def json_path(value: Any, path: str) -> Any:
    """Follow a simple dotted path (`$.data.items`, `$.items.0`); None where it leads nowhere."""
    if not path.startswith("$"):
        raise ValueError(f"json_path {path!r} must start with '$'")
    for part in filter(None, path[1:].split(".")):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


# --- the declarative adapter ---

def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, dict | list):
        raise TemplateError("a form or query value cannot be an object or a nested list")
    return str(value)


def _flat(body: Any) -> dict[str, str | list[str]]:
    if not isinstance(body, dict):
        raise TemplateError("a form body or query must be a table of values")
    return {str(k): [_text(x) for x in v] if isinstance(v, list) else _text(v)
            for k, v in body.items()}


def _headers(tool: Tool, env: Mapping[str, str]) -> httpx.Headers:
    environ = dict(env)
    return httpx.Headers({k: resolve_env(v, environ) for k, v in tool.headers.items()})


@lru_cache(maxsize=1024)
def _parsed(url: str) -> httpx.URL:
    """A rendered URL, parsed once. Most endpoints render to the same string on every call,
    and httpx's parser (with its host checks) was about 60 % of building a request (33 of
    55 us). httpx copies the URL into each request, so the cached one is never changed; a URL
    that fails to parse raises each time, as before."""
    return httpx.URL(url)


class DeclarativeAdapter:
    """Builds requests and reads answers from the catalog entry alone."""

    def build_request(self, tool: Tool, cmd: DispatchAttempt,
                      env: Mapping[str, str]) -> httpx.Request:
        body: Any = cmd.arguments if tool.body is None else render(
            tool.body, operation_key=cmd.operation_key, operation_id=cmd.operation_id,
            epoch=cmd.epoch, arguments=cmd.arguments)
        headers = _headers(tool, env)
        url = _parsed(urltemplate.render(
            urltemplate.parse(tool.endpoint), operation_key=cmd.operation_key,
            operation_id=cmd.operation_id, epoch=cmd.epoch, arguments=cmd.arguments, env=env))
        # A stable key never hurts: send it whenever a header name is configured, whether or
        # not the provider is known to deduplicate by it.
        if tool.idempotency_header:
            headers[tool.idempotency_header] = cmd.operation_key
        if tool.fencing_header:
            headers[tool.fencing_header] = str(cmd.epoch)
        if tool.method == "GET":  # a GET carries its arguments in the query string
            return httpx.Request("GET", url, headers=headers, params=_flat(body))
        if tool.body_encoding == "form":
            return httpx.Request(tool.method, url, headers=headers, data=_flat(body))
        return httpx.Request(tool.method, url, headers=headers, json=body)

    def classify(self, tool: Tool, response: httpx.Response) -> Classified:
        return classify_http(tool, response)

    def build_readback(self, tool: Tool, operation_key: str, operation_id: str,
                       arguments: dict[str, Any], env: Mapping[str, str]) -> httpx.Request | None:
        if tool.readback is None:
            return None
        url = _parsed(urltemplate.render(
            urltemplate.parse(tool.readback.url, allow_epoch=False), operation_key=operation_key,
            operation_id=operation_id, epoch=0, arguments=arguments, env=env))
        return httpx.Request(tool.readback.method, url, headers=_headers(tool, env))

    def readback_found(self, tool: Tool, response: httpx.Response) -> ReadbackResult:
        evidence = "sha256:" + hashlib.sha256(response.content).hexdigest()
        if tool.readback is None:
            return ReadbackResult(None, None, evidence, response.status_code,
                                  "the tool has no readback")
        r = read_answer(tool.readback, response.status_code, response.content,
                        response.headers)
        return replace(r, evidence_digest=evidence, http_status=response.status_code)


# --- loading ---

_DECLARATIVE = DeclarativeAdapter()
_cache: dict[tuple[str, str | None], ProviderAdapter] = {}


def load_adapter(tool: Tool) -> ProviderAdapter:
    """The tool's adapter, built once per tool name (and adapter spec, for catalog reloads)."""
    key = (tool.name, tool.adapter)
    adapter = _cache.get(key)
    if adapter is None:
        adapter = _DECLARATIVE if tool.adapter is None else _load(tool.name, tool.adapter)
        _cache[key] = adapter
    return adapter


def clear_adapter_cache() -> None:
    _cache.clear()


def _factory(spec: str) -> Any:
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise LookupError("expected 'package.module:Factory'")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            return ep.load()
    raise LookupError(f"not a 'package.module:Factory' path, and no entry point of that name "
                      f"in group {ENTRY_POINT_GROUP!r}")


def _load(tool_name: str, spec: str) -> ProviderAdapter:
    where = f"tool {tool_name!r}: adapter {spec!r}"
    try:
        factory = _factory(spec)
    except Exception as exc:
        raise CatalogError(f"{where}: cannot load it: {type(exc).__name__}: {exc}",
                           tool=tool_name, field="adapter") from exc
    if not callable(factory):
        raise CatalogError(f"{where}: {factory!r} is not callable", tool=tool_name,
                           field="adapter")
    try:
        adapter = factory()
    except Exception as exc:
        raise CatalogError(f"{where}: the factory raised {type(exc).__name__}: {exc}",
                           tool=tool_name, field="adapter") from exc
    if not isinstance(adapter, ProviderAdapter):
        missing = [m for m in ("build_request", "classify", "build_readback", "readback_found")
                   if not callable(getattr(adapter, m, None))]
        raise CatalogError(f"{where}: the factory returned {type(adapter).__name__}, which "
                           f"lacks {', '.join(missing)}", tool=tool_name, field="adapter")
    return adapter
