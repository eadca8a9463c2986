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

A cluster whose nodes differ in GPU type or count (Slurm's GRES, ``gpu:h100:8``) is
planned pool by pool (:func:`pools`): each task is planned on the nodes of one type, with
that type's performance model, and never across types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple

from plan.calibration import Efficiency
from plan.hardware import GpuSpec, gpu_spec, load_gpus
from plan.objective import FailureModel
from plan.perf import PerfAssumptions
from plan.planner import (
    Assignment,
    Cluster,
    Granularity,
    Plan,
    PlanRequest,
    TaskCurve,
    plan_cluster,
    task_curves,
)
from unicorn_core.config import Config, PlanConfig
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.protocol import AgentAction
from unicorn_core.taskspec import TaskSpec, check_unique_names
from unicornd.actions import Action, Decision, Grow, LaunchAgents, NodeArgv, Requeue, SendCommand, Shrink
from unicornd.calibrate import planner_inputs
from unicornd.launch import Render, renderer
from unicornd.solvecache import BEYOND_ONE_STEP, SolveCache
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
"""How long a requeued job may take to run again, from the requeue's return, before its rung
fails (Slurm holds a requeued job for cred_expire, then the scheduler starts it: seconds on
a healthy cluster)."""

REQUEUE_QUEUED_LIMIT_S: Final = 1800.0
"""How long a committed requeue may wait to be performed before its rung fails. A backstop
only: allocation changes run one at a time (a whole-cluster replan at 4,096 nodes queues
minutes of them), and the requeue's own outcome ends the wait if it fails; but an owed
action that is lost (one the store cannot read after an upgrade) would otherwise hold its
task waiting for good."""


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

    gpu_types: Mapping[str, GpuSpec] = field(default_factory=dict)
    """Slurm GRES GPU type -> performance model (``[plan] gpu_types``); see :meth:`gpu_for`."""

    @classmethod
    def from_config(cls, cfg: Config) -> PlanContext:
        return cls(
            gpu=gpu_spec(cfg.plan.gpu),
            failure=FailureModel(cfg.plan.node_mtbf_h),
            render_for=lambda gpus, generation: renderer(cfg.agent, gpus, generation),
            assume=PerfAssumptions(distributed_optimizer=cfg.plan.distributed_optimizer),
            plan=cfg.plan,
            gpu_types=gpu_type_specs(cfg.plan.gpu_types),
        )

    def gpu_for(self, gpu_type: str) -> GpuSpec:
        """The performance model of Slurm GPU type ``gpu_type``: ``[plan] gpu_types``'s
        entry, else the etc/gpus.toml type of that name or the only one it prefixes
        (``h100`` -> ``h100-80g``), else ``[plan] gpu`` (untyped GRES says nothing)."""
        if gpu_type in self.gpu_types:
            return self.gpu_types[gpu_type]
        known = load_gpus()
        if gpu_type in known:
            return known[gpu_type]
        prefixed = [name for name in known if gpu_type and name.startswith(f"{gpu_type.lower()}-")]
        return known[prefixed[0]] if len(prefixed) == 1 else self.gpu

    def for_pool(self, pool: Pool) -> PlanContext:
        gpu = self.gpu_for(pool.gpu_type)
        return self if gpu == self.gpu else replace(self, gpu=gpu)


def gpu_type_specs(text: str) -> dict[str, GpuSpec]:
    """``[plan] gpu_types`` (``"h100=h100-80g,a100=a100-40g"``) as a mapping; raises
    InvalidArgument naming a bad entry or an unknown etc/gpus.toml type."""
    out: dict[str, GpuSpec] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        slurm_type, sep, spec = (x.strip() for x in item.partition("="))
        if not sep or not slurm_type or not spec:
            raise InvalidArgument(f"plan.gpu_types: {item!r} is not TYPE=GPU (e.g. h100=h100-80g)")
        out[slurm_type] = gpu_spec(spec)
    return out


@dataclass(frozen=True)
class Pool:
    """Nodes of one GPU type and count (``nodes``: all of them, plannable or not) and the
    planned tasks that run there (``tasks``, by id). ``placeable`` False: the pool of
    tasks whose accepted GPU types no node has (they get no GPUs)."""

    gpu_type: str
    gpus_per_node: int
    nodes: tuple[str, ...]
    tasks: tuple[str, ...]
    placeable: bool = True

    def describe(self) -> str:
        what = f"{self.gpus_per_node} x {self.gpu_type or 'untyped'} GPU"
        return what if self.placeable else f"no node of an accepted GPU type ({what})"


def node_kind(snapshot: Snapshot, name: str) -> tuple[str, int]:
    """A node's (GPU type, GPUs): its pool's key (0 GPUs recorded: the snapshot's count)."""
    rec = snapshot.nodes[name]
    return rec.gpu_type, rec.gpus or snapshot.gpus_per_node


def pools(snapshot: Snapshot) -> list[Pool]:
    """The cluster's planning pools: one per (GPU type, GPUs per node) among its nodes.

    Each planned task goes to exactly one: the kind most of its current nodes are (if it
    accepts that type; ties by kind), else the accepted kind with the most plannable GPUs
    not yet taken by the tasks placed before it (running tasks first, then by id; a new
    task takes its ``min_gpus``). A task that accepts no kind present is placed in an
    unplaceable pool of its own kind. One kind only: one pool of every node and task."""
    kinds = {name: node_kind(snapshot, name) for name in snapshot.nodes}
    keys = sorted(set(kinds.values())) or [("", snapshot.gpus_per_node)]
    tasks = planned_tasks(snapshot)
    if len(keys) == 1 and not any(t.gpu_types and keys[0][0] not in t.gpu_types for t in tasks):
        return [Pool(keys[0][0], keys[0][1], tuple(sorted(kinds)), tuple(t.task_id for t in tasks))]
    free = dict.fromkeys(keys, 0)
    for name in snapshot.plannable():
        free[kinds[name]] += kinds[name][1]
    placed: dict[tuple[str, int], list[str]] = {k: [] for k in keys}
    lost: list[str] = []
    for task in sorted(tasks, key=lambda t: (not t.nodes, t.task_id)):
        accepted = [k for k in keys if not task.gpu_types or k[0] in task.gpu_types]
        held: dict[tuple[str, int], int] = {}
        for n in task.nodes:
            if n in kinds:
                held[kinds[n]] = held.get(kinds[n], 0) + 1
        mine = sorted((k for k in held if k in accepted), key=lambda k: (-held[k], k))
        if mine:
            key = mine[0]
            free[key] -= held[key] * key[1]
        elif accepted:
            key = max(accepted, key=lambda k: (free[k], k))
            free[key] -= task.min_gpus
        else:
            lost.append(task.task_id)
            continue
        placed[key].append(task.task_id)
    out = [
        Pool(k[0], k[1], tuple(sorted(n for n, kind in kinds.items() if kind == k)), tuple(placed[k]))
        for k in keys
    ]
    if lost:
        out.append(Pool("", snapshot.gpus_per_node, (), tuple(lost), placeable=False))
    return out


def pool_snapshot(snapshot: Snapshot, pool: Pool) -> Snapshot:
    """The snapshot a pool is planned on: its nodes and planned tasks (tasks planned in
    other pools left out, so their nodes count as other users'), and every node its tasks
    hold now, those of another kind marked held (never planned here: the task leaves
    them). ``gpus_per_node`` is the pool's."""
    tasks = {
        tid: t for tid, t in snapshot.tasks.items() if t.state not in PLANNED_STATES or tid in pool.tasks
    }
    names = set(pool.nodes) | {n for tid in pool.tasks for n in snapshot.tasks[tid].nodes}
    key = (pool.gpu_type, pool.gpus_per_node)
    nodes = {}
    for name in sorted(names):
        rec = snapshot.nodes.get(name)
        if rec is None:
            continue
        foreign_kind = not pool.placeable or node_kind(snapshot, name) != key
        nodes[name] = replace(rec, held=True) if foreign_kind and not rec.held else rec
    return replace(snapshot, tasks=tasks, nodes=nodes, gpus_per_node=pool.gpus_per_node, check=False)


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


CurveMemo = dict[tuple[TaskSpec, Cluster, int, PerfAssumptions], tuple[Efficiency | None, TaskCurve]]
"""Task curves kept across solves (:func:`solve`): keyed by what a curve is computed from
besides the calibration, which is compared on use (it is a mapping, so no key)."""

CURVE_MEMO_MAX: Final = 1024
"""A memo this large is emptied before the next entry (a build needs one curve per task;
a curve at 4,096 nodes holds ~64 KB)."""


def solve(inputs: SolveInputs, ctx: PlanContext, memo: CurveMemo | None = None) -> Plan:
    """The solve itself: every task's curve up to one node more than the cluster, then the
    planner (:func:`plan.planner.plan_cluster`).

    ``memo``: curves of earlier solves to reuse. The lookup's one-step snapshots of one
    build share their cluster and calibration, so each task's curve is computed once per
    build instead of once per solve (``scripts/bench/lookup.py`` at 4,096 nodes: a solve
    took 52.0 ms without the memo, 31.1 ms with it). A curve is the
    same function of the same inputs either way, so the plan is the same."""
    cluster = inputs.cluster
    top = cluster.workers + 1
    if memo is None:
        curves = task_curves(inputs.specs, cluster, top, ctx.assume, calibration=inputs.efficiency)
        return plan_cluster(curves, cluster, inputs.request)
    if memo and next(iter(memo))[1:] != (cluster, top, ctx.assume):
        memo.clear()  # another cluster: none of these curves can serve (a node was lost or came back)
    out: list[TaskCurve] = []
    for spec in inputs.specs:
        eff = None if inputs.efficiency is None else inputs.efficiency.get(spec.name)
        key = (spec, cluster, top, ctx.assume)
        kept = memo.get(key)
        if kept is None or kept[0] != eff:
            calibration = None if eff is None else {spec.name: eff}
            (curve,) = task_curves((spec,), cluster, top, ctx.assume, calibration=calibration)
            if len(memo) >= CURVE_MEMO_MAX:
                memo.clear()
            kept = memo[key] = (eff, curve)
        out.append(kept[1])
    check_unique_names(inputs.specs, "tasks")
    return plan_cluster(out, cluster, inputs.request)


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
        try:
            why = miss_reason(inputs.key, inputs.basis, ctx.solves.table)
        except Exception as e:  # a record only: it must never fail the replan
            why = f"unknown ({e!r})"
        ctx.solves.note_miss(why)
        plan = solve(inputs, ctx)
        ctx.solves.put(inputs.key, inputs.basis, plan)
        return plan


def miss_reason(
    key: Hashable, basis: PlanBasis | None, table: tuple[Hashable, PlanBasis | None, bool] | None
) -> str:
    """Why a cacheable solve was not in the one-step table (``table``: the newest the lookup
    started, :attr:`SolveCache.table`): what differs between the state asked for and the
    state the table was built around. Pure; for the record (the scale bench counts them)."""
    if table is None:
        return (
            "no table: the lookup has built none (below [plan] lookup_min_nodes, no plan basis "
            "yet, several GPU pools, or not built yet)"
        )
    base, table_basis, whole = table
    if table_basis is not basis:
        return "the plan basis changed since the table (new calibration or cluster)"
    if not isinstance(key, SolveKey) or not isinstance(base, SolveKey):
        return "inputs the table does not hold"
    diffs = []
    if key.ids != base.ids or key.specs != base.specs:
        diffs.append("the tasks changed")
    elif key.current != base.current:
        diffs.append("task sizes changed")
    kind = (key.cluster.gpus_per_node, key.cluster.gpu, key.cluster.granularity, key.nodes_known)
    if kind != (base.cluster.gpus_per_node, base.cluster.gpu, base.cluster.granularity, base.nodes_known):
        diffs.append("the cluster changed")
    lost = base.cluster.nodes - key.cluster.nodes
    if lost != 1:
        diffs.append(
            "no node fewer" if lost == 0 else f"{lost} nodes fewer" if lost > 0 else f"{-lost} node(s) more"
        )
    newly = sorted(key.faulted - base.faulted)
    if len(newly) > 1:
        diffs.append(f"{len(newly)} tasks newly faulted ({', '.join(newly[:4])})")
    if base.faulted - key.faulted:
        diffs.append("a faulted task recovered")
    if diffs:
        return BEYOND_ONE_STEP + "; ".join(diffs)
    return "one step, but the table was not built whole yet" if not whole else "one step, not in the table"


def replan_decision(snapshot: Snapshot, ctx: PlanContext, now_s: float) -> tuple[Plan | None, Decision]:
    """The one replan: the planner's allocation for ``snapshot`` and the transition to it.

    Pure. (None, empty decision) when no task is planned. A plan that cannot be applied
    (:func:`plan_transition` raises InvalidArgument, e.g. fewer healthy nodes than it
    needs) gives its plan and a decision that only says why: the input that asked for
    the replan still stands, and the next replan tries again.
    """
    groups = pools(snapshot)
    if len(groups) == 1:  # one kind of node, every task accepts it: the whole cluster
        plan = plan_for(snapshot, ctx.for_pool(groups[0]), now_s)
        if plan is None:
            return None, Decision(notes=("replan: no task to plan",))
        render = ctx.render_for(snapshot.gpus_per_node, snapshot.plan_generation + 1)
        try:
            return plan, plan_transition(snapshot, plan, render, now_s)
        except InvalidArgument as e:
            return plan, Decision(notes=(f"replan not applied: {e}",))
    phases = _Phases(gen=snapshot.plan_generation + 1)
    plans: list[Plan] = []
    failed: list[str] = []
    for pool in groups:
        if not pool.tasks:
            continue
        sub = pool_snapshot(snapshot, pool)
        plan = plan_for(sub, ctx.for_pool(pool), now_s)
        if plan is None:
            continue
        plans.append(plan)
        try:
            _transition_into(sub, plan, ctx.render_for(pool.gpus_per_node, phases.gen), now_s, phases)
        except InvalidArgument as e:
            failed.append(f"{pool.describe()}: {e}")
        phases.notes.append(f"plan-{phases.gen}: pool {pool.describe()}: {', '.join(pool.tasks)}")
    if not plans:
        return None, Decision(notes=("replan: no task to plan",))
    merged = _merged(plans)
    if failed:
        return merged, Decision(notes=tuple(f"replan not applied: {why}" for why in failed))
    return merged, phases.decision()


def _merged(plans: Sequence[Plan]) -> Plan:
    """One plan of the pools' plans (their assignments, totals summed; ``worker_gpus`` the
    largest pool's node size, for display)."""
    return Plan(
        assignments=tuple(a for p in plans for a in p.assignments),
        workers=sum(p.workers for p in plans),
        spare_workers=sum(p.spare_workers for p in plans),
        worker_gpus=max(p.worker_gpus for p in plans),
        total_waf_tflops=sum(p.total_waf_tflops for p in plans),
        objective_tflop=sum(p.objective_tflop for p in plans),
    )


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
        # A node Slurm holds down stays its task's only while the task keeps enough up ones:
        # a task that shrinks lets it go first, and it is nobody's new node (Slurm would
        # start no job there).
        kept = sorted((n for n in task.nodes if n in usable_set), key=lambda n: snapshot.node(n).slurm_down)
        out[task.task_id] = kept[: needs[task.task_id]]
        taken.update(out[task.task_id])
    free = [n for n in usable if n not in taken and not snapshot.node(n).slurm_down]
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
    for task in tasks:
        # A new allocation (the task gains nodes, so its job is resized or requeued, or it is
        # on its way back from a requeue) starts only on nodes Slurm has up: a node it keeps
        # that Slurm holds down gives way to a free one while any is left (kept, a requeue
        # would wait for that node forever).
        nodes = out[task.task_id]
        if task.requeue is None and set(nodes) <= set(task.nodes):
            continue
        for i, node in enumerate(nodes):
            if free and snapshot.node(node).slurm_down:
                nodes[i] = free.pop(0)
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

    def decision(self) -> Decision:
        return Decision(
            actions=self.actions(),
            tasks=tuple(self.tasks),
            incidents=tuple(self.incidents),
            notes=tuple(self.notes),
            plan_generation=self.gen,
        )


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
    phases = _Phases(gen=snapshot.plan_generation + 1)
    _transition_into(snapshot, new_plan, render, now_s, phases)
    return phases.decision()


def _transition_into(
    snapshot: Snapshot, new_plan: Plan, render: Render, now_s: float, phases: _Phases
) -> None:
    """:func:`plan_transition`'s work, added to ``phases`` (a cluster of several pools
    collects every pool's actions there, so the phases stay in order across pools)."""
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
    for task in planned:
        new_nodes = allocation[task.task_id]
        _move_task(snapshot, phases, task, new_nodes, layouts[task.task_id], render=render, now_s=now_s)


def _by_requeue(
    task: TaskRecord, new_nodes: tuple[str, ...], adds: bool, resize_count: int, max_resizes: int
) -> bool:
    """Whether ``task``'s job reaches ``new_nodes`` by a requeue rather than in place: it
    keeps none of its nodes; it holds GRES (GPUs) and gains nodes (22.05 and 24.11 refuse
    to expand such a job); it is pending on its way back from a requeue (it holds no nodes
    to shrink: its node list is set anew); or the resizes would pass the policy's limit."""
    return (
        not set(task.nodes) & set(new_nodes)
        or (adds and bool(task.job_gres))
        or task.requeue is not None
        or task.resizes_this_run + resize_count > max_resizes
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
    if _by_requeue(task, new_nodes, bool(added), resize_count, pol.max_resizes_per_run):
        # The agents start once the job runs again (:func:`unicornd.decide.on_job_running`);
        # until then its processes die on purpose and their exits are not faults.
        phases.resizes.append(Requeue(f"{base}/requeue", task.task_id, job, new_nodes))
        wait = RequeueWait(f"{base}/requeue", deadline_s=now_s + REQUEUE_QUEUED_LIMIT_S)
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
