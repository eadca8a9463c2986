"""Sections only the coordinator acts on: planning, recovery, probes, alerts, metrics.

``[plan]`` (the cluster-wide planner's GPU type, node MTBF and calibration), ``[recovery]`` (the
error-handling ladder, its breakers and the drain limiter: unicornd's ``Policy``),
``[ssh]`` (out-of-band probes of nodes whose agent fell silent), ``[alerts]`` (alert
delivery by command or webhook) and ``[metrics]`` (the Prometheus endpoint). unicornd
builds its daemon from them; unicornctl shows ``[plan]`` as well. Nothing on the
compute nodes reads them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from unicorn_core.config.schema import _BOUNDS, Section, _meta, _show
from unicorn_core.errors import ConfigError, InvalidArgument


@dataclass(frozen=True, kw_only=True)
class PlanConfig(Section):
    """The cluster-wide planner as unicornd runs it."""

    gpu: str = field(
        default="a100-80g",
        metadata=_meta(
            "GPU type of the nodes, a name from etc/gpus.toml (the planner's performance "
            "model needs it; Slurm's gres often does not say). Default a100-80g."
        ),
    )
    gpu_types: str = field(
        default="",
        metadata=_meta(
            "Slurm GRES GPU types and their etc/gpus.toml names, TYPE=NAME comma-separated "
            "(e.g. h100=h100-80g,a100=a100-40g). A type not listed is looked up by its own "
            "name, then as the only etc/gpus.toml name it prefixes (h100 -> h100-80g), "
            "else planned as `gpu`. Nodes of different types are planned apart."
        ),
    )
    node_mtbf_h: float = field(
        default=672.0,
        metadata=_meta(
            "Mean time between failures of one node, in hours, before any history: how long "
            "a new plan is expected to run, which prices a transition (Unicron Eq. 3). The "
            "planner uses it as the prior of the MTBF it estimates from the node failures "
            "unicorn found (see mtbf_prior_failures). Default 672 h (4 weeks).",
            gt=0,
        ),
    )
    calibrate: bool = field(
        default=True,
        metadata=_meta(
            "Plan with the measured inputs (iteration times, transition times, node MTBF; "
            "see the keys below) instead of the analytic model and the constants alone. "
            "unicornd measures either way, and unicornctl plan --explain shows both. Off on "
            "the dev cluster, whose GPUs are CPU processes sharing a few cores: what they "
            "measure says nothing about a GPU's layouts. Default true.",
        ),
    )
    mtbf_prior_failures: float = field(
        default=2.0,
        metadata=_meta(
            "How many failures node_mtbf_h counts as against the measured history: the "
            "planner's MTBF is (mtbf_prior_failures x node_mtbf_h + node-hours seen) / "
            "(mtbf_prior_failures + failures seen). Default 2: a 16-node cluster's own "
            "history outweighs a 4-week prior after about 3.5 days.",
            gt=0,
        ),
    )
    iteration_prior_samples: float = field(
        default=20.0,
        metadata=_meta(
            "How many measured iterations the analytic performance model counts as, per "
            "(model, layout, GPU type): the planner's speed for a layout is the analytic one "
            "shrunk towards the measured one by samples / (samples + this). Default 20: "
            "iteration times are steady, so a few dozen outweigh a model that is often "
            "10-30% off; 0 trusts the first measurement fully.",
            ge=0,
        ),
    )
    iteration_window: int = field(
        default=500,
        metadata=_meta(
            "Iterations a measured iteration time remembers: beyond this many, each new one "
            "weighs 1/iteration_window (an exponentially weighted mean), so the estimate "
            "follows a cluster that changes and memory stays bounded. Default 500.",
            ge=1,
        ),
    )
    iteration_warmup: int = field(
        default=2,
        metadata=_meta(
            "Iterations after each launch or restart whose times are not measured (start-up "
            "costs: allocator, compilation, data loader). Default 2.",
            ge=0,
        ),
    )
    transition_prior_samples: float = field(
        default=1.0,
        metadata=_meta(
            "How many measured transitions the prior D_transition (60 s restart plus "
            "reloading 18 B per parameter at 10 GB/s) counts as, per task. Default 1: "
            "transitions are rare, and each one measured says a lot about the next.",
            ge=0,
        ),
    )
    transition_window: int = field(
        default=10,
        metadata=_meta(
            "Transitions a task's measured transition time remembers (later ones weigh "
            "1/transition_window each). Default 10.",
            ge=1,
        ),
    )
    distributed_optimizer: bool = field(
        default=True,
        metadata=_meta(
            "Whether layouts may use Megatron's distributed optimizer (optimizer state "
            "sharded over data-parallel ranks). Off where the trainers cannot run it, e.g. "
            "Megatron-LM on CPU ranks (its distributed optimizer needs CUDA tensors). "
            "Default true."
        ),
    )
    lookup_min_nodes: int = field(
        default=512,
        metadata=_meta(
            "From this many nodes on, unicornd solves the plan of every single-node failure "
            "ahead, in a worker process at the lowest CPU priority, so the failure's replan "
            "takes it instead of solving (0.15 s at 4,096 nodes and 200 tasks, 9 ms taken). "
            "Below it a solve takes milliseconds and no worker runs. Default 512; a very "
            "large value turns it off.",
            ge=0,
        ),
    )
    lookup_workers: int = field(
        default=0,
        metadata=_meta(
            "Worker processes that solve the single-node failures ahead (lookup_min_nodes), "
            "each at the lowest CPU priority, so they use only CPU time nothing else wants. "
            "0: one per CPU, at most 4. Default 0.",
            ge=0,
        ),
    )


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig(Section):
    """The error-handling ladder, its breakers and the drain limiter (unicornd's ``Policy``).

    Every constant the decision functions use. ``RecoveryConfig()`` is the defaults;
    constructing one with out-of-range values raises InvalidArgument (the loader reports
    them first, as config errors).
    """

    max_retries_in_place: int = field(
        default=2,
        metadata=_meta(
            "SEV3 reattempts in place before a process restart. Default 2: SEV3 faults are "
            "transient (connection resets, NCCL timeouts caused elsewhere); two ride out a "
            "network blip, more only delay the restart a persistent fault needs.",
            ge=0,
        ),
    )
    max_process_restarts: int = field(
        default=1,
        metadata=_meta(
            "SEV2 restarts of a task's processes on the same nodes before the node is "
            "isolated. Default 1: a second failure on the same nodes points at the node.",
            ge=0,
        ),
    )
    settle_s: float = field(
        default=10.0,
        metadata=_meta(
            "Seconds after an action in which findings no worse than the current rung are "
            "its consequences (peers' collectives time out, restarted ranks exit), not new "
            "failures. Default 10: NCCL's abort after a peer dies takes seconds.",
            ge=0,
        ),
    )
    retry_timeout_s: float = field(
        default=60.0,
        metadata=_meta(
            "Seconds without an iteration after a retry in place before it failed. Default 60. "
            "While the task's launch has not finished its first iteration (start-up), "
            "transition_timeout_s instead.",
            ge=0,
        ),
    )
    restart_timeout_s: float = field(
        default=180.0,
        metadata=_meta(
            "Seconds without an iteration after a process restart before it failed (a restart "
            "reloads a checkpoint). Default 180.",
            ge=0,
        ),
    )
    transition_timeout_s: float = field(
        default=600.0,
        metadata=_meta(
            "Seconds without an iteration after a transition before it failed (it may resize "
            "jobs and start agents on new nodes). Default 600.",
            ge=0,
        ),
    )
    no_progress_limit: int = field(
        default=3,
        metadata=_meta(
            "Recoveries allowed while the iteration does not pass its previous maximum; "
            "beyond, the task is stopped and the operator told (a restart-loop breaker). Default 3.",
            ge=0,
        ),
    )
    recovery_budget: int = field(
        default=10,
        metadata=_meta(
            "Ladder actions per task per budget_window_s; beyond, the task is stopped and the "
            "operator told. "
            "Default 10 per hour: more than one fault every six minutes is not self-healing.",
            ge=0,
        ),
    )
    budget_window_s: float = field(
        default=3600.0, metadata=_meta("Window of recovery_budget, in seconds. Default 3600.", ge=0)
    )
    max_drain_fraction: float = field(
        default=0.25,
        metadata=_meta(
            "Fraction of the nodes unicorn may drain per drain_window_s without an "
            "operator's confirmation (but at least min_drains_per_window): a storm of false "
            "positives must not empty the cluster. Default 0.25.",
            ge=0,
            le=1,
        ),
    )
    min_drains_per_window: int = field(
        default=1,
        metadata=_meta(
            "Drains always allowed per drain_window_s, whatever the fraction gives. Default 1, "
            "so a 4-node cluster still heals a dead node by itself.",
            ge=0,
        ),
    )
    drain_window_s: float = field(
        default=600.0, metadata=_meta("Window of the drain limiter, in seconds. Default 600.", ge=0)
    )
    node_failure_limit: int = field(
        default=2,
        metadata=_meta(
            "Failures of one node per node_failure_window_s after which it stays drained "
            "until an operator resumes it (flapping nodes cost every task a transition). Default 2.",
            ge=0,
        ),
    )
    node_failure_window_s: float = field(
        default=86400.0,
        metadata=_meta("Window of node_failure_limit, in seconds. Default 86400 (a day).", ge=0),
    )
    node_check_on_join: bool = field(
        default=True,
        metadata=_meta(
            "A returning node runs the node check before it rejoins a task (a node that comes "
            "back broken would fail the task again). Default true."
        ),
    )
    jit_checkpoint: bool = field(
        default=True,
        metadata=_meta(
            "Before a transition stops ranks, healthy nodes are told to checkpoint now, so at "
            "most the current iteration is recomputed. Default true."
        ),
    )
    max_resizes_per_run: int = field(
        default=1,
        metadata=_meta(
            "Resizes (shrink or expansion) of one job run before unicorn requeues instead. "
            "Default 1: without slurmdbd Slurm 22.05 resizes a job once per run (measured).",
            ge=0,
        ),
    )
    command_deadline_s: float = field(
        default=120.0,
        metadata=_meta("Seconds an agent may take to restart, relaunch or stop. Default 120.", gt=0),
    )
    checkpoint_deadline_s: float = field(
        default=60.0, metadata=_meta("Seconds an agent may take to checkpoint now. Default 60.", gt=0)
    )
    remembered_findings: int = field(
        default=64,
        metadata=_meta(
            "Finding ids kept per incident to drop redelivered ones (a redelivery arrives "
            "soon, not after 64 newer findings). Default 64.",
            gt=0,
        ),
    )
    drain_reason_chars: int = field(
        default=160,
        metadata=_meta(
            "Longest drain reason written to Slurm (a fixed-size field; sinfo -R shows one "
            "line). Default 160.",
            gt=0,
        ),
    )
    straggler_cooldown_s: float = field(
        default=3600.0,
        metadata=_meta(
            "Seconds after unicorn replaced or reported a straggler node (a node persistently "
            "slower than its task's other nodes) in which it does not act on that node again "
            "(unicornd/decide/stragglers.py). At most 86400: the incidents that remember the "
            "act are kept a day. Default 3600.",
            ge=0,
            le=86400,
        ),
    )

    def __post_init__(self) -> None:
        """A policy built in code passes the same bounds the loader checks (field metadata)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if not math.isfinite(value):
                raise InvalidArgument(f"policy {f.name} must be finite, got {value!r}")
            for bound_name, (compare, symbol) in _BOUNDS.items():
                if bound_name in f.metadata and not compare(value, f.metadata[bound_name]):
                    raise InvalidArgument(
                        f"policy {f.name} must be {symbol} {f.metadata[bound_name]:g}, got {value!r}"
                    )

    def drain_limit(self, nodes: int) -> int:
        """Drains allowed per window on a cluster of ``nodes`` nodes."""
        return max(self.min_drains_per_window, math.floor(self.max_drain_fraction * nodes))


@dataclass(frozen=True, kw_only=True)
class SshConfig(Section):
    """Out-of-band confirmation: when a node's agent falls silent, unicornd probes the node
    over SSH to tell a dead node (drain) from a dead agent (relaunch it, no drain)."""

    enabled: bool = field(
        default=True,
        metadata=_meta(
            "Probe a node over SSH when its agent falls silent. A node that does not answer "
            "at all (timeout, no route) is confirmed dead "
            "and drained at once; one that answers (even to refuse) gets a new agent and is "
            "never drained for the silence. Off, or when the probe cannot log in: only "
            "Slurm's view confirms a dead node (NOT_RESPONDING/DOWN while the agent is "
            "silent), which takes slurmctld's SlurmdTimeout. Default: true."
        ),
    )
    hosts: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "Endpoints of nodes whose SSH address is not their Slurm name on port 22, as "
            "NODE=HOST:PORT entries (in the environment: comma-separated). Default: empty."
        ),
    )
    user: str = field(
        default="root",
        metadata=_meta("User to log in as on the nodes. Default: root."),
    )
    key_file: str = field(
        default="",
        metadata=_meta(
            "Private key to log in with; empty = the SSH client defaults (~/.ssh/id_*). Default: empty."
        ),
    )
    known_hosts: str = field(
        default="",
        metadata=_meta(
            "known_hosts file with the nodes' host keys; empty = ~/.ssh/known_hosts. Host "
            "keys are always checked: an unknown host key is a failed probe. Default: empty."
        ),
    )
    connect_timeout_s: float = field(
        default=5.0,
        metadata=_meta(
            "Seconds to wait for a node to accept the SSH connection before it counts as "
            "dead. Default 5: a live node answers in milliseconds, even under load; this is "
            "added to the detection time of a dead node that drops packets (a refused "
            "connection fails at once).",
            gt=0,
        ),
    )
    command_timeout_s: float = field(
        default=10.0,
        metadata=_meta(
            "Seconds the probe command on the node may run (agent lookup, kernel log scan). Default 10.",
            gt=0,
        ),
    )
    kernel_log: str = field(
        default="",
        metadata=_meta(
            "Where the probe reads the node's kernel log for Xid/ECC/MCE evidence: empty = "
            "dmesg; else a file path, where {node} stands for the node name (the dev "
            "cluster gives each node a file). Default: empty."
        ),
    )

    def endpoints(self) -> dict[str, tuple[str, int]]:
        """``hosts`` as node -> (host, port); entries that do not parse are left out
        (a loaded config has none: :meth:`problems` rejects them)."""
        return {p[0]: (p[1], p[2]) for p in map(_host_entry, self.hosts) if p is not None}

    def problems(self) -> list[str]:
        return [f"hosts entry {e!r} is not NODE=HOST:PORT" for e in self.hosts if _host_entry(e) is None]


