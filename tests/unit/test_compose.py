"""infra/compose.yaml (and its cluster profile) checked by parsing against the CLI itself:
every service's command parses with `effectledger`'s own parser, its environment is made of
real settings that validate, its published ports and health check follow from those settings,
and the defaults are secure (credentials from `deploy-env`, nothing open that need not be)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from effectledger_cli import healthcheck
from effectledger_cli.deploy_env import NATS_USERS, generate
from effectledger_cli.main import _settings, build_parser
from effectledger_cli.up_plan import demo_catalog_text
from effectledger_core.catalog import Catalog
from effectledger_core.config import Settings
from effectledger_sandbox import server as sandbox_server
from tests.support.compose import INFRA, load_compose

SANDBOX_ENV = {sandbox_server.API_KEY_ENV, sandbox_server.WEBHOOK_URL_ENV,
               sandbox_server.WEBHOOK_SECRET_ENV, sandbox_server.WEBHOOK_ROUTES_ENV}
# Every variable the services read is a Settings field (the dispatcher's health port too).
EXTRA_ENV: set[str] = set()
NATS_ROLES = {"ledger", "dispatcher", "reconciler", "streams"}
PROVIDER_KEY = sandbox_server.API_KEY_ENV
@pytest.fixture(params=[("compose.yaml",), ("compose.yaml", "compose.cluster.yaml")],
                ids=["single", "cluster"])
def compose(request: pytest.FixtureRequest) -> tuple[dict[str, Any], dict[str, str]]:
    return load_compose(*request.param)


def _apps(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in doc["services"].items() if "build" in s}


def _settings_of(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The Settings the service's own command line and environment produce."""
    for name in [n for n in os.environ if n.startswith("EFFECTLEDGER_")]:
        monkeypatch.delenv(name)
    for name, value in service.get("environment", {}).items():
        monkeypatch.setenv(name, str(value))
    args = build_parser().parse_args(service["command"])
    return _settings(args)


def test_every_service_command_parses_with_the_cli(compose: tuple[dict[str, Any], Any]) -> None:
    doc, _ = compose
    parser = build_parser()
    roles = set()
    for name, service in _apps(doc).items():
        args = parser.parse_args(service["command"])  # SystemExit on an unknown flag
        roles.add(args.command)
        assert name.startswith(args.command), (name, service["command"])
    assert roles == {"migrate", "streams", "ledger", "dispatcher", "reconciler", "sandbox"}


