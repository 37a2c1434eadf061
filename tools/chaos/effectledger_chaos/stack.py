"""The system under test, as separate processes, wired through the fault proxy.

```
            ┌──────── proxy (own process) ────────┐
services ──▶│ nats ─▶ nats-server (own)           │
ledger   ──▶│ pg   ─▶ PostgreSQL (own cluster)    │
disp/rec ──▶│ provider ─▶ sandbox                 │
sandbox  ──▶│ webhook ─▶ reconciler-1, -2 (failover)
            └─────────────────────────────────────┘
```
On a cluster (`--nats-cluster N`) every node's client port has its own route (`nats`,
`nats-2`, ...) and every route between two nodes runs through its own link (`route-i-j`), so
a node can be cut off from its peers; `--ledgers M` runs M ledger replicas (`ledger`,
`ledger-2`, ...) on one database. The harness itself talks to everything directly (ledger
HTTP, database, NATS, the sandbox's back door), so a network fault never blinds the checker.
Services are configured only through `EFFECTLEDGER_*` variables, as an operator would run them;
secrets go in the environment of the processes that need them, never on a command line.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from effectledger_bus import permissions
from effectledger_cli import files, nats_auth, up_nats
from effectledger_cli.embedded import free_port
from effectledger_core import unsafe
from effectledger_core.subjects import Subjects
from effectledger_testkit.postgres import PrivatePostgres

from . import catalog
from .config import TOOL_TYPES, ChaosConfig
from .natsconn import connect_quiet
from .procs import NatsServer, Service, private_postgres, python_service, wait_port
from .proxy import ProxyClient
from .schedule import ledger_names, nats_names

SUBJECT_PREFIX = "chaos"
STREAM_PREFIX = "CHAOS"
DB_NAME = "chaos"
WEBHOOK_PROVIDER = catalog.WEBHOOK_PROVIDER
# Configured beside the sandbox, bound to no tool: the attacker signs with its secret.
PARTNER_PROVIDER = "partner"
SUBJECTS = Subjects(SUBJECT_PREFIX, STREAM_PREFIX)
# The tenant whose agent credentials the attacker holds, and the harness's own NATS user: it
# reads every stream, deletes messages (stream_delete) and sends bad input, so it may do
# anything; it is the proving ground's observer, not a role of the product.
ATTACKER_TENANT = "mallory"
# An operator-role name: the ledger answers it on the trusted request subjects, in its own
# inbox (`_INBOX_<user>.`, see `harness_options`).
HARNESS_USER = "operator-chaos-harness"
# A cluster's nodes are `chaos-nats-1`, ... to JetStream (stream_info().cluster.leader).
NODE_PREFIX = "chaos-nats"


@dataclass
class ExitRecord:
    service: str
    incarnation: int
    code: int | None
    reason: str | None  # why we expected it; None: nobody signalled it
    at: float  # wall clock
    crash_points: str
    tail: str = ""


@dataclass
class Stack:
    cfg: ChaosConfig
    workdir: Path
    log: Callable[[str], None] = print
    services: dict[str, Service] = field(default_factory=dict)
    exits: list[ExitRecord] = field(default_factory=list)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        # Canaries: planted secrets that must never appear in any log, message or row.
        self.api_key = "sk_canary_" + secrets.token_hex(16)
        raw = secrets.token_bytes(24)
        self.webhook_secret = "whsec_" + base64.b64encode(raw).decode()
        # A second provider the deployment takes Standard Webhooks from, whose secret the
        # attacker holds (attacker.py): its signed events must decide no other provider's tool.
        self.partner_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        self.canaries = {"provider_api_key": self.api_key,
                         "webhook_secret": self.webhook_secret,
                         "webhook_secret_body": self.webhook_secret.removeprefix("whsec_")}
        self.pg: PrivatePostgres | None = None
        self._pg_root: Path | None = None
        # A cluster's first node keeps the single server's name (`nats`), so the faults on
        # "the broker" read the same on both shapes.
        self.nats_nodes = [NatsServer(self.workdir, self.logs, name)
                           for name in nats_names(self.cfg.nats_cluster)]
        self.nats = self.nats_nodes[0]
        self.ports = {name: free_port() for name in (
            "nats_proxy", "pg_proxy", "provider_proxy", "webhook_proxy", "proxy_control",
            "sandbox", "ledger")}
        # Each node's client port gets its own proxy route (`nats`, `nats-2`, ...): services
        # know every node and nats-py moves among them; the net faults on `nats` cut the first.
        self.nats_proxy_ports = [self.ports["nats_proxy"],
                                 *(free_port() for _ in self.nats_nodes[1:])]
        self.ledger_ports = [self.ports["ledger"],
                             *(free_port() for _ in range(self.cfg.ledgers - 1))]
        self.nats_plan = up_nats.NatsPlan(
            [n.port for n in self.nats_nodes],
            [free_port() for _ in self.nats_nodes] if len(self.nats_nodes) > 1 else [])
        # Every route between two nodes runs through its own proxy link (`route-i-j`: from i
        # to j), so one node can be cut off from the others while its clients still reach it.
        self.route_ports = {(i, j): free_port() for i in range(len(self.nats_nodes))
                            for j in range(len(self.nats_nodes)) if i != j}
        self.reconciler_ports = [free_port() for _ in range(self.cfg.reconcilers)]
        self.proxy = ProxyClient(self.ports["proxy_control"])
        self.supervising = False
        self._supervisor: asyncio.Task[None] | None = None
        self.restart_delay: dict[str, float] = {}
        self.auth: nats_auth.AuthFiles | None = None
        if self.cfg.unsafe_nats_without_permissions:
            self.log(unsafe.warning(unsafe.NATS_WITHOUT_PERMISSIONS))
        else:
            self.auth = self._nats_users()
            if not self.clustered:
                self.nats.use_config(self.auth.config)
        if self.clustered:
            self._cluster_configs()

    @property
    def clustered(self) -> bool:
        return len(self.nats_nodes) > 1

    def _cluster_configs(self) -> None:
        """Every node's configuration, rendered by `effectledger up`'s own code (up_nats)
        with the same users and permissions, its routes dialled through the proxy links.

        A route's advertised address is a port nobody listens on: a node that hears of a
        peer through gossip must not open a direct route around the proxy (an implicit route
        is tried once and dropped), so only the configured, proxied routes exist. Clients are
        told no node addresses either (`no_advertise`): they keep to the proxied ones."""
        folder = self.workdir / "nats-cluster"
        folder.mkdir(mode=0o700, exist_ok=True)
        authorization = self.auth.authorization() if self.auth is not None else ""
        n = len(self.nats_nodes)
        for i, node in enumerate(self.nats_nodes):
            routes = [self.route_ports[(i, j)] for j in range(n) if j != i]
            text = up_nats.node_config(
                self.nats_plan, i, node.store, authorization, name=NODE_PREFIX,
                cluster_name="effectledger-chaos", routes=routes,
                cluster_extra=f"advertise: 127.0.0.1:{free_port()}\nno_advertise: true")
            conf = folder / f"{node.name}.conf"
            files.write_private(conf, text)
            node.use_config(conf)

    def node_of_server(self, server_name: str) -> NatsServer | None:
        """The node JetStream calls `server_name` (chaos-nats-2 is the node `nats-2`)."""
        for i, node in enumerate(self.nats_nodes):
            if server_name == f"{NODE_PREFIX}-{i + 1}":
                return node
        return None

    def partition_routes(self, node: NatsServer) -> list[str]:
        """The proxy links of every route to and from `node`."""
        k = self.nats_nodes.index(node)
        return [f"route-{i + 1}-{j + 1}" for (i, j) in self.route_ports if k in (i, j)]

    def _nats_users(self) -> nats_auth.AuthFiles:
        """The product's users and permissions (as `effectledger up` makes them), one per
        service, plus the harness's own."""
        harness = permissions.Principal(
            permissions.Role.OPERATOR, HARNESS_USER,
            permissions.Permissions(publish=(">",), subscribe=(">",)))
        product = permissions.plane(
            SUBJECTS, dispatchers=[f"dispatcher-{i + 1}" for i in range(self.cfg.dispatchers)],
            reconcilers=[f"reconciler-{i + 1}" for i in range(self.cfg.reconcilers)],
            tenants=[ATTACKER_TENANT], others=[harness])
        return nats_auth.write(self.workdir / "nats-auth", product, SUBJECTS,
                               host="127.0.0.1", port=self.nats.port, store_dir=self.nats.store,
                               url=self.nats_plan.url if self.clustered else None,
                               server=not self.clustered)

    def nats_env(self, user: str) -> dict[str, str]:
        """A service's own NATS user (nothing when the broker runs open)."""
        if self.auth is None:
            return {}
        cred = self.auth.credentials[user]
        return {"EFFECTLEDGER_NATS_USER": cred.user, "EFFECTLEDGER_NATS_PASSWORD": cred.password}

    def credential(self, user: str) -> permissions.Credential | None:
        return None if self.auth is None else self.auth.credentials[user]

    # -- addresses ------------------------------------------------------------------------

    @property
    def ledger_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['ledger']}"

    @property
    def ledger_urls(self) -> dict[str, str]:
        """Every ledger replica's intake, by service name."""
        return {name: f"http://127.0.0.1:{port}"
                for name, port in zip(ledger_names(self.cfg.ledgers), self.ledger_ports,
                                      strict=True)}

    @property
    def sandbox_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['sandbox']}"

    @property
    def provider_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['provider_proxy']}"

    @property
    def nats_direct(self) -> list[str]:
        """The harness's server list, every node (with its credentials when the broker has
        users): it reads and deletes around the proxy, whichever node is down."""
        cred = self.credential(HARNESS_USER)
        auth = "" if cred is None else f"{cred.user}:{cred.password}@"
        return [f"nats://{auth}127.0.0.1:{n.port}" for n in self.nats_nodes]

    @property
    def harness_options(self) -> dict[str, Any]:
        """nats-py options for the harness's requests to the ledger: replies come to its own
        inbox, the only place the ledger answers it when the broker has users."""
        if self.auth is None:
            return {}
        return {"inbox_prefix": permissions.inbox_prefix(HARNESS_USER).encode()}

    @property
    def db_direct(self) -> str:
        if self.pg is not None:
            return self.pg.url(DB_NAME)
        if self.cfg.database_url:
            return self.cfg.database_url
        return f"sqlite+aiosqlite:///{self.workdir / 'ledger.db'}"

    @property
    def db_for_services(self) -> str:
        if self.pg is not None:
            return self.pg.url(DB_NAME, port=self.ports["pg_proxy"])
        return self.db_direct

    def reconciler_url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.reconciler_ports[i]}"

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- start ----------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
        env.update({
            "PYTHONUNBUFFERED": "1",
            "EFFECTLEDGER_DATABASE_URL": self.db_for_services,
            "EFFECTLEDGER_NATS_URL": ",".join(f"nats://127.0.0.1:{p}"
                                              for p in self.nats_proxy_ports),
            "EFFECTLEDGER_STREAM_REPLICAS": str(self.cfg.stream_replicas),
            "EFFECTLEDGER_SUBJECT_PREFIX": SUBJECT_PREFIX,
            "EFFECTLEDGER_STREAM_PREFIX": STREAM_PREFIX,
            "EFFECTLEDGER_STREAM_STORAGE": "file",
            "EFFECTLEDGER_CATALOG_PATH": str(self.workdir / "catalog.toml"),
            "EFFECTLEDGER_LEDGER_HOST": "127.0.0.1",
            "EFFECTLEDGER_LEDGER_PORT": str(self.ports["ledger"]),
            "EFFECTLEDGER_LOG_LEVEL": "INFO",
            **self.cfg.timing.env(),
        })
        return env

    async def start(self) -> None:
        (self.workdir / "catalog.toml").write_text(
            catalog.render(self.provider_url, self.cfg.timing))
        # The database, then the proxy (it needs the database's port), then the broker: a
        # cluster's routes run through the proxy.
        await self._start_database()
        self._start_proxy()
        await self.services["proxy"].wait_ready(30)
        await asyncio.gather(*(n.start() for n in self.nats_nodes))
        await self.wait_jetstream(60)
        base = self._base_env()
        self._start_sandbox(base)
        await self.services["sandbox"].wait_ready(30)
        await self._configure_sandbox()
        ledgers = []
        for name, port in zip(ledger_names(self.cfg.ledgers), self.ledger_ports, strict=True):
            # Replicas share the database and the ledger's NATS user (one role).
            ledger = python_service(name, "ledger", ["-m", "effectledger_cli", "ledger"],
                                    {**base, **self.nats_env("ledger"),
                                     "EFFECTLEDGER_LEDGER_PORT": str(port)},
                                    self.logs, self.workdir,
                                    # It accepts intents from then on, with or without NATS.
                                    b"ledger listening:")
            self.services[name] = ledger
            ledgers.append(ledger)
        # One at a time: the first applies the database migrations.
        for ledger in ledgers:
            ledger.start()
            await ledger.wait_ready(90)
        for i in range(self.cfg.dispatchers):
            name = f"dispatcher-{i + 1}"
            env = {**base, **self.nats_env(name), "EFFECTLEDGER_DISPATCHER_ID": name,
                   "EFFECTLEDGER_DISPATCHER_CONCURRENCY": "16",
                   catalog.API_KEY_ENV: self.api_key}
            if self.cfg.unsafe_skip_claim:
                env[unsafe.SKIP_CLAIM.env] = "1"
            if self.cfg.unsafe_no_send_deadline:
                env[unsafe.NO_SEND_DEADLINE.env] = "1"
            self.services[name] = python_service(
                name, "dispatcher", ["-m", "effectledger_cli", "dispatcher"], env, self.logs,
                self.workdir, f"dispatcher ready: {name}".encode())
        for i in range(self.cfg.reconcilers):
            name = f"reconciler-{i + 1}"
            env = {**base, **self.nats_env(name), "EFFECTLEDGER_RECONCILER_ID": name,
                   "EFFECTLEDGER_RECONCILER_PORT": str(self.reconciler_ports[i]),
                   "EFFECTLEDGER_WEBHOOK_SECRETS": json.dumps(
                       {WEBHOOK_PROVIDER: [self.webhook_secret],
                        PARTNER_PROVIDER: [self.partner_secret]}),
                   # The native (Stripe-scheme) provider signs with the same secret string.
                   catalog.NATIVE_SECRET_ENV: self.webhook_secret,
                   catalog.API_KEY_ENV: self.api_key}
            if self.cfg.unsafe_skip_webhook_verification:
                env[unsafe.SKIP_WEBHOOK_VERIFICATION.env] = "1"
            self.services[name] = python_service(
                name, "reconciler", ["-m", "effectledger_cli", "reconciler"], env, self.logs,
                self.workdir, b"reconciler ready:")
        workers = [s for s in self.services.values() if s.kind in ("dispatcher", "reconciler")]
        for s in workers:
            s.start()
        await asyncio.gather(*(s.wait_ready(90) for s in workers))
        for node in self.nats_nodes:
            self.services[node.name] = node.service
        for name in self.services:
            self.locks[name] = asyncio.Lock()
        self.locks["postgres"] = asyncio.Lock()
        # Every fault on the broker (whole or one node) holds this: one at a time, so a
        # cluster of three never has two nodes faulted at once.
        self.locks["broker"] = asyncio.Lock()
        for route in ("nats", "pg", "provider", "webhook"):
            self.locks[f"route:{route}"] = asyncio.Lock()

    async def _start_database(self) -> None:
        if self.cfg.database == "sqlite" or self.cfg.database_url:
            return
        # PostgreSQL runs as the postgres user: its folder lives under /tmp, which it can reach.
        self._pg_root = Path(tempfile.mkdtemp(prefix="effectledger-chaos-pg-"))
        self.pg = private_postgres(self._pg_root)
        await asyncio.to_thread(self.pg.init)
        await asyncio.to_thread(self.pg.start)
        await asyncio.to_thread(self.pg.create_database, DB_NAME)

    def _start_proxy(self) -> None:
        routes = [f"{node.name}={port}:{node.port}"
                  for node, port in zip(self.nats_nodes, self.nats_proxy_ports, strict=True)]
        routes += [f"route-{i + 1}-{j + 1}={port}:{self.nats_plan.cluster_ports[j]}"
                   for (i, j), port in self.route_ports.items()]
        routes += [f"provider={self.ports['provider_proxy']}:{self.ports['sandbox']}",
                   "webhook={}:{}".format(self.ports["webhook_proxy"],
                                          ",".join(map(str, self.reconciler_ports)))]
        if self.pg is not None:
            routes.append(f"pg={self.ports['pg_proxy']}:{self.pg.port}")
        args = ["-m", "effectledger_chaos.proxy", "--control", str(self.ports["proxy_control"])]
        for r in routes:
            args += ["--route", r]
        proxy = python_service("proxy", "proxy", args, self._plain_env(), self.logs,
                               self.workdir, b"chaos proxy ready")
        self.services["proxy"] = proxy
        proxy.start()

    def _plain_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _start_sandbox(self, base: dict[str, str]) -> None:
        env = {**self._plain_env(),
               catalog.API_KEY_ENV: self.api_key,
               "EFFECTLEDGER_SANDBOX_WEBHOOK_URL":
                   f"http://127.0.0.1:{self.ports['webhook_proxy']}/v1/webhooks/"
                   f"{WEBHOOK_PROVIDER}",
               "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET": self.webhook_secret,
               "EFFECTLEDGER_SANDBOX_WEBHOOK_ROUTES": TOOL_TYPES["c"]["route"]}
        sandbox = python_service(
            "sandbox", "sandbox", ["-m", "effectledger_sandbox", "--port",
                                   str(self.ports["sandbox"])], env, self.logs, self.workdir,
            b"listening on")
        self.services["sandbox"] = sandbox
        sandbox.start()

    async def _configure_sandbox(self) -> None:
        route = TOOL_TYPES["c"]["route"]
        async with httpx.AsyncClient(base_url=self.sandbox_url, timeout=10) as http:
            # The webhook-only tool hears "not applied" too, so refused requests can be
            # decided without a human; the ledger checks the fencing token of such a webhook.
            r = await http.post(f"/_config/routes/{route}",
                                json={"webhooks": True, "not_applied_webhooks": True})
            r.raise_for_status()
            # The native-webhook tool's route speaks the provider's own dialect to its own
            # endpoint, through the same webhook proxy.
            r = await http.post(f"/_config/routes/{TOOL_TYPES['f']['route']}", json={
                "webhooks": True, "not_applied_webhooks": True, "scheme": "stripe",
                "url": f"http://127.0.0.1:{self.ports['webhook_proxy']}/v1/webhooks/"
                       f"{catalog.NATIVE_PROVIDER}"})
            r.raise_for_status()

    # -- supervision ----------------------------------------------------------------------

    def start_supervisor(self) -> None:
        self.supervising = True
        self._supervisor = asyncio.create_task(self._supervise(), name="supervisor")

    async def stop_supervisor(self) -> None:
        self.supervising = False
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor

    def record_exit(self, s: Service) -> ExitRecord | None:
        cur = s.current
        if cur is None or cur.alive or getattr(cur, "_recorded", False):
            return None
        cur._recorded = True  # type: ignore[attr-defined]
        reason = cur.expected_exit
        if reason is None and cur.crash_points and cur.popen.returncode == -signal.SIGKILL:
            reason = f"crash_point:{cur.crash_points}"
        rec = ExitRecord(s.name, len(s.incarnations), cur.popen.returncode, reason,
                         round(time.time(), 3), cur.crash_points,
                         "" if reason else s.tail(25))
        self.exits.append(rec)
        if reason is None:
            self.log(f"!! {s.name} exited unexpectedly with {cur.popen.returncode}")
        return rec

    async def _supervise(self) -> None:
        """Restart services that died (faults record their own restarts; crashes are noted)."""
        while self.supervising:
            for s in list(self.services.values()):
                if s.held_down or s.alive:
                    continue
                rec = self.record_exit(s)
                if rec is not None and rec.reason is None:
                    await asyncio.sleep(0.5)  # a crash-looping service must not spin
                if not s.alive and not s.held_down and self.supervising:
                    s.start()
            await asyncio.sleep(0.2)  # supervision period

    # -- cleanup --------------------------------------------------------------------------

    async def stop(self) -> None:
        await self.stop_supervisor()
        order = ["dispatcher", "reconciler", "ledger", "sandbox", "proxy", "nats"]
        for kind in order:
            group = [s for s in self.services.values() if s.kind == kind]
            await asyncio.gather(*(s.stop(10) for s in group), return_exceptions=True)
        for node in self.nats_nodes:
            if node.service.alive:
                await node.service.stop(10)
        if self.pg is not None:
            await asyncio.to_thread(self.pg.stop)

    def kill_everything(self) -> None:
        for s in [*self.services.values(), *(n.service for n in self.nats_nodes)]:
            s.kill_now()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                self.pg.stop_immediate()

    def cleanup_pg_folder(self, keep: bool) -> None:
        if self._pg_root is None:
            return
        if keep:
            with contextlib.suppress(OSError):
                shutil.copy(self._pg_root / "postgres.log", self.logs / "postgres.log")
        shutil.rmtree(self._pg_root, ignore_errors=True)

    # -- direct reads ---------------------------------------------------------------------

    async def sandbox_get(self, path: str) -> Any:
        async with httpx.AsyncClient(base_url=self.sandbox_url, timeout=30) as http:
            r = await http.get(path)
            r.raise_for_status()
            return r.json()

    async def wait_nats(self, timeout_s: float = 30) -> None:
        for node in self.nats_nodes:
            await wait_port(node.port, timeout_s, node.service)

    def broker_down(self) -> bool:
        """The broker as a whole is held down by a fault (every node of a cluster: one node
        down is not an outage, its peers serve)."""
        return all(n.service.held_down for n in self.nats_nodes)

    async def wait_jetstream(self, timeout_s: float) -> None:
        """Until JetStream answers (a cluster has elected its meta leader): the services set
        up their streams at start and a dispatcher exits if it cannot."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            nc = None
            try:
                nc = await connect_quiet(self.nats_direct, connect_timeout=2,
                                         allow_reconnect=False)
                await nc.jetstream().account_info()
                return
            except Exception as exc:
                last = f"{type(exc).__name__}: {exc}"
            finally:
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await nc.close()
            await asyncio.sleep(0.5)  # the meta leader's election has no event to wait on
        raise TimeoutError(f"JetStream not ready within {timeout_s}s: {last}")
