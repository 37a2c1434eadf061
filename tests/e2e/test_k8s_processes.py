"""The Kubernetes embedded-demo, run as plain processes (no cluster needed).

The overlay is rendered with `kubectl kustomize`; then every pod's container runs with exactly
its arguments and the environment Kubernetes would give it (ConfigMaps, generated Secrets,
fields), with only what the cluster provides moved to this machine: Service and pod names
become 127.0.0.1 with free ports, the database a fresh one on the test PostgreSQL. NATS runs
the ConfigMap's nats.conf as three clustered nodes. The migration Job runs its init container
and its container, then two ledgers, two dispatchers and two reconcilers (the base's replica
counts) and the sandbox bring demo intents to rest as succeeded, on three-replica streams.
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
from effectledger_cli import children
from effectledger_cli.embedded import free_port, nats_server_binary
from tests.support.k8s import NO_KUBECTL, container_env, find, pod_spec, render
from tests.support.servers import postgres_database
from tests.support.upproc import free_ports_in_a_row

pytestmark = [pytest.mark.slow, pytest.mark.postgres,
              pytest.mark.skipif(shutil.which("kubectl") is None, reason=NO_KUBECTL)]
AT_REST = {"succeeded", "failed", "cancelled", "needs_review"}


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    with postgres_database() as url:
        assert url is not None
        yield url


class Moves:
    """Cluster names and ports -> this machine's loopback and free ports."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.nats = [free_port() for _ in range(3)]
        self.routes = [free_port() for _ in range(3)]
        self.monitor = [free_port() for _ in range(3)]
        self.http = {role: [first + i for i in range(n)] for role, n in replicas.items()
                     for first in [free_ports_in_a_row(n)]}
        self.health = [free_port() for _ in range(replicas["dispatcher"])]

    def value(self, text: str, database: str, catalog: Path) -> str:
        if text.startswith("postgresql+asyncpg://"):
            return database
        if text == "/etc/effectledger/catalog.toml":
            return str(catalog)
        for i, port in enumerate(self.nats):
            text = text.replace(f"nats-{i}.nats-headless:4222", f"127.0.0.1:{port}")
        text = re.sub(r"//reconciler-webhooks:\d+", f"//127.0.0.1:{self.http['reconciler'][0]}",
                      text)
        return re.sub(r"//sandbox:\d+", f"//127.0.0.1:{self.http['sandbox'][0]}", text)

    def nats_conf(self, conf: str, i: int, store: Path) -> str:
        conf = conf.replace("port: 4222", f"port: {self.nats[i]}")
        conf = conf.replace("http_port: 8222", f"http_port: {self.monitor[i]}")
        conf = conf.replace("port: 6222", f"listen: 127.0.0.1:{self.routes[i]}")
        conf = conf.replace("store_dir: /data", f'store_dir: "{store}"')
        for j, port in enumerate(self.routes):
            conf = conf.replace(f"nats-{j}.nats-headless:6222", f"127.0.0.1:{port}")
        return conf


def _args(args: list[str], port: int | None) -> list[str]:
    out = list(args)
    if "--host" in out:
        out[out.index("--host") + 1] = "127.0.0.1"
    if "--port" in out and port is not None:
        out[out.index("--port") + 1] = str(port)
    return out


