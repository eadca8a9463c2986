"""Handling policies as pure functions: ``on_event(snapshot, notice, clock_s) -> Decision``.

* ``unicorn``: Unicron's severity ladder. SEV3 retries in place, SEV2 restarts the
  process on the same nodes (both escalate to SEV1 when the task has lost a node), SEV1
  and node returns replan the whole cluster with the real planner (:func:`plan_cluster`,
  Eq. 4), restoring state from host memory or peers. It pays our measured detection,
  restart, snapshot-stall and restore costs (:class:`~plan.sim.costs.UnicornCosts`).
* ``megatron``: plain Megatron-LM with a fixed TP/PP per task. Every failure hangs the
  job until the collective timeout; it is then resubmitted from its last persistent
  checkpoint on the same number of nodes when free ones make up for a lost node, else
  on the nodes left at the largest DP that fits (its TP, PP and the global batch fixed).
  When repaired nodes make its full allocation possible again, it is resubmitted there.
* ``per-task``: what a single-job elastic system (DLRover, NVRx) can do, with unicorn's
  costs, so the ratio to it measures cluster-wide planning alone: a SEV1 reconfigures
  only the task hit (onto its own nodes plus free ones), a returning node goes to the
  first task that lost one.
* ``oobleck``, ``varuna``, ``bamboo``: :mod:`plan.sim.elastic`.
* ``equally``, ``weighted``, ``sized``: megatron's handling on the static baseline
  allocations of :mod:`plan.baselines`.

Single-job systems (everything but ``unicorn``) start from a fixed allocation: the
planner's failure-free allocation for their own throughput curves, so their gap to
unicorn is failure handling and what their systems can run, not the initial split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from plan.baselines import Baseline, baseline_allocation, best_within
from plan.hardware import GpuSpec
from plan.objective import FailureModel, TransitionModel, waf_curve
from plan.planner import Cluster, Granularity, PlanRequest, TaskCurve, plan_cluster, task_curves
from plan.sim.costs import ElasticCosts, MegatronCosts, UnicornCosts
from plan.sim.state import Action, Decision, Notice, Phase, Snapshot, TaskDecision, TaskView
from plan.sim.systems import RunConfig, fixed_shape
from plan.sim.trace import EventKind
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.taskspec import TaskSpec, check_unique_names


@dataclass(frozen=True)
class Workload:
    """Tasks on a cluster of whole nodes, with their performance curves (worker = node)."""

    tasks: tuple[TaskSpec, ...]
    cluster: Cluster
    curves: tuple[TaskCurve, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    @property
    def gpus_per_node(self) -> int:
        return self.cluster.gpus_per_node

    @property
    def gpu(self) -> GpuSpec:
        return self.cluster.gpu

    def waf(self, task: int, nodes: int) -> float:
        """F(t, nodes), weighted TFLOP/s of the best layout (0 when no layout uses that many nodes)."""
        curve = self.curves[task].waf
        return float(curve[nodes]) if 0 <= nodes < curve.shape[0] else 0.0

    def iteration_s(self, task: int, nodes: int) -> float:
        """Iteration time of the task's best layout on ``nodes`` nodes (``inf`` if none)."""
        est = self.curves[task].estimate(nodes)
        return est.iteration_s if est is not None else math.inf

    def layout(self, task: int, nodes: int) -> Layout | None:
        est = self.curves[task].estimate(nodes)
        return est.layout if est is not None else None

    def weighted(self, task: int, cfg: RunConfig | None) -> float:
        """Weighted TFLOP/s of ``cfg`` (0 when the task's GPU requirement is not met)."""
        if cfg is None:
            return 0.0
        spec = self.tasks[task]
        if cfg.gpus < spec.min_gpus or (spec.max_gpus is not None and cfg.gpus > spec.max_gpus):
            return 0.0
        return spec.weight * cfg.tflops

    def ideal_waf(self) -> float:
        """W*: the planner's best failure-free allocation of the whole cluster, best layouts."""
        return plan_cluster(self.curves, self.cluster).total_waf_tflops

    def curves_from(self, configs: Sequence[Sequence[RunConfig | None]]) -> tuple[TaskCurve, ...]:
        """Task curves for the planner from per-node-count configurations of another system."""
        out = []
        for curve, row in zip(self.curves, configs, strict=True):
            tflops = np.array([c.tflops if c is not None else 0.0 for c in row], dtype=np.float64)
            tflops.resize(curve.tflops.shape[0], refcheck=False)
            out.append(replace(curve, tflops=tflops, waf=waf_curve(curve.task, tflops, curve.worker_gpus)))
        return tuple(out)


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


