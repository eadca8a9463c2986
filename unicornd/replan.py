"""From the current allocation to the planner's new one: which nodes, which Slurm resize, which commands.

:func:`plan_transition` is pure: it takes the snapshot, the :class:`plan.planner.Plan`
the planner returned for it, and a ``render`` callable (``launcher.render`` builds the
argv), and returns a :class:`~unicornd.actions.Decision`. Node choice keeps every task
on as many of its current healthy nodes as it may keep (moving ranks costs a restart
and a checkpoint load elsewhere), then hands free healthy nodes out in name order.

For each task whose nodes or layout change (or that waits for this plan), in order
over all tasks: JIT checkpoint (``checkpoint_now`` to its healthy nodes), ``stop`` on
healthy nodes it leaves, then shrinks and requeues (they free nodes), then grows, then
``relaunch`` on the nodes it keeps and :class:`LaunchAgents` on new ones. A job that
would exceed ``Policy.max_resizes_per_run`` (Slurm without slurmdbd resizes a job once
per run), or that is not running, is requeued onto its new nodes instead; its agents
are launched when Slurm shows it running again (:class:`~unicornd.state.RequeueWait`).
A shrink or grow that Slurm refuses comes back as an outcome and turns into the same
requeue (:func:`unicornd.decide.on_outcome`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple

from plan.calibration import Efficiency
from plan.hardware import GpuSpec, gpu_spec
from plan.objective import FailureModel
from plan.perf import PerfAssumptions
from plan.planner import Assignment, Cluster, Granularity, Plan, PlanRequest, plan_cluster, task_curves
from unicorn_core.config import Config, PlanConfig
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.protocol import AgentAction
from unicorn_core.taskspec import TaskSpec
from unicornd.actions import Action, Decision, Grow, LaunchAgents, NodeArgv, Requeue, SendCommand, Shrink
from unicornd.calibrate import planner_inputs
from unicornd.launch import Render, renderer
from unicornd.solvecache import SolveCache
from unicornd.state import (
    Incident,
    LadderStage,
    NodeHealth,
    PlanBasis,
    RequeueWait,
    Snapshot,
    TaskRecord,
    TaskState,
)

REQUEUE_TIMEOUT_S: Final = 120.0
"""How long a requeued job may take to run again before its rung fails (Slurm holds a
requeued job for cred_expire, then the scheduler starts it: seconds on a healthy cluster)."""


@dataclass(frozen=True)
class PlanContext:
    """What a replan needs besides the snapshot: the GPU type, the failure model before any
    history (its MTBF is the calibration's prior), how a layout becomes command lines
    (``render_for(gpus_per_node, generation)``), the performance model's assumptions (which
    layouts it may choose) and the ``[plan]`` section (the calibration's prior weights and
    windows). Built once from the configuration (:meth:`from_config`), by unicornd and by
    every preview, so both plan with the same inputs."""

    gpu: GpuSpec
    failure: FailureModel
    render_for: Callable[[int, int], Render]
    assume: PerfAssumptions = field(default_factory=PerfAssumptions)
    plan: PlanConfig = field(default_factory=PlanConfig)
    solves: SolveCache = field(default_factory=SolveCache, compare=False, repr=False)

    @classmethod
    def from_config(cls, cfg: Config) -> PlanContext:
        return cls(
            gpu=gpu_spec(cfg.plan.gpu),
            failure=FailureModel(cfg.plan.node_mtbf_h),
            render_for=lambda gpus, generation: renderer(cfg.agent, gpus, generation),
            assume=PerfAssumptions(distributed_optimizer=cfg.plan.distributed_optimizer),
            plan=cfg.plan,
        )


PLANNED_STATES = frozenset({TaskState.PENDING, TaskState.LAUNCHING, TaskState.RUNNING, TaskState.RECOVERING})
"""Tasks the planner must cover: every task that has not ended or been stopped."""


def planned_tasks(snapshot: Snapshot) -> list[TaskRecord]:
    """The tasks a plan covers (:data:`PLANNED_STATES`), by id."""
    return sorted((t for t in snapshot.tasks.values() if t.state in PLANNED_STATES), key=lambda t: t.task_id)


class SolveKey(NamedTuple):
    """A calibrated solve's inputs besides its plan basis (see :func:`solve_inputs`)."""

    specs: tuple[TaskSpec, ...]
    ids: tuple[str, ...]
    nodes_known: int
    cluster: Cluster
    current: tuple[int, ...]
    faulted: frozenset[str]

    def one_node_lost(self, task_name: str | None) -> SolveKey:
        """The key of the snapshot one plannable node less leaves, with ``task_name``'s task
        faulted (None: a spare node's): what :func:`solve_inputs` gives for
        :func:`unicornd.lookup.one_step_snapshots`' snapshots, made without them."""
        faulted = self.faulted if task_name is None else self.faulted | {task_name}
        return self._replace(cluster=replace(self.cluster, nodes=self.cluster.nodes - 1), faulted=faulted)


