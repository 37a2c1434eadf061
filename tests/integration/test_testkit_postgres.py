"""The tools' one private-PostgreSQL helper: a cluster that starts, serves, survives a crash
(`stop -m immediate`) with its committed data, and stops."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from effectledger_testkit.postgres import PrivatePostgres, can_start

pytestmark = pytest.mark.skipif(not can_start(),
                                reason="PostgreSQL's initdb (or the postgres user) is missing")


@pytest.fixture
def cluster() -> Iterator[PrivatePostgres]:
    # Not tmp_path: as root the server runs as `postgres`, which cannot enter pytest's 0700 tree.
    root = Path(tempfile.mkdtemp(prefix="effectledger-testkit-pg-"))
    root.chmod(0o755)
    pg = PrivatePostgres(root / "pg", {"fsync": "off", "listen_addresses": "127.0.0.1"})
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_private_cluster_keeps_committed_rows_across_a_crash(cluster: PrivatePostgres) -> None:
    cluster.init()
    cluster.start()
    assert cluster.running()
    url = cluster.create_database("kit")
    assert url == f"postgresql+asyncpg://postgres@127.0.0.1:{cluster.port}/kit"
    cluster.psql("CREATE TABLE t (v int); INSERT INTO t VALUES (41), (1)", db="kit")
    assert cluster.psql("SHOW fsync") == "off"

    cluster.stop_immediate()
    assert not cluster.running()
    cluster.start()
    assert cluster.psql("SELECT sum(v) FROM t", db="kit") == "42"


def test_a_failing_statement_is_a_clear_error(cluster: PrivatePostgres) -> None:
    cluster.init()
    cluster.start()
    with pytest.raises(RuntimeError, match="psql failed"):
        cluster.psql("SELECT * FROM no_such_table")
