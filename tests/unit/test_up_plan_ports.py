"""`up`'s plan: one port for two roles is refused naming both, and the webhook URLs are the
catalog's providers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from effectledger_cli.main import build_parser
from effectledger_cli.up_plan import Refused, UpPlan, plan, webhook_providers
from effectledger_core.catalog import Catalog

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, *flags: str) -> UpPlan:
    return plan(build_parser().parse_args(["up", "--data-dir", str(tmp_path), *flags]))


@pytest.mark.parametrize(("flags", "both"), [
    (["--ledger-port", "20100", "--reconciler-port", "20100"],
     "port 20100 is given to both ledger (--ledger-port) and reconciler webhooks "
     "(--reconciler-port)"),
    (["--sandbox-port", "20200", "--nats-port", "20200"],
     "port 20200 is given to both sandbox (--sandbox-port) and nats (--nats-port)"),
    (["--reconciler-port", "20300", "--reconcilers", "2", "--metrics-port", "20301"],
     "port 20301 is given to both reconciler webhooks 2 (--reconciler-port) and dispatcher "
     "metrics (--metrics-port)"),
])
def test_one_port_for_two_roles_is_refused_naming_both(
        tmp_path: Path, flags: list[str], both: str) -> None:
    with pytest.raises(Refused) as info:
        _plan(tmp_path, *flags)
    assert str(info.value) == f"effectledger up: {both}; give each its own port"
    assert info.value.code == 2
    assert not (tmp_path / "logs").exists()


def test_the_webhook_urls_are_the_catalogs_providers_and_the_sandbox_only_when_it_runs(
        tmp_path: Path) -> None:
    text = (REPO / "tests/e2e/catalog_providers.toml").read_text().replace(
        "@SANDBOX_URL@", "http://127.0.0.1:9")
    (tmp_path / "c.toml").write_text(text)
    catalog = Catalog.load(tmp_path / "c.toml")
    assert webhook_providers(catalog, None, False) == ["github", "stripe", "svix"]
    assert webhook_providers(catalog, json.dumps({"acme": ["whsec_x"]}), True) == [
        "acme", "github", "sandbox", "stripe", "svix"]
