"""The simulator: conservation, determinism, hand-computed losses, and the policies' rules."""

from __future__ import annotations

import itertools
import math

import pytest

from plan.baselines import Baseline
from plan.hardware import gpu_spec
from plan.planner import PlanRequest, plan_cluster, waf_of
from plan.sim.costs import MEASURED, MegatronCosts, UnicornCosts
from plan.sim.engine import Cause, SimResult, node_bound_wtflop, simulate
from plan.sim.policies import (
    DEFAULT_POLICY_NAMES,
    POLICY_NAMES,
    MegatronPolicy,
    UnicornPolicy,
    Workload,
    build_workload,
    make_policy,
    planned_allocation,
)
from plan.sim.report import ratios, run_policies
from plan.sim.state import (
    TRANSITIONS,
    Action,
    Notice,
    Phase,
    Snapshot,
    TaskDecision,
    TaskView,
    check_transition,
)
from plan.sim.trace import (
    DAY_S,
    HOUR_S,
    TRACE_A,
    TRACE_B,
    EventKind,
    Trace,
    TraceEvent,
    TraceSpec,
    generate_trace,
)
from unicorn_core.errors import InvalidArgument
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import load_tasks

A100 = gpu_spec("a100-80g")


def workload(case: int, nodes: int = 16) -> Workload:
    return build_workload(load_tasks(etc_dir() / "tasks" / "cases" / f"case{case}.toml"), nodes, 8, A100)


CASE5 = workload(5)


def quiet(days: float, nodes: int = 16) -> Trace:
    return Trace("quiet", nodes, days * DAY_S, ())


def lost(result: SimResult) -> float:
    return sum(result.lost_wtflop.values())


def test_every_phase_pair_is_allowed_or_rejected() -> None:
    for old, new in itertools.product(Phase, Phase):
        if new in TRANSITIONS[old]:
            check_transition("t", old, new)
        else:
            with pytest.raises(InvalidArgument, match=f"{old.value} -> {new.value}"):
                check_transition("t", old, new)
    assert Phase.DETECTING not in TRANSITIONS[Phase.WAITING]  # nothing runs, nothing hangs


@pytest.mark.parametrize("case", [1, 2, 3, 4, 5])
def test_without_failures_every_policy_earns_its_own_plan_below_the_ideal(case: int) -> None:
    work = workload(case)
    trace = quiet(3)
    results = run_policies(trace, work, POLICY_NAMES)
    ideal = waf_of(work.curves, planned_allocation(work, 16))
    for name, r in results.items():
        assert r.ideal_waf_tflops == pytest.approx(ideal, rel=1e-12), name
        assert r.accumulated_wtflop == pytest.approx(r.own_waf_tflops * trace.duration_s, rel=1e-12), name
        steady = (ideal - r.own_waf_tflops) * trace.duration_s
        assert r.lost_wtflop[Cause.STEADY_STATE] == pytest.approx(steady, abs=1e-6 * ideal * trace.duration_s)
        assert lost(r) == pytest.approx(steady, abs=1e-6 * ideal * trace.duration_s), name
        assert 0 < r.fraction_of_ideal <= 1.0, name
    # unicorn pays its memory snapshots: no free checkpoints, even without failures
    assert 0.99 < results["unicorn"].fraction_of_ideal < 1.0
    for b in Baseline:
        assert results["unicorn"].accumulated_wtflop >= 0.99 * results[b.value].accumulated_wtflop


@pytest.mark.parametrize("spec", [TRACE_A, TRACE_B], ids=lambda s: s.name)
def test_losses_by_cause_add_up_to_the_gap(spec: TraceSpec) -> None:
    trace = generate_trace(spec, 3)
    for r in run_policies(trace, CASE5, POLICY_NAMES).values():
        assert r.accumulated_wtflop + lost(r) == pytest.approx(r.ideal_wtflop, rel=1e-9), r.policy
        assert all(v >= -1e-6 * r.ideal_wtflop for v in r.lost_wtflop.values()), r.policy
        assert 0 < r.accumulated_wtflop < r.ideal_wtflop


def test_same_seed_same_result() -> None:
    one = run_policies(generate_trace(TRACE_B, 5), CASE5, POLICY_NAMES)
    two = run_policies(generate_trace(TRACE_B, 5), CASE5, POLICY_NAMES)
    assert one == two
    other = run_policies(generate_trace(TRACE_B, 6), CASE5, POLICY_NAMES)
    assert one["unicorn"].accumulated_wtflop != other["unicorn"].accumulated_wtflop


def single(kind: EventKind, at_s: float, node: int, back_s: float | None, days: float = 4) -> Trace:
    events = [TraceEvent(at_s, kind, node)]
    if back_s is not None:
        events.append(TraceEvent(back_s, EventKind.NODE_RETURN, node))
    return Trace("single", 16, days * DAY_S, tuple(events))


