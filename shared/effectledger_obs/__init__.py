"""Observability shared by every service: Prometheus metrics, OpenTelemetry traces, logs.

`metrics` defines the metrics; `http` serves them (an ASGI route, a small health port);
`tracing` sets up OpenTelemetry from the standard `OTEL_*` variables and carries context in
NATS headers and outbox rows; `logs` configures text or JSON logs with operation context.
"""
