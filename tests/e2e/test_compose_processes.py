"""The compose stack's configuration, run as plain processes (no Docker engine needed).

Every service runs with exactly the command and environment infra/compose.yaml gives it,
after `${VAR}` filled from a fresh `effectledger deploy-env`, with only what a container
network provides moved to this machine: the service names (nats, postgres, sandbox,
reconciler) become 127.0.0.1, fixed ports become free ones, the database becomes a fresh one
on the test PostgreSQL, and NATS runs the mounted configuration (nats.conf, or with the cluster
profile nats-cluster.conf on three nodes) with its ports, routes and folder moved.
So the users and passwords, the API tokens, the one-shot migrate and streams steps (services
that may not create streams and a ledger that does not migrate), the provider key and the
webhook secret pairing are all exercised as deployed: demo intents on every kind of tool come
to rest as succeeded, each health check passes, and the streams have one replica, or three
with the cluster profile.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from effectledger_bus.permissions import inbox_prefix
from effectledger_cli import children, healthcheck
from effectledger_cli.embedded import free_port, nats_server_binary
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


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.cluster.yaml")],
                         ids=["single", "cluster"])
def test_the_compose_services_run_the_demo_with_their_compose_configuration(
        tmp_path: Path, database: str, files: tuple[str, ...]) -> None:
    doc, _ = load_compose(*files)
    services: dict[str, dict[str, Any]] = doc["services"]
    nodes = sorted(n for n in services if n == "nats" or n.startswith("nats-"))
    ports = {name: free_port() for name in ("ledger", "sandbox", "reconciler",
                                             "dispatcher-health")}
    for node in nodes:
        for kind in ("client", "monitor", "route"):
            ports[f"{node}/{kind}"] = free_port()
    hosts = {"sandbox": ports["sandbox"], "reconciler": ports["reconciler"],
             **{node: ports[f"{node}/client"] for node in nodes}}
    catalog = tmp_path / "catalog.toml"
    catalog.write_text((INFRA / "catalog.compose.toml").read_text().replace(
        "sandbox:8700", f"127.0.0.1:{ports['sandbox']}"))
    confs = {node: _nats_conf(services[node], node, nodes, ports, tmp_path) for node in nodes}
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
        for node in nodes:
            started.append(children.spawn(node, [nats_server_binary(), "-c", str(confs[node])],
                                          {**base_env, **env_of(node)}, logs))
        for child in started:
            children.wait_listening(child, ports[f"{child.name}/client"], 15)
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
        replicas = asyncio.run(_stream_replicas(env_of("streams")))
        assert set(replicas.values()) == {len(nodes)}, replicas  # 1, or 3 when clustered
    finally:
        children.stop([c for c in started if c.name not in nodes], 10)
        children.stop([c for c in started if c.name in nodes], 5)


def _nats_conf(service: dict[str, Any], node: str, nodes: list[str], ports: dict[str, int],
               tmp_path: Path) -> Path:
    """The node's mounted configuration with its ports, routes and folder moved here."""
    source = next(v.split(":")[0] for v in service["volumes"]
                  if v.split(":")[1] == "/etc/nats/nats.conf")
    text = (INFRA / source).read_text()
    text = text.replace("port: 4222", f"port: {ports[f'{node}/client']}")
    text = text.replace("http_port: 8222", f"http_port: {ports[f'{node}/monitor']}")
    text = text.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{ports[f'{node}/route']}")
    for other in nodes:
        text = text.replace(f"nats-route://{other}:6222",
                            f"nats-route://127.0.0.1:{ports[f'{other}/route']}")
    text = text.replace("store_dir: /data", f'store_dir: "{tmp_path / node}"')
    folder = tmp_path / f"{node}-etc"
    folder.mkdir()
    shutil.copy(INFRA / "nats" / "permissions.conf", folder)  # included beside it
    path = folder / "nats.conf"
    path.write_text(text)
    return path


async def _stream_replicas(env: dict[str, str]) -> dict[str, int]:
    user = env["EFFECTLEDGER_NATS_USER"]
    nc = await nats.connect(env["EFFECTLEDGER_NATS_URL"].split(","), user=user,
                            password=env["EFFECTLEDGER_NATS_PASSWORD"],
                            inbox_prefix=inbox_prefix(user).encode())  # its permitted inbox
    try:
        js = nc.jetstream()
        return {name: (await js.stream_info(name)).config.num_replicas or 0
                for name in ("EFFECTS_DISPATCH", "EFFECTS_EVENTS")}
    finally:
        await nc.close()


def _run_demo(url: str, ledger_env: dict[str, str], started: list[children.Child]) -> None:
    agent_token = next(iter(json.loads(ledger_env["EFFECTLEDGER_AGENT_TOKENS"])))
    with httpx.Client(base_url=url, timeout=10) as anonymous:
        assert anonymous.post("/v1/intents", json={"tool": "create_ticket",
                                                   "arguments": {}}).status_code == 401
    calls = [("create_ticket", {"title": "compose"}),
             ("send_email", {"to": "ops@example.com", "subject": "compose", "body": "hi"}),
             ("charge_card", {"amount": 100, "currency": "EUR"}),
             # readback, form body, webhook
             ("post_message", {"channel": "#ops", "text": "compose"})]
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
    argv = ["effectledger", *_command(service["command"], ports, role)]
    url = healthcheck.endpoint(role, env, argv)
    assert url is not None, name
    assert httpx.get(url, timeout=5).status_code == 200, (name, url)
