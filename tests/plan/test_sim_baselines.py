"""The baselines Unicron compares with, each on a tiny scripted trace, and the ideal they face."""

from __future__ import annotations

import math

import pytest

from plan.hardware import gpu_spec
from plan.planner import plan_cluster, waf_of
from plan.sim.costs import MEASURED, ElasticCosts, UnicornCosts, checkpoint_gib_per_gpu
from plan.sim.elastic import BambooPolicy, OobleckPolicy, VarunaPolicy
from plan.sim.engine import Cause, node_bound_wtflop, simulate
from plan.sim.policies import DEFAULT_POLICY_NAMES, build_workload, make_policy, planned_allocation
from plan.sim.report import run_policies, summary_json
from plan.sim.state import Action, Notice, Phase, Snapshot, TaskView
from plan.sim.systems import oobleck_n0, varuna_curve
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
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import load_tasks

A100 = gpu_spec("a100-80g")
CASE5_TASKS = load_tasks(etc_dir() / "tasks" / "cases" / "case5.toml")
CASE5 = build_workload(CASE5_TASKS, 16, 8, A100)
PAIR = build_workload(CASE5_TASKS[3:4], 2, 8, A100)  # one 7B task on a redundant pair of nodes


def sev1(at_s: float, node: int, nodes: int = 16, days: float = 2) -> Trace:
    return Trace("scripted", nodes, days * DAY_S, (TraceEvent(at_s, EventKind.SEV1, node),))


def rate(decision_waf: float | None) -> float:
    assert decision_waf is not None
    return decision_waf


def test_bamboo_keeps_running_through_one_failure_in_a_redundant_pair() -> None:
    policy = make_policy("bamboo", PAIR)
    assert isinstance(policy, BambooPolicy)
    first = policy.initial(2)[0]
    assert first.nodes == 2 and first.config == (2, 0)
    cfg = policy.config(0, 2)
    assert cfg is not None and cfg.layout is not None and cfg.layout.tp == 1 and cfg.layout.pp >= 2
    assert 0 < cfg.failover_tflops < cfg.tflops
    f2 = rate(first.waf_tflops)
    f1 = PAIR.tasks[0].weight * cfg.failover_tflops
    fail_s, days = 3 * HOUR_S + 17.0, 1.0
    r = simulate(sev1(fail_s, 1, nodes=2, days=days), PAIR, policy)
    pause = MEASURED.restart_in_place_s
    # the survivor runs its lost successor's stage from its redundant copy: no rollback,
    # only the iteration in flight is redone
    assert r.lost_wtflop[Cause.DETECTION] == pytest.approx(f2 * MEASURED.detect_node_loss_s)
    assert r.lost_wtflop[Cause.TRANSITION] == pytest.approx(f1 * pause + f2 * (fail_s % cfg.iteration_s))
    after = days * DAY_S - fail_s - MEASURED.detect_node_loss_s
    assert r.lost_wtflop[Cause.SUB_HEALTHY] == pytest.approx((f2 - f1) * after)
    assert r.accumulated_wtflop > f1 * after  # it kept training on the one node left


def test_bamboo_reconfigures_on_a_second_loss_and_when_that_is_worth_more() -> None:
    policy = make_policy("bamboo", CASE5)
    assert isinstance(policy, BambooPolicy)
    alloc = policy.allocation
    names = CASE5.names
    views = [TaskView(n, Phase.RUNNING, k, k, None, (k, 0)) for n, k in zip(names, alloc, strict=True)]
    hit = views[0]
    lost_one = TaskView(hit.name, Phase.DETECTING, hit.workers, hit.workers - 1, 10.0, hit.config)
    snap = Snapshot(10.0, 16, 15, 0, (lost_one, *views[1:]))
    decision = policy.on_event(snap, Notice(EventKind.SEV1, 0, hit.name), 10.0)[0]
    # days until the next expected failure: re-forming the pipelines on the nodes left
    # earns more than running a stage twice
    assert decision.nodes == hit.workers - 1 and decision.config == (hit.workers - 1, 0)
    in_failover = TaskView(
        hit.name, Phase.DETECTING, hit.workers - 1, hit.workers - 2, 20.0, (hit.workers, 1)
    )
    snap = Snapshot(20.0, 16, 14, 0, (in_failover, *views[1:]))
    assert policy.failover(0, in_failover) is None  # no redundant copy is left for the stage
    again = policy.on_event(snap, Notice(EventKind.SEV1, 1, hit.name), 20.0)[0]
    assert again.config[1:] == (0,)


