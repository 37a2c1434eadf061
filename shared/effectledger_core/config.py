"""Configuration from `EFFECTLEDGER_*` environment variables and flags (pydantic-settings).

Credentials and TLS settings for NATS and PostgreSQL come from here, never from code. The
database URL carries PostgreSQL's own options (`?ssl=require` etc. for asyncpg).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from .subjects import Subjects

DEMO_CATALOG = Path(__file__).with_name("demo_catalog.toml")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EFFECTLEDGER_", extra="ignore")

    # storage
    database_url: str = "sqlite+aiosqlite:///effectledger-data/ledger.db"
    auto_migrate: bool = True
    db_pool_size: int = 10

    # broker
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_token: SecretStr | None = None
    nats_creds_file: str | None = None
    nats_tls_ca_file: str | None = None
    nats_tls_cert_file: str | None = None
    nats_tls_key_file: str | None = None
    subject_prefix: str = Field(default="effects", pattern=r"^[a-zA-Z0-9_-]+(\.[a-zA-Z0-9_-]+)*$")
    stream_prefix: str = Field(default="EFFECTS", pattern=r"^[A-Za-z0-9_-]+$")
    stream_storage: str = Field(default="file", pattern="^(file|memory)$")
    stream_replicas: int = 1
    stream_max_age_s: float = 7 * 86400
    duplicate_window_s: float = 120.0

    # catalog
    catalog_path: str = str(DEMO_CATALOG)

    # ledger
    ledger_host: str = "127.0.0.1"
    ledger_port: int = 8600
    relay_batch_size: int = 256
    relay_poll_interval_s: float = 0.5
    relay_lease_s: float = 30.0
    sweep_after_s: float = 60.0
    sweep_interval_s: float = 5.0
    inbox_concurrency: int = 16

    # dispatcher
    dispatcher_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    dispatcher_concurrency: int = 32
    claim_timeout_s: float = 5.0
    ack_wait_s: float = 60.0
    max_deliver: int = 20

    # reconciler
    reconciler_host: str = "127.0.0.1"
    reconciler_port: int = 8800

    log_level: str = "INFO"

    @property
    def subjects(self) -> Subjects:
        return Subjects(prefix=self.subject_prefix, stream_prefix=self.stream_prefix)
