"""Cluster-wide allocation: tasks + cluster + current state -> a :class:`Plan` (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from plan.calibration import Efficiency, calibrated_table
from plan.hardware import GpuSpec
from plan.objective import FailureModel, TransitionModel, gains, waf_curve
from plan.perf import LayoutEstimate, LayoutTable, PerfAssumptions, layout_table
from plan.solver import FloatArray, Solution, solve
from unicorn_core.errors import InvalidArgument
from unicorn_core.taskspec import TaskSpec, check_unique_names


class Granularity(StrEnum):
    """The unit the planner hands out."""

    GPU = "gpu"
    NODE = "node"


@dataclass(frozen=True)
class Cluster:
    """A homogeneous pool of ``nodes`` nodes with ``gpus_per_node`` GPUs of type ``gpu``."""

    nodes: int
    gpus_per_node: int
    gpu: GpuSpec
    granularity: Granularity = Granularity.NODE

    def __post_init__(self) -> None:
        if self.nodes < 0 or self.gpus_per_node <= 0:
            raise InvalidArgument(
                f"cluster needs nodes >= 0 and gpus_per_node > 0, got {self.nodes}, {self.gpus_per_node}"
            )

    @property
    def worker_gpus(self) -> int:
        """GPUs per worker: 1, or a whole node."""
        return 1 if self.granularity is Granularity.GPU else self.gpus_per_node

    @property
    def workers(self) -> int:
        return self.nodes * self.gpus_per_node // self.worker_gpus

    def with_nodes(self, nodes: int) -> Cluster:
        return Cluster(nodes, self.gpus_per_node, self.gpu, self.granularity)


@dataclass(frozen=True, eq=False)
class TaskCurve:
    """T(t, x) and F(t, x) of one task for x = 0..len-1 workers, and where they come from."""

    task: TaskSpec
    worker_gpus: int
    tflops: FloatArray
    waf: FloatArray
    table: LayoutTable

    def estimate(self, workers: int) -> LayoutEstimate | None:
        return self.table.best.get(workers * self.worker_gpus) if workers > 0 else None


def task_curves(
    tasks: Sequence[TaskSpec],
    cluster: Cluster,
    max_workers: int,
    assume: PerfAssumptions | None = None,
    calibration: Mapping[str, Efficiency] | None = None,
) -> tuple[TaskCurve, ...]:
    """Performance curves of every task up to ``max_workers`` (layout tables are memoised).

    ``calibration``: measured speed per task name (:func:`plan.calibration.efficiency`);
    each world size's layout is then the fastest at calibrated speed. Tasks it does not
    name use the analytic model.
    """
    check_unique_names(tuple(tasks), "tasks")
    curves = []
    wg = cluster.worker_gpus
    for task in tasks:
        table = layout_table(task.model, cluster.gpu, cluster.gpus_per_node, assume or PerfAssumptions())
        if calibration is not None and task.name in calibration:
            table = calibrated_table(table, calibration[task.name])
        # A copy, not a view: a view would keep the per-GPU array (wg times larger) alive
        # for as long as the curve (the lookup's workers keep curves between solves).
        tflops = np.ascontiguousarray(table.tflops_by_gpus(max_workers * wg)[::wg])
        curves.append(TaskCurve(task, wg, tflops, waf_curve(task, tflops, wg), table))
    return tuple(curves)


@dataclass(frozen=True)
class Assignment:
    """One task's share in a plan."""

    task: str
    workers: int
    gpus: int
    estimate: LayoutEstimate | None  # None when the task gets nothing (or cannot run)
    tflops: float
    waf_tflops: float
    previous_workers: int
    changed: bool  # reconfigured: a different worker count, or restarted after a fault


