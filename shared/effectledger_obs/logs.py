"""Logging for every service: text for a terminal (the default) or JSON lines.

`EFFECTLEDGER_LOG_FORMAT=json` writes one JSON object per line (`python-json-logger`), with a
traceback, when there is one, as one escaped string field. `EFFECTLEDGER_LOG_LEVEL` sets the
level. Lines about an operation carry `operation_id`, `epoch`, `attempt_id`, `tool`, `tenant`
(from `bind(...)` or a call's `extra=`) and, when tracing is on, `trace_id` and `span_id`.

httpx and httpcore log every request line at INFO, query string included; GET tools carry
their arguments there, and arguments may be personal data. They are held at WARNING. Provider
calls go through aiohttp, whose client logs no request lines; httpx still carries the agents'
SDK and the sandbox's webhooks, so its loggers stay quiet here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import IO, Any

from pythonjsonlogger.json import JsonFormatter

from . import tracing

CONTEXT_FIELDS = ("operation_id", "epoch", "attempt_id", "tool", "tenant")
FORMATS = ("text", "json")
# Loggers that would write request URLs (query strings with arguments) or bodies.
QUIET_LOGGERS = ("httpx", "httpcore", "hpack")

_format = "text"  # as configured: announce() writes in the same format

_context: ContextVar[dict[str, Any] | None] = ContextVar("effectledger_log_context",
                                                         default=None)


@contextlib.contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Add operation fields to every log line written inside the block (this task only)."""
    current = _context.get()
    merged = {**(current or {}), **{k: v for k, v in fields.items() if v is not None}}
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Copies the bound operation fields and the current trace ids onto each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _context.get()
        if ctx:
            for key, value in ctx.items():
                if not hasattr(record, key):
                    setattr(record, key, value)
        if tracing.ENABLED and not hasattr(record, "trace_id"):
            ids = tracing.current_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...` with the operation fields that are set."""

    _KEYS = (*CONTEXT_FIELDS, "trace_id")

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={getattr(record, k)}" for k in self._KEYS if hasattr(record, k))
        return f"{line} [{extra}]" if extra else line


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        "{asctime}{levelname}{name}{message}", style="{",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False, json_ensure_ascii=False)


def parse_level(level: str) -> int:
    """A logging level by name; a clear error naming the setting for anything else."""
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"EFFECTLEDGER_LOG_LEVEL: unknown level {level!r} "
                         "(use DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return value


def configure_logging(level: str = "INFO", fmt: str = "text", *,
                      stream: IO[str] | None = None) -> None:
    """Replace the root logger's handlers with one writing `fmt` lines at `level`."""
    if fmt not in FORMATS:
        raise ValueError(f"EFFECTLEDGER_LOG_FORMAT: unknown format {fmt!r} (use text or json)")
    global _format
    numeric = parse_level(level)
    _format = fmt
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))


def announce(message: str) -> None:
    """A line on stdout that supervisors and tests wait for ("ledger ready: ..."), written
    whatever the level, as plain text or, in JSON mode, as a JSON object like the logs."""
    if _format == "json":
        message = json.dumps({"level": "INFO", "logger": "effectledger", "message": message})
    print(message, flush=True)
