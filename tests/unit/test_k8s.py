"""infra/k8s: both overlays render with kustomize, every resource validates against the
Kubernetes schemas (kubernetes-validate, strict), and the manifests say what the issue asks:
ledger replicas >= 2, PDBs, probes, requests, non-root pods, a migration Job that also applies
the streams, three-node JetStream, a webhook Service, credentials only from Secrets, and
commands and settings the CLI accepts.

Rendering uses `kubectl kustomize` (kustomize is built into kubectl); no renderer on PyPI
renders kustomizations (the `kustomize` package there generates them from Python files)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from effectledger_cli.deploy_env import generate
from effectledger_cli.main import build_parser
from effectledger_core.config import Settings
from tests.support.k8s import K8S, NO_KUBECTL, find, pod_spec, render

COMPOSE_CATALOG = K8S.parent / "catalog.compose.toml"
SERVICES = ("ledger", "dispatcher", "reconciler")
# The sandbox reads its own variables (the dispatcher's health port is a Settings field).
EXTRA_ENV = {"EFFECTLEDGER_SANDBOX_API_KEY",
             "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET", "EFFECTLEDGER_SANDBOX_WEBHOOK_URL",
             "EFFECTLEDGER_SANDBOX_WEBHOOK_ROUTES"}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason=NO_KUBECTL)


@pytest.fixture(params=["embedded-demo", "production"])
def rendered(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param, tmp_path)


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def test_every_resource_validates_against_the_kubernetes_schemas(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any problem


def test_services_are_replicated_probed_budgeted_and_non_root(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    assert find(docs, "Deployment", "ledger")["spec"]["replicas"] >= 2
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
               for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert budgets >= {*SERVICES, "nats"}
    for doc in _workloads(docs):
        pod = pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            requests = c["resources"]["requests"]
            assert requests.get("cpu") and requests.get("memory"), c["name"]
            if doc["kind"] != "Job":
                assert "livenessProbe" in c and "readinessProbe" in c, c["name"]


def test_the_migration_job_migrates_and_then_applies_the_streams(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    pod = pod_spec(find(docs, "Job", "effectledger-migrate"))
    assert [c["args"] for c in pod["initContainers"]] == [["migrate"]]
    assert [c["args"] for c in pod["containers"]] == [["streams", "apply"]]
    config = find(docs, "ConfigMap", "effectledger-config")["data"]
    # services never create or change streams, and the ledger does not migrate by itself
    assert config["EFFECTLEDGER_STREAMS_CREATE_MISSING"] == "false"
    assert config["EFFECTLEDGER_AUTO_MIGRATE"] == "false"
    assert config["EFFECTLEDGER_STREAM_REPLICAS"] == "3"


def test_nats_is_a_three_node_jetstream_cluster_the_services_connect_to(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    sts = find(docs, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    conf = find(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert "jetstream {" in conf
    service = sts["spec"]["serviceName"]
    pods = [f"nats-{i}.{service}" for i in range(3)]
    assert all(f"nats://{p}:6222" in conf for p in pods)
    url = find(docs, "ConfigMap", "effectledger-config")["data"]["EFFECTLEDGER_NATS_URL"]
    assert set(url.split(",")) == {f"nats://{p}:4222" for p in pods}
    assert 'include "permissions.conf"' in conf
    permissions = find(docs, "ConfigMap", "nats-config")["data"]["permissions.conf"]
    assert permissions == (K8S.parent / "nats" / "permissions.conf").read_text()


def test_the_webhook_service_reaches_the_reconcilers_listening_port(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    svc = find(docs, "Service", "reconciler-webhooks")
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "reconciler"}
    container = pod_spec(find(docs, "Deployment", "reconciler"))["containers"][0]
    args = build_parser().parse_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[svc["spec"]["ports"][0]["targetPort"]] == args.reconciler_port
    assert args.reconciler_host == "0.0.0.0"


def test_commands_and_settings_are_the_clis_and_credentials_come_from_secrets(
        rendered: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch) -> None:
    overlay, docs = rendered
    fields = {f"EFFECTLEDGER_{f.upper()}" for f in Settings.model_fields}
    config = find(docs, "ConfigMap", "effectledger-config")["data"]
    for name in [n for n in os.environ if n.startswith("EFFECTLEDGER_")]:
        monkeypatch.delenv(name)
    for key, value in config.items():
        assert key in fields, key
        monkeypatch.setenv(key, value)
    Settings()  # the shared settings validate
    provider_key_users = set()
    for doc in _workloads(docs):
        for c in pod_spec(doc).get("initContainers", []) + pod_spec(doc)["containers"]:
            if c["image"].startswith("nats") or c["image"].startswith("postgres"):
                continue
            build_parser().parse_args(c["args"])  # SystemExit if the CLI rejects them
            for env in c.get("env", []):
                assert env["name"] in fields | EXTRA_ENV, (c["name"], env["name"])
                if env["name"].endswith(("PASSWORD", "TOKENS", "SECRETS", "_KEY", "SECRET",
                                         "DATABASE_URL")):
                    assert "valueFrom" in env, (c["name"], env["name"])  # never a literal
            refs = [e.get("secretRef", {}).get("name", "") for e in c.get("envFrom", [])]
            refs += [e.get("valueFrom", {}).get("secretKeyRef", {}).get("name", "")
                     for e in c.get("env", [])]
            if any(r.startswith("effectledger-provider-keys") for r in refs):
                provider_key_users.add(c["name"])
    expected = {"dispatcher", "reconciler"} | ({"sandbox"} if overlay == "embedded-demo" else set())
    assert provider_key_users == expected
    secrets = [d for d in docs if d["kind"] == "Secret"]
    if overlay == "production":
        assert secrets == []  # created outside this repository
    else:
        assert {s["metadata"]["name"].rsplit("-", 1)[0] for s in secrets} == {
            "effectledger-secrets", "effectledger-provider-keys"}


def test_the_demo_runs_the_full_demo_catalog_against_its_sandbox(tmp_path: Path) -> None:
    docs = render("embedded-demo", tmp_path)
    catalog = find(docs, "ConfigMap", "effectledger-catalog")["data"]["catalog.toml"]
    assert catalog == COMPOSE_CATALOG.read_text()
    svc = find(docs, "Service", "sandbox")
    assert svc["spec"]["ports"][0]["port"] == 8700 and "http://sandbox:8700/" in catalog


def test_the_nats_configmap_loads_in_nats_server_with_the_secrets_passwords(
        tmp_path: Path) -> None:
    from effectledger_cli.embedded import nats_server_binary

    docs = render("production", tmp_path)
    data = find(docs, "ConfigMap", "nats-config")["data"]
    conf = tmp_path / "nats.conf"
    conf.write_text(data["nats.conf"])
    (tmp_path / "permissions.conf").write_text(data["permissions.conf"])
    env = {**os.environ, **generate(), "POD_NAME": "nats-0"}
    checked = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], env=env,
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr + checked.stdout
