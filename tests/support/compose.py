"""infra/compose.yaml as compose reads it: YAML with merge keys, a second file merged over
the first, and `${VAR}` filled from an `.env` made by `effectledger deploy-env`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from effectledger_cli.deploy_env import generate

INFRA = Path(__file__).resolve().parents[2] / "infra"
VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::?[?-][^}]*)?\}")


def interpolated(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:?message}` and `${VAR:-default}`, from the .env values."""
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            assert m.group(1) in env, f"${{{m.group(1)}}} is not made by deploy-env"
            return env[m.group(1)]
        return VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolated(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolated(v, env) for k, v in value.items()}
    return value


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of a second file: mappings merge key by key, volumes by target."""
    out = dict(base)
    for key, value in override.items():
        if key == "volumes" and isinstance(value, list) and isinstance(out.get(key), list):
            targets = {v.split(":")[1]: v for v in out[key]}
            targets.update({v.split(":")[1]: v for v in value})
            out[key] = list(targets.values())
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def load_compose(*names: str) -> tuple[dict[str, Any], dict[str, str]]:
    env = generate()
    doc: dict[str, Any] = {}
    for name in names:
        doc = merged(doc, yaml.safe_load((INFRA / name).read_text()))
    return interpolated(doc, env), env