def test_megatron_restarts_on_the_nodes_left_at_a_lower_dp_then_grows_back() -> None:
    costs = MegatronCosts()
    policy = make_policy("megatron", CASE5, megatron=costs)
    assert isinstance(policy, MegatronPolicy)
    alloc = planned_allocation(CASE5, 16)
    assert sum(alloc) == 16 and alloc[0] == 8  # no spare; node 0 belongs to the first task
    first = policy.initial(16)[0]
    full, shrunk = policy.config(0, 8), policy.config(0, 7)
    assert full is not None and shrunk is not None and full.layout is not None and shrunk.layout is not None
    # fixed TP/PP: 7 nodes take DP 16 on 4 of them (DP 28 does not divide the batch)
    assert (shrunk.layout.tp, shrunk.layout.pp) == (full.layout.tp, full.layout.pp)
    assert shrunk.layout.dp < full.layout.dp and shrunk.nodes == 4
    f8 = first.waf_tflops
    f4 = policy._start(0, shrunk, 0.0).waf_tflops
    assert f8 is not None and f4 is not None and 0 < f4 < f8
    model = CASE5.tasks[0].model
    fail_s, repair_s = 10 * HOUR_S + 7 * 60, 2 * DAY_S
    r = simulate(single(EventKind.SEV1, fail_s, 0, fail_s + repair_s), CASE5, policy)
    debt = f8 * (fail_s % first.checkpoint_interval_s)
    grow_s = costs.restart_s + costs.save_s(model, 4 * 8)
    assert r.lost_wtflop[Cause.DETECTION] == pytest.approx(f8 * costs.detection_s)
    assert r.lost_wtflop[Cause.TRANSITION] == pytest.approx(f4 * costs.restart_s + debt + f8 * grow_s)
    assert r.lost_wtflop[Cause.SUB_HEALTHY] == pytest.approx((f8 - f4) * (repair_s - costs.detection_s))


def test_megatron_takes_a_spare_node_instead_of_shrinking() -> None:
    costs = MegatronCosts()
    policy = make_policy("megatron", CASE5, megatron=costs, spare_nodes=1)
    first = policy.initial(16)[0]
    assert first.waf_tflops is not None
    f = first.waf_tflops
    fail_s = 3 * HOUR_S + 100
    r = simulate(single(EventKind.SEV1, fail_s, 0, None), CASE5, policy)
    assert r.lost_wtflop[Cause.SUB_HEALTHY] == pytest.approx(0.0, abs=1e-6)
    failures = f * (costs.detection_s + costs.restart_s + fail_s % first.checkpoint_interval_s)
    assert lost(r) - r.lost_wtflop[Cause.STEADY_STATE] == pytest.approx(failures)


def test_unicorn_sev2_restarts_in_place_from_memory_at_measured_costs() -> None:
    costs = UnicornCosts()
    policy = make_policy("unicorn", CASE5)
    first = policy.initial(16)[0]
    assert first.waf_tflops is not None and first.jit_interval_s is not None
    f = first.waf_tflops
    iteration_s = CASE5.iteration_s(0, 8)
    assert first.jit_interval_s == iteration_s  # just-in-time saves: a process fault loses the iteration
    assert f < CASE5.waf(0, 8)  # the snapshots stall training
    fail_s = 5 * HOUR_S + 12.3
    r = simulate(single(EventKind.SEV2, fail_s, 0, None, days=1), CASE5, policy)
    assert r.lost_wtflop[Cause.DETECTION] == pytest.approx(f * MEASURED.detect_process_exit_s)
    restart_s = MEASURED.restart_in_place_s + costs.restore_s(CASE5.tasks[0].model, 64)
    assert r.lost_wtflop[Cause.TRANSITION] == pytest.approx(f * (restart_s + fail_s % iteration_s))
    assert r.lost_wtflop[Cause.SUB_HEALTHY] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("copied", [False, True])  # the last snapshot's copy complete at the loss
def test_a_lost_node_falls_back_to_the_last_snapshot_its_peer_holds(copied: bool) -> None:
    policy = make_policy("per-task", CASE5)  # unicorn's own starts; only the task hit moves
    first = policy.initial(16)[0]
    assert first.waf_tflops is not None
    interval, lag = first.checkpoint_interval_s, first.checkpoint_lag_s
    assert 0 < lag < interval
    offset = (lag + interval) / 2 if copied else lag / 2
    fail_s = 40 * interval + offset
    r = simulate(single(EventKind.SEV1, fail_s, 0, None, days=1), CASE5, policy)
    # within ``lag`` of a snapshot its copy is not complete: the one before it is used
    lost_s = offset if copied else interval + offset
    k = 6  # per-task runs the 7 nodes left as the best count within them
    again = UnicornPolicy(CASE5).start(0, k, UnicornPolicy(CASE5).relaunch_s(0, k))
    assert again.waf_tflops is not None
    transition = again.waf_tflops * again.downtime_s + first.waf_tflops * lost_s
    assert r.lost_wtflop[Cause.TRANSITION] == pytest.approx(transition)
    assert r.lost_wtflop[Cause.DETECTION] == pytest.approx(first.waf_tflops * MEASURED.detect_node_loss_s)