def test_every_effectledger_variable_is_a_setting_that_validates(
        compose: tuple[dict[str, Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    doc, _ = compose
    fields = {f"EFFECTLEDGER_{f.upper()}" for f in Settings.model_fields}
    for name, service in _apps(doc).items():
        env = service.get("environment", {})
        unknown = {k for k in env if k not in fields | SANDBOX_ENV | EXTRA_ENV}
        assert not unknown, (name, unknown)
        if service["command"][0] != "sandbox":
            _settings_of(service, monkeypatch)  # ValidationError on a bad value


def test_published_ports_and_health_checks_follow_the_services_settings(
        compose: tuple[dict[str, Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    doc, _ = compose
    published: dict[str, list[str]] = {}
    for name, service in _apps(doc).items():
        role = service["command"][0]
        if role in ("migrate", "streams"):
            assert service["restart"] == "no" and service["healthcheck"] == {"disable": True}
            continue
        assert service["restart"] == "unless-stopped", name
        test = service["healthcheck"]["test"]
        assert test == ["CMD", "python", "-m", "effectledger_cli.healthcheck", role], name
        url = healthcheck.endpoint(role, {k: str(v) for k, v in
                                          service.get("environment", {}).items()},
                                   ["effectledger", *service["command"]])
        assert url is not None, f"{name}: its health check would probe nothing"
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        if role == "ledger":
            s = _settings_of(service, monkeypatch)
            assert (s.ledger_host, s.ledger_port) == ("0.0.0.0", port)
        elif role == "reconciler":
            s = _settings_of(service, monkeypatch)
            assert (s.reconciler_host, s.reconciler_port) == ("0.0.0.0", port)
        published[role] = service.get("ports", [])
    # Only what must be reachable from outside is published on every interface: the webhook
    # endpoint. The API is on the host's loopback; NATS, PostgreSQL and the sandbox nowhere.
    assert published.pop("reconciler") == ["8800:8800"]
    assert published.pop("ledger") == ["127.0.0.1:8600:8600"]
    assert all(not p for p in published.values()), published
    for name, service in doc["services"].items():
        assert "healthcheck" in service, name
        if name not in _apps(doc):
            assert service["restart"] == "unless-stopped" and "ports" not in service, name


def test_credentials_come_from_deploy_env_and_reach_only_who_uses_them(
        compose: tuple[dict[str, Any], dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    doc, env = compose
    apps = {s["command"][0]: s for s in _apps(doc).values()}
    for role, service in apps.items():
        has_key = PROVIDER_KEY in service.get("environment", {})
        assert has_key == (role in ("dispatcher", "reconciler", "sandbox")), role
    ledger = _settings_of(apps["ledger"], monkeypatch)
    assert ledger.agent_tokens and ledger.operator_tokens  # the API is not open
    for role in NATS_ROLES:
        s = _settings_of(apps[role], monkeypatch)
        assert s.nats_user == role and s.nats_password is not None
        assert s.nats_password.get_secret_value() == env[f"NATS_{role.upper()}_PASSWORD"]
        assert s.streams_create_missing is False, role
    assert set(NATS_USERS) >= NATS_ROLES
    assert 'include "permissions.conf"' in (INFRA / "nats" / "nats.conf").read_text()
    conf = (INFRA / "nats" / "permissions.conf").read_text()
    for role in NATS_ROLES:
        assert f'user: "{role}"\n      password: $NATS_{role.upper()}_PASSWORD' in conf
    # the sandbox signs webhooks with the secret the reconciler verifies, sent to its port
    reconciler = _settings_of(apps["reconciler"], monkeypatch)
    sandbox_env = apps["sandbox"]["environment"]
    secrets = {p: [x.get_secret_value() for x in v]
               for p, v in reconciler.webhook_secrets.items()}
    assert secrets == {"sandbox": [sandbox_env[sandbox_server.WEBHOOK_SECRET_ENV]]}
    assert sandbox_env[sandbox_server.WEBHOOK_URL_ENV] == (
        f"http://reconciler:{reconciler.reconciler_port}/v1/webhooks/sandbox")
    assert doc["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] == \
        env["POSTGRES_PASSWORD"]


def test_the_compose_catalog_is_the_full_demo_catalog_on_the_sandbox_service(
        compose: tuple[dict[str, Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    doc, _ = compose
    apps = {s["command"][0]: s for s in _apps(doc).values()}
    sandbox_port = int(apps["sandbox"]["command"][apps["sandbox"]["command"].index("--port") + 1])
    catalog_file = INFRA / "catalog.compose.toml"
    assert catalog_file.read_text() == demo_catalog_text(sandbox_port, "sandbox")
    for role in ("ledger", "dispatcher", "reconciler"):
        s = _settings_of(apps[role], monkeypatch)
        mounts = {v.split(":")[1]: v.split(":")[0] for v in apps[role]["volumes"]}
        assert mounts[s.catalog_path] == "./catalog.compose.toml", role
    endpoints = {t.endpoint for t in Catalog.load(catalog_file).tools.values()}
    assert endpoints and all(e.startswith(f"http://sandbox:{sandbox_port}/") for e in endpoints)


def test_the_cluster_profile_runs_three_nats_nodes_and_three_replica_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    doc, _ = load_compose("compose.yaml", "compose.cluster.yaml")
    nodes = [n for n in doc["services"] if n.startswith("nats")]
    assert sorted(nodes) == ["nats", "nats-2", "nats-3"]
    conf = (INFRA / "nats" / "nats-cluster.conf").read_text()
    for node in nodes:
        assert f"nats-route://{node}:6222" in conf
        mounts = {v.split(":")[1]: v.split(":")[0] for v in doc["services"][node]["volumes"]}
        assert mounts["/etc/nats/nats.conf"] == "./nats/nats-cluster.conf", node
    names = {doc["services"][n]["environment"]["NATS_SERVER_NAME"] for n in nodes}
    assert len(names) == 3
    for service in _apps(doc).values():
        role = service["command"][0]
        if role in NATS_ROLES:
            s = _settings_of(service, monkeypatch)
            assert s.stream_replicas == 3, role
            assert set(s.nats_url.split(",")) == {f"nats://{n}:4222" for n in nodes}


def test_deploy_env_values_survive_compose_env_file_quoting() -> None:
    from effectledger_cli.deploy_env import render

    env = generate()
    for line in render(env).splitlines():
        if line.startswith("#"):
            continue
        name, _, quoted = line.partition("=")
        assert quoted.startswith("'") and quoted.endswith("'") and "'" not in quoted[1:-1]
        assert quoted[1:-1] == env[name]
    json.loads(env["EFFECTLEDGER_WEBHOOK_SECRETS"])


def test_the_image_holds_only_the_product_and_runs_as_non_root() -> None:
    lines = [line.strip() for line in (INFRA / "Dockerfile").read_text().splitlines()]
    copies = [src for line in lines if line.startswith("COPY ") and "--from=" not in line
              for src in line.split()[1:-1]]
    assert sorted(copies) == ["README.md", "pyproject.toml", "services", "shared"]
    assert sum(line.startswith("FROM ") for line in lines) >= 2  # multi-stage
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"
    assert any(line.startswith("HEALTHCHECK") for line in lines)


@pytest.mark.parametrize("conf", ["nats.conf", "nats-cluster.conf"])
def test_the_nats_configuration_loads_with_the_deploy_env_passwords(conf: str) -> None:
    """nats-server parses each `$NAME` value as configuration: a password it cannot read
    back as a string would stop NATS (and so the stack) at start."""
    import subprocess

    from effectledger_cli.embedded import nats_server_binary

    env = {**os.environ, **generate(), "NATS_SERVER_NAME": "nats-1"}
    for _ in range(20):  # several draws: a bad password is a matter of chance
        env.update(generate())
        checked = subprocess.run([nats_server_binary(), "-c", str(INFRA / "nats" / conf), "-t"],
                                 env=env, capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr + checked.stdout
