"""End-to-end fixtures: the real services as processes, each test on its own database.

`db_url` is overridden here so that every end-to-end test gets a fresh PostgreSQL database
(dropped afterwards), not the session's shared one: the services migrate it themselves, and
counts such as `/v1/stats` must see only this test's rows.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from effectledger_core.config import Settings
from tests.support.cluster import Cluster
from tests.support.servers import postgres_database
from tests.support.upproc import reaped


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)  # so fixtures can tell whether the test failed
    return report


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
        return
    request.getfixturevalue("pg_url")  # skips, with the reason, when there is no PostgreSQL
    with postgres_database() as url:
        assert url is not None
        yield url


@pytest.fixture
async def make_cluster(settings: Settings, tmp_path: Path, request: pytest.FixtureRequest
                       ) -> AsyncIterator[Callable[..., Cluster]]:
    """`make_cluster(env={...})`: a Cluster with extra EFFECTLEDGER_* defaults for all its
    processes. Every process is stopped afterwards; logs are printed if the test failed."""
    made: list[Cluster] = []

    def make(env: dict[str, str] | None = None) -> Cluster:
        c = Cluster(settings, tmp_path / f"cluster{len(made)}", env=env)
        made.append(c)
        return c

    yield make
    for c in made:
        failed = any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False)
                     for w in ("setup", "call"))
        if failed:
            print(f"\n===== service logs ({c.workdir}) =====\n{c.log_tails(60)}")
        await c.aclose()


@pytest.fixture
async def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    """Sandbox, ledger and one dispatcher, started and ready."""
    c = make_cluster()
    await c.start()
    return c


@pytest.fixture
def running_up() -> Iterator[list[subprocess.Popen[str]]]:
    """The `effectledger up` processes a test starts: each is stopped and reaped afterwards."""
    with reaped() as started:
        yield started