def test_varuna_morphs_to_the_nodes_left_and_restarts_from_its_checkpoint() -> None:
    policy = make_policy("varuna", CASE5)
    assert isinstance(policy, VarunaPolicy)
    k = policy.allocation[0]
    first = policy.initial(16)[0]
    f_full = rate(first.waf_tflops)
    fail_s = 9 * HOUR_S + 123.0
    r = simulate(sev1(fail_s, 0), CASE5, policy)
    curve = varuna_curve(CASE5.tasks[0].model, A100, 8, 16)
    cfg = curve[k - 1]
    assert cfg is not None and cfg.layout is not None and cfg.layout.tp == 1  # no tensor parallelism
    morphed = policy.start(0, cfg, 0.0, planned=False)
    assert morphed.nodes == k - 1
    f_less = rate(morphed.waf_tflops)
    model = CASE5.tasks[0].model
    downtime = MEASURED.relaunch_s + checkpoint_gib_per_gpu(model, cfg.gpus) * MEASURED.load_s_per_gib
    debt = f_full * (fail_s % first.checkpoint_interval_s)  # back to the last persistent checkpoint
    assert first.checkpoint_interval_s >= ElasticCosts().varuna_checkpoint_interval_s
    assert r.lost_wtflop[Cause.TRANSITION] == pytest.approx(f_less * downtime + debt)
    assert r.lost_wtflop[Cause.DETECTION] == pytest.approx(f_full * MEASURED.detect_node_loss_s)


def test_oobleck_instantiates_its_templates_on_the_nodes_left() -> None:
    policy = make_policy("oobleck", CASE5)
    assert isinstance(policy, OobleckPolicy)
    f = ElasticCosts().oobleck_f
    k = policy.allocation[0]
    first = policy.initial(16)[0]
    assert len(first.config) >= f + 1 and sum(first.config) == k
    n0 = oobleck_n0(CASE5.tasks[0].model, A100, 8, f, k)
    assert n0 is not None
    fail_s = 4 * HOUR_S + 55.5
    r = simulate(sev1(fail_s, 0), CASE5, policy)
    cfg = policy.config(0, k - 1)
    assert cfg is not None and sum(cfg.pipelines) == k - 1 and len(cfg.pipelines) >= f + 1
    assert all(n0 <= p <= k - f * n0 for p in cfg.pipelines)  # only pre-generated templates
    again = policy.start(0, cfg, 0.0, planned=False)
    downtime = MEASURED.relaunch_s + ElasticCosts().state_copy_s(CASE5.tasks[0].model, cfg.gpus)
    # the state comes from the other pipelines: only the iteration in flight is redone
    assert first.checkpoint_interval_s == pytest.approx(policy.config(0, k).iteration_s)  # type: ignore[union-attr]
    in_flight = rate(first.waf_tflops) * (fail_s % first.checkpoint_interval_s)
    assert r.lost_wtflop[Cause.TRANSITION] == pytest.approx(rate(again.waf_tflops) * downtime + in_flight)


def test_oobleck_cannot_run_below_f_plus_one_pipelines() -> None:
    policy = make_policy("oobleck", PAIR)
    assert policy.initial(2)[0].config == (1, 1)  # two one-node pipelines
    r = simulate(sev1(HOUR_S, 1, nodes=2, days=1), PAIR, policy)
    view = TaskView(PAIR.names[0], Phase.DETECTING, 2, 1, 0.0, (1, 1))
    decision = policy.on_event(Snapshot(0.0, 2, 1, 0, (view,)), Notice(EventKind.SEV1, 1, view.name), 0.0)
    assert decision[0].action is Action.WAIT
    assert r.accumulated_wtflop == pytest.approx(r.own_waf_tflops * HOUR_S)  # nothing after the loss


