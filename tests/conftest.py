"""Shared fixtures: real PostgreSQL / NATS (or a skip with the reason), isolated per run."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from effectledger_core.config import Settings
from tests.support.servers import nats_server, postgres_database, unique_prefix


@pytest.fixture(scope="session")
def pg_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with postgres_database() as url:
        if url is None:
            pytest.skip("no PostgreSQL: none on 127.0.0.1:5432 (or EFFECTLEDGER_TEST_PG_URL) "
                        "and no Docker engine for testcontainers")
        yield url


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with nats_server(tmp_path_factory.mktemp("nats")) as url:
        if url is None:
            pytest.skip("no NATS: none on 127.0.0.1:4222, no Docker, no nats-server binary")
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each database-backed test runs on the embedded default and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
async def settings(nats_url: str, db_url: str, tmp_path: Path) -> AsyncIterator[Settings]:
    """Settings with a private subject prefix and stream names; streams deleted afterwards."""
    subject_prefix, stream_prefix = unique_prefix()
    s = Settings(database_url=db_url, nats_url=nats_url, subject_prefix=subject_prefix,
                 stream_prefix=stream_prefix, stream_storage="file")
    yield s
    import nats

    from effectledger_bus.streams import delete_streams

    nc = await nats.connect(nats_url)
    try:
        await delete_streams(nc.jetstream(), s)
    finally:
        await nc.close()


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[object]:
    """A migrated ledger store; on PostgreSQL the tables are truncated afterwards."""
    from effectledger_ledger.db.schema import metadata
    from effectledger_ledger.db.store import Store
    from effectledger_ledger.migrate import upgrade

    st = Store(db_url)
    await upgrade(st)
    yield st
    if st.is_postgres:
        import sqlalchemy as sa

        async with st.transaction() as conn:
            names = ", ".join(t.name for t in metadata.sorted_tables)
            await conn.execute(sa.text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    await st.close()


# The modules whose tests run one after another on one worker under `pytest -n 2` (why: below,
# and docs/testing.md). Each also says so with `xdist_group("heavy")`, which xdist on pytest 9.2
# ignores (tests/support/scheduling.py); the collection fails when the two disagree.
HEAVY = "heavy"
HEAVY_MODULES = frozenset({
    "tests/e2e/test_availability.py",
    "tests/e2e/test_bench_agent.py",
    "tests/e2e/test_bench_quick.py",
    "tests/e2e/test_chaos_can_fail.py",
    "tests/e2e/test_chaos_ci.py",
    "tests/e2e/test_chaos_cluster_ci.py",
    "tests/e2e/test_up.py",
})


@pytest.hookimpl(optionalhook=True)  # xdist's hook: no error when xdist is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadgroup` (pyproject.toml) with the heavy modules as one group."""
    if config.getoption("dist") != "loadgroup":
        return None
    from tests.support.scheduling import ModuleGroups

    return ModuleGroups(config, log, HEAVY_MODULES, HEAVY)


def _check_heavy_marks(items: list[pytest.Item]) -> None:
    wrong = sorted({i.nodeid.split("::", 1)[0] for i in items
                    if any(m.args[:1] == (HEAVY,) for m in i.iter_markers("xdist_group"))
                    != (i.nodeid.split("::", 1)[0] in HEAVY_MODULES)})
    if wrong:
        raise pytest.UsageError(
            f"xdist_group({HEAVY!r}) marks and tests/conftest.py's HEAVY_MODULES disagree on "
            f"{', '.join(wrong)}: every test of a listed module carries the mark, no other")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Nothing here may depend on wall-clock sleeps; this only orders the tests.
    #
    # On one process the slow tests run last: the quick ones report first. On two workers
    # (`pytest -n 2`, with `--dist loadgroup` from pyproject.toml) they run first instead:
    # with the longest tests handed out early, the run ends on short unit tests, not on one
    # worker finishing an 80 s end-to-end test while the other waits. Every worker collects
    # and sorts the same way, as xdist requires.
    #
    # Every test runs on whichever worker is free, except those of HEAVY_MODULES (marked
    # `xdist_group("heavy")`): the chaos runs and the benchmarks (each starts a private
    # PostgreSQL, nats-server and a dozen service processes) and the tests that time the
    # services' answers. They run one after another on one worker, first (xdist hands out the
    # largest group first), so no two of them ever compete for the cores. Each worker is its
    # own process with its own session fixtures: its own PostgreSQL database (`pg_url`) and,
    # per test, its own NATS prefix.
    _check_heavy_marks(items)
    slow_first = "PYTEST_XDIST_WORKER" in os.environ
    items.sort(key=lambda i: bool(i.get_closest_marker("slow")) != slow_first)
