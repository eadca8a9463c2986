"""The plan basis and the one-step lookup: a failure's plan solved ahead is the plan the
failure gets, found in the cache instead of solved; nothing decides differently."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import cast

from detect.statuses import ErrorStatus, Severity
from plan.calibration import Running, model_key
from plan.hardware import gpu_spec
from plan.objective import FailureModel
from tests.unicornd.coord_world import apply, finding, layout_for, render, task, world
from unicornd.actions import Decision
from unicornd.core import Core
from unicornd.decide import on_basis_due, on_finding, resolve
from unicornd.lookup import SPARE, Lookup, one_step_snapshots, structure, warm
from unicornd.replan import PLANNED_STATES, CurveMemo, PlanContext, SolveKey, plan_for, solve, solve_inputs
from unicornd.state import (
    PLAN_BASIS_REFRESH_S,
    Calibration,
    Incident,
    MeasuredLayout,
    NodeHealth,
    PlanBasis,
    Policy,
    Snapshot,
    TaskState,
)

T0 = 1_700_000_000.0


def ctx() -> PlanContext:
    return PlanContext(gpu_spec("a100-80g"), FailureModel(24.0), lambda _gpn, _gen: render)


def cluster() -> Snapshot:
    """Three tasks on 2, 3 and 2 of 9 nodes (n8, n9 spare), with a plan basis."""
    snap = world(
        9,
        [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4", "n5"]), task("c", 3, ["n6", "n7"])],
        Policy(max_drain_fraction=1.0),
    )
    return snap.apply(plan_basis=PlanBasis(snap.calibration, T0 - 10))


def measured(gpu: str, iteration_s: float) -> Calibration:
    """A calibration that measured task a's model twice as slow as the model says (or not)."""
    t = cluster().tasks["a"]
    run = Running(mean=iteration_s, samples=50.0, count=50)
    return Calibration(layouts=(MeasuredLayout(gpu, model_key(t.model), layout_for(2), run, T0),))


def test_a_basis_is_taken_first_then_renewed_only_when_due_and_the_calibration_moved() -> None:
    snap = cluster()
    bare = replace(snap, plan_basis=None)
    first = on_basis_due(bare, T0)
    assert first.plan_basis == PlanBasis(bare.calibration, T0)
    assert on_basis_due(snap, T0 + PLAN_BASIS_REFRESH_S).empty, "due, but nothing measured since"
    moved = replace(snap, calibration=replace(snap.calibration, node_failures=1))
    assert on_basis_due(moved, T0 - 10 + PLAN_BASIS_REFRESH_S - 1).empty, "not due yet"
    renewed = on_basis_due(moved, T0 - 10 + PLAN_BASIS_REFRESH_S)
    assert renewed.plan_basis is not None and renewed.plan_basis.calibration is moved.calibration
    idle = replace(bare, tasks={k: t.with_state(TaskState.STOPPED) for k, t in bare.tasks.items()})
    assert not any(t.state in PLANNED_STATES for t in idle.tasks.values())
    assert on_basis_due(idle, T0).empty, "nothing planned: no basis"


def test_the_planner_reads_the_basis_not_the_live_calibration() -> None:
    gpu = gpu_spec("a100-80g").name
    snap = cluster()
    slow = measured(gpu, 50.0)
    live_slow = replace(snap, calibration=slow)  # measured after the basis was taken
    basis_slow = live_slow.apply(plan_basis=PlanBasis(slow, T0))
    assert plan_for(live_slow, ctx(), T0) == plan_for(snap, ctx(), T0), "the basis still holds"
    assert plan_for(basis_slow, ctx(), T0) == plan_for(replace(basis_slow, plan_basis=None), ctx(), T0)


def test_each_task_and_a_spare_get_a_one_step_snapshot_with_a_node_out_and_the_task_faulted() -> None:
    snap = cluster()
    steps = dict(one_step_snapshots(snap))
    assert sorted(steps) == sorted(["a", "b", "c", SPARE])
    b = steps["b"]
    assert len(b.plannable()) == len(snap.plannable()) - 1
    assert b.nodes["n5"].health is NodeHealth.DRAINING and b.open_incident("b") is not None
    assert b.open_incident("a") is None and b.tasks == snap.tasks
    assert steps[SPARE].open_incident("b") is None and len(steps[SPARE].plannable()) == 8