@dataclass(frozen=True)
class SolveInputs:
    """Everything one solve reads, gathered from a snapshot (cheap: no curves, no solve).
    ``key`` identifies the solve in a :class:`~unicornd.solvecache.SolveCache` together with ``basis``."""

    specs: tuple[TaskSpec, ...]
    cluster: Cluster
    request: PlanRequest
    efficiency: Mapping[str, Efficiency] | None
    basis: PlanBasis | None
    key: Hashable


def solve_inputs(
    snapshot: Snapshot, ctx: PlanContext, now_s: float, *, calibrated: bool = True
) -> SolveInputs | None:
    """What :func:`plan_for` solves (None: no task is planned). Calibrated inputs come from
    the snapshot's :class:`PlanBasis` when it has one (at the basis's time), else from its
    live calibration at ``now_s``; the cache key holds them only when they come from a
    basis or from configuration (live ones change with every report: never cached)."""
    tasks = planned_tasks(snapshot)
    if not tasks:
        return None
    cluster = Cluster(len(snapshot.plannable()), snapshot.gpus_per_node, ctx.gpu, Granularity.NODE)
    current = tuple(len(t.nodes) for t in tasks)
    faulted = frozenset(t.name for t in tasks if snapshot.open_incident(t.task_id) is not None)
    specs = tuple(t.spec() for t in tasks)
    if not (calibrated and ctx.plan.calibrate):
        request = PlanRequest(current=current, faulted=faulted, failure=ctx.failure)
        return SolveInputs(specs, cluster, request, None, None, (specs, cluster, current, faulted))
    basis = snapshot.plan_basis
    source, at_s = snapshot, now_s
    if basis is not None:
        source, at_s = replace(snapshot, calibration=basis.calibration, check=False), basis.t_s
    inputs = planner_inputs(
        source, tasks, gpu=ctx.gpu, assume=ctx.assume, prior=ctx.failure, plan=ctx.plan, now_s=at_s
    )
    request = PlanRequest(current, faulted, inputs.failure, inputs.transition)
    # planner_inputs also reads the task ids (measured transitions) and the node count
    # (node-hours), besides the basis.
    ids = tuple(t.task_id for t in tasks)
    key = SolveKey(specs, ids, len(snapshot.nodes), cluster, current, faulted) if basis is not None else None
    return SolveInputs(specs, cluster, request, inputs.efficiency, basis, key)


def solve(inputs: SolveInputs, ctx: PlanContext) -> Plan:
    """The solve itself: every task's curve up to one node more than the cluster, then the
    planner (:func:`plan.planner.plan_cluster`)."""
    cluster = inputs.cluster
    curves = task_curves(
        inputs.specs, cluster, cluster.workers + 1, ctx.assume, calibration=inputs.efficiency
    )
    return plan_cluster(curves, cluster, inputs.request)


