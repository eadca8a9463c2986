"""Handling policies as pure functions: ``on_event(snapshot, notice, clock_s) -> Decision``.

* ``unicorn``: Unicron's severity ladder. SEV3 retries in place, SEV2 restarts the
  process on the same nodes (both escalate to SEV1 when the task has lost a node), SEV1
  and node returns replan the whole cluster with the real planner (:func:`plan_cluster`,
  Eq. 4), restoring state from host memory or data-parallel peers.
* ``megatron``: a fixed allocation; every failure hangs the job until the collective
  timeout, then it is resubmitted and restarted from its last persistent checkpoint;
  a task that lost a node waits for a free node or the repair.
* ``per-task``: what a single-job elastic system (DLRover, NVRx) can do. Detection and
  restart costs are unicorn's, so the ratio to it measures cluster-wide planning alone:
  a SEV1 reconfigures only the task hit (onto its own nodes plus free ones), a returning
  node goes to the first task that lost one.
* ``equally``, ``weighted``, ``sized``: megatron's handling on the static baseline
  allocations of :mod:`plan.baselines`.

Every cost default below names its source. "Unicron" is He et al., "Unicron: Economizing
Self-Healing LLM Training at Scale" (2023); its Section 2 breaks a manual recovery on
256 H800 GPUs into a 30 min hang, 9 min resubmission, 14 min set-up and 15 min
recomputation; its Table 2 gives the detection times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from plan.baselines import Baseline, baseline_allocation, best_within
from plan.hardware import GpuSpec
from plan.objective import FailureModel, TransitionModel
from plan.planner import Cluster, Granularity, PlanRequest, TaskCurve, plan_cluster, task_curves
from plan.sim.state import Action, Decision, Notice, Phase, Snapshot, TaskDecision, TaskView
from plan.sim.trace import EventKind
from unicorn_core.errors import InvalidArgument
from unicorn_core.taskspec import TaskSpec, check_unique_names

MINUTE_S = 60.0


@dataclass(frozen=True)
class UnicornCosts:
    """unicorn's detection and recovery costs (also used by ``per-task``)."""

    detect_sev1_s: float = 5.6  # Unicron Table 2: node health check, lost connection
    detect_sev2_s: float = 1.8  # Unicron Table 2: process supervision, abnormal exit
    detect_sev3_s: float = 0.3  # Unicron Table 2: exception propagation (connection refused/reset)
    # SEV3 retry in place: no restart; what is lost is the partial iteration (rolled back to
    # the last in-memory checkpoint). Assumption: no published figure for the retry itself.
    retry_s: float = 0.0
    # D_transition of the planner: a 60 s restart (NVRx's in-job restart cycle is ~1 min)
    # plus reloading 18 B per parameter at 10 GB/s from host memory or DP peers.
    transition: TransitionModel = field(default_factory=TransitionModel)
    # D_running of the planner: Unicron's 1-7 failures a week per 128 GPUs (midpoint).
    failure: FailureModel = field(default_factory=FailureModel)

    def detection_s(self, kind: EventKind) -> float:
        return {
            EventKind.SEV1: self.detect_sev1_s,
            EventKind.SEV2: self.detect_sev2_s,
            EventKind.SEV3: self.detect_sev3_s,
            EventKind.NODE_RETURN: 0.0,
        }[kind]


@dataclass(frozen=True)
class MegatronCosts:
    """Terminate-and-restart costs of plain Megatron (also the static baselines')."""

    detection_s: float = 30 * MINUTE_S  # Unicron Sec. 2: hang until the all-reduce timeout
    resubmit_s: float = 9 * MINUTE_S  # Unicron Sec. 2: resubmission
    setup_s: float = 14 * MINUTE_S  # Unicron Sec. 2: environment set-up (incl. checkpoint load)
    # Unicron Sec. 2 recomputes 15 min on average: half of a 30 min persistent checkpoint interval.
    checkpoint_interval_s: float = 30 * MINUTE_S

    def __post_init__(self) -> None:
        values = (self.detection_s, self.resubmit_s, self.setup_s)
        if min(values) < 0 or not self.checkpoint_interval_s > 0:
            raise InvalidArgument("megatron costs must be >= 0 and the checkpoint interval > 0")

    @property
    def restart_s(self) -> float:
        return self.resubmit_s + self.setup_s


