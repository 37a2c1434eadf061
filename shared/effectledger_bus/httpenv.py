"""What an HTTP client takes from its environment, as httpx did: the proxy (`HTTP_PROXY`,
`HTTPS_PROXY`, `NO_PROXY`, either case) and the CA bundle (`SSL_CERT_FILE`, `SSL_CERT_DIR`,
else certifi's). Both aiohttp clients use it: the dispatcher's and reconciler's provider
session and the agents' async client.

Read once, when a session is built, never per request: aiohttp's own `trust_env` reads the
environment and ~/.netrc again on every request (0.4 ms of CPU per request, measured in the
agents' client: docs/benchmark.md, issue 30 round seven).
"""

from __future__ import annotations

import os
import ssl
import urllib.request

import certifi


def ssl_context() -> ssl.SSLContext:
    """The CA bundle httpx used (certifi), or the operator's, as httpx honoured
    SSL_CERT_FILE and SSL_CERT_DIR."""
    return ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE") or certifi.where(),
                                      capath=os.environ.get("SSL_CERT_DIR"))


class Proxies:
    """The proxy for a scheme and host, from the environment as it was when this was built."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env
        self._by_host: dict[tuple[str, str], str | None] = {}

    def __call__(self, scheme: str, host: str) -> str | None:
        if not self._env:  # the usual case: one dict check per request
            return None
        key = (scheme, host)
        if key not in self._by_host:
            proxy = self._env.get(scheme)
            if proxy and urllib.request.proxy_bypass(host):  # NO_PROXY, once per host
                proxy = None
            self._by_host[key] = proxy
        return self._by_host[key]


def env_proxies() -> Proxies:
    found = urllib.request.getproxies_environment()
    return Proxies({k: v for k, v in found.items() if k in ("http", "https")})