def plan_for(snapshot: Snapshot, ctx: PlanContext, now_s: float, *, calibrated: bool = True) -> Plan | None:
    """The planner's allocation for ``snapshot``: the call every replan of unicornd makes.

    The nodes :meth:`Snapshot.plannable` names form the cluster (healthy, not held, no
    other user's job unless a task holds the node already); tasks with an open incident
    are the faulted ones. None when no task is planned. ``unicornctl plan --what-if-fail`` calls
    it on a hypothetical snapshot, so both always agree. The planner's inputs are
    calibrated by the snapshot's measurements (:func:`unicornd.calibrate.planner_inputs`:
    iteration times, transition times, node MTBF), as of its plan basis when it has one
    (:class:`unicornd.state.PlanBasis`); ``calibrated=False``, or ``[plan] calibrate =
    false``, plans with the analytic model and the configured constants instead (``plan
    --explain`` shows both). A plan solved before for the same inputs is taken from
    ``ctx.solves`` (the same plan: see :class:`~unicornd.solvecache.SolveCache`).
    """
    with ctx.solves.measure() as took:
        inputs = solve_inputs(snapshot, ctx, now_s, calibrated=calibrated)
        if inputs is None:
            return None
        if inputs.key is None:
            return solve(inputs, ctx)
        cached = ctx.solves.get(inputs.key, inputs.basis)
        took.hit = cached is not None
        if cached is not None:
            return cached
        plan = solve(inputs, ctx)
        ctx.solves.put(inputs.key, inputs.basis, plan)
        return plan


def replan_decision(snapshot: Snapshot, ctx: PlanContext, now_s: float) -> tuple[Plan | None, Decision]:
    """The one replan: the planner's allocation for ``snapshot`` and the transition to it.

    Pure. (None, empty decision) when no task is planned. A plan that cannot be applied
    (:func:`plan_transition` raises InvalidArgument, e.g. fewer healthy nodes than it
    needs) gives its plan and a decision that only says why: the input that asked for
    the replan still stands, and the next replan tries again.
    """
    plan = plan_for(snapshot, ctx, now_s)
    if plan is None:
        return None, Decision(notes=("replan: no task to plan",))
    render = ctx.render_for(snapshot.gpus_per_node, snapshot.plan_generation + 1)
    try:
        return plan, plan_transition(snapshot, plan, render, now_s)
    except InvalidArgument as e:
        return plan, Decision(notes=(f"replan not applied: {e}",))


def _nodes_needed(assignment: Assignment, gpus_per_node: int) -> tuple[int, Layout | None]:
    if assignment.estimate is None or assignment.gpus <= 0:
        return 0, None
    return math.ceil(assignment.gpus / gpus_per_node), assignment.estimate.layout


def _allocate(
    snapshot: Snapshot, tasks: Sequence[TaskRecord], needs: Mapping[str, int]
) -> dict[str, tuple[str, ...]]:
    """New node list per task: current healthy nodes first (in their order), then free ones
    (never a node another user's job holds: :meth:`Snapshot.plannable`)."""
    usable = snapshot.plannable()
    usable_set = set(usable)
    taken: set[str] = set()
    out: dict[str, list[str]] = {}
    for task in tasks:
        kept = [n for n in task.nodes if n in usable_set][: needs[task.task_id]]
        out[task.task_id] = kept
        taken.update(kept)
    free = [n for n in usable if n not in taken]
    short = sum(needs[t.task_id] - len(out[t.task_id]) for t in tasks) - len(free)
    if short > 0:
        raise InvalidArgument(
            f"plan needs {sum(needs.values())} nodes, only {len(usable)} are healthy, not held "
            "and free of other users' jobs "
            f"({short} missing); replan on the current snapshot"
        )
    for task in tasks:
        while len(out[task.task_id]) < needs[task.task_id]:
            out[task.task_id].append(free.pop(0))
    return {k: tuple(v) for k, v in out.items()}


