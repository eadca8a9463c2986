"""The planner's inputs, calibrated from what unicornd measured (issue 21, item 2).

Pure, like the decisions that call it: functions of the snapshot, an input and a clock.
The measurements live in :attr:`Snapshot.calibration <unicornd.state.Calibration>`, so they
are committed with every decision and a restarted or standby unicornd plans with them.
The estimators are :mod:`plan.calibration`'s (why shrinkage: see there).

Where each measurement comes from:

* **Iteration times** (:func:`on_iteration`, from :func:`unicornd.decide.on_progress`): the
  rank's own ``duration_s`` of a training iteration report (checkpoint and evaluation steps
  excluded by the caller), weighted by the new iterations it covers, for the task's layout
  on the configured GPU type. Counted only while the task runs with no incident open and no
  requeue under way, only for iterations past its mark (so a report delivered again after a
  crash, or a recomputed iteration, counts once) and not for the first
  ``[plan] iteration_warmup`` iterations after a launch or restart.
* **Transitions** (:func:`on_started`): a plan's launch or relaunch of a task that ran
  before (``TaskRecord.launched_s``) to the first iteration its new ranks finished: what
  the goodput ledger books as ``transition``.
* **Node failures** (:func:`counted`, from :func:`unicornd.decide.resolve`, so every
  decision passes through it): each entry a decision adds to a node's ``failures_s``, i.e.
  each node an incident isolated or a node check convicted. Node-hours are the nodes known
  now times the time since the first counted decision (a cluster that grew is
  under-counted before it grew: the estimate errs towards failing more often).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from plan.calibration import (
    HOUR_S,
    Efficiency,
    Running,
    calibrated,
    efficiency,
    model_key,
    node_mtbf_h,
    observe,
    transition_s,
)
from plan.hardware import GpuSpec
from plan.objective import FailureModel, TransitionModel
from plan.perf import PerfAssumptions, estimate_layout
from unicorn_core.config import PlanConfig
from unicorn_core.errors import InvalidArgument
from unicornd.actions import Decision
from unicornd.state import MAX_MEASURED_LAYOUTS, Calibration, MeasuredLayout, Snapshot, TaskRecord


@dataclass(frozen=True)
class IterationSample:
    """The timing of one iteration report: ``duration_s``, the mean of the ``span``
    iterations ending at the reported one, measured on GPU type ``gpu``."""

    duration_s: float
    span: int
    gpu: str

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or self.span < 1 or not self.gpu:
            raise InvalidArgument(
                f"iteration sample needs duration_s > 0, span >= 1 and a GPU type, got "
                f"{self.duration_s!r}, {self.span!r}, {self.gpu!r}"
            )


def on_iteration(
    cal: Calibration,
    task: TaskRecord,
    iteration: int,
    sample: IterationSample,
    *,
    plan: PlanConfig,
    at_s: float,
) -> Calibration:
    """``cal`` with the report of ``iteration`` by ``task`` (as it was before the report)
    measured, if it counts (see the module docstring; the caller checks the task's state)."""
    if task.layout is None or (task.last_iteration is not None and iteration <= task.last_iteration):
        return cal
    warm = cal.warm_after.get(task.task_id)
    if warm is not None and iteration <= warm:
        return cal
    new = sample.span if task.last_iteration is None else iteration - task.last_iteration
    weight = float(max(1, min(sample.span, new)))
    model = model_key(task.model)
    layouts = list(cal.layouts)
    found = next(
        (i for i, m in enumerate(layouts) if (m.gpu, m.model, m.layout) == (sample.gpu, model, task.layout)),
        None,
    )
    old = layouts[found].iteration_s if found is not None else None
    entry = MeasuredLayout(
        sample.gpu,
        model,
        task.layout,
        observe(old, sample.duration_s, weight, plan.iteration_window),
        at_s,
    )
    if found is not None:
        layouts[found] = entry
    else:
        if len(layouts) >= MAX_MEASURED_LAYOUTS:
            layouts.remove(min(layouts, key=lambda m: m.updated_s))
        layouts.append(entry)
    return replace(cal, layouts=tuple(layouts))


def on_started(
    cal: Calibration, task: TaskRecord, iteration: int, *, at_s: float, plan: PlanConfig, by_plan: bool
) -> Calibration:
    """``task`` (as it was before) finished ``iteration``, the first of ranks just started:
    its warm-up begins; if a plan started them (``by_plan``) and the task ran before, the
    time since the plan's launch is a measured transition."""
    warm_after = {**cal.warm_after, task.task_id: iteration + plan.iteration_warmup}
    transitions = cal.transitions
    if (
        by_plan
        and task.last_iteration is not None
        and task.launched_s is not None
        and at_s >= task.launched_s
    ):
        measured = observe(
            transitions.get(task.task_id), at_s - task.launched_s, 1.0, float(plan.transition_window)
        )
        transitions = {**transitions, task.task_id: measured}
    return replace(cal, warm_after=warm_after, transitions=transitions)


def counted(snapshot: Snapshot, decision: Decision, now_s: float) -> Decision:
    """``decision`` with the node failures it records counted (each entry it adds to a
    node's ``failures_s``), and the count's start set at its first decision."""
    cal = decision.calibration or snapshot.calibration
    new = 0
    for rec in decision.nodes:
        before = Counter(snapshot.node(rec.name).failures_s)
        new += sum((Counter(rec.failures_s) - before).values())
    if not new and cal.since_s is not None:
        return decision
    since = now_s if cal.since_s is None else cal.since_s
    return replace(decision, calibration=replace(cal, node_failures=cal.node_failures + new, since_s=since))


# --- what the planner uses -------------------------------------------------------------


def node_hours(snapshot: Snapshot, now_s: float) -> float:
    """Node-hours observed: the nodes known times the hours since the count began."""
    since = snapshot.calibration.since_s
    if since is None:
        return 0.0
    return len(snapshot.nodes) * max(0.0, now_s - since) / HOUR_S


@dataclass(frozen=True)
class PlannerInputs:
    """The calibrated inputs of one solve: measured speed per task name (tasks with no
    measurement are absent), the failure model and the transition model."""

    efficiency: Mapping[str, Efficiency]
    failure: FailureModel
    transition: TransitionModel


def planner_inputs(
    snapshot: Snapshot,
    tasks: Iterable[TaskRecord],
    *,
    gpu: GpuSpec,
    assume: PerfAssumptions,
    prior: FailureModel,
    plan: PlanConfig,
    now_s: float,
) -> PlannerInputs:
    """What the planner should believe about ``tasks`` now (``prior``: the configured MTBF)."""
    cal = snapshot.calibration
    speed: dict[str, Efficiency] = {}
    transitions: dict[str, float] = {}
    analytic = TransitionModel()
    for t in tasks:
        timings = cal.timings(gpu.name, model_key(t.model))
        if timings:
            speed[t.name] = efficiency(
                t.model,
                gpu,
                snapshot.gpus_per_node,
                timings,
                prior_samples=plan.iteration_prior_samples,
                assume=assume,
            )
        if t.task_id in cal.transitions:
            transitions[t.name] = transition_s(
                analytic.transition_s(t.spec()), plan.transition_prior_samples, cal.transitions[t.task_id]
            )
    mtbf = node_mtbf_h(
        prior.node_mtbf_h, plan.mtbf_prior_failures, cal.node_failures, node_hours(snapshot, now_s)
    )
    return PlannerInputs(speed, FailureModel(mtbf), TransitionModel(measured_s=transitions))


# --- predicted next to measured (``unicornctl plan --explain``) -------------------------


@dataclass(frozen=True)
class Compared:
    """One planner input: the model's prediction (``predicted``), what was measured
    (``measured``, the mean of ``observations`` reports, transitions or failures; None:
    nothing yet) and what the planner uses (``planned``). None where it does not apply (a
    task without a layout)."""

    predicted: float | None
    measured: float | None
    observations: int
    planned: float | None


@dataclass(frozen=True)
class TaskExplanation:
    """A task's calibrated inputs at its current layout."""

    task_id: str
    name: str
    layout: str | None
    gpus: int
    iteration_s: Compared
    tflops_per_gpu: Compared
    transition_s: Compared


@dataclass(frozen=True)
class Explanation:
    """Every planned task's inputs, and the cluster's node MTBF."""

    gpu: str
    tasks: tuple[TaskExplanation, ...]
    node_mtbf_h: Compared
    node_failures: int
    node_hours: float


def explain(
    snapshot: Snapshot,
    tasks: Sequence[TaskRecord],
    *,
    gpu: GpuSpec,
    assume: PerfAssumptions,
    prior: FailureModel,
    plan: PlanConfig,
    now_s: float,
) -> Explanation:
    """Predicted, measured and planned values of every input the calibration refines."""
    cal = snapshot.calibration
    inputs = planner_inputs(snapshot, tasks, gpu=gpu, assume=assume, prior=prior, plan=plan, now_s=now_s)
    rows = []
    analytic = TransitionModel()
    for t in tasks:
        measured = cal.measured(gpu.name, model_key(t.model), t.layout) if t.layout is not None else None
        none = Compared(None, None, 0, None)
        iteration, tflops = none, none
        if t.layout is not None:
            try:
                est = estimate_layout(t.model, t.layout, gpu, snapshot.gpus_per_node, assume)
            except InvalidArgument:
                est = None
            if est is not None:
                eff = inputs.efficiency.get(t.name, Efficiency())
                used = calibrated(est, eff.of(t.layout))
                seen = measured.count if measured is not None else 0
                mean = measured.mean if measured is not None and measured.mean > 0 else None
                per_gpu = (
                    t.model.model_flop_per_iteration() / mean / t.layout.world_size / 1e12
                    if mean is not None
                    else None
                )
                iteration = Compared(est.iteration_s, mean, seen, used.iteration_s)
                tflops = Compared(est.tflops_per_gpu, per_gpu, seen, used.tflops_per_gpu)
        moved: Running | None = cal.transitions.get(t.task_id)
        transition = Compared(
            analytic.transition_s(t.spec()),
            moved.mean if moved is not None else None,
            moved.count if moved is not None else 0,
            inputs.transition.transition_s(t.spec()),
        )
        rows.append(
            TaskExplanation(
                t.task_id,
                t.name,
                t.layout.describe() if t.layout is not None else None,
                len(t.nodes) * snapshot.gpus_per_node,
                iteration,
                tflops,
                transition,
            )
        )
    hours = node_hours(snapshot, now_s)
    mtbf = Compared(
        prior.node_mtbf_h,
        hours / cal.node_failures if cal.node_failures else None,
        cal.node_failures,
        inputs.failure.node_mtbf_h,
    )
    return Explanation(gpu.name, tuple(rows), mtbf, cal.node_failures, hours)