@dataclass(frozen=True)
class Workload:
    """Tasks on a cluster of whole nodes, with their performance curves (worker = node)."""

    tasks: tuple[TaskSpec, ...]
    cluster: Cluster
    curves: tuple[TaskCurve, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    def waf(self, task: int, nodes: int) -> float:
        """F(t, nodes), weighted TFLOP/s (0 when no layout uses that many nodes)."""
        curve = self.curves[task].waf
        return float(curve[nodes]) if 0 <= nodes < curve.shape[0] else 0.0

    def iteration_s(self, task: int, nodes: int) -> float:
        """Iteration time of the task's best layout on ``nodes`` nodes (``inf`` if none)."""
        est = self.curves[task].estimate(nodes)
        return est.iteration_s if est is not None else math.inf


def build_workload(tasks: Sequence[TaskSpec], nodes: int, gpus_per_node: int, gpu: GpuSpec) -> Workload:
    """Curves of ``tasks`` on ``nodes`` nodes of ``gpus_per_node`` GPUs (node granularity)."""
    check_unique_names(tuple(tasks), "workload")
    if not tasks:
        raise InvalidArgument("a workload needs at least one task")
    cluster = Cluster(nodes, gpus_per_node, gpu, Granularity.NODE)
    return Workload(tuple(tasks), cluster, task_curves(tasks, cluster, cluster.workers))


class Policy(Protocol):
    """A handling policy: pure decisions from a snapshot, no I/O, no hidden state."""

    @property
    def name(self) -> str: ...

    def initial(self, nodes: int) -> Decision:
        """The allocation at the start, on ``nodes`` healthy nodes."""
        ...

    def detection_s(self, kind: EventKind) -> float:
        """Seconds from a failure of ``kind`` until the policy learns of it."""
        ...

    def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> Decision:
        """One decision per task (workload order) after ``notice``."""
        ...


def _hit_index(snapshot: Snapshot, notice: Notice) -> int | None:
    if notice.task is None:
        return None
    for i, view in enumerate(snapshot.tasks):
        if view.name == notice.task:
            return i
    raise InvalidArgument(f"notice names unknown task {notice.task!r}")


def _intact(view: TaskView) -> bool:
    """The task still holds every node it ran on (a SEV2/SEV3 can be handled in place)."""
    return view.workers > 0 and view.held == view.workers


class UnicornPolicy:
    """Severity ladder plus cluster-wide replanning with the real planner."""

    def __init__(self, workload: Workload, costs: UnicornCosts | None = None) -> None:
        self.workload = workload
        self.costs = costs or UnicornCosts()

    @property
    def name(self) -> str:
        return "unicorn"

    def detection_s(self, kind: EventKind) -> float:
        return self.costs.detection_s(kind)

    def transition_s(self, task: int) -> float:
        """D_transition of ``task`` (the planner's model): restart plus reloading its model states."""
        return self.costs.transition.transition_s(self.workload.tasks[task])

    def start(self, task: int, nodes: int, downtime_s: float) -> TaskDecision:
        """(Re)start ``task`` on ``nodes`` nodes after ``downtime_s``.

        In-memory checkpoints every iteration: a failure loses at most the current one.
        """
        interval = self.workload.iteration_s(task, nodes)
        return TaskDecision(nodes, Action.RESTART, downtime_s, interval if nodes else math.inf)

    def initial(self, nodes: int) -> Decision:
        plan = plan_cluster(self.workload.curves, self.workload.cluster.with_nodes(nodes))
        return tuple(self.start(i, k, 0.0) for i, k in enumerate(plan.allocation))

    def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> Decision:
        hit = _hit_index(snapshot, notice)
        views = snapshot.tasks
        if hit is not None and notice.kind in (EventKind.SEV2, EventKind.SEV3) and _intact(views[hit]):
            in_place = self.costs.retry_s if notice.kind is EventKind.SEV3 else self.transition_s(hit)
            return tuple(
                self.start(i, v.workers, in_place) if i == hit else TaskDecision.keep(v)
                for i, v in enumerate(views)
            )
        return self.replan(snapshot, hit)

    def replan(self, snapshot: Snapshot, hit: int | None) -> Decision:
        """Cluster-wide plan on the healthy nodes; tasks whose count changes, and the one hit, restart."""
        views = snapshot.tasks
        current = tuple(v.workers for v in views)
        faulted = frozenset({views[hit].name}) if hit is not None else frozenset()
        request = PlanRequest(current, faulted, self.costs.failure, self.costs.transition)
        cluster = self.workload.cluster.with_nodes(snapshot.healthy)
        plan = plan_cluster(self.workload.curves, cluster, request)
        out = []
        for i, (view, k) in enumerate(zip(views, plan.allocation, strict=True)):
            if i == hit or k != view.workers:
                out.append(self.start(i, k, self.transition_s(i)))
            else:
                out.append(TaskDecision.keep(view))
        return tuple(out)


class MegatronPolicy:
    """A fixed allocation with terminate-and-restart recovery from persistent checkpoints."""

    def __init__(
        self, name: str, workload: Workload, allocation: Sequence[int], costs: MegatronCosts | None = None
    ) -> None:
        if len(allocation) != len(workload.tasks) or min(allocation, default=0) < 0:
            raise InvalidArgument(f"{name}: allocation {list(allocation)} does not fit the workload")
        self._name = name
        self.workload = workload
        self.allocation = tuple(allocation)
        self.costs = costs or MegatronCosts()

    @property
    def name(self) -> str:
        return self._name

    def detection_s(self, kind: EventKind) -> float:
        return 0.0 if kind is EventKind.NODE_RETURN else self.costs.detection_s

    def _start(self, nodes: int, downtime_s: float) -> TaskDecision:
        return TaskDecision(nodes, Action.RESTART, downtime_s, self.costs.checkpoint_interval_s)

    def initial(self, nodes: int) -> Decision:
        if sum(self.allocation) > nodes:
            raise InvalidArgument(f"{self.name}: allocation needs {sum(self.allocation)} of {nodes} nodes")
        return tuple(self._start(k, 0.0) for k in self.allocation)

    def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> Decision:
        hit = _hit_index(snapshot, notice)
        views = snapshot.tasks
        out = [TaskDecision.keep(v) for v in views]
        waiting = [i for i, v in enumerate(views) if i == hit or v.phase is Phase.WAITING]
        waiting.sort(key=lambda i: (views[i].lost_at_s is None, views[i].lost_at_s or 0.0, i))
        free = snapshot.free
        for i in waiting:
            view, need = views[i], self.allocation[i]
            if view.held + free >= need:
                free -= need - view.held
                out[i] = self._start(need, self.costs.restart_s)
            else:
                out[i] = TaskDecision(view.held, Action.WAIT)
        return tuple(out)


class PerTaskPolicy:
    """Single-job elasticity: only the task hit reconfigures; returns go to the first task that lost a node.

    This is what DLRover or NVRx can do inside one job, with unicorn's detection and restart costs.
    """

    def __init__(
        self, workload: Workload, allocation: Sequence[int], costs: UnicornCosts | None = None
    ) -> None:
        if len(allocation) != len(workload.tasks):
            raise InvalidArgument(f"per-task: allocation {list(allocation)} does not fit the workload")
        self.workload = workload
        self.allocation = tuple(allocation)
        self.costs = costs or UnicornCosts()
        self._unicorn = UnicornPolicy(workload, self.costs)  # shares the in-place ladder steps

    @property
    def name(self) -> str:
        return "per-task"

    def detection_s(self, kind: EventKind) -> float:
        return self.costs.detection_s(kind)

    def initial(self, nodes: int) -> Decision:
        if sum(self.allocation) > nodes:
            raise InvalidArgument(f"per-task: allocation needs {sum(self.allocation)} of {nodes} nodes")
        return tuple(self._unicorn.start(i, k, 0.0) for i, k in enumerate(self.allocation))

    def _best(self, task: int, nodes: int) -> int:
        waf: npt.NDArray[np.float64] = self.workload.curves[task].waf
        return best_within(waf, min(nodes, self.allocation[task]))

    def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> Decision:
        hit = _hit_index(snapshot, notice)
        views = snapshot.tasks
        if hit is not None and notice.kind in (EventKind.SEV2, EventKind.SEV3) and _intact(views[hit]):
            return self._unicorn.on_event(snapshot, notice, clock_s)
        out = [TaskDecision.keep(v) for v in views]
        free = snapshot.free
        if hit is not None:
            view = views[hit]
            k = self._best(hit, view.held + free)
            free += view.held - k
            out[hit] = self._unicorn.start(hit, k, self._unicorn.transition_s(hit))
        if notice.kind is EventKind.NODE_RETURN:
            affected = [
                i
                for i, v in enumerate(views)
                if v.workers < self.allocation[i] and v.phase is not Phase.DETECTING
            ]
            affected.sort(key=lambda i: (views[i].lost_at_s is None, views[i].lost_at_s or 0.0, i))
            if affected:
                i = affected[0]
                k = self._best(i, views[i].held + free)
                if k > views[i].workers:
                    out[i] = self._unicorn.start(i, k, self._unicorn.transition_s(i))
        return tuple(out)


POLICY_NAMES = ("unicorn", "megatron", "per-task", *(b.value for b in Baseline))


def planned_allocation(workload: Workload, nodes: int) -> tuple[int, ...]:
    """The planner's failure-free allocation on ``nodes`` nodes."""
    return plan_cluster(workload.curves, workload.cluster.with_nodes(nodes)).allocation


def make_policy(
    name: str,
    workload: Workload,
    *,
    unicorn: UnicornCosts | None = None,
    megatron: MegatronCosts | None = None,
    spare_nodes: int = 0,
) -> Policy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`).

    Fixed allocations (``megatron``, ``per-task``, baselines) leave ``spare_nodes`` nodes
    out as hot spares; ``megatron`` and ``per-task`` start from the planner's allocation
    on the rest, so their gap to ``unicorn`` is failure handling, not the initial split.
    ``unicorn`` plans over every healthy node.
    """
    nodes = workload.cluster.nodes
    if not 0 <= spare_nodes < nodes:
        raise InvalidArgument(f"spare nodes must be in 0..{nodes - 1}, got {spare_nodes}")
    usable = nodes - spare_nodes
    if name == "unicorn":
        return UnicornPolicy(workload, unicorn)
    if name == "megatron":
        return MegatronPolicy(name, workload, planned_allocation(workload, usable), megatron)
    if name == "per-task":
        return PerTaskPolicy(workload, planned_allocation(workload, usable), unicorn)
    if name in {b.value for b in Baseline}:
        wafs = [c.waf[: usable + 1] for c in workload.curves]
        allocation = baseline_allocation(workload.tasks, wafs, usable, Baseline(name))
        return MegatronPolicy(name, workload, allocation, megatron)
    raise InvalidArgument(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