def _argv(
    render: Render, task: TaskRecord, layout: Layout, nodes: tuple[str, ...]
) -> dict[str, tuple[str, ...]]:
    rendered = render(task, layout, nodes)
    if set(rendered) != set(nodes):
        raise InvalidArgument(
            f"render gave argv for {sorted(rendered)}, task {task.task_id} runs on {list(nodes)}"
        )
    out = {n: tuple(rendered[n]) for n in nodes}
    empty = [n for n, argv in out.items() if not argv]
    if empty:
        raise InvalidArgument(f"render gave an empty argv for {empty}")
    return out


@dataclass
class _Phases:
    """Actions grouped by execution phase, and the records a transition writes."""

    gen: int
    checkpoints: list[Action] = field(default_factory=list)
    stops: list[Action] = field(default_factory=list)
    resizes: list[Action] = field(default_factory=list)
    grows: list[Action] = field(default_factory=list)
    launches: list[Action] = field(default_factory=list)
    tasks: list[TaskRecord] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def actions(self) -> tuple[Action, ...]:
        return (*self.checkpoints, *self.stops, *self.resizes, *self.grows, *self.launches)


def _check_plan(snapshot: Snapshot, new_plan: Plan) -> tuple[list[TaskRecord], dict[str, Assignment]]:
    planned = sorted(
        (t for t in snapshot.tasks.values() if t.state in PLANNED_STATES), key=lambda t: t.task_id
    )
    by_name: dict[str, TaskRecord] = {}
    for task in planned:
        if task.name in by_name:
            raise InvalidArgument(
                f"tasks {by_name[task.name].task_id} and {task.task_id} share the name {task.name!r}"
            )
        by_name[task.name] = task
    assignments = {a.task: a for a in new_plan.assignments}
    unknown = sorted(set(assignments) - set(by_name))
    missing = sorted(set(by_name) - set(assignments))
    if unknown or missing:
        raise InvalidArgument(f"plan does not match the tasks: unknown {unknown}, missing {missing}")
    return planned, {task.task_id: assignments[task.name] for task in planned}


def plan_transition(snapshot: Snapshot, new_plan: Plan, render: Render, now_s: float) -> Decision:
    """Actions and records that move every task to ``new_plan``.

    Raises InvalidArgument (nothing changed) when the plan names an unknown task or
    misses a planned one, needs more healthy nodes than there are, gives GPUs to a task
    without a Slurm job, or ``render`` does not cover the planned nodes. Tasks whose
    nodes and layout stay the same are left alone, unless their incident waits for
    this plan (they are relaunched from their nearest state).
    """
    planned, assignments = _check_plan(snapshot, new_plan)
    needs: dict[str, int] = {}
    layouts: dict[str, Layout | None] = {}
    for task in planned:
        needs[task.task_id], layouts[task.task_id] = _nodes_needed(
            assignments[task.task_id], snapshot.gpus_per_node
        )
        if needs[task.task_id] and task.job_id is None:
            raise InvalidArgument(
                f"task {task.task_id} has no Slurm job; register its job id before planning it"
            )
    allocation = _allocate(snapshot, planned, needs)
    phases = _Phases(gen=snapshot.plan_generation + 1)
    for task in planned:
        new_nodes = allocation[task.task_id]
        _move_task(snapshot, phases, task, new_nodes, layouts[task.task_id], render=render, now_s=now_s)
    return Decision(
        actions=phases.actions(),
        tasks=tuple(phases.tasks),
        incidents=tuple(phases.incidents),
        notes=tuple(phases.notes),
        plan_generation=phases.gen,
    )


