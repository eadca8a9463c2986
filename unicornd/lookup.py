"""The one-step lookup: the plan of every single-node failure, solved before it happens.

At 4,096 nodes and 200 tasks a full solve takes 0.1-0.2 s (``scripts/bench/scale.py``).
After each change of what the planner would see (the plan basis, the tasks' nodes and
states, which tasks are faulted, the nodes), :class:`Lookup` solves, in worker processes,
the snapshot each planned task's next single-node failure would leave when its replan runs
(:func:`one_step_snapshots`: one of its nodes out, the task faulted), and one for a spare
node lost, and puts the plans into the planner's :class:`~unicornd.replan.SolveCache`.
The replan then finds its plan there (:func:`unicornd.replan.plan_for`).

Nothing decides differently because of it: a cached plan is keyed by the solve's exact
inputs (they come from the snapshot's plan basis, :class:`unicornd.state.PlanBasis`), so
it is the plan the solve would give; a failure the table did not foresee, or one that
comes before the table is built, is solved as before. Small clusters, whose solve takes
milliseconds, get no table (``min_nodes``).

Unicron (Sec. 5.2) precomputes the same one-step reactions; plan/lookup.py was its
standalone form, keyed by task, not by inputs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Final

from detect.statuses import ErrorStatus, Severity
from plan.hardware import GpuSpec
from plan.objective import FailureModel
from plan.perf import PerfAssumptions
from plan.planner import Assignment, Plan
from unicorn_core.config import PlanConfig
from unicorn_core.logs import get_logger
from unicornd.actions import Decision
from unicornd.core import Core
from unicornd.launch import Render
from unicornd.replan import CurveMemo, PlanContext, SolveKey, planned_tasks, pools, solve, solve_inputs
from unicornd.solvecache import SolveCache
from unicornd.state import Incident, NodeHealth, Snapshot, TaskRecord

log = get_logger(__name__)

LOOKUP_MIN_NODES: Final = 512
"""Below this many nodes a full solve takes under ~12 ms (N = 256: 11.7 ms, N = 1,024: 47 ms
in ``scripts/bench/scale.py``): no table, no worker process."""
CHUNK: Final = 4
"""Tasks solved per call to the worker: its plans are usable as each chunk comes back,
and a change of the inputs stops a build within one chunk."""
DEBOUNCE_S: Final = 0.5
"""Wait this long after a change before building (a recovery commits several in a row)."""
SPARE: Final = ""
"""The one-step snapshot of a spare node lost (no task's)."""
MAX_AUTO_WORKERS: Final = 4
"""``[plan] lookup_workers = 0`` starts one worker per CPU, at most this many."""

_WORKER_CURVES: CurveMemo = {}
"""A worker process's task curves, kept from chunk to chunk (:func:`unicornd.replan.solve`)."""


def _incident(task: TaskRecord, node: str) -> Incident:
    return Incident(
        incident_id=f"lookup/{task.task_id}",
        task_id=task.task_id,
        node=node,
        rank=None,
        status=ErrorStatus.LOST_CONNECTION,
        severity=Severity.SEV1,
        rule="lookup",
        evidence="a failure solved ahead",
        opened_s=0.0,
    )


def one_step_snapshots(snap: Snapshot, only: Collection[str] | None = None) -> list[tuple[str, Snapshot]]:
    """(task id, snapshot) for each planned task holding a plannable node: the snapshot its
    replan sees after one of its nodes failed (the node draining, the task with an open
    incident, as the ladder's isolate rung leaves them); and (:data:`SPARE`, the snapshot
    after a plannable node no task holds failed), if there is one. Which of a task's nodes
    fails does not matter to the planner (it counts nodes). ``only``: just these ids (each
    snapshot copies the node mapping: a worker's chunk builds its own, not all)."""
    plannable = snap.plannable()
    usable = set(plannable)
    out: list[tuple[str, Snapshot]] = []
    held: set[str] = set()
    for task in planned_tasks(snap):
        held.update(task.nodes)
        nodes = [n for n in task.nodes if n in usable]
        if not nodes or (only is not None and task.task_id not in only):
            continue
        node = snap.node(nodes[-1]).with_health(NodeHealth.DRAINING, "lookup: solved ahead")
        faulted = snap.open_incident(task.task_id) is not None
        out.append(
            (
                task.task_id,
                snap.apply(nodes=[node], incidents=() if faulted else [_incident(task, node.name)]),
            )
        )
    spare = next((n for n in plannable if n not in held), None)
    if spare is not None and (only is None or SPARE in only):
        node = snap.node(spare).with_health(NodeHealth.DRAINING, "lookup: solved ahead")
        out.append((SPARE, snap.apply(nodes=[node])))
    return out


@dataclass(frozen=True)
class SolveParts:
    """What a solve needs of a :class:`PlanContext`, in a form a worker process can take."""

    gpu: GpuSpec
    failure: FailureModel
    assume: PerfAssumptions
    plan: PlanConfig

    @classmethod
    def of(cls, ctx: PlanContext) -> SolveParts:
        return cls(ctx.gpu, ctx.failure, ctx.assume, ctx.plan)

    def context(self) -> PlanContext:
        return PlanContext(self.gpu, self.failure, _no_render, self.assume, self.plan)


def _lowest_priority() -> None:
    """The worker runs only on otherwise idle CPU (``SCHED_IDLE``; nice 19 where that is not
    allowed): solving ahead must not slow unicornd's own loop, the agents or Redis."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _no_render(_gpus: int, _generation: int) -> Render:
    raise AssertionError("a solve ahead renders no command line")


def solve_ahead(
    snap: Snapshot,
    parts: SolveParts,
    now_s: float,
    tasks: Sequence[str] | None,
    memo: CurveMemo | None = None,
) -> list[tuple[str, Plan]]:
    """(task id or :data:`SPARE`, plan) of the one-step snapshots of ``tasks`` (None: all)
    whose inputs can be cached. Pure; runs in the worker process. Only plans travel back (their keys
    are made where they are stored, :meth:`~unicornd.replan.SolveKey.one_node_lost`: a key
    holds every task's spec, and unpickling them holds the parent's GIL). ``memo``: the
    task curves to reuse (default: the worker process's own, kept between chunks)."""
    ctx = parts.context()
    curves = _WORKER_CURVES if memo is None else memo
    out: list[tuple[str, Plan]] = []
    for tid, hyp in one_step_snapshots(snap, None if tasks is None else set(tasks)):
        inputs = solve_inputs(hyp, ctx, now_s)
        if inputs is not None and inputs.key is not None:
            out.append((tid, solve(inputs, ctx, curves)))
    return out


def store(
    snap: Snapshot,
    base: SolveKey,
    plans: Sequence[tuple[str, Plan]],
    cache: SolveCache,
    canon: dict[Assignment, Assignment] | None = None,
) -> None:
    """Put the one-step plans of ``snap`` (whose key is ``base``) into ``cache``. Their
    assignments are shared where equal, through ``canon`` (one per plan basis: every
    table's plans differ in a few tasks each; 74 KB a plan at 200 tasks otherwise)."""
    canon = {} if canon is None else canon
    for tid, plan in plans:
        shared = replace(plan, assignments=tuple(canon.setdefault(a, a) for a in plan.assignments))
        cache.put(base.one_node_lost(_name(snap, tid)), snap.plan_basis, shared)


def _name(snap: Snapshot, tid: str) -> str | None:
    return None if tid == SPARE else snap.tasks[tid].name


def missing(snap: Snapshot, base: SolveKey, ids: Sequence[str], cache: SolveCache) -> list[str]:
    """The ids of ``ids`` whose one-step plan ``cache`` lacks. A table is often built again
    for inputs seen before: a task's rank crash opens an incident (its task faulted, a new
    table) and the task's recovery closes it (the table before it, whose plans are kept)."""
    return [tid for tid in ids if cache.get(base.one_node_lost(_name(snap, tid)), snap.plan_basis) is None]


def structure(snap: Snapshot) -> tuple[object, ...]:
    """What the one-step plans depend on besides the tasks' specs, cheaply (it is compared
    after a debounce): the basis, the node records (the same mapping while no node
    changes: :meth:`Snapshot.apply` keeps it), each task's state and nodes, and which
    tasks are faulted."""
    faulted = frozenset(i.task_id for i in snap.incidents.values() if i.is_open and i.task_id is not None)
    places = tuple((t.task_id, t.state, t.nodes, t.task_id in faulted) for t in snap.tasks.values())
    return (snap.plan_basis, snap.nodes, places)


class Lookup:
    """Keeps the planner's :class:`~unicornd.replan.SolveCache` holding the plans of the
    committed snapshot's single-node failures (see the module docstring). :meth:`follow`
    is a :class:`~unicornd.core.Core` follower; :meth:`run` is a root task of unicornd."""

    def __init__(self, core: Core, *, min_nodes: int = LOOKUP_MIN_NODES, workers: int = 0) -> None:
        self.core = core
        self.min_nodes = min_nodes
        self.workers = workers or min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0)))
        """Worker processes; a build keeps one chunk in flight on each."""
        self.builds = 0
        self.build_s: list[float] = []
        self.solved = 0
        self.reused = 0
        """One-step plans a build found cached already (for inputs seen before)."""
        self.failures = 0
        self._changed = asyncio.Event()
        self._built: tuple[object, ...] | None = None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._canon: dict[Assignment, Assignment] = {}
        self._canon_basis: object = None

    def follow(self, _before: Snapshot, after: Snapshot, _decision: Decision) -> None:
        if len(after.nodes) >= self.min_nodes and after.plan_basis is not None:
            self._changed.set()

    async def run(self) -> None:
        try:
            while True:
                await self._changed.wait()
                await asyncio.sleep(DEBOUNCE_S)
                self._changed.clear()
                snap = self.core.committed
                if snap is None or snap.plan_basis is None or len(snap.nodes) < self.min_nodes:
                    continue
                shape = structure(snap)
                if shape == self._built:
                    continue
                try:
                    await self._build(snap, shape)
                except Exception as e:  # an optimisation: its failure must not stop unicornd
                    log.error("lookup_failed", error=repr(e))
                    self.failures += 1
                    if self._pool is not None:
                        self._pool.shutdown(wait=False, cancel_futures=True)
                        self._pool = None
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)

    async def _build(self, snap: Snapshot, shape: tuple[object, ...]) -> None:
        """Solve every one-step snapshot of ``snap``, a chunk at a time; stop early when the
        inputs change again (the next build starts from the newer snapshot)."""
        if self._pool is None:
            # spawn, not fork: unicornd has threads (to_thread), which fork would copy mid-state.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_lowest_priority,
            )
        started = time.monotonic()
        groups = pools(snap)
        if len(groups) > 1:
            # TODO(issue 24): one-step plans per pool. The replan of a cluster of several GPU
            # kinds solves each pool's snapshot (replan.pool_snapshot); whole-cluster plans
            # solved here would never be asked for.
            return
        ctx = self.core.ctx.for_pool(groups[0])  # the replan's context: its GPU type's model
        parts = SolveParts.of(ctx)
        base = solve_inputs(snap, ctx, time.time())
        if base is None or not isinstance(base.key, SolveKey):
            return  # nothing planned, or nothing cacheable (no basis, or analytic inputs)
        # The largest tasks first: a node that fails is most likely one of theirs.
        by_size = sorted(planned_tasks(snap), key=lambda t: (-len(t.nodes), t.task_id))
        ids = [t.task_id for t in by_size] + [SPARE]
        ctx.solves.table_started(base.key, snap.plan_basis)
        todo = missing(snap, base.key, ids, ctx.solves)
        reused = len(ids) - len(todo)
        self.reused += reused
        if self._canon_basis is not snap.plan_basis:  # assignments are shared within a basis
            self._canon, self._canon_basis = {}, snap.plan_basis
        loop = asyncio.get_running_loop()
        chunks = [todo[i : i + CHUNK] for i in range(0, len(todo), CHUNK)]
        chunks.reverse()  # popped from the end: the largest tasks' go first
        flying: set[asyncio.Future[list[tuple[str, Plan]]]] = set()
        try:
            while chunks or flying:
                while chunks and len(flying) < self.workers:
                    chunk = chunks.pop()
                    flying.add(loop.run_in_executor(self._pool, solve_ahead, snap, parts, time.time(), chunk))
                done, flying = await asyncio.wait(flying, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    plans = fut.result()
                    store(snap, base.key, plans, ctx.solves, self._canon)
                    self.solved += len(plans)
                now = self.core.committed
                if now is not snap and (now is None or structure(now) != shape):
                    return  # the inputs moved on: the next build starts from the newer snapshot
        finally:
            # Chunks not started are dropped; one a worker is solving runs to its end, and
            # its result (or error) is ignored.
            for fut in flying:
                fut.cancel()
        ctx.solves.table_built(base.key, snap.plan_basis)
        self._built = shape
        self.builds += 1
        self.build_s.append(time.monotonic() - started)
        log.info("lookup_built", solved=len(todo), reused=reused, seconds=round(self.build_s[-1], 3))


def warm(snap: Snapshot, ctx: PlanContext, now_s: float) -> int:
    """Solve ``snap``'s one-step snapshots here and cache them (what :class:`Lookup` does in
    its worker, for tests and tools); how many plans were cached."""
    groups = pools(snap)
    if len(groups) > 1:
        return 0
    ctx = ctx.for_pool(groups[0])
    base = solve_inputs(snap, ctx, now_s)
    if base is None or not isinstance(base.key, SolveKey):
        return 0
    ctx.solves.table_started(base.key, snap.plan_basis)
    plans = solve_ahead(snap, SolveParts.of(ctx), now_s, None, memo={})
    store(snap, base.key, plans, ctx.solves)
    ctx.solves.table_built(base.key, snap.plan_basis)
    return len(plans)