def test_the_ideal_is_the_best_failure_free_plan_and_nobody_passes_it() -> None:
    ideal = plan_cluster(CASE5.curves, CASE5.cluster).total_waf_tflops
    assert ideal == pytest.approx(waf_of(CASE5.curves, planned_allocation(CASE5, 16)))
    assert CASE5.ideal_waf() == ideal
    for spec in (TRACE_A, TRACE_B):
        trace = generate_trace(spec, 1)
        bound = node_bound_wtflop(trace, CASE5) / (ideal * trace.duration_s)
        assert bound < 1.0
        for name, r in run_policies(trace, CASE5, DEFAULT_POLICY_NAMES).items():
            assert r.ideal_waf_tflops == ideal, name
            assert 0 < r.fraction_of_ideal <= bound + 1e-12, name
            assert r.fraction_of_ideal == r.accumulated_wtflop / (ideal * trace.duration_s)


def test_summary_reports_every_policy_against_the_ideal_and_unicorn_against_each() -> None:
    trace = generate_trace(TRACE_B, 2)
    results = run_policies(trace, CASE5, DEFAULT_POLICY_NAMES)
    out = summary_json(trace, results, CASE5)
    policies = out["policies"]
    assert isinstance(policies, dict) and set(policies) == set(DEFAULT_POLICY_NAMES)
    for name, entry in policies.items():
        assert isinstance(entry, dict)
        assert entry["fraction_of_ideal"] == round(results[name].fraction_of_ideal, 4)
        share = entry["lost_share"]
        assert isinstance(share, dict)
        assert sum(v for v in share.values() if isinstance(v, float)) == pytest.approx(
            1 - results[name].fraction_of_ideal, abs=1e-3
        )
    vs = out["unicorn_vs"]
    assert isinstance(vs, dict) and set(vs) == set(DEFAULT_POLICY_NAMES) - {"unicorn"}
    info = out["trace"]
    assert isinstance(info, dict) and 0.9 < float(str(info["node_bound_fraction"])) < 1.0


def test_every_policy_pays_measured_detection_except_megatron_which_hangs() -> None:
    unicorn = make_policy("unicorn", CASE5)
    assert unicorn.detection_s(EventKind.SEV1) == MEASURED.detect_node_loss_s == 1.33
    assert unicorn.detection_s(EventKind.SEV2) == MEASURED.detect_process_exit_s
    assert unicorn.detection_s(EventKind.SEV3) == MEASURED.detect_exception_s
    for name in ("oobleck", "varuna", "bamboo", "per-task"):
        policy = make_policy(name, CASE5)
        assert all(policy.detection_s(k) == unicorn.detection_s(k) for k in EventKind), name
    assert make_policy("megatron", CASE5).detection_s(EventKind.SEV3) == 30 * 60


def test_young_daly_snapshot_interval() -> None:
    costs = UnicornCosts(snapshot_every=None)
    model = CASE5.tasks[0].model
    stall = costs.snapshot_stall_s(model, 64)
    assert stall == pytest.approx(checkpoint_gib_per_gpu(model, 64) * MEASURED.snapshot_s_per_gib)
    mtbf = 30 * DAY_S
    assert costs.snapshot_interval_s(model, 64, 1.0, mtbf) == pytest.approx(math.sqrt(2 * stall * mtbf))
    assert costs.snapshot_interval_s(model, 64, 1e9, mtbf) == 1e9  # never more often than an iteration
    assert UnicornCosts().snapshot_interval_s(model, 64, 2.0, mtbf) == 20.0  # [ckpt] snapshot_every = 10


@pytest.mark.parametrize("spec", [TRACE_A, TRACE_B], ids=lambda s: s.name)
def test_unicorn_is_closest_to_the_ideal(spec: TraceSpec) -> None:
    results = run_policies(generate_trace(spec, 4), CASE5, DEFAULT_POLICY_NAMES)
    best = max(results.values(), key=lambda r: r.accumulated_wtflop)
    assert best.policy == "unicorn"