def hit_index(snapshot: Snapshot, notice: Notice) -> int | None:
    """Index of the task the notice's failure hit and that still awaits handling."""
    if notice.task is None:
        return None
    for i, view in enumerate(snapshot.tasks):
        if view.name == notice.task:
            return i
    raise InvalidArgument(f"notice names unknown task {notice.task!r}")


def intact(view: TaskView) -> bool:
    """The task still holds every node it ran on (a SEV2/SEV3 can be handled in place)."""
    return view.workers > 0 and view.held == view.workers


def by_loss(views: Sequence[TaskView], indices: Sequence[int]) -> list[int]:
    """``indices`` ordered by when the task last lost a node (never last)."""
    return sorted(indices, key=lambda i: (views[i].lost_at_s is None, views[i].lost_at_s or 0.0, i))


class UnicornPolicy:
    """Severity ladder plus cluster-wide replanning with the real planner."""

    def __init__(
        self, workload: Workload, costs: UnicornCosts | None = None, failure: FailureModel | None = None
    ) -> None:
        self.workload = workload
        self.costs = costs or UnicornCosts()
        self.failure = failure or FailureModel()
        ideal = plan_cluster(workload.curves, workload.cluster).allocation
        # D_transition of the planner's Eq. 3: our measured relaunch plus the restore at the
        # failure-free allocation (one node for a task that gets none there)
        measured = {
            t.name: self.relaunch_s(i, max(k, 1))
            for i, (t, k) in enumerate(zip(workload.tasks, ideal, strict=True))
        }
        self.transition = TransitionModel(measured_s=measured)

    @property
    def name(self) -> str:
        return "unicorn"

    def detection_s(self, kind: EventKind) -> float:
        return self.costs.detection_s(kind)

    def _gpus(self, nodes: int) -> int:
        return nodes * self.workload.gpus_per_node

    def relaunch_s(self, task: int, nodes: int) -> float:
        """A relaunch on a new allocation: measured, plus restoring the state at the new layout."""
        model = self.workload.tasks[task].model
        return self.costs.measured.relaunch_s + self.costs.restore_s(model, self._gpus(nodes))

    def restart_in_place_s(self, task: int, nodes: int, kind: EventKind) -> float:
        """SEV2: restart the processes on the same nodes; SEV3: the retry's timeout first."""
        model = self.workload.tasks[task].model
        restart = self.costs.measured.restart_in_place_s + self.costs.restore_s(model, self._gpus(nodes))
        return restart + (self.costs.retry_timeout_s if kind is EventKind.SEV3 else 0.0)

    def start(self, task: int, nodes: int, downtime_s: float) -> TaskDecision:
        """(Re)start ``task`` on ``nodes`` nodes after ``downtime_s``, with memory snapshots.

        Snapshots every ``snapshot_interval_s`` stall training for one copy each; a lost
        node falls back to the newest snapshot its ring peer holds in full.
        """
        est = self.workload.curves[task].estimate(nodes)
        if nodes == 0 or est is None:
            return TaskDecision(nodes, Action.RESTART, downtime_s)
        model, gpus = self.workload.tasks[task].model, self._gpus(nodes)
        interval = self.costs.snapshot_interval_s(model, gpus, est.iteration_s, self.failure.running_s(nodes))
        stall = self.costs.snapshot_stall_s(model, gpus)
        lag = self.costs.replication_lag_s(model, gpus, nodes)
        return TaskDecision(
            nodes,
            Action.RESTART,
            downtime_s,
            checkpoint_interval_s=max(interval, lag) + stall,
            checkpoint_lag_s=lag,
            jit_interval_s=est.iteration_s,
            waf_tflops=self.workload.waf(task, nodes) * interval / (interval + stall),
        )

    def initial(self, nodes: int) -> Decision:
        plan = plan_cluster(self.workload.curves, self.workload.cluster.with_nodes(nodes))
        return tuple(self.start(i, k, 0.0) for i, k in enumerate(plan.allocation))

    def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> Decision:
        hit = hit_index(snapshot, notice)
        views = snapshot.tasks
        if hit is not None and notice.kind in (EventKind.SEV2, EventKind.SEV3) and intact(views[hit]):
            workers = views[hit].workers
            downtime = self.restart_in_place_s(hit, workers, notice.kind)
            return tuple(
                self.start(i, workers, downtime) if i == hit else TaskDecision.keep(v)
                for i, v in enumerate(views)
            )
        return self.replan(snapshot, hit)

    def replan(self, snapshot: Snapshot, hit: int | None) -> Decision:
        """Cluster-wide plan on the healthy nodes; tasks whose count changes, and the one hit, restart."""
        views = snapshot.tasks
        current = tuple(v.workers for v in views)
        faulted = frozenset({views[hit].name}) if hit is not None else frozenset()
        request = PlanRequest(current, faulted, self.failure, self.transition)
        cluster = self.workload.cluster.with_nodes(snapshot.healthy)
        plan = plan_cluster(self.workload.curves, cluster, request)
        out = []
        for i, (view, k) in enumerate(zip(views, plan.allocation, strict=True)):
            if i == hit or k != view.workers:
                out.append(self.start(i, k, self.relaunch_s(i, k)))
            else:
                out.append(TaskDecision.keep(view))
        return tuple(out)


