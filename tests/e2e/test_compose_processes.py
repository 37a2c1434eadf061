"""The compose stack's configuration, run as plain processes (no Docker engine needed).

Every service runs with exactly the command and environment infra/compose.yaml gives it,
after `${VAR}` filled from a fresh `effectledger deploy-env`, with only what a container
network provides moved to this machine: the service names (nats, postgres, sandbox,
reconciler) become 127.0.0.1, fixed ports become free ones, the database becomes a fresh one
on the test PostgreSQL, and NATS runs infra/nats/nats.conf with its ports and folder moved.
So the users and passwords, the API tokens, the one-shot migrate and streams steps (services
that may not create streams and a ledger that does not migrate), the provider key and the
webhook secret pairing are all exercised as deployed: demo intents on every kind of tool come
to rest as succeeded.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from effectledger_cli import children, healthcheck
from effectledger_cli.embedded import free_port, nats_server_binary
from effectledger_core.config import Settings
from tests.support.compose import INFRA, load_compose
from tests.support.servers import postgres_database

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
AT_REST = {"succeeded", "failed", "cancelled", "needs_review"}


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    with postgres_database() as url:
        assert url is not None
        yield url


def _moved(value: str, hosts: dict[str, int], database: str) -> str:
    if value.startswith("postgresql+asyncpg://"):
        return database
    for host, port in hosts.items():
        value = re.sub(rf"(?<=//){host}:\d+", f"127.0.0.1:{port}", value)
    return value


def _command(command: list[str], ports: dict[str, int], role: str) -> list[str]:
    out = list(command)
    if "--host" in out:
        out[out.index("--host") + 1] = "127.0.0.1"
    if "--port" in out:
        out[out.index("--port") + 1] = str(ports[role])
    return out


def test_the_compose_services_run_the_demo_with_their_compose_configuration(
        tmp_path: Path, database: str) -> None:
    doc, _ = load_compose("compose.yaml")
    services: dict[str, dict[str, Any]] = doc["services"]
    ports = {name: free_port() for name in ("nats", "nats-monitor", "ledger", "sandbox",
                                             "reconciler", "dispatcher-health")}
    hosts = {"nats": ports["nats"], "sandbox": ports["sandbox"],
             "reconciler": ports["reconciler"]}
    catalog = tmp_path / "catalog.toml"
    catalog.write_text((INFRA / "catalog.compose.toml").read_text().replace(
        "sandbox:8700", f"127.0.0.1:{ports['sandbox']}"))
    conf = tmp_path / "nats.conf"
    conf.write_text((INFRA / "nats" / "nats.conf").read_text()
                    .replace("port: 4222", f"port: {ports['nats']}")
                    .replace("http_port: 8222", f"http_port: {ports['nats-monitor']}")
                    .replace("/data", str(tmp_path / "jetstream")))
    logs = tmp_path / "logs"
    logs.mkdir()
    base_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    started: list[children.Child] = []

    def env_of(name: str) -> dict[str, str]:
        env = {k: _moved(str(v), hosts, database)
               for k, v in services[name].get("environment", {}).items()}
        if "EFFECTLEDGER_CATALOG_PATH" in env:
            env["EFFECTLEDGER_CATALOG_PATH"] = str(catalog)
        if "EFFECTLEDGER_DISPATCHER_HEALTH_PORT" in env:
            env["EFFECTLEDGER_DISPATCHER_HEALTH_PORT"] = str(ports["dispatcher-health"])
        return {**base_env, **env}

    def run(name: str) -> children.Child:
        role = services[name]["command"][0]
        child = children.spawn(name, children.cli(*_command(services[name]["command"], ports,
                                                            role)), env_of(name), logs)
        started.append(child)
        return child

    try:
        nats = children.spawn("nats", [nats_server_binary(), "-c", str(conf)],
                              {**base_env, **env_of("nats")}, logs)
        started.append(nats)
        children.wait_listening(nats, ports["nats"], 15)
        for step in ("migrate", "streams"):  # compose: service_completed_successfully
            child = run(step)
            assert child.proc.wait(timeout=120) == 0, child.tail()
        sandbox = run("sandbox")
        children.wait_listening(sandbox, ports["sandbox"], 30)
        ledger = run("ledger")
        children.wait_listening(ledger, ports["ledger"], 60)
        run("dispatcher")
        reconciler = run("reconciler")
        children.wait_listening(reconciler, ports["reconciler"], 60)
        _run_demo(f"http://127.0.0.1:{ports['ledger']}", env_of("ledger"), started)
        for name in ("ledger", "dispatcher", "reconciler", "sandbox"):
            _check_health(name, services[name], env_of(name), ports)
    finally:
        services_first = [c for c in started if c.name != "nats"]
        children.stop(services_first, 10)
        children.stop([c for c in started if c.name == "nats"], 5)


def _run_demo(url: str, ledger_env: dict[str, str], started: list[children.Child]) -> None:
    agent_token = next(iter(json.loads(ledger_env["EFFECTLEDGER_AGENT_TOKENS"])))
    with httpx.Client(base_url=url, timeout=10) as anonymous:
        assert anonymous.post("/v1/intents", json={"tool": "create_ticket",
                                                   "arguments": {}}).status_code == 401
    calls = [("create_ticket", {"title": "compose"}), ("send_email", {"title": "compose"}),
             ("charge_card", {"amount": 100, "currency": "EUR"}),
             ("post_message", {"title": "compose"})]  # readback, form body, webhook
    with httpx.Client(base_url=url, timeout=10,
                      headers={"Authorization": f"Bearer {agent_token}"}) as http:
        deadline = time.monotonic() + 60
        while http.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, [c.tail() for c in started]
            time.sleep(0.1)  # polling the readiness endpoint
        ids = []
        for i, (tool, args) in enumerate(calls):
            resp = http.post("/v1/intents", json={"tool": tool, "arguments": args,
                                                  "idempotency_key": f"compose-{i}"})
            assert resp.status_code == 201, resp.text
            ids.append(resp.json()["id"])
        states: dict[str, str] = {}
        while time.monotonic() < deadline + 60:
            states = {i: http.get(f"/v1/operations/{i}").json()["state"] for i in ids}
            if all(s in AT_REST for s in states.values()):
                break
            for child in started:
                assert child.proc.poll() is None or child.name in ("migrate", "streams"), \
                    child.tail()
            time.sleep(0.2)  # polling the API until every operation is at rest
    assert set(states.values()) == {"succeeded"}, (states, [c.tail() for c in started])


def _check_health(name: str, service: dict[str, Any], env: dict[str, str],
                  ports: dict[str, int]) -> None:
    """The compose health check of `name` (the image's healthcheck module, with the same
    command and environment) finds its service healthy."""
    role = service["command"][0]
    if role == "dispatcher" and "dispatcher_health_port" not in Settings.model_fields:
        return  # no health port in this tree yet: its check would probe nothing
    argv = ["effectledger", *_command(service["command"], ports, role)]
    url = healthcheck.endpoint(role, env, argv)
    assert url is not None, name
    assert httpx.get(url, timeout=5).status_code == 200, (name, url)