def _host_entry(entry: str) -> tuple[str, str, int] | None:
    """``NODE=HOST:PORT`` as (node, host, port); None when it is not one."""
    node, eq, where = entry.partition("=")
    host, colon, port = where.rpartition(":")
    node, host = node.strip(), host.strip()
    if not (eq and colon and node and host and port.isdigit() and 0 < int(port) < 65536):
        return None
    return node, host, int(port)


_WEBHOOK_SCHEMES = ("http", "https")


@dataclass(frozen=True, kw_only=True)
class AlertsConfig(Section):
    """Where unicornd sends alerts (incident opened, escalated, needs an operator, closed).

    Both targets may be set; each alert goes to every configured one. Neither set = no
    alerts (incidents still show in ``unicornctl incidents`` and the metrics).
    """

    command: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "Command run for each alert, as an argv list (no shell), with the alert as one "
            "JSON object on its standard input; a non-zero exit is a failed delivery. In the "
            "environment: comma-separated. Default: empty (no command)."
        ),
    )
    webhook_url: str = field(
        default="",
        metadata=_meta(
            "URL that receives each alert as an HTTP POST of one JSON object "
            "(Content-Type: application/json); any 2xx answer is a delivery. http:// or "
            "https://. Default: empty (no webhook)."
        ),
    )
    timeout_s: float = field(
        default=10.0,
        metadata=_meta(
            "Seconds one delivery (the command, or the webhook's POST) may take before it is "
            "abandoned as failed. Default 10 s: a receiver answers in well under a second or "
            "is down; a stuck one must not hold back later alerts for long.",
            gt=0,
        ),
    )
    queue_max: int = field(
        default=100,
        metadata=_meta(
            "Alerts waiting for delivery at most; when full, the oldest is dropped (and "
            "counted) so a dead receiver never grows unicornd's memory. Default 100: far more "
            "than a burst of incidents produces while a receiver is briefly slow.",
            ge=1,
        ),
    )

    def problems(self) -> list[str]:
        found = []
        if self.command and not self.command[0].strip():
            found.append(f"command = {_show(self.command)}: the program (first item) must not be empty")
        if self.webhook_url:
            parts = urlsplit(self.webhook_url)
            if parts.scheme not in _WEBHOOK_SCHEMES or not parts.hostname:
                shown = f"{parts.scheme}://{parts.hostname or ''}/..." if parts.scheme else "(no scheme)"
                found.append(f"webhook_url = {shown}: expected an http:// or https:// URL with a host")
        return found


