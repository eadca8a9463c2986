"""unicorn's configuration: one TOML file, overridable key by key from the environment.

Precedence, lowest first: the defaults written in the dataclasses below, the TOML file
(``load_config(path)``, else ``$UNICORN_CONFIG``, else no file), then environment
variables named ``UNICORN_<SECTION>__<KEY>`` (double underscore between the parts, e.g.
``UNICORN_REDIS__URL``, ``UNICORN_SLURM__COMMAND_TIMEOUT_S``).

The settings are a tree of frozen dataclasses rooted at ``Config``; every field carries
its unit in its name and documents meaning, default and why in ``metadata["doc"]``
(listed by ``describe()``); numeric bounds are ``metadata`` too (``gt``, ``ge``, ``lt``,
``le``). Loading is generic over the tree: a new section is a new dataclass and a new
field on ``Config``, with no loader changes. Supported field types: ``str``, ``int``,
``float``, ``bool``, ``Literal[...]`` of strings, ``tuple[<one of those>, ...]``, and
nested sections. The root holds only sections (a root key would have no ``__`` in its
environment variable name).

Checks, all reported together in one ``ConfigError``: unknown sections and keys (with
the valid ones listed), wrong types (``int`` is accepted for ``float``, ``bool`` never
for a number), ``Literal`` choices, bounds, then the cross-field checks each section
states in ``problems()``. ``validate()`` runs the same checks on a ``Config`` built in
code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

from unicorn_core.errors import ConfigError, InvalidArgument

CONFIG_ENV = "UNICORN_CONFIG"
"""Environment variable naming the config file when ``load_config`` gets no path."""
ENV_PREFIX = "UNICORN_"
ENV_SEPARATOR = "__"

SlurmBackend = Literal["auto", "cli", "pyslurm"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]

_BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}
_REDIS_SCHEMES = ("redis", "rediss", "unix")


def _meta(
    doc: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> dict[str, object]:
    """Field metadata: the documentation (meaning, unit, default and why) and bounds."""
    meta: dict[str, object] = {"doc": doc}
    for name, bound in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)):
        if bound is not None:
            meta[name] = bound
    return meta


class Section:
    """Base of every settings section. Override ``problems()`` for cross-field checks."""

    def problems(self) -> list[str]:
        """Cross-field inconsistencies, as messages naming the keys; empty when fine.

        Keys are named relative to the section (the loader prefixes ``<section>: ``).
        Runs only once every field has the right type and is within its bounds.
        """
        return []


@dataclass(frozen=True, kw_only=True)
class RedisConfig(Section):
    """The Redis server that holds all coordination state (heartbeats, job records)."""

    url: str = field(
        default="redis://127.0.0.1:6379/0",
        metadata=_meta(
            "Redis server URL: redis://host:port/db, rediss:// for TLS, or unix:///path.sock. "
            "May carry credentials (redis://user:password@host), but password_file keeps the "
            "secret out of this file. Default: a local Redis on the standard port, database 0, "
            "as the dev cluster runs it."
        ),
    )
    password_file: str = field(
        default="",
        metadata=_meta(
            "Path of a file whose content (one trailing newline stripped) is the Redis "
            "password; empty = no password beyond any in url. A file rather than a value so "
            "the secret never sits in unicorn.toml or in the environment. Default: empty "
            "(the dev Redis has no auth)."
        ),
    )
    key_prefix: str = field(
        default="unicorn",
        metadata=_meta(
            "Prefix of every Redis key unicorn writes (<prefix>:...), so several deployments "
            "or test runs can share one Redis server. Default: unicorn."
        ),
    )
    socket_timeout_s: float = field(
        default=5.0,
        metadata=_meta(
            "Seconds one Redis command may take before it fails (as a temporary error). "
            "Default 5 s: far above a healthy round trip (under 1 ms on a LAN), short enough "
            "that a stuck server is noticed within a few heartbeats.",
            gt=0,
        ),
    )
    connect_timeout_s: float = field(
        default=2.0,
        metadata=_meta(
            "Seconds to wait for a connection to Redis to open. Default 2 s: a connection "
            "opens in milliseconds or the server is unreachable; fail fast and retry.",
            gt=0,
        ),
    )

    agent_acl: bool = field(
        default=True,
        metadata=_meta(
            "Give the agents of each Slurm job their own Redis user, confined to that job's "
            "heartbeats, event streams and commands (unicornd creates it with a random password "
            "when it launches the job's agents and deletes it when the task is gone); false = "
            "agents connect with unicornd's own credentials. Default: true. Needs Redis >= 7 and "
            "a unicornd user allowed ACL SETUSER/DELUSER/USERS."
        ),
    )
    operator_password_file: str = field(
        default="",
        metadata=_meta(
            "Password file of the Redis user <key_prefix>-operator, which may read the status "
            "and send drain/resume requests; unicornd (re)creates that user at start. unicornctl "
            "connects as the most privileged user whose password file the caller can read: "
            "password_file (unicornd's), then this, then user_password_file. Make it readable "
            "by operators only (e.g. mode 0640, group slurm.operators_group). Default: empty (no "
            "operator user)."
        ),
    )
    user_password_file: str = field(
        default="",
        metadata=_meta(
            "Password file of the Redis user <key_prefix>-user, which may read the status and "
            "register or stop tasks (the sbatch wrapper) but not drain; unicornd (re)creates it "
            "at start. Readable by every user of the cluster. Default: empty (no such user)."
        ),
    )

    def problems(self) -> list[str]:
        found = []
        parts = urlsplit(self.url)
        if parts.scheme not in _REDIS_SCHEMES:
            found.append(
                f"url = {_show(_redact_url(self.url))}: expected a URL starting with "
                + ", ".join(f"{scheme}://" for scheme in _REDIS_SCHEMES)
            )
        elif parts.password and self.password_file:
            found.append("url carries a password and password_file is set too; keep only one")
        if not self.key_prefix or self.key_prefix != self.key_prefix.strip():
            found.append(f"key_prefix = {_show(self.key_prefix)}: expected a non-empty name without spaces")
        return found

    def password(self) -> str | None:
        """The password read from ``password_file``; None when no file is configured.

        Reads the file on each call, so a rotated secret is picked up on reconnect.
        Raises ``ConfigError`` naming the file when it cannot be read or is empty.
        """
        return read_secret("redis.password_file", self.password_file) if self.password_file else None


def read_secret(key: str, path_text: str) -> str:
    """The content of the secret file ``path_text`` (config key ``key``), one trailing newline
    stripped; ``ConfigError`` naming both when it cannot be read or is empty."""
    path = Path(path_text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{key} {str(path)!r}: cannot read: {reason}") from exc
    secret = text.removesuffix("\n").removesuffix("\r")
    if not secret:
        raise ConfigError(f"{key} {str(path)!r}: file is empty")
    return secret


@dataclass(frozen=True, kw_only=True)
class SlurmConfig(Section):
    """How unicorn talks to the Slurm controller."""

    backend: SlurmBackend = field(
        default="auto",
        metadata=_meta(
            "How to reach Slurm: cli runs squeue/scontrol/sbatch; pyslurm calls the pyslurm "
            "bindings (no process per call, but must match the installed Slurm version); auto "
            "uses pyslurm when it imports and the CLI otherwise. Default: auto."
        ),
    )
    command_timeout_s: float = field(
        default=30.0,
        metadata=_meta(
            "Seconds one Slurm command or pyslurm call may run before it is killed and "
            "reported as a timeout. Default 30 s: slurmctld answers slowly under load (its "
            "own MessageTimeout defaults to 10 s), but a call stuck longer has failed.",
            gt=0,
        ),
    )
    bin_dir: str = field(
        default="",
        metadata=_meta(
            "Folder holding the Slurm client commands (squeue, scontrol, sbatch, srun); "
            "empty = find them on PATH. Default: empty; set it when a service manager starts "
            "unicorn with a minimal PATH."
        ),
    )
    conf: str = field(
        default="",
        metadata=_meta(
            "Path of the slurm.conf that Slurm commands use (passed as SLURM_CONF); empty = "
            "Slurm's default (an inherited $SLURM_CONF, else the compiled-in path). Default: "
            "empty; the dev cluster points it at its own slurm.conf."
        ),
    )
    munge_socket: str = field(
        default="",
        metadata=_meta(
            "Path of munged's socket, for the MUNGE credential that signs each task "
            "registration (unicornd accepts a registration only from the job's owner, root or "
            "the SlurmUser); empty = munge's default socket. Default: empty; the dev cluster "
            "points it at its own munged."
        ),
    )
    operators_group: str = field(
        default="",
        metadata=_meta(
            "Unix group whose members may change the cluster through unicornctl (drain, "
            "resume), besides root and Slurm's SlurmUser; empty = only those two. Default: "
            "empty. unicornctl checks it before it sends a request; Redis ACLs are what stop "
            "a client that bypasses unicornctl."
        ),
    )


@dataclass(frozen=True, kw_only=True)
class AgentConfig(Section):
    """The per-node agent that supervises training processes and reports heartbeats."""

    heartbeat_interval_s: float = field(
        default=1.0,
        metadata=_meta(
            "Seconds between the heartbeats the node agent writes to Redis. Default 1 s: one "
            "small write per second is cheap and lets a dead node be noticed in seconds.",
            gt=0,
        ),
    )
    heartbeat_ttl_s: float = field(
        default=5.0,
        metadata=_meta(
            "Seconds a heartbeat key lives in Redis before it expires by itself, so a dead "
            "agent's last beat does not linger. Must exceed heartbeat_interval_s, or a live "
            "agent's key would vanish between beats. Default 5 s: five beats.",
            gt=0,
        ),
    )
    bin_dir: str = field(
        default="",
        metadata=_meta(
            "Directory holding unicorn-agent, torchrun and python on the compute nodes. "
            "Empty = the directory of the Python running unicornd (one shared virtual "
            "environment, as on the dev cluster). Default: empty."
        ),
    )
    rendezvous_host: str = field(
        default="",
        metadata=_meta(
            "Address torchrun's nodes meet at. Empty = the first node of the task (its "
            "Slurm name must resolve). The dev cluster sets 127.0.0.1. Default: empty."
        ),
    )
    rendezvous_port_base: int = field(
        default=29500,
        metadata=_meta(
            "First TCP port for torchrun rendezvous; each launch of a task takes the next "
            "one of 1000 (so a relaunch never waits for a port in TIME_WAIT). Default 29500.",
            ge=1024,
        ),
    )

    def problems(self) -> list[str]:
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            return [
                f"heartbeat_ttl_s = {self.heartbeat_ttl_s:g} must be greater than "
                f"heartbeat_interval_s = {self.heartbeat_interval_s:g} "
                "(a live agent's heartbeat would expire between beats)"
            ]
        return []


@dataclass(frozen=True, kw_only=True)
class DetectConfig(Section):
    """Failure detection: lost heartbeats, hangs and slowdowns."""

    heartbeat_timeout_s: float = field(
        default=1.5,
        metadata=_meta(
            "Seconds without a heartbeat after which a node agent counts as lost. Must "
            "exceed agent.heartbeat_interval_s. Default 1.5 s: with 1 s beats a dead node is "
            "caught within 2 s (Unicron: 5.6 s) and a beat up to 0.5 s late is tolerated; "
            "measured without false alarms under CPU contention (BENCHMARKS.md). Silence "
            "alone never drains a node: unicornd confirms out of band first.",
            gt=0,
        ),
    )
    hang_factor: float = field(
        default=2.0,
        metadata=_meta(
            "A rank silent for longer than this multiple of the learned mean iteration time "
            "counts as hung (a ratio, no unit; must be > 1). Default 2 (Unicron uses 3): "
            "steady training jitters far below 2x, checkpoint steps are excluded or "
            "announced, and a stuck collective is caught within 2 iterations; measured "
            "without false alarms in BENCHMARKS.md.",
            gt=1,
        ),
    )
    max_hang_factor: float = field(
        default=4.0,
        metadata=_meta(
            "Upper bound of the learned hang factor (a ratio, no unit; >= hang_factor). The "
            "factor in force is 1.25 x the largest iteration-time/mean ratio seen recently, "
            "kept between hang_factor and this: steady training is judged at hang_factor, "
            "a noisy one (shared CPUs, data-loading stalls) at up to this. Default 4.",
            gt=1,
        ),
    )
    warmup_iterations: int = field(
        default=2,
        metadata=_meta(
            "Number of first iterations left out of the learned mean iteration time, because "
            "they include compilation, allocator and data-loader warm-up. Default 2.",
            ge=0,
        ),
    )
    rules_file: str = field(
        default="",
        metadata=_meta(
            "Path of a TOML file of extra classification rules ([[rule]] tables, see "
            "detect/rules.py), tried before the built-in rules; a rule named like a built-in "
            "replaces it. Empty = built-in rules only. Default: empty."
        ),
    )


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
    node_mtbf_h: float = field(
        default=672.0,
        metadata=_meta(
            "Mean time between failures of one node, in hours: how long a new plan is "
            "expected to run, which prices a transition (Unicron Eq. 3). Default 672 h "
            "(4 weeks).",
            gt=0,
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
            "Seconds without an iteration after a retry in place before it failed. Default 60.", ge=0
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
        default=False,
        metadata=_meta(
            "Probe a node over SSH before acting on a lost heartbeat. Off = a silent agent is "
            "treated as a dead node (SEV1; the drain limiter caps the damage). Default: false "
            "(needs keys and host keys set up; the dev cluster turns it on)."
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
class CkptConfig(Section):
    """The checkpoint engine as the node agent and the built-in trainer run it (``ckpt/``)."""

    shm_dir: str = field(
        default="/dev/shm/unicorn-ckpt",  # noqa: S108 - the memory tier is a tmpfs by design
        metadata=_meta(
            "Host-memory tier: ranks copy their snapshots under <shm_dir>/snap and the agent "
            "keeps its ring predecessors' copies under <shm_dir>/peer. A tmpfs so a snapshot "
            "costs a memory copy and survives the rank's crash. Best a tmpfs of its own "
            "mounted huge=within_size (or huge=advise): restores then map 2 MiB pages, ~3x "
            "faster than /dev/shm's 4 KiB ones. The Slurm Epilog frees a job's folders when "
            "it ends. Empty = no memory tier (the trainer saves only to --save-dir). "
            "Default: /dev/shm/unicorn-ckpt."
        ),
    )
    local_dir: str = field(
        default="/var/tmp/unicorn-ckpt",  # noqa: S108 - node-local disk, kept across reboots
        metadata=_meta(
            "Local-disk tier: the agent persists every sealed snapshot here (survives a "
            "reboot, not a lost disk). Empty = no local tier. Default: /var/tmp/unicorn-ckpt "
            "(kept across reboots, unlike /tmp)."
        ),
    )
    remote_dir: str = field(
        default="",
        metadata=_meta(
            "Remote tier: a shared file system path every node mounts; the agent persists "
            "every sealed snapshot here too. Empty = off. Default: empty (the trainer's "
            "--save-dir, written with torch.distributed.checkpoint, stays the persistent tier)."
        ),
    )
    keep_versions: int = field(
        default=3,
        metadata=_meta(
            "Iterations kept per tier (local, remote, peer backups), oldest evicted first; "
            "the latest complete one is never evicted. Default 3: the newest, and two to fall "
            "back to if it turns out incomplete.",
            ge=1,
        ),
    )
    peer_factor: int = field(
        default=1,
        metadata=_meta(
            "Number of next nodes of the task (ring order) each agent copies its snapshots "
            "to; 0 = no replication. Capped at the task's nodes minus one. Default 1 (TRANSOM's "
            "ring backup): survives the loss of any one node.",
            ge=0,
        ),
    )
    peer_rate_mib_s: float = field(
        default=256.0,
        metadata=_meta(
            "MiB/s at most that one agent sends to its peers, so replication does not compete "
            "with training traffic. Default 256 (about 2 Gbit/s, a small share of a training "
            "network).",
            gt=0,
        ),
    )
    peer_port_base: int = field(
        default=31000,
        metadata=_meta(
            "First TCP port of the agents' replication servers: the agent of node i (its "
            "index in the job's node list) of job J listens on base + (97*J + i) % 1000, so "
            "every agent can compute its peers' ports. Default 31000.",
            ge=1024,
            le=64535,
        ),
    )
    peer_host: str = field(
        default="",
        metadata=_meta(
            "Address the replication servers listen on and are reached at. Empty = every "
            "node's Slurm name (which must resolve), listening on all interfaces. The dev "
            "cluster sets 127.0.0.1. Default: empty."
        ),
    )
    snapshot_every: int = field(
        default=10,
        metadata=_meta(
            "Iterations between the built-in trainer's memory snapshots (besides the save "
            "interval and the SIGUSR1/SIGTERM just-in-time saves); 0 = only those. A "
            "snapshot blocks a rank for about one memory copy, so this can be far shorter "
            "than a disk save interval. Default 10.",
            ge=0,
        ),
    )


@dataclass(frozen=True, kw_only=True)
class LogConfig(Section):
    """Logging of every unicorn process (see ``unicorn_core.logs.configure_logging``)."""

    level: LogLevel = field(
        default="info",
        metadata=_meta("Lowest level written: debug, info, warning or error. Default: info."),
    )
    format: LogFormat = field(
        default="auto",
        metadata=_meta(
            "json writes one JSON object per line (for daemons and log collectors); console "
            "writes readable lines (for people at a terminal); auto picks json when stderr is "
            "not a terminal and console when it is. Default: auto."
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Config(Section):
    """All of unicorn's settings. Build with ``load_config()``; ``Config()`` is the defaults."""

    redis: RedisConfig = field(
        default_factory=RedisConfig, metadata=_meta("Redis connection (coordination state).")
    )
    slurm: SlurmConfig = field(default_factory=SlurmConfig, metadata=_meta("Access to Slurm."))
    agent: AgentConfig = field(default_factory=AgentConfig, metadata=_meta("Per-node agent."))
    detect: DetectConfig = field(default_factory=DetectConfig, metadata=_meta("Failure detection."))
    plan: PlanConfig = field(default_factory=PlanConfig, metadata=_meta("Cluster-wide planning."))
    recovery: RecoveryConfig = field(
        default_factory=RecoveryConfig, metadata=_meta("Error-handling ladder, breakers, drain limiter.")
    )
    ckpt: CkptConfig = field(default_factory=CkptConfig, metadata=_meta("Checkpoint engine."))
    ssh: SshConfig = field(default_factory=SshConfig, metadata=_meta("Out-of-band node probes over SSH."))
    alerts: AlertsConfig = field(
        default_factory=AlertsConfig, metadata=_meta("Alert delivery (command, webhook).")
    )
    metrics: MetricsConfig = field(
        default_factory=MetricsConfig, metadata=_meta("Prometheus endpoint of unicornd.")
    )
    log: LogConfig = field(default_factory=LogConfig, metadata=_meta("Logging."))

    def problems(self) -> list[str]:
        if self.detect.max_hang_factor < self.detect.hang_factor:
            return [
                f"detect.max_hang_factor = {self.detect.max_hang_factor:g} must be >= "
                f"detect.hang_factor = {self.detect.hang_factor:g}"
            ]
        if self.detect.heartbeat_timeout_s <= self.agent.heartbeat_interval_s:
            return [
                f"detect.heartbeat_timeout_s = {self.detect.heartbeat_timeout_s:g} must be greater "
                f"than agent.heartbeat_interval_s = {self.agent.heartbeat_interval_s:g} "
                "(every healthy agent would be declared lost between beats)"
            ]
        return []

    def redis_password(self) -> str | None:
        """Shorthand for ``self.redis.password()``."""
        return self.redis.password()


