"""Slurm records as the rest of unicorn sees them: frozen values, independent of backend."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from unicorn_core.errors import InvalidArgument

NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_REASON_CHARS = 400


class NodeState(enum.StrEnum):
    """Slurm's base node state (flags such as DRAIN live in ``NodeInfo.flags``)."""

    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    DOWN = "DOWN"
    ERROR = "ERROR"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"


class JobState(enum.StrEnum):
    """Slurm's job states; anything newer Slurm adds maps to ``OTHER`` (raw kept)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    RESIZING = "RESIZING"
    CONFIGURING = "CONFIGURING"
    OTHER = "OTHER"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        JobState.COMPLETED,
        JobState.CANCELLED,
        JobState.FAILED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.PREEMPTED,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.OUT_OF_MEMORY,
    }
)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node. ``flags`` are upper-case Slurm flags (DRAIN, NOT_RESPONDING, ...)."""

    name: str
    state: NodeState
    flags: frozenset[str]
    reason: str
    cpus: int
    gpus: int
    gpus_used: int
    real_memory_mib: int
    partitions: tuple[str, ...]
    features: tuple[str, ...] = ()
    """Active node features (``sinfo``'s ``active_features``, ``scontrol``'s ``ActiveFeatures``)."""
    gpu_type: str = ""
    """The GPUs' type from GRES (``gpu:h100:8`` -> ``h100``); empty when GRES names none.
    A node with GPUs of two types reports the type it has most of (ties: by name)."""

    @property
    def drained(self) -> bool:
        """Drain requested (DRAINING while jobs finish, DRAINED after)."""
        return "DRAIN" in self.flags

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags

    @property
    def usable(self) -> bool:
        """The scheduler may place work here: up, responding, not drained."""
        return (
            self.state in (NodeState.IDLE, NodeState.MIXED, NodeState.ALLOCATED)
            and self.responding
            and not self.drained
            and not self.flags & {"MAINTENANCE", "REBOOT_REQUESTED", "POWERED_DOWN", "POWER_DOWN"}
        )


@dataclass(frozen=True, slots=True)
class JobInfo:
    """One job. ``nodes`` is expanded; empty while pending."""

    job_id: int
    name: str
    state: JobState
    state_raw: str
    reason: str
    nodes: tuple[str, ...]
    num_nodes: int
    batch: bool
    restarts: int
    user: str
    gres: str = ""
    """The generic resources it asked for, per node or per job as Slurm prints them
    (``gres/gpu:8``; 22.05: ``gres:gpu:8``); empty: none. Slurm (22.05 and 24.11) refuses
    to expand a running job that holds GRES: such a job grows only through a requeue."""
    batch_host: str = ""
    """The node running a batch job's script; empty when unknown or none. Slurm refuses a
    shrink that removes it (22.05 and 24.11: "Invalid node name specified"; slurmctld logs
    "You cannot remove the batch host from a job when resizing")."""

    @property
    def holds_gres(self) -> bool:
        return bool(self.gres)


@dataclass(frozen=True, slots=True)
class JobLimits:
    """The most nodes and GPUs Slurm's own policy lets one job hold (None: no limit), and
    where each limit comes from (``partition gpu: MaxNodes=4``, ``QoS normal: node=2``)."""

    max_nodes: int | None = None
    max_gpus: int | None = None
    sources: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GrowResult:
    """How a job was grown: ``expand`` (in place, job keeps running) or ``requeue``."""

    job_id: int
    method: str
    nodes_added: tuple[str, ...]


def check_node_name(name: str) -> str:
    """Return ``name`` if it is a syntactically valid Slurm node name, else raise."""
    if not isinstance(name, str) or not NODE_NAME.match(name):
        raise InvalidArgument(f"invalid node name {name!r}: expected letters, digits, '_', '.', '-'")
    return name


def check_reason(reason: str) -> str:
    """Return a drain/down reason fit for ``scontrol``: one line, bounded, non-empty."""
    if not reason or not reason.strip():
        raise InvalidArgument("a reason is required")
    if "\n" in reason or "\r" in reason:
        raise InvalidArgument(f"reason must be one line: {reason!r}")
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidArgument(f"reason longer than {MAX_REASON_CHARS} characters")
    return reason.strip()


def check_job_id(job_id: int) -> int:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id <= 0:
        raise InvalidArgument(f"invalid job id {job_id!r}: expected a positive integer")
    return job_id