@dataclass(frozen=True)
class Plan:
    """An allocation of the whole cluster, with its predicted WAF and objective value."""

    assignments: tuple[Assignment, ...]
    workers: int
    spare_workers: int
    worker_gpus: int
    total_waf_tflops: float
    objective_tflop: float  # sum of G: weighted TFLOP over the expected running phase

    def workers_by_task(self) -> dict[str, int]:
        return {a.task: a.workers for a in self.assignments}

    @property
    def allocation(self) -> tuple[int, ...]:
        return tuple(a.workers for a in self.assignments)


@dataclass(frozen=True)
class PlanRequest:
    """Everything a solve needs besides the curves: the state the cluster is in now."""

    current: tuple[int, ...] | None = None  # workers per task now; None = nothing running
    faulted: frozenset[str] = frozenset()  # tasks that must restart whatever happens
    failure: FailureModel = field(default_factory=FailureModel)
    transition: TransitionModel = field(default_factory=TransitionModel)


def gain_arrays(
    curves: Sequence[TaskCurve], workers: int, nodes: int, request: PlanRequest
) -> list[FloatArray]:
    """G(t, x') for each task over x' = 0..workers (Eq. 3); D_running for ``nodes`` nodes."""
    current = request.current or (0,) * len(curves)
    if len(current) != len(curves):
        raise InvalidArgument(f"current allocation has {len(current)} entries for {len(curves)} tasks")
    running_s = request.failure.running_s(nodes)
    out = []
    for curve, now in zip(curves, current, strict=True):
        now_waf = float(curve.waf[now]) if now < curve.waf.shape[0] else 0.0
        faulted = curve.task.name in request.faulted
        transition_s = request.transition.transition_s(curve.task)
        out.append(
            gains(
                _fit(curve.waf, workers),
                current=now,
                current_waf=now_waf,
                faulted=faulted,
                running_s=running_s,
                transition_s=transition_s,
            )
        )
    return out


def _fit(values: FloatArray, workers: int) -> FloatArray:
    if values.shape[0] < workers + 1:
        raise InvalidArgument(f"task curves cover {values.shape[0] - 1} workers, the cluster has {workers}")
    return values[: workers + 1]


def make_plan(curves: Sequence[TaskCurve], workers: int, request: PlanRequest, solution: Solution) -> Plan:
    """Assemble a :class:`Plan` from a solution."""
    current = request.current or (0,) * len(curves)
    assignments = []
    for curve, k, now in zip(curves, solution.workers, current, strict=True):
        est = curve.estimate(k)
        waf = float(curve.waf[k])
        assignments.append(
            Assignment(
                task=curve.task.name,
                workers=k,
                gpus=k * curve.worker_gpus,
                estimate=est if waf > 0 else None,
                tflops=float(curve.tflops[k]) if waf > 0 else 0.0,
                waf_tflops=waf,
                previous_workers=now,
                changed=k != now or curve.task.name in request.faulted,
            )
        )
    used = sum(solution.workers)
    return Plan(
        assignments=tuple(assignments),
        workers=workers,
        spare_workers=workers - used,
        worker_gpus=curves[0].worker_gpus if curves else 1,
        total_waf_tflops=float(sum(a.waf_tflops for a in assignments)),
        objective_tflop=solution.objective,
    )


def plan_cluster(curves: Sequence[TaskCurve], cluster: Cluster, request: PlanRequest = PlanRequest()) -> Plan:
    """The allocation maximising the sum of G over all tasks (Unicron Eq. 4)."""
    unknown = request.faulted - {c.task.name for c in curves}
    if unknown:
        raise InvalidArgument(f"faulted task(s) {sorted(unknown)} are not among the tasks")
    workers = cluster.workers
    g = gain_arrays(curves, workers, cluster.nodes, request)
    return make_plan(curves, workers, request, solve(g, workers))


def waf_of(curves: Sequence[TaskCurve], allocation: Sequence[int]) -> float:
    """Total F of an allocation (weighted TFLOP/s)."""
    return float(sum(c.waf[k] for c, k in zip(curves, allocation, strict=True)))
