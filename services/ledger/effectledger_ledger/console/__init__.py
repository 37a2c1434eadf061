"""The operator console (`/console`) and the API's own Swagger UI (`/docs`), both served from
assets in this package, so they work on a network without internet access."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from ..auth import Authenticator
from ..service import LedgerService
from .app import create_console
from .sessions import PREFIX

SWAGGER = f"{PREFIX}/static/swagger"


# FastAPI's own documentation pages load their scripts from a CDN; they are replaced.
CDN_PAGES = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})


async def docs(request: Request) -> HTMLResponse:
    """The API's Swagger UI from the console's vendored assets."""
    app = request.app
    return get_swagger_ui_html(
        openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} — API",
        swagger_js_url=f"{SWAGGER}/swagger-ui-bundle.js",
        swagger_css_url=f"{SWAGGER}/swagger-ui.css",
        swagger_favicon_url=f"{PREFIX}/static/favicon.svg",
        # The validator badge would send the spec to an outside service.
        swagger_ui_parameters={"validatorUrl": None})


def mount(app: FastAPI, service: LedgerService, authenticator: Authenticator) -> None:
    """Mount the console at /console and serve /docs from the vendored Swagger UI instead of
    FastAPI's CDN-loaded one (and drop /redoc, which has no local assets here)."""
    app.router.routes[:] = [r for r in app.router.routes
                            if getattr(r, "path", None) not in CDN_PAGES]
    app.mount(PREFIX, create_console(service, authenticator), name="console")
    app.add_api_route("/docs", docs, include_in_schema=False)
