"""The boundary between the simulator and a policy: what a policy sees and what it decides.

A policy is told of an event (:class:`Notice`) together with a :class:`Snapshot` of the
cluster, and answers one :class:`TaskDecision` per task. The same types serve the
coordinator later: a snapshot is what it reads from Redis and Slurm, a decision what its
executor applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from plan.sim.trace import EventKind
from unicorn_core.errors import InvalidArgument


class Phase(StrEnum):
    """Where a task is; each phase charges its rate F(t, workers) to one account.

    RUNNING      trains on ``workers`` and earns F (accumulated WAF).
    DETECTING    hit by a failure not noticed yet: hung or dead, earns nothing (detection).
    RESTARTING   being restarted or reconfigured for the decided downtime (transition).
    RECOMPUTING  redoing the work lost since its last checkpoint (transition).
    WAITING      holds nodes but cannot run until more come back (sub-healthy).
    IDLE         runs nothing: given no workers, or a count no layout can use (sub-healthy).

    Allowed moves are :data:`TRANSITIONS`; anything else is a simulator or policy bug.
    """

    RUNNING = "running"
    DETECTING = "detecting"
    RESTARTING = "restarting"
    RECOMPUTING = "recomputing"
    WAITING = "waiting"
    IDLE = "idle"


_ANY_DECISION = frozenset({Phase.RESTARTING, Phase.WAITING, Phase.IDLE})
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.RUNNING: _ANY_DECISION | {Phase.DETECTING},
    Phase.DETECTING: _ANY_DECISION,
    Phase.RESTARTING: _ANY_DECISION | {Phase.DETECTING, Phase.RECOMPUTING, Phase.RUNNING},
    Phase.RECOMPUTING: _ANY_DECISION | {Phase.DETECTING, Phase.RUNNING},
    Phase.WAITING: _ANY_DECISION,
    Phase.IDLE: _ANY_DECISION,
}


def check_transition(task: str, old: Phase, new: Phase) -> None:
    """Raise :class:`InvalidArgument` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    if new not in TRANSITIONS[old]:
        raise InvalidArgument(f"task {task!r}: illegal phase change {old.value} -> {new.value}")


@dataclass(frozen=True)
class TaskView:
    """One task as a policy sees it."""

    name: str
    phase: Phase
    workers: int  # nodes its current configuration runs on (0 when waiting or idle)
    held: int  # healthy nodes it holds (fewer than ``workers`` right after a SEV1)
    lost_at_s: float | None  # when it last lost a node to a failure; None: never
    config: tuple[int, ...] = ()  # the ``config`` of the decision that started it


@dataclass(frozen=True)
class Snapshot:
    """The cluster at ``clock_s``: node counts and every task, in workload order."""

    clock_s: float
    nodes: int  # cluster size
    healthy: int  # nodes up
    free: int  # nodes up that no task holds
    tasks: tuple[TaskView, ...]


@dataclass(frozen=True)
class Notice:
    """An event as the policy learns of it: after detection for failures, at once for returns.

    ``task`` is the task the failure hit while that task still awaits handling; ``None``
    for returns, for failures of free nodes, and once another decision has already
    handled the task (a second fault detected later).
    """

    kind: EventKind
    node: int
    task: str | None


class Action(StrEnum):
    """What a decision does to one task."""

    KEEP = "keep"  # leave it as it is (``nodes`` must equal what it holds)
    RESTART = "restart"  # (re)start on ``nodes`` nodes after ``downtime_s``; then redo lost work
    WAIT = "wait"  # hold ``nodes`` nodes and run nothing until a later decision


@dataclass(frozen=True)
class TaskDecision:
    """One task's part of a decision.

    The restore points apply from this (re)start on. A failure that takes a node loses
    the running time since the last restore point, taken every ``checkpoint_interval_s``
    after the process starts and usable ``checkpoint_lag_s`` after it was taken (a
    snapshot still being copied to a peer); ``inf``: never checkpoints. A failure that
    leaves the node (a process or network fault) falls back to restore points every
    ``jit_interval_s`` with no lag (one iteration with just-in-time saves); ``None``: the
    same as a lost node.

    ``waf_tflops`` is what the task earns while it trains (weighted TFLOP/s, after any
    checkpoint stall); ``None``: the workload's best layout on ``nodes`` nodes.
    ``config`` is the policy's own note of the configuration (pipeline sizes, a failover
    flag), handed back in :class:`TaskView`.
    """

    nodes: int
    action: Action
    downtime_s: float = 0.0
    checkpoint_interval_s: float = math.inf
    checkpoint_lag_s: float = 0.0
    jit_interval_s: float | None = None
    waf_tflops: float | None = None
    config: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.nodes < 0:
            raise InvalidArgument(f"a decision cannot give {self.nodes} nodes")
        if not self.downtime_s >= 0:
            raise InvalidArgument(f"downtime must be >= 0, got {self.downtime_s!r}")
        if not self.checkpoint_interval_s > 0:
            raise InvalidArgument(f"checkpoint interval must be > 0, got {self.checkpoint_interval_s!r}")
        if not self.checkpoint_lag_s >= 0:
            raise InvalidArgument(f"checkpoint lag must be >= 0, got {self.checkpoint_lag_s!r}")
        if self.jit_interval_s is not None and not self.jit_interval_s > 0:
            raise InvalidArgument(f"jit interval must be > 0, got {self.jit_interval_s!r}")
        if self.waf_tflops is not None and not (self.waf_tflops >= 0 and math.isfinite(self.waf_tflops)):
            raise InvalidArgument(f"waf must be finite and >= 0, got {self.waf_tflops!r}")

    @staticmethod
    def keep(view: TaskView) -> TaskDecision:
        return TaskDecision(view.held, Action.KEEP)


Decision = tuple[TaskDecision, ...]