# --------------------------------------------------------------------------- loading

T = TypeVar("T")


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read the config: defaults, then the TOML file, then ``UNICORN_<SECTION>__<KEY>`` vars.

    ``path`` None means ``$UNICORN_CONFIG`` (looked up in ``env``) when set, else no file.
    ``env`` None means ``os.environ``; it is only read. Raises ``ConfigError`` listing
    every problem found, with nothing applied.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if path is None:
        configured = environ.get(CONFIG_ENV, "")
        path = Path(configured) if configured else None
    data = read_toml(path) if path is not None else {}
    return settings_from(Config, data, environ, source=str(path) if path is not None else "")


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """Parse one TOML file; ``ConfigError`` naming ``what`` and the file when it is missing or invalid."""
    where = f"{what} {str(path)!r}"
    try:
        with path.open("rb") as stream:
            return tomllib.load(stream)
    except FileNotFoundError as exc:
        raise ConfigError(f"{where}: not found") from exc
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text: {exc}") from exc


def settings_from(
    root: type[T], data: Mapping[str, object], env: Mapping[str, str] | None = None, *, source: str = ""
) -> T:
    """Build and check the settings tree ``root`` from parsed TOML ``data`` and ``env``.

    Generic over any tree of frozen dataclasses (``Config`` is one); ``source`` names
    where ``data`` came from, for messages. Raises ``ConfigError`` with every problem.
    """
    errors: list[str] = []
    overrides, origins = _env_overrides(root, env or {}, errors)
    merged = _merge(data, overrides)
    settings = _build(root, merged, "", origins, errors)
    if not errors:
        errors.extend(_cross_field_problems(settings, ""))
    if errors:
        raise _config_error(errors, source)
    return settings