def test_the_embedded_demo_overlay_runs_as_its_pods_would(tmp_path: Path,
                                                          database: str) -> None:
    docs = render("embedded-demo", tmp_path)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    replicas = {name: d["spec"]["replicas"] for name, d in deployments.items()}
    assert replicas["ledger"] >= 2
    moves = Moves(replicas)
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(moves.value(
        find(docs, "ConfigMap", "effectledger-catalog")["data"]["catalog.toml"], database,
        catalog))
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[children.Child] = []

    def env_for(container: dict[str, Any], pod: str, health: int | None = None
                ) -> dict[str, str]:
        env = container_env(container, docs, {"metadata.name": pod})
        env = {k: moves.value(v, database, catalog) for k, v in env.items()}
        if health is not None:
            env["EFFECTLEDGER_DISPATCHER_HEALTH_PORT"] = str(health)
            env["EFFECTLEDGER_DISPATCHER_HEALTH_HOST"] = "127.0.0.1"
        return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}

    try:
        nats_container = pod_spec(find(docs, "StatefulSet", "nats"))["containers"][0]
        nats_files = find(docs, "ConfigMap", "nats-config")["data"]
        for i in range(3):
            folder = tmp_path / f"nats-{i}-etc"
            folder.mkdir()
            (folder / "permissions.conf").write_text(nats_files["permissions.conf"])
            path = folder / "nats.conf"
            path.write_text(moves.nats_conf(nats_files["nats.conf"], i, tmp_path / f"js-{i}"))
            node = children.spawn(f"nats-{i}", [nats_server_binary(), "-c", str(path)],
                                  env_for(nats_container, f"nats-{i}"), logs)
            started.append(node)
        for node, port in zip(started, moves.nats, strict=True):
            children.wait_listening(node, port, 15)
        job = pod_spec(find(docs, "Job", "effectledger-migrate"))
        for container in job["initContainers"] + job["containers"]:  # in order, as the Job
            step = children.spawn(container["name"], children.cli(*container["args"]),
                                  env_for(container, "migrate"), logs)
            started.append(step)
            assert step.proc.wait(timeout=180) == 0, step.tail()
        for role in ("sandbox", "ledger", "dispatcher", "reconciler"):
            container = pod_spec(deployments[role])["containers"][0]
            for i in range(replicas[role]):
                port = moves.http[role][i] if "--port" in container["args"] else None
                health = moves.health[i] if role == "dispatcher" else None
                child = children.spawn(f"{role}-{i}", children.cli(*_args(container["args"],
                                                                           port)),
                                       env_for(container, f"{role}-{i}", health), logs)
                started.append(child)
                if port is not None:
                    children.wait_listening(child, port, 60)
        env = env_for(pod_spec(deployments["ledger"])["containers"][0], "ledger-0")
        _demo([f"http://127.0.0.1:{p}" for p in moves.http["ledger"]], env, started)
        for role in ("sandbox", "ledger", "dispatcher", "reconciler"):
            _check_probes(role, pod_spec(deployments[role])["containers"][0], moves)
        info = _stream_replicas(moves, env_for(job["containers"][0], "migrate"))
        assert info == {"EFFECTS_DISPATCH": 3, "EFFECTS_EVENTS": 3}
    finally:
        children.stop([c for c in started if not c.name.startswith("nats")], 10)
        children.stop([c for c in started if c.name.startswith("nats")], 5)


def _stream_replicas(moves: Moves, env: dict[str, str]) -> dict[str, int]:
    """Stream name -> replicas, as the cluster reports them (with the streams user)."""
    async def ask() -> dict[str, int]:
        user = env["EFFECTLEDGER_NATS_USER"]
        nc = await nats.connect(f"nats://127.0.0.1:{moves.nats[0]}", user=user,
                                password=env["EFFECTLEDGER_NATS_PASSWORD"],
                                inbox_prefix=inbox_prefix(user).encode())
        try:
            js = nc.jetstream()
            return {name: (await js.stream_info(name)).config.num_replicas or 0
                    for name in ("EFFECTS_DISPATCH", "EFFECTS_EVENTS")}
        finally:
            await nc.close()

    return asyncio.run(ask())


def _demo(urls: list[str], ledger_env: dict[str, str], started: list[children.Child]) -> None:
    token = next(iter(json.loads(ledger_env["EFFECTLEDGER_AGENT_TOKENS"])))
    calls = [("create_ticket", {"title": "k8s"}),
             ("send_email", {"to": "ops@example.com", "subject": "k8s", "body": "hi"}),
             ("charge_card", {"amount": 7, "currency": "EUR"}),
             ("post_message", {"channel": "#ops", "text": "k8s"})]
    ids: list[tuple[str, str]] = []
    deadline = time.monotonic() + 120
    for n, url in enumerate(urls):  # every ledger replica takes intents
        with httpx.Client(base_url=url, timeout=10,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            while http.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, [c.tail() for c in started]
                time.sleep(0.1)  # polling the readiness endpoint
            for i, (tool, args) in enumerate(calls):
                resp = http.post("/v1/intents", json={"tool": tool, "arguments": args,
                                                      "idempotency_key": f"k8s-{n}-{i}"})
                assert resp.status_code == 201, resp.text
                ids.append((url, resp.json()["id"]))
    states: dict[str, str] = {}
    with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {token}"}) as http:
        while time.monotonic() < deadline:
            states = {i: http.get(f"{url}/v1/operations/{i}").json()["state"] for url, i in ids}
            if all(s in AT_REST for s in states.values()):
                break
            time.sleep(0.2)  # polling the API until every operation is at rest
    assert set(states.values()) == {"succeeded"}, (states, [c.tail() for c in started])


def _check_probes(role: str, container: dict[str, Any], moves: Moves) -> None:
    """Every replica answers its container's liveness and readiness probes with 200."""
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert named[get["port"]]  # the probe names a declared port
        ports = moves.health if role == "dispatcher" else moves.http[role]
        for port in ports:
            resp = httpx.get(f"http://127.0.0.1:{port}{get['path']}", timeout=5)
            assert resp.status_code == 200, (role, probe, port, resp.text)
