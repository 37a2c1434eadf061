"""What a chaos run is: its options, fault kinds, tool types and the services' timing.

Everything that shapes a run is here and written to its report, so a run can be replayed from
its report (`--replay`), fault schedule included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Tool types: (a) idempotent by key with readback; (b) non-idempotent with readback;
# (c) non-idempotent, webhook only; (d) non-idempotent, no oracle at all; (e) non-idempotent,
# addressed by path (an argument in the URL), read back by a search that counts effects;
# (f) non-idempotent, confirmed only by the provider's own (Stripe-signed) webhooks declared
# in the catalog.
TOOL_TYPES: dict[str, dict[str, str]] = {
    "a": {"tool": "idem_readback", "route": "idem"},
    # Type b's provider ignores the fencing token (the sandbox's `*nofence` routes), so that
    # a superseded attempt sent late would apply a second effect: the send deadline's test.
    "b": {"tool": "plain_readback", "route": "plainrbnofence"},
    "c": {"tool": "plain_webhook", "route": "plainhook"},
    "d": {"tool": "plain_blind", "route": "plainblind"},
    "e": {"tool": "path_update", "route": "plainpath"},
    "f": {"tool": "native_webhook", "route": "plainnative"},
}
TOOL_TYPE_OF = {v["tool"]: k for k, v in TOOL_TYPES.items()}
DEFAULT_TOOL_MIX = {"a": 30, "b": 20, "c": 20, "d": 10, "e": 10, "f": 10}
DEFAULT_TOOL_MIX_TEXT = ",".join(f"{k}={v}" for k, v in DEFAULT_TOOL_MIX.items())

# Fault kinds, grouped. A group name in --faults selects all its kinds.
FAULT_GROUPS: dict[str, tuple[str, ...]] = {
    "process": ("kill", "pause", "crash_point", "pause_before_send"),
    "broker": ("nats_restart", "nats_long_outage", "stream_delete"),
    "database": ("pg_restart",),
    "network": ("net_blackhole", "net_reset", "net_latency"),
    "provider": ("drop_after_apply", "late_apply", "status_before_apply", "status_after_apply",
                 "rate_limit_seconds", "rate_limit_date", "slow_body", "readback_lag"),
    "webhook": ("webhook_duplicate", "webhook_concurrent", "webhook_reorder", "webhook_resign",
                "webhook_forged", "webhook_expired"),
    "bad_input": ("bad_input",),
    # Forgeries on the bus, anonymously and with an agent's credentials (attacker.py).
    "attack": ("attacker",),
    # A clustered broker and several ledgers (--nats-cluster >= 3, --ledgers >= 2): one node
    # killed, one cut off from its peers, a stream's leader killed, a ledger replica killed
    # while it holds outbox leases. On a run without the cluster they are skipped, not failed.
    "cluster": ("nats_node_kill", "nats_partition", "stream_leader_kill", "ledger_replica_kill"),
}
ALL_FAULTS: tuple[str, ...] = tuple(k for g in FAULT_GROUPS.values() for k in g)
# Faults aimed at one operation (armed in the sandbox before it is submitted) rather than at
# a moment of the run.
PER_OP_FAULTS = frozenset(FAULT_GROUPS["provider"] + FAULT_GROUPS["webhook"])
# The synthetic crash point "after send, before response": a provider delay holds the request
# while the dispatcher that sent it is SIGKILLed (no named crash point can sit inside httpx).
SYNTHETIC_AFTER_SEND = "dispatcher.after_send"
# The cluster kinds that need a broker quorum to survive one node (three nodes or more), and
# the one that needs a second ledger.
NATS_CLUSTER_FAULTS = frozenset({"nats_node_kill", "nats_partition", "stream_leader_kill"})
LEDGER_REPLICA_FAULTS = frozenset({"ledger_replica_kill"})
MAX_NATS_NODES = 5  # JetStream's limit for a stream's replicas (as `effectledger up`)
MAX_LEDGERS = 3


def parse_faults(text: str) -> list[str]:
    """`all`, `none`, group names, kinds; `-kind` removes one (e.g. `all,-nats_long_outage`)."""
    chosen: list[str] = []
    for raw in (p.strip() for p in text.split(",")):
        if not raw:
            continue
        remove = raw.startswith("-")
        name = raw.lstrip("-")
        if name == "all":
            kinds: tuple[str, ...] = ALL_FAULTS
        elif name == "none":
            kinds = ()
        elif name in FAULT_GROUPS:
            kinds = FAULT_GROUPS[name]
        elif name in ALL_FAULTS:
            kinds = (name,)
        else:
            raise ValueError(f"unknown fault {name!r}; kinds: {', '.join(ALL_FAULTS)}; "
                             f"groups: all, none, {', '.join(FAULT_GROUPS)}")
        for k in kinds:
            if remove and k in chosen:
                chosen.remove(k)
            elif not remove and k not in chosen:
                chosen.append(k)
    return chosen


def parse_tool_mix(text: str) -> dict[str, int]:
    """`a=30,b=20,c=20,d=10,e=10,f=10` (weights; missing types get 0)."""
    mix = {k: 0 for k in TOOL_TYPES}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, weight = part.partition("=")
        name = name.strip()
        if name in TOOL_TYPE_OF:
            name = TOOL_TYPE_OF[name]
        if name not in TOOL_TYPES or not weight.strip().isdigit():
            raise ValueError(f"tool mix entries are {'|'.join(TOOL_TYPES)}=<weight>: "
                             f"{part!r}")
        mix[name] = int(weight)
    if sum(mix.values()) <= 0:
        raise ValueError("the tool mix needs at least one positive weight")
    return mix


@dataclass
class Timing:
    """Service settings shortened so a run converges in minutes (all documented in the report).

    Provider horizon (6 s) > claim reply latency (claim timeout, 2 s) + late apply (2 s) +
    readback lag (1 s) + proxy latency, so a "not found after the horizon" readback can be
    trusted: that is the provider's contract, and faults stay inside it.
    """

    provider_timeout_s: float = 2.0
    horizon_s: float = 6.0
    max_attempts: int = 6
    ack_wait_s: float = 4.0
    claim_timeout_s: float = 2.0
    sweep_after_s: float = 8.0
    sweep_interval_s: float = 2.0
    reconcile_sweep_after_s: float = 25.0
    # Kept below the reconcile sweep, as in production (120 s < 900 s): a verdict re-sent after
    # a sweep must not fall inside the window and be dropped as a duplicate of the lost one.
    duplicate_window_s: float = 20.0
    # A claimed attempt with no outcome this long is presumed lost (a deleted outcome message).
    # Default: just past the long broker outage, so an outcome merely delayed by the outage is
    # not presumed lost (in production it is 900 s).
    lost_outcome_after_s: float | None = None
    relay_lease_s: float = 5.0
    webhook_wait_s: float = 6.0
    reconcile_deadline_s: float = 90.0
    max_late_apply_s: float = 2.0
    max_readback_lag_s: float = 1.0
    max_latency_ms: float = 150.0

    @property
    def pause_before_send_s(self) -> float:
        """How long `pause_before_send` freezes a claimed dispatcher: past every step that
        leads to a new epoch applying the effect (the command's redelivery after ack_wait,
        another dispatcher's patience with the claim, the readback after the horizon, the
        retry's own call), so that a send on waking would be a second effect."""
        from effectledger_dispatcher.decision import LOST_GRACE_S

        return round(self.ack_wait_s + self.provider_timeout_s + LOST_GRACE_S
                     + self.horizon_s + 10.0, 2)

    def env(self) -> dict[str, str]:
        return {
            "EFFECTLEDGER_ACK_WAIT_S": str(self.ack_wait_s),
            "EFFECTLEDGER_CLAIM_TIMEOUT_S": str(self.claim_timeout_s),
            "EFFECTLEDGER_SWEEP_AFTER_S": str(self.sweep_after_s),
            "EFFECTLEDGER_SWEEP_INTERVAL_S": str(self.sweep_interval_s),
            "EFFECTLEDGER_RECONCILE_SWEEP_AFTER_S": str(self.reconcile_sweep_after_s),
            "EFFECTLEDGER_DUPLICATE_WINDOW_S": str(self.duplicate_window_s),
            "EFFECTLEDGER_LOST_OUTCOME_AFTER_S": str(self.lost_outcome_after_s or 900.0),
            "EFFECTLEDGER_RELAY_LEASE_S": str(self.relay_lease_s),
            "EFFECTLEDGER_WEBHOOK_WAIT_S": str(self.webhook_wait_s),
            "EFFECTLEDGER_RECONCILE_DEADLINE_S": str(self.reconcile_deadline_s),
            # The duplicate audit re-reads retried keys just after the horizon, so it finishes
            # within the quiet period.
            "EFFECTLEDGER_AUDIT_SLACK_S": "1",
        }


@dataclass
class ChaosConfig:
    ops: int = 200
    seed: int = 1
    concurrency: int = 8
    duration_s: float | None = None  # the fault phase; default from ops
    faults: list[str] = field(default_factory=lambda: list(ALL_FAULTS))
    tool_mix: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_TOOL_MIX))
    database: str = "postgres"  # postgres | sqlite
    database_url: str | None = None  # a given PostgreSQL (no pg faults then)
    dispatchers: int = 3
    reconcilers: int = 2
    # nats-server processes clustered over loopback routes (1: a single server), and ledger
    # replicas sharing the database (several need PostgreSQL).
    nats_cluster: int = 1
    ledgers: int = 1
    ci: bool = False
    # The long broker outage: longer than nats-py's default reconnect budget (60 attempts x 2 s,
    # about 2 minutes) in a full run; shortened in CI mode, where minutes are not affordable.
    long_outage_s: float | None = None
    quiet_max_s: float = 150.0
    unsafe_skip_claim: bool = False
    unsafe_skip_webhook_verification: bool = False
    unsafe_no_send_deadline: bool = False
    unsafe_nats_without_permissions: bool = False
    timing: Timing = field(default_factory=Timing)
    progress: bool = True
    progress_interval_s: float = 5.0
    workdir: str | None = None
    keep_workdir: bool = False

    def __post_init__(self) -> None:
        if self.ops < 1:
            raise ValueError("--ops must be at least 1")
        if not 1 <= self.dispatchers <= 3:
            raise ValueError("--dispatchers must be 1..3")
        if not 1 <= self.reconcilers <= 2:
            raise ValueError("--reconcilers must be 1..2")
        if self.database not in ("postgres", "sqlite"):
            raise ValueError("--database must be postgres or sqlite")
        if not 1 <= self.nats_cluster <= MAX_NATS_NODES:
            raise ValueError(f"--nats-cluster must be 1..{MAX_NATS_NODES}")
        if not 1 <= self.ledgers <= MAX_LEDGERS:
            raise ValueError(f"--ledgers must be 1..{MAX_LEDGERS}")
        if self.ledgers > 1 and self.database == "sqlite":
            raise ValueError("--ledgers above 1 needs PostgreSQL: SQLite has a single writer")
        if isinstance(self.timing, dict):
            self.timing = Timing(**self.timing)
        if self.timing.lost_outcome_after_s is None:
            self.timing.lost_outcome_after_s = max(20.0, self.outage_s + 5.0)

    @property
    def fault_phase_s(self) -> float:
        if self.duration_s is not None:
            return self.duration_s
        # Roughly 6 submissions per second, at least 30 s so every kind of fault fits.
        return max(30.0, self.ops / 6.0)

    @property
    def outage_s(self) -> float:
        if self.long_outage_s is not None:
            return self.long_outage_s
        return 15.0 if self.ci else 130.0

    @property
    def stream_replicas(self) -> int:
        """R3 on a cluster of three or more (JetStream's usual choice: one node may fail)."""
        return min(self.nats_cluster, 3)

    def fault_applies(self, kind: str) -> bool:
        """Whether this run's shape can carry the fault kind (cluster kinds need a cluster)."""
        if kind in NATS_CLUSTER_FAULTS:
            return self.nats_cluster >= 3
        if kind in LEDGER_REPLICA_FAULTS:
            return self.ledgers >= 2
        return True

    @property
    def active_faults(self) -> list[str]:
        return [k for k in self.faults if self.fault_applies(k)]

    @property
    def skipped_faults(self) -> list[str]:
        """Chosen kinds this run cannot carry (e.g. `all` on one nats-server): skipped, and
        said so in the report, never counted as failures."""
        return [k for k in self.faults if not self.fault_applies(k)]

    @property
    def pg_faults_possible(self) -> bool:
        return self.database == "postgres" and self.database_url is None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["fault_phase_s"] = self.fault_phase_s
        out["outage_s"] = self.outage_s
        out["stream_replicas"] = self.stream_replicas
        out["faults_skipped"] = self.skipped_faults
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChaosConfig:
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**data)