def validate(settings: object) -> None:
    """Run every load-time check on a settings tree built in code (e.g. ``Config(...)``)."""
    if not _is_section(type(settings)):
        raise TypeError(f"expected a settings dataclass, got {type(settings).__name__}")
    data = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}  # type: ignore[arg-type]
    settings_from(type(settings), _as_data(data), {})


# --------------------------------------------------------------------------- describe


@dataclass(frozen=True)
class SettingInfo:
    """One leaf setting, for ``unicornctl config --describe`` and the docs."""

    key: str
    """Dotted path, e.g. ``redis.socket_timeout_s`` (section ``redis``, key ``socket_timeout_s``)."""
    env_var: str
    """Environment variable that overrides it, e.g. ``UNICORN_REDIS__SOCKET_TIMEOUT_S``."""
    expected: str
    """What values it takes, in words (``a number > 0``, ``one of "auto", "cli"``)."""
    default: object
    doc: str


def describe(root: type[Any] = Config) -> tuple[SettingInfo, ...]:
    """Every leaf setting of the tree ``root``, in declaration order."""
    return tuple(_describe(root, ""))


def _describe(cls: type[Any], path: str) -> Iterator[SettingInfo]:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(path, f.name)
        hint = hints[f.name]
        if _is_section(hint):
            yield from _describe(hint, key)
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default
        bounds = " and ".join(
            f"{symbol} {f.metadata[name]:g}" for name, (_, symbol) in _BOUNDS.items() if name in f.metadata
        )
        yield SettingInfo(
            key=key,
            env_var=ENV_PREFIX + ENV_SEPARATOR.join(key.split(".")).upper(),
            expected=_expected(hint) + (f" {bounds}" if bounds else ""),
            default=default,
            doc=str(f.metadata.get("doc", "")),
        )