class MegatronPolicy:
    """Fixed TP/PP per task, terminate-and-restart from persistent checkpoints (Unicron Sec. 2).

    After a failure the job is resubmitted on the nodes it still holds plus free ones, up to
    its allocation (the same number of nodes when free ones make up for a lost one), at
    the largest data-parallel size its fixed TP, PP and global batch allow there; nodes
    that size cannot use are released. With no such size it waits for nodes. When a node
    returns, a job below its allocation that can run faster on the free nodes is stopped
    (Megatron-LM's ``--exit-signal-handler`` saves a checkpoint first: nothing is lost)
    and resubmitted on them.
    """

    def __init__(
        self, name: str, workload: Workload, allocation: Sequence[int], costs: MegatronCosts | None = None
    ) -> None:
        if len(allocation) != len(workload.tasks) or min(allocation, default=0) < 0:
            raise InvalidArgument(f"{name}: allocation {list(allocation)} does not fit the workload")
        self._name = name
        self.workload = workload
        self.allocation = tuple(allocation)
        self.costs = costs or MegatronCosts()
        self.layouts = tuple(workload.layout(i, k) for i, k in enumerate(self.allocation))

    @property
    def name(self) -> str:
        return self._name

    def detection_s(self, kind: EventKind) -> float:
        return 0.0 if kind is EventKind.NODE_RETURN else self.costs.detection_s

    def config(self, task: int, nodes: int) -> RunConfig | None:
        """The task's fixed TP/PP at the largest DP that fits on ``nodes`` nodes."""
        base = self.layouts[task]
        if base is None or nodes <= 0:
            return None
        w = self.workload
        return fixed_shape(w.tasks[task].model, w.gpu, w.gpus_per_node, base, nodes)

    def _start(self, task: int, cfg: RunConfig | None, downtime_s: float) -> TaskDecision:
        if cfg is None:
            return TaskDecision(0, Action.RESTART, downtime_s)
        model = self.workload.tasks[task].model
        stall = self.costs.stall_fraction(model, cfg.gpus)
        interval = self.costs.checkpoint_interval_s + self.costs.save_s(model, cfg.gpus)
        waf = self.workload.weighted(task, cfg) * (1.0 - stall)
        return TaskDecision(
            cfg.nodes, Action.RESTART, downtime_s, interval, waf_tflops=waf, config=(cfg.gpus,)
        )

    def initial(self, nodes: int) -> Decision:
        if sum(self.allocation) > nodes:
            raise InvalidArgument(f"{self.name}: allocation needs {sum(self.allocation)} of {nodes} nodes")
        return tuple(self._start(i, self.config(i, k), 0.0) for i, k in enumerate(self.allocation))

    def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> Decision:
        hit = hit_index(snapshot, notice)
        views = snapshot.tasks
        out = [TaskDecision.keep(v) for v in views]
        free = snapshot.free
        if hit is not None:
            view = views[hit]
            cfg = self.config(hit, min(self.allocation[hit], view.held + free))
            if cfg is None:
                out[hit] = TaskDecision(view.held, Action.WAIT)
            else:
                free += view.held - cfg.nodes
                out[hit] = self._start(hit, cfg, self.costs.restart_s)
        if notice.kind is EventKind.NODE_RETURN:
            below = [
                i
                for i, v in enumerate(views)
                if i != hit and v.phase is not Phase.DETECTING and v.workers < self.allocation[i]
            ]
            for i in by_loss(views, below):
                view = views[i]
                cfg = self.config(i, min(self.allocation[i], view.held + free))
                now = self.config(i, view.workers) if view.phase is not Phase.WAITING else None
                if cfg is None or (now is not None and cfg.tflops <= now.tflops):
                    continue
                free += view.held - cfg.nodes
                gpus = now.gpus if now is not None else 0
                save = self.costs.save_s(self.workload.tasks[i].model, gpus) if gpus else 0.0
                out[i] = self._start(i, cfg, self.costs.restart_s + save)
        return tuple(out)