def view(name: str, workers: int, held: int | None = None, phase: Phase = Phase.RUNNING) -> TaskView:
    return TaskView(name, phase, workers, workers if held is None else held, None)


def test_unicorn_replans_the_whole_cluster_with_the_planner_on_sev1() -> None:
    alloc = planned_allocation(CASE5, 16)
    names = CASE5.names
    views = tuple(view(n, k) for n, k in zip(names, alloc, strict=True))
    views = (view(names[0], alloc[0], alloc[0] - 1, Phase.DETECTING), *views[1:])
    snap = Snapshot(100.0, 16, 15, 0, views)
    policy = UnicornPolicy(CASE5)
    decision = policy.on_event(snap, Notice(EventKind.SEV1, 0, names[0]), 100.0)
    request = PlanRequest(alloc, frozenset({names[0]}), policy.failure, policy.transition)
    expected = plan_cluster(CASE5.curves, CASE5.cluster.with_nodes(15), request).allocation
    assert tuple(d.nodes for d in decision) == expected
    for d, k, now in zip(decision, expected, alloc, strict=True):
        assert (d.action is Action.KEEP) == (k == now and d is not decision[0])
    assert decision[0].action is Action.RESTART


def test_sev2_on_a_task_that_lost_a_node_escalates_to_a_replan() -> None:
    alloc = planned_allocation(CASE5, 16)
    names = CASE5.names
    rest = (view(n, k) for n, k in zip(names[1:], alloc[1:], strict=True))
    views = (view(names[0], alloc[0], alloc[0] - 1, Phase.DETECTING), *rest)
    snap = Snapshot(0.0, 16, 15, 0, views)
    policy = UnicornPolicy(CASE5)
    decision = policy.on_event(snap, Notice(EventKind.SEV2, 3, names[0]), 0.0)
    assert decision == policy.replan(snap, 0)  # not an in-place restart on 7 of 8 nodes
    assert sum(d.nodes for d in decision) <= 15
    assert any(d.nodes != k for d, k in zip(decision[1:], alloc[1:], strict=True))


def test_per_task_gives_a_returning_node_to_the_first_task_that_lost_one() -> None:
    policy = make_policy("per-task", CASE5)
    alloc = planned_allocation(CASE5, 16)
    names = CASE5.names
    # task 3 lost a node first, task 0 later; both run smaller; one node comes back
    views = (
        TaskView(names[0], Phase.RUNNING, alloc[0] - 2, alloc[0] - 2, 50.0),
        view(names[1], alloc[1]),
        view(names[2], alloc[2]),
        TaskView(names[3], Phase.RUNNING, alloc[3] - 1, alloc[3] - 1, 10.0),
        view(names[4], alloc[4]),
    )
    snap = Snapshot(60.0, 16, 14, 14 - sum(v.held for v in views), views)
    decision = policy.on_event(snap, Notice(EventKind.NODE_RETURN, 5, None), 60.0)
    unicorn = UnicornPolicy(CASE5)
    assert decision[3] == unicorn.start(3, alloc[3], unicorn.relaunch_s(3, alloc[3]))
    assert decision[3].action is Action.RESTART
    assert all(d.action is Action.KEEP for i, d in enumerate(decision) if i != 3)


def test_a_policy_that_overcommits_nodes_is_rejected() -> None:
    class Greedy(MegatronPolicy):
        def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> tuple[TaskDecision, ...]:
            return tuple(TaskDecision(v.held + 1, Action.RESTART) for v in snapshot.tasks)

    policy = Greedy("greedy", CASE5, planned_allocation(CASE5, 16))
    with pytest.raises(InvalidArgument, match="healthy nodes"):
        simulate(single(EventKind.SEV2, 10.0, 0, None), CASE5, policy)


def test_unknown_policy_and_bad_spares() -> None:
    with pytest.raises(InvalidArgument, match="known: unicorn"):
        make_policy("nonesuch", CASE5)
    with pytest.raises(InvalidArgument, match="spare nodes"):
        make_policy("megatron", CASE5, spare_nodes=16)
    with pytest.raises(InvalidArgument, match="16 nodes"):
        simulate(quiet(1, nodes=16), workload(5, nodes=8), make_policy("unicorn", workload(5, nodes=8)))


@pytest.mark.parametrize("spec", [TRACE_A, TRACE_B], ids=lambda s: s.name)
def test_unicorn_beats_every_baseline_and_nobody_passes_the_node_bound(spec: TraceSpec) -> None:
    trace = generate_trace(spec, 0)
    results = run_policies(trace, CASE5, DEFAULT_POLICY_NAMES)
    rel = ratios(results)
    assert rel["megatron"] == 1.0 and math.isfinite(rel["unicorn"])
    assert all(rel["unicorn"] > rel[p] for p in DEFAULT_POLICY_NAMES if p != "unicorn")
    bound = node_bound_wtflop(trace, CASE5)
    for r in results.values():
        assert r.accumulated_wtflop <= bound
    assert results["unicorn"].accumulated_wtflop > 0.99 * bound
