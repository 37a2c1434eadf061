"""OpenTelemetry tracing, configured by the standard `OTEL_*` environment variables.

Off unless configured: with no exporter asked for, no SDK is loaded and every helper here
returns at its first line (`ENABLED` is False), so services pay a flag check per call site.
Tracing is on when one of these is set:

- `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (OTLP over HTTP;
  `OTEL_TRACES_EXPORTER` may be left unset or say `otlp`);
- `OTEL_TRACES_EXPORTER=console`: spans as JSON lines on stderr;
- `EFFECTLEDGER_TRACES_FILE=PATH`: spans as JSON lines appended to PATH as each one ends
  (tests, and a quick look without a collector).

`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off. Sampling follows
`OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (the SDK reads them; default: parent-based,
always on), the service name `OTEL_SERVICE_NAME`, other resource attributes
`OTEL_RESOURCE_ATTRIBUTES`.

Context travels as W3C `traceparent`/`tracestate`: in NATS message headers (`inject`,
`extract`) and in the outbox row (`current_traceparent`, `context_from_traceparent`), so a
command the relay publishes long after the request, or after a restart, joins its trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import IO, TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

ENABLED = False
# With a parent-based sampler (the SDK's default), a child of an unsampled span is never
# sampled: such spans are skipped outright, and their parent's context is passed on instead.
# The SDK would create a non-recording span for each (about 18 us apiece on the benchmark
# machine), which at 1 % sampling is nearly all of tracing's cost.
_PARENT_BASED = True
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
_files: list[IO[str]] = []
_PROPAGATOR = TraceContextTextMapPropagator()

__all__ = ["ENABLED", "SpanKind", "annotate", "configure_tracing", "context_from_traceparent",
           "current_ids", "current_traceparent", "extract", "inject", "shutdown_tracing",
           "span"]


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if env.get("EFFECTLEDGER_TRACES_FILE") or exporter == "console":
        return True
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure_tracing(service_name: str, *, env: Mapping[str, str] | None = None,
                      exporter: SpanExporter | None = None) -> bool:
    """Set up tracing for this process if the environment asks for it; True when on.

    `exporter` (tests) replaces the one the environment names, exported synchronously.
    """
    global ENABLED, _tracer, _provider, _PARENT_BASED
    env = os.environ if env is None else env
    if exporter is None and not wanted(env):
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    shutdown_tracing()  # a previous set-up (tests) flushes and closes first
    attrs: dict[str, str] = {}
    if not env.get("OTEL_SERVICE_NAME"):
        attrs[SERVICE_NAME] = service_name
    provider = TracerProvider(resource=Resource.create(attrs))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif env.get("EFFECTLEDGER_TRACES_FILE"):
        # Each span written as it ends: a local append is cheap, and a process that is killed
        # (or stops on a re-raised SIGTERM, as uvicorn does) loses no batch.
        provider.add_span_processor(SimpleSpanProcessor(_exporter_from(env)))
    else:
        provider.add_span_processor(BatchSpanProcessor(_exporter_from(env)))
    _provider = provider
    _tracer = provider.get_tracer("effectledger")
    with contextlib.suppress(Exception):  # already set in this process (tests): ours is used
        trace.set_tracer_provider(provider)
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    _PARENT_BASED = sampler == "" or sampler.startswith("parentbased_")
    ENABLED = True
    return True


def _exporter_from(env: Mapping[str, str]) -> SpanExporter:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    path = env.get("EFFECTLEDGER_TRACES_FILE")
    if path:
        # Line-buffered, open as long as the exporter: closed by shutdown_tracing().
        out = open(path, "a", encoding="utf-8", buffering=1)
        _files.append(out)
        return ConsoleSpanExporter(out=out, formatter=_one_line)
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        import sys

        return ConsoleSpanExporter(out=sys.stderr, formatter=_one_line)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_* (the SDK's)


def _one_line(span: Any) -> str:
    return str(span.to_json(indent=None)) + "\n"


def shutdown_tracing() -> None:
    """Flush and stop the exporter (at exit; also before re-configuring in tests)."""
    global ENABLED, _tracer, _provider
    ENABLED = False
    _tracer = None
    if _provider is not None:
        _provider.shutdown()
        _provider = None
    while _files:
        _files.pop().close()


@contextlib.contextmanager
def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, context: Context | None = None,
         attributes: Mapping[str, str | int | float | bool] | None = None,
         ) -> Iterator[trace.Span | None]:
    """A span when tracing is on, else nothing (yields None). Exceptions are recorded."""
    if _tracer is None:
        yield None
        return
    if _PARENT_BASED:
        parent = trace.get_current_span(context).get_span_context()
        if parent.is_valid and not parent.trace_flags.sampled:
            if context is None:
                yield None
                return
            token = otel_context.attach(context)  # inject() passes the parent's context on
            try:
                yield None
            finally:
                otel_context.detach(token)
            return
    with _tracer.start_as_current_span(name, context=context, kind=kind,
                                       attributes=dict(attributes or {})) as s:
        yield s


def inject(headers: MutableMapping[str, str] | None = None) -> MutableMapping[str, str] | None:
    """Add the current context's `traceparent` (and `tracestate`) to `headers`.

    Returns `headers` unchanged (None stays None) when tracing is off.
    """
    if not ENABLED:
        return headers
    carrier: MutableMapping[str, str] = {} if headers is None else headers
    _PROPAGATOR.inject(carrier)
    return carrier if carrier else headers


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The context carried by `headers` (a NATS message's or an HTTP request's), if any."""
    if not ENABLED or not headers or "traceparent" not in headers:
        return None
    return _PROPAGATOR.extract(headers)


def current_traceparent() -> str | None:
    """The current span's W3C `traceparent`, to keep in a row and resume later."""
    if not ENABLED:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def context_from_traceparent(traceparent: str | None) -> Context | None:
    if not ENABLED or not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def annotate(**attributes: str | int | float | bool | None) -> None:
    """Add attributes (those not None) to the current span, e.g. the operation id."""
    if not ENABLED:
        return
    current = trace.get_current_span()
    for key, value in attributes.items():
        if value is not None:
            current.set_attribute(f"effectledger.{key}", value)


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, for logs and journal entries."""
    if not ENABLED:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