class PerTaskPolicy:
    """Single-job elasticity: only the task hit reconfigures; returns go to the first task that lost a node.

    This is what DLRover or NVRx can do inside one job, with unicorn's measured costs.
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
        hit = hit_index(snapshot, notice)
        views = snapshot.tasks
        if hit is not None and notice.kind in (EventKind.SEV2, EventKind.SEV3) and intact(views[hit]):
            return self._unicorn.on_event(snapshot, notice, clock_s)
        out = [TaskDecision.keep(v) for v in views]
        free = snapshot.free
        if hit is not None:
            view = views[hit]
            k = self._best(hit, view.held + free)
            free += view.held - k
            out[hit] = self._unicorn.start(hit, k, self._unicorn.relaunch_s(hit, k))
        if notice.kind is EventKind.NODE_RETURN:
            affected = [
                i
                for i, v in enumerate(views)
                if v.workers < self.allocation[i] and v.phase is not Phase.DETECTING
            ]
            affected = by_loss(views, affected)
            if affected:
                i = affected[0]
                k = self._best(i, views[i].held + free)
                if k > views[i].workers:
                    out[i] = self._unicorn.start(i, k, self._unicorn.relaunch_s(i, k))
        return tuple(out)


STATIC_NAMES = tuple(b.value for b in Baseline)
DEFAULT_POLICY_NAMES = ("unicorn", "megatron", "oobleck", "varuna", "bamboo", "per-task")
POLICY_NAMES = (*DEFAULT_POLICY_NAMES, *STATIC_NAMES)


def planned_allocation(workload: Workload, nodes: int) -> tuple[int, ...]:
    """The planner's failure-free allocation on ``nodes`` nodes."""
    return plan_cluster(workload.curves, workload.cluster.with_nodes(nodes)).allocation


def make_policy(
    name: str,
    workload: Workload,
    *,
    unicorn: UnicornCosts | None = None,
    megatron: MegatronCosts | None = None,
    elastic: ElasticCosts | None = None,
    spare_nodes: int = 0,
) -> Policy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`).

    Fixed allocations (every policy but ``unicorn``) leave ``spare_nodes`` nodes out as hot
    spares and start from the planner's allocation of the rest for their own throughput
    curves. ``unicorn`` plans over every healthy node.
    """
    from plan.sim.elastic import ELASTIC_NAMES, make_elastic  # here: elastic imports this module

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
    if name in ELASTIC_NAMES:
        return make_elastic(name, workload, usable, elastic or ElasticCosts())
    if name in STATIC_NAMES:
        wafs = [c.waf[: usable + 1] for c in workload.curves]
        allocation = baseline_allocation(workload.tasks, wafs, usable, Baseline(name))
        return MegatronPolicy(name, workload, allocation, megatron)
    raise InvalidArgument(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