# --------------------------------------------------------------------------- internals


class _MismatchError(Exception):
    """A value is not of the expected type; ``expected`` says what was wanted, in words."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _is_section(hint: object) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _valid(cls: type[Any]) -> str:
    """``valid keys: a, b`` (or ``valid sections:`` when every field is a section)."""
    hints = get_type_hints(cls)
    names = sorted(f.name for f in dataclasses.fields(cls))
    noun = "sections" if all(_is_section(hints[name]) for name in names) else "keys"
    return f"valid {noun}: {', '.join(names)}"


def _noun(cls: type[Any]) -> str:
    return "section" if _valid(cls).startswith("valid sections") else "key"


def _build(
    cls: type[T], data: Mapping[str, object], path: str, origins: Mapping[str, str], errors: list[str]
) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    errors.extend(
        f"unknown {_noun(cls)} {_join(path, name)!r}; {_valid(cls)}" for name in data if name not in fields
    )
    values: dict[str, object] = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key, hint, value = _join(path, name), hints[name], data[name]
        origin = f" (from ${origins[key]})" if key in origins else ""
        if _is_section(hint):
            if isinstance(value, Mapping):
                values[name] = _build(hint, value, key, origins, errors)
            else:
                errors.append(f"{key} = {_show(value)}{origin}: expected a table ([{key}])")
            continue
        try:
            checked = _check(value, hint)
        except _MismatchError as exc:
            errors.append(f"{key} = {_show(value)}{origin}: expected {exc.expected}")
            continue
        broken = [
            f"{key} = {_show(value)}{origin}: must be {symbol} {f.metadata[bound_name]:g}"
            for bound_name, (compare, symbol) in _BOUNDS.items()
            if bound_name in f.metadata and not compare(checked, f.metadata[bound_name])
        ]
        errors.extend(broken)
        if not broken:  # an out-of-range value never reaches a constructor that checks it too
            values[name] = checked
    return cls(**values)


_SCALARS: dict[type, Callable[[object], bool]] = {
    bool: lambda value: isinstance(value, bool),
    int: lambda value: isinstance(value, int) and not isinstance(value, bool),
    float: lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    str: lambda value: isinstance(value, str),
}


def _check(value: object, hint: Any) -> object:
    """``value`` converted to ``hint``'s type (int to float, list to tuple), or ``_MismatchError``."""
    if get_origin(hint) is tuple:
        if not isinstance(value, list | tuple):
            raise _MismatchError(_expected(hint))
        try:
            return tuple(_check(item, get_args(hint)[0]) for item in value)
        except _MismatchError:
            raise _MismatchError(_expected(hint)) from None
    if get_origin(hint) is Literal:
        matches = isinstance(value, str) and value in get_args(hint)
    elif hint in _SCALARS:
        matches = _SCALARS[hint](value)
    else:
        raise TypeError(f"unsupported settings field type {hint!r}")
    if not matches:
        raise _MismatchError(_expected(hint))
    if hint is float and isinstance(value, int | float):
        if not math.isfinite(value):
            raise _MismatchError("a finite number")
        return float(value)
    return value