def test_the_one_step_keys_are_made_from_the_base_key_as_the_solve_would_make_them() -> None:
    snap = cluster()
    base = solve_inputs(snap, ctx(), T0)
    assert base is not None and isinstance(base.key, SolveKey)
    for tid, hyp in one_step_snapshots(snap):
        made = base.key.one_node_lost(None if tid == SPARE else snap.tasks[tid].name)
        solved = solve_inputs(hyp, ctx(), T0 + 99)
        assert solved is not None and solved.key == made, tid


def test_a_failure_solved_ahead_gets_the_same_decision_from_the_cache() -> None:
    snap = cluster()
    warmed = ctx()
    assert warm(snap, warmed, T0) == 4
    fault = finding("f1", 2, "n4", ErrorStatus.ECC_ERROR)  # b loses n4 (not its last node)
    decided = on_finding(snap, fault, T0 + 5)
    from_cache = resolve(snap, decided, warmed, T0 + 5)
    assert warmed.solves.hits == 1 and warmed.solves.misses == 0
    cold = ctx()
    solved = resolve(snap, decided, cold, T0 + 5)
    assert cold.solves.hits == 0 and cold.solves.misses == 1
    assert from_cache == solved
    assert from_cache.plan_generation == snap.plan_generation + 1 and from_cache.actions


def test_a_failure_the_table_did_not_foresee_is_solved() -> None:
    snap = cluster()
    warmed = ctx()
    warm(snap, warmed, T0)
    later = apply(snap, on_finding(snap, finding("f1", 1, "n1", ErrorStatus.ECC_ERROR), T0 + 1))
    # a second failure while a's incident waits: not one step from the table's snapshot
    decided = on_finding(later, finding("f2", 3, "n6", ErrorStatus.ECC_ERROR), T0 + 2)
    resolve(later, decided, warmed, T0 + 2)
    assert warmed.solves.misses >= 1
    # Each miss says why: two nodes out and two tasks faulted since the table's snapshot.
    whys = [why for _t, why in warmed.solves.missed]
    assert len(whys) == warmed.solves.misses
    assert whys[-1] == "beyond one step: 2 nodes fewer; 2 tasks newly faulted (a, c)", whys
    assert warmed.solves.misses_beyond_one_step == sum(w.startswith("beyond one step") for w in whys) >= 1


def test_a_miss_without_a_table_or_on_another_basis_says_so() -> None:
    snap = cluster()
    cold = ctx()
    resolve(snap, on_finding(snap, finding("f1", 2, "n4", ErrorStatus.ECC_ERROR), T0 + 5), cold, T0 + 5)
    assert [why for _t, why in cold.solves.missed] == [
        "no table: the lookup has built none (below [plan] lookup_min_nodes, no plan basis "
        "yet, several GPU pools, or not built yet)"
    ]
    warmed = ctx()
    warm(snap, warmed, T0)
    renewed = snap.apply(plan_basis=PlanBasis(snap.calibration, T0))  # equal contents, a new basis
    resolve(
        renewed, on_finding(renewed, finding("f1", 2, "n4", ErrorStatus.ECC_ERROR), T0 + 5), warmed, T0 + 5
    )
    assert warmed.solves.hits == 0
    assert [why for _t, why in warmed.solves.missed] == [
        "the plan basis changed since the table (new calibration or cluster)"
    ]
    assert warmed.solves.misses_beyond_one_step == 0 and cold.solves.misses_beyond_one_step == 0


async def test_the_lookup_builds_the_table_in_a_worker_process() -> None:
    snap = cluster()
    context = ctx()
    lookup = Lookup(cast(Core, SimpleNamespace(ctx=context, committed=snap)), min_nodes=0)
    try:
        await lookup._build(snap, structure(snap))
    finally:
        assert lookup._pool is not None
        lookup._pool.shutdown(wait=True)
    assert lookup.builds == 1 and lookup.solved == 4 and len(context.solves) == 4
    decided = on_finding(snap, finding("f1", 3, "n7", ErrorStatus.ECC_ERROR), T0 + 5)
    assert resolve(snap, decided, context, T0 + 5) == resolve(snap, decided, ctx(), T0 + 5)
    assert context.solves.hits == 1


