"""infra/k8s rendered as kubectl would apply it (`kubectl kustomize`), and what a pod's
container would see: its arguments and its environment from ConfigMaps, Secrets and fields."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from effectledger_cli.deploy_env import generate, k8s_files

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
NO_KUBECTL = "kubectl (with its built-in kustomize) is not installed"


def render(overlay: str, tmp_path: Path) -> list[dict[str, Any]]:
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    if overlay == "embedded-demo":  # what `effectledger deploy-env --k8s` writes
        for name, text in k8s_files(generate()).items():
            (tree / "overlays" / overlay / name).write_text(text)
    out = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert found, f"no {kind} {name}"
    return found[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container_env(container: dict[str, Any], docs: list[dict[str, Any]],
                  fields: dict[str, str]) -> dict[str, str]:
    """The environment Kubernetes gives `container`: envFrom ConfigMaps and Secrets, then its
    env list (values, secretKeyRef, configMapKeyRef, fieldRef from `fields`)."""
    def data(kind: str, name: str) -> dict[str, str]:
        doc = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()}
        return dict(doc.get("data", {}))

    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(data("ConfigMap", source["configMapRef"]["name"]))
        else:
            env.update(data("Secret", source["secretRef"]["name"]))
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]
        if "secretKeyRef" in ref:
            key = ref["secretKeyRef"]
            env[item["name"]] = data("Secret", key["name"])[key["key"]]
        elif "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            env[item["name"]] = data("ConfigMap", key["name"])[key["key"]]
        else:
            env[item["name"]] = fields[ref["fieldRef"]["fieldPath"]]
    return env