def _expected(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(_show(choice) for choice in get_args(hint))
    if get_origin(hint) is tuple:
        return f"a list, each item {_expected(get_args(hint)[0])}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    raise TypeError(f"unsupported settings field type {hint!r}")


def _show(value: object) -> str:
    """``value`` as TOML would spell it (strings in double quotes), cut to 80 characters."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, list | tuple):
        text = "[" + ", ".join(_show(item) for item in value) + "]"
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{key} = {_show(item)}" for key, item in value.items()) + "}"
    else:
        text = repr(value) if isinstance(value, int | float) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _parse_env(text: str, hint: Any) -> object:
    """An environment variable's text as a value of ``hint``'s type (checked later)."""
    if hint is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1"):
            return True
        if lowered in ("false", "0"):
            return False
        raise _MismatchError("true or false (or 1 or 0)")
    if hint is int:
        try:
            return int(text.strip(), 10)
        except ValueError:
            raise _MismatchError(_expected(hint)) from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise _MismatchError(_expected(hint)) from None
    if get_origin(hint) is tuple:
        items = text.split(",") if text.strip() else []
        return [_parse_env(item.strip(), get_args(hint)[0]) for item in items]
    return text  # str and Literal: as is (choices are checked with the rest)


def _env_overrides(
    root: type[Any], env: Mapping[str, str], errors: list[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``UNICORN_A__B`` variables as nested data, and which variable set each dotted key."""
    overrides: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name in sorted(env):
        rest = name.removeprefix(ENV_PREFIX)
        if rest == name or ENV_SEPARATOR not in rest:
            continue  # UNICORN_CONFIG, UNICORN_ETC_DIR, ...: not settings
        parts = rest.lower().split(ENV_SEPARATOR)
        cls, target = root, overrides
        for depth, part in enumerate(parts):
            key = ".".join(parts[: depth + 1])
            hints = get_type_hints(cls)
            if part not in {f.name for f in dataclasses.fields(cls)}:
                errors.append(f"unknown {_noun(cls)} {key!r} (from ${name}); {_valid(cls)}")
                break
            hint, last = hints[part], depth == len(parts) - 1
            if _is_section(hint) and last:
                errors.append(f"${name} names the section {key!r}, not a key; {_valid(hint)}")
            elif _is_section(hint):
                cls, target = hint, target.setdefault(part, {})
                continue
            elif not last:
                errors.append(f"${name}: {key!r} is a key, not a section")
            else:
                try:
                    target[part] = _parse_env(env[name], hint)
                    origins[key] = name
                except _MismatchError as exc:
                    errors.append(f"{key} = {_show(env[name])} (from ${name}): expected {exc.expected}")
            break
    return overrides, origins


def _merge(base: Mapping[str, object], overrides: Mapping[str, object]) -> dict[str, object]:
    """``base`` with ``overrides`` laid over it, table by table (neither is changed)."""
    merged = dict(base)
    for key, value in overrides.items():
        below = merged.get(key)
        if isinstance(value, Mapping):
            if below is None:
                merged[key] = _merge({}, value)
            elif isinstance(below, Mapping):
                merged[key] = _merge(below, value)
            # else: the file has a non-table here; that error is reported by _build
        else:
            merged[key] = value
    return merged


def _cross_field_problems(settings: object, path: str) -> Iterator[str]:
    for f in dataclasses.fields(settings):  # type: ignore[arg-type]
        child = getattr(settings, f.name)
        if _is_section(type(child)):
            yield from _cross_field_problems(child, _join(path, f.name))
    if isinstance(settings, Section):
        prefix = f"{path}: " if path else ""
        yield from (prefix + problem for problem in settings.problems())


def _as_data(data: Mapping[str, object]) -> dict[str, object]:
    """A settings tree's field values as plain nested data, as if parsed from TOML."""
    return {
        key: _as_data({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})  # type: ignore[arg-type]
        if _is_section(type(value))
        else value
        for key, value in data.items()
    }


def _config_error(errors: list[str], source: str) -> ConfigError:
    where = f"config {source}" if source else "config"
    if len(errors) == 1:
        return ConfigError(f"{where}: {errors[0]}")
    return ConfigError(f"{where}: {len(errors)} problems: " + "; ".join(errors))