async def test_a_table_for_inputs_seen_before_is_not_solved_again() -> None:
    """A task's rank crash faults it (a new table); its recovery brings back the inputs of
    the table before, whose plans are still cached: that build solves nothing. Equal
    assignments are one object across the tables of a basis."""
    snap = cluster()
    crashed = snap.apply(
        incidents=[
            Incident(
                incident_id="i1",
                task_id="b",
                node="n4",
                rank=3,
                status=ErrorStatus.EXITED_ABNORMALLY,
                severity=Severity.SEV2,
                rule="exit",
                evidence="rank 3 killed",
                opened_s=T0,
            )
        ]
    )
    context = ctx()
    lookup = Lookup(cast(Core, SimpleNamespace(ctx=context, committed=snap)), min_nodes=0)
    try:
        await lookup._build(snap, structure(snap))
        lookup.core = cast(Core, SimpleNamespace(ctx=context, committed=crashed))
        await lookup._build(crashed, structure(crashed))
        lookup.core = cast(Core, SimpleNamespace(ctx=context, committed=snap))
        await lookup._build(snap, structure(snap))  # recovered: the first table's inputs
    finally:
        assert lookup._pool is not None
        lookup._pool.shutdown(wait=True)
    # The crashed table: b's own failure and a spare's are the first table's b failure
    # (b faulted, one node less), so 2 of its 4 were cached; the recovered table: all 4.
    assert (lookup.builds, lookup.solved, lookup.reused) == (3, 4 + 2 + 0, 0 + 2 + 4)
    assignments = [a for _key, (_basis, plan) in context.solves._plans.items() for a in plan.assignments]
    assert len({id(a) for a in assignments}) == len(set(assignments))


async def test_the_lookup_builds_after_a_change_and_leaves_no_worker_when_cancelled() -> None:
    snap = cluster()
    context = ctx()
    lookup = Lookup(cast(Core, SimpleNamespace(ctx=context, committed=snap)), min_nodes=0)
    running = asyncio.create_task(lookup.run())
    lookup.follow(snap, snap, Decision())
    deadline = time.monotonic() + 60
    while lookup.builds == 0:
        assert time.monotonic() < deadline and not running.done(), "no build"
        await asyncio.sleep(0.05)
    assert lookup._pool is not None
    workers = [p.pid for p in (lookup._pool._processes or {}).values()]
    lookup.follow(snap, snap, Decision())  # the same inputs: nothing to build again
    await asyncio.sleep(1.0)
    assert lookup.builds == 1
    running.cancel()
    await asyncio.wait_for(asyncio.gather(running, return_exceptions=True), 5)
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"worker(s) {workers} still running"
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_curves_kept_between_solves_give_the_plans_solved_afresh() -> None:
    """The lookup's workers keep each task's curve from solve to solve (unicornd.replan.solve's
    memo). One memo across two bases whose calibrations differ (task a measured twice as slow
    as the model, then as fast): every one-step plan equals the plan solved without it, so a
    curve of another calibration is never taken."""
    gpu = gpu_spec("a100-80g").name
    memo: CurveMemo = {}
    c = ctx()
    for iteration_s in (50.0, 0.01):
        cal = measured(gpu, iteration_s)
        snap = replace(cluster(), calibration=cal).apply(plan_basis=PlanBasis(cal, T0))
        for tid, hyp in one_step_snapshots(snap):
            inputs = solve_inputs(hyp, c, T0)
            assert inputs is not None and inputs.efficiency, "calibrated inputs"
            assert solve(inputs, c, memo) == solve(inputs, c), (iteration_s, tid)
    assert 0 < len(memo) <= 2 * len(cluster().tasks)


async def test_a_build_on_two_workers_caches_the_plans_a_solve_here_would() -> None:
    """Chunks go to every worker at once; the table is the one :func:`warm` solves in place."""
    tasks = [task(f"t{i}", i + 1, [f"n{2 * i + 1}", f"n{2 * i + 2}"]) for i in range(9)]
    snap = world(20, tasks, Policy(max_drain_fraction=1.0))
    snap = snap.apply(plan_basis=PlanBasis(snap.calibration, T0))
    here, there = ctx(), ctx()
    assert warm(snap, here, T0) == 10  # 9 tasks and a spare: 3 chunks
    lookup = Lookup(cast(Core, SimpleNamespace(ctx=there, committed=snap)), min_nodes=0, workers=2)
    try:
        await lookup._build(snap, structure(snap))
        assert lookup._pool is not None and len(lookup._pool._processes or {}) == 2
    finally:
        assert lookup._pool is not None
        lookup._pool.shutdown(wait=True)
    assert lookup.builds == 1 and lookup.solved == 10
    assert dict(there.solves._plans) == dict(here.solves._plans)