def _move_task(
    snapshot: Snapshot,
    phases: _Phases,
    task: TaskRecord,
    new_nodes: tuple[str, ...],
    layout: Layout | None,
    *,
    render: Render,
    now_s: float,
) -> None:
    """Add the actions that move ``task`` to ``new_nodes`` at ``layout`` (none if unchanged)."""
    pol = snapshot.policy
    inc = snapshot.open_incident(task.task_id)
    waiting = inc is not None and inc.stage is LadderStage.REPLAN
    same = set(new_nodes) == set(task.nodes) and layout == task.layout
    if same and not waiting and not (task.state is TaskState.PENDING and new_nodes):
        return
    base = f"plan-{phases.gen}/{task.task_id}"
    job = task.job_id
    healthy_now = [n for n in task.nodes if snapshot.node(n).health is NodeHealth.HEALTHY]
    alive = healthy_now if task.state is not TaskState.PENDING and job is not None else []
    if pol.jit_checkpoint and job is not None:
        phases.checkpoints.extend(
            SendCommand(
                f"{base}/checkpoint_now/{n}", job, n, AgentAction.CHECKPOINT_NOW, pol.checkpoint_deadline_s
            )
            for n in alive
        )
    if job is not None:
        phases.stops.extend(
            SendCommand(f"{base}/stop/{n}", job, n, AgentAction.STOP, pol.command_deadline_s)
            for n in alive
            if n not in new_nodes
        )
    new = replace(task, nodes=new_nodes, layout=layout, launched_s=now_s, generation=phases.gen)
    if not new_nodes or layout is None or job is None:
        if job is not None and task.state is not TaskState.PENDING:
            phases.resizes.append(Requeue(f"{base}/requeue", task.task_id, job, ()))
        phases.tasks.append(replace(new.with_state(TaskState.PENDING), resizes_this_run=0, launched_s=None))
        phases.notes.append(f"plan-{phases.gen}: {task.task_id} gets no GPUs; held pending")
        return
    argv = _argv(render, task, layout, new_nodes)
    dropped = [n for n in task.nodes if n not in new_nodes]
    added = [n for n in new_nodes if n not in task.nodes]
    resize_count = int(bool(dropped)) + int(bool(added))
    # A pending task registered with its job's nodes (``task.nodes``) has no agents yet:
    # its job is resized like a running one's, and agents start on every planned node.
    fresh = task.state is TaskState.PENDING
    running = bool(set(task.nodes) & set(new_nodes))
    # A job holding GRES (GPUs) cannot be expanded (22.05 and 24.11 refuse it): it grows by
    # a requeue onto all its planned nodes, as the planner's transition cost assumes.
    by_requeue = bool(added) and bool(task.job_gres)
    if not running or by_requeue or task.resizes_this_run + resize_count > pol.max_resizes_per_run:
        # The agents start once the job runs again (:func:`unicornd.decide.on_job_running`);
        # until then its processes die on purpose and their exits are not faults.
        phases.resizes.append(Requeue(f"{base}/requeue", task.task_id, job, new_nodes))
        wait = RequeueWait(f"{base}/requeue", deadline_s=now_s + REQUEUE_TIMEOUT_S)
        new = replace(new, resizes_this_run=0, requeue=wait)
        how = "requeue"
    else:
        if dropped:
            kept = tuple(n for n in new_nodes if n in task.nodes)
            phases.resizes.append(Shrink(f"{base}/shrink", task.task_id, job, kept))
        if added:
            phases.grows.append(Grow(f"{base}/grow", task.task_id, job, tuple(added)))
        if not fresh:
            phases.launches.extend(
                SendCommand(
                    f"{base}/relaunch/{n}", job, n, AgentAction.RELAUNCH, pol.command_deadline_s, argv[n]
                )
                for n in new_nodes
                if n in task.nodes
            )
        starting = new_nodes if fresh else tuple(added)
        if starting:
            commands = tuple(NodeArgv(n, argv[n]) for n in starting)
            phases.launches.append(LaunchAgents(f"{base}/launch", task.task_id, job, commands))
        new = replace(new, resizes_this_run=task.resizes_this_run + resize_count)
        how = "+".join(w for w, on in (("shrink", dropped), ("grow", added)) if on) or (
            "launch" if fresh else "relaunch"
        )
    phases.tasks.append(new.with_state(TaskState.LAUNCHING))
    if inc is not None and waiting:
        phases.incidents.append(replace(inc.moved(LadderStage.TRANSITION, now_s), last_action_s=now_s))
    phases.notes.append(
        f"plan-{phases.gen}: {task.task_id} {layout.describe()} on {', '.join(new_nodes)} ({how})"
    )