@dataclass(frozen=True, kw_only=True)
class MetricsConfig(Section):
    """unicornd's Prometheus endpoint (``GET /metrics``)."""

    listen: str = field(
        default="",
        metadata=_meta(
            "Address the metrics endpoint listens on, as HOST:PORT ([::1]:PORT for IPv6; "
            "port 0 = any free port, for tests); empty = no endpoint. Default: empty, because "
            "several unicornd (dev clusters, tests) may share a machine and a fixed port would "
            "collide; a production head node sets e.g. 0.0.0.0:9464."
        ),
    )

    def address(self) -> tuple[str, int] | None:
        """``listen`` as (host, port) without IPv6 brackets; None when off. Raises
        ``ConfigError`` when it is not HOST:PORT (a loaded config never is)."""
        if not self.listen:
            return None
        host, colon, port = self.listen.rpartition(":")
        host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
        if not (colon and host and port.isdigit() and int(port) <= 65535):
            raise ConfigError(
                f"metrics.listen = {_show(self.listen)}: expected HOST:PORT, e.g. 127.0.0.1:9464"
            )
        return host, int(port)

    def problems(self) -> list[str]:
        try:
            self.address()
        except ConfigError:
            return [f"listen = {_show(self.listen)}: expected HOST:PORT (port 0-65535) or empty"]
        return []


@dataclass(frozen=True, kw_only=True)
class LeaderConfig(Section):
    """Leader election among unicornd processes (one per head node): one leads, the others
    stand by and take over when its lease in Redis runs out."""

    lease_s: float = field(
        default=3.0,
        metadata=_meta(
            "How long the leader's lease lasts without renewal; it renews every third of it. "
            "A standby takes over at most lease_s + lease_s/3 after the leader stopped "
            "(died, hung, cut off). Default 3 s: takeover within 4 s, and a leader must miss "
            "two renewals (event-loop stalls of 2 s) before it loses the lease.",
            gt=0.0,
        ),
    )
