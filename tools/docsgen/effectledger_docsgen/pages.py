"""The generated pages: their place in the site (relative to docs/) and what renders them."""

from __future__ import annotations

from collections.abc import Callable

from . import alerts, catalog, cli, http, messages, metrics, settings

PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": lambda: cli.render(),
    "reference/http.md": lambda: http.render(),
    "reference/messages.md": lambda: messages.render(),
    "reference/catalog-fields.md": catalog.render,
    "reference/metrics.md": metrics.render,
    "reference/settings.md": settings.render,
    "operations/alerts.md": lambda: alerts.render(),
}
