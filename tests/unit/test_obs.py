"""The observability package: metric naming, logs, trace propagation, the health port."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import Counter, Gauge, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from effectledger_obs import logs, metrics, tracing
from effectledger_obs.http import HealthPortError, HealthServer, HttpObservability

FORBIDDEN_LABELS = {"operation_id", "tenant", "operation_key", "attempt_id", "key", "id",
                    "arguments", "path", "url"}


def _families() -> list[Counter | Gauge | Histogram]:
    return [v for v in vars(metrics).values() if isinstance(v, Counter | Gauge | Histogram)]


def test_metric_names_follow_prometheus_conventions_and_labels_are_bounded() -> None:
    families = _families()
    assert len(families) >= 30
    for fam in families:
        [desc] = fam.describe()
        assert desc.name.startswith("effectledger_"), desc.name
        assert desc.documentation, desc.name
        labels = set(fam._labelnames)
        assert not labels & FORBIDDEN_LABELS, (desc.name, labels)
        if isinstance(fam, Histogram):
            assert desc.name.endswith(("_seconds", "_size")), desc.name


def test_exported_names_include_suffixed_samples() -> None:
    names = metrics.exported_names()
    assert "effectledger_transitions_total" in names
    assert "effectledger_provider_call_duration_seconds_bucket" in names
    assert "effectledger_retry_budget_tokens" in names


def test_bounded_maps_unknown_values_to_other() -> None:
    assert metrics.bounded("sandbox", {"sandbox"}) == "sandbox"
    assert metrics.bounded("attacker-chosen-text", {"sandbox"}) == "other"
    assert metrics.bounded(None, {"sandbox"}) == "other"


# ---- logs ----------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_logs_are_one_object_per_line_with_bound_operation_fields(
        restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("INFO", "json", stream=out)
    log = logging.getLogger("effectledger.test")
    with logs.bind(operation_id="op-1", epoch=2, tool="create_ticket", tenant="acme"):
        log.info("transition %s -> %s", "pending", "in_flight", extra={"attempt_id": "a-1"})
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        log.exception("unexpected")
    log.debug("not at this level")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "transition pending -> in_flight"
    assert first["level"] == "INFO" and first["logger"] == "effectledger.test"
    assert (first["operation_id"], first["epoch"], first["attempt_id"], first["tool"],
            first["tenant"]) == ("op-1", 2, "a-1", "create_ticket", "acme")
    assert "operation_id" not in second  # the binding ended with its block
    assert "ValueError" in second["exc_info"]


def test_text_logs_append_the_operation_fields(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("info", "text", stream=out)
    with logs.bind(operation_id="op-9", epoch=1):
        logging.getLogger("x").warning("hello")
    assert out.getvalue().rstrip().endswith("x: hello [operation_id=op-9 epoch=1]")


def test_httpx_request_lines_are_not_logged_at_info(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("DEBUG", "text", stream=out)
    logging.getLogger("httpx").info('HTTP Request: GET http://p/v1?email=canary "200 OK"')
    assert "canary" not in out.getvalue()


def test_bad_log_settings_fail_with_the_setting_named() -> None:
    with pytest.raises(ValueError, match="EFFECTLEDGER_LOG_LEVEL"):
        logs.configure_logging("LOUD", "text")
    with pytest.raises(ValueError, match="EFFECTLEDGER_LOG_FORMAT"):
        logs.configure_logging("INFO", "xml")


# ---- tracing -------------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.configure_tracing("test", exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


def test_tracing_is_off_unless_the_environment_asks() -> None:
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                               "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                               "OTEL_TRACES_EXPORTER": "none"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing.wanted({"EFFECTLEDGER_TRACES_FILE": "/tmp/x"})
    assert not tracing.configure_tracing("svc", env={})
    assert not tracing.ENABLED
    with tracing.span("nothing") as sp:
        assert sp is None
    assert tracing.inject(None) is None
    assert tracing.current_traceparent() is None
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None


def test_context_survives_headers_and_a_stored_traceparent(
        spans: InMemorySpanExporter) -> None:
    with tracing.span("request") as root:
        assert root is not None
        headers = tracing.inject({})
        stored = tracing.current_traceparent()
    assert headers is not None and "traceparent" in headers and stored
    with tracing.span("consume", context=tracing.extract(headers)):
        pass
    with tracing.span("relay publish", context=tracing.context_from_traceparent(stored)):
        ids = tracing.current_ids()
    finished = {s.name: s for s in spans.get_finished_spans()}
    trace_id = finished["request"].context.trace_id
    assert finished["consume"].context.trace_id == trace_id
    assert finished["relay publish"].context.trace_id == trace_id
    assert finished["relay publish"].parent is not None
    assert finished["relay publish"].parent.span_id == finished["request"].context.span_id
    assert ids is not None and ids[0] == format(trace_id, "032x")


def test_trace_file_exporter_writes_one_json_span_per_line(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "spans.jsonl"
    assert tracing.configure_tracing("svc", env={"EFFECTLEDGER_TRACES_FILE": str(path)})
    try:
        with tracing.span("one"), tracing.span("two"):
            pass
    finally:
        tracing.shutdown_tracing()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["two", "one"]
    assert rows[0]["resource"]["attributes"]["service.name"] == "svc"


def test_log_lines_carry_the_trace_id_when_tracing_is_on(
        spans: InMemorySpanExporter, restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("INFO", "json", stream=out)
    with tracing.span("work"):
        logging.getLogger("t").info("inside")
    line = json.loads(out.getvalue())
    [span] = spans.get_finished_spans()
    assert line["trace_id"] == format(span.context.trace_id, "032x")


# ---- HTTP ----------------------------------------------------------------------------------


async def test_health_server_serves_metrics_health_and_readiness() -> None:
    ready = {"nats": True, "ledger": True}

    async def check() -> dict[str, bool]:
        return ready

    server = HealthServer(check, port=0)
    port = await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/readyz")).status_code == 200
            ready["nats"] = False
            r = await client.get("/readyz")
            assert r.status_code == 503 and r.json()["checks"]["nats"] is False
            text = (await client.get("/metrics")).text
            assert "# TYPE effectledger_transitions_total counter" in text
    finally:
        await server.stop()


async def test_http_metrics_use_the_route_template_not_the_path() -> None:
    async def get_op(request: Request) -> JSONResponse:
        return JSONResponse({"id": request.path_params["op"]})

    app = HttpObservability(Starlette(routes=[Route("/v1/operations/{op}", get_op)]))
    before = metrics.HTTP_REQUESTS.labels("/v1/operations/{op}", "GET", "200")._value.get()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/v1/operations/op-secret-id")).status_code == 200
        assert (await client.get("/nowhere")).status_code == 404
    after = metrics.HTTP_REQUESTS.labels("/v1/operations/{op}", "GET", "200")._value.get()
    assert after == before + 1
    from prometheus_client import REGISTRY, generate_latest

    exposition = generate_latest(REGISTRY).decode()
    assert "op-secret-id" not in exposition
    assert 'route="unmatched"' in exposition


async def test_http_requests_join_the_callers_trace_and_probes_make_no_spans(
        spans: InMemorySpanExporter) -> None:
    async def get_op(request: Request) -> JSONResponse:
        return JSONResponse({"id": request.path_params["op"]})

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = HttpObservability(Starlette(routes=[Route("/v1/operations/{op}", get_op),
                                              Route("/healthz", healthz)]))
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        await client.get("/v1/operations/op-1",
                         headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        await client.get("/healthz")
    [span] = spans.get_finished_spans()
    assert span.name == "GET /v1/operations/{op}"
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == parent


async def test_a_health_port_in_use_fails_with_the_setting_named() -> None:
    async def check() -> dict[str, bool]:
        return {}

    first = HealthServer(check, port=0)
    port = await first.start()
    try:
        second = HealthServer(check, port=port, setting="EFFECTLEDGER_DISPATCHER_HEALTH_PORT")
        with pytest.raises(HealthPortError, match="EFFECTLEDGER_DISPATCHER_HEALTH_PORT"):
            await second.start()
    finally:
        await first.stop()


def test_children_of_unsampled_spans_are_skipped_but_the_context_still_travels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # no root is sampled
    exporter = InMemorySpanExporter()
    import os

    tracing.configure_tracing("test", exporter=exporter, env=dict(os.environ))
    try:
        with tracing.span("root") as root:
            assert root is not None and not root.get_span_context().trace_flags.sampled
            headers = tracing.inject({})
        assert headers is not None
        with tracing.span("consume", context=tracing.extract(headers)) as child:
            assert child is None  # never sampled under a parent-based sampler: not made
            passed_on = tracing.inject({})
        assert passed_on == headers  # downstream sees the same unsampled trace
    finally:
        tracing.shutdown_tracing()
    assert exporter.get_finished_spans() == ()
