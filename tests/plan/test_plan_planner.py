"""Cluster-wide plans: optimal vs baselines on Unicron's Table 3, sanity properties, look-up table."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from plan.baselines import Baseline, apportion, baseline_allocation
from plan.hardware import gpu_spec
from plan.lookup import build_one_step_table, tasks_hit
from plan.planner import Cluster, Granularity, PlanRequest, plan_cluster, task_curves, waf_of
from plan.solver import brute_force
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import TaskSpec, load_task_file, load_tasks

A100 = gpu_spec("a100-80g")
TASKS = etc_dir() / "tasks"
GPT3_7B = load_task_file(TASKS / "gpt3-7b.toml")
GPT3_13B = load_task_file(TASKS / "gpt3-13b.toml")


def case(n: int) -> tuple[TaskSpec, ...]:
    return load_tasks(TASKS / "cases" / f"case{n}.toml")


@pytest.mark.parametrize("granularity", list(Granularity))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_table3_plan_beats_every_baseline(n: int, granularity: Granularity) -> None:
    tasks = case(n)
    cluster = Cluster(16, 8, A100, granularity)
    curves = task_curves(tasks, cluster, cluster.workers)
    plan = plan_cluster(curves, cluster)
    assert plan.total_waf_tflops > 0
    assert sum(a.gpus for a in plan.assignments) <= 128
    for kind in Baseline:
        alloc = baseline_allocation(tasks, [c.waf for c in curves], cluster.workers, kind)
        assert sum(alloc) <= cluster.workers
        assert plan.total_waf_tflops >= waf_of(curves, alloc) - 1e-9, kind


def test_dp_plan_equals_brute_force_on_real_curves() -> None:
    tasks = case(4)[:3]
    cluster = Cluster(6, 8, A100, Granularity.NODE)
    curves = task_curves(tasks, cluster, cluster.workers)
    plan = plan_cluster(curves, cluster)
    running_s = PlanRequest().failure.running_s(6)
    bf = brute_force([c.waf * running_s for c in curves], cluster.workers)
    assert plan.objective_tflop == pytest.approx(bf.objective)


def test_total_waf_never_drops_with_more_nodes() -> None:
    tasks = case(2)
    big = Cluster(24, 8, A100, Granularity.NODE)
    curves = task_curves(tasks, big, big.workers)
    totals = [plan_cluster(curves, big.with_nodes(n)).total_waf_tflops for n in range(25)]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(totals))
    assert totals[0] == 0 and totals[-1] > totals[8] > 0


def test_task_below_requirement_gets_nothing() -> None:
    needy = replace(GPT3_13B, name="needy", min_gpus=64)
    small = replace(GPT3_7B, name="small")
    cluster = Cluster(6, 8, A100, Granularity.NODE)  # 48 GPUs: not enough for needy's 64
    curves = task_curves((needy, small), cluster, cluster.workers)
    assert not np.any(curves[0].waf)
    plan = plan_cluster(curves, cluster)
    needy_a, small_a = plan.assignments
    assert needy_a.workers == 0 and needy_a.waf_tflops == 0 and needy_a.estimate is None
    assert small_a.waf_tflops > 0
    # below min_gpus F is 0 even where a layout fits
    picky = replace(GPT3_7B, name="picky", min_gpus=16)
    (curve,) = task_curves((picky,), cluster, cluster.workers)
    assert curve.tflops[1] > 0 and curve.waf[1] == 0 and curve.waf[2] > 0


@pytest.mark.parametrize("heavy_first", [True, False])
def test_weights_shift_workers_to_heavier_task(heavy_first: bool) -> None:
    heavy = replace(GPT3_7B, name="heavy", weight=2.0)
    light = replace(GPT3_7B, name="light", weight=0.5)
    tasks = (heavy, light) if heavy_first else (light, heavy)
    cluster = Cluster(6, 8, A100, Granularity.NODE)  # 48 GPUs: 32 + 16, no even split exists
    plan = plan_cluster(task_curves(tasks, cluster, cluster.workers), cluster)
    got = plan.workers_by_task()
    assert got["heavy"] > got["light"] > 0
    equal = tuple(replace(t, weight=1.0) for t in tasks)
    assert sum(plan_cluster(task_curves(equal, cluster, cluster.workers), cluster).allocation) == 6


def test_replanning_without_events_changes_nothing() -> None:
    tasks = case(5)
    cluster = Cluster(16, 8, A100, Granularity.NODE)
    curves = task_curves(tasks, cluster, cluster.workers)
    base = plan_cluster(curves, cluster)
    again = plan_cluster(curves, cluster, PlanRequest(current=base.allocation))
    assert again.allocation == base.allocation
    assert not any(a.changed for a in again.assignments)


def test_transition_cost_keeps_current_allocation_when_gain_is_small() -> None:
    tasks = case(1)[:2]
    cluster = Cluster(8, 8, A100, Granularity.NODE)
    curves = task_curves(tasks, cluster, cluster.workers)
    current = (2, 4)  # both feasible, sub-optimal (2 spare nodes)
    cheap = plan_cluster(curves, cluster, PlanRequest(current=current))
    assert cheap.allocation != current  # with the default cost the spare nodes are worth using
    costly = PlanRequest(current=current, transition=replace(PlanRequest().transition, restart_s=1e9))
    assert plan_cluster(curves, cluster, costly).allocation == current


@pytest.mark.parametrize("granularity", list(Granularity))
def test_lookup_table_matches_direct_solves(granularity: Granularity) -> None:
    tasks = case(2)
    cluster = Cluster(16, 8, A100, granularity)
    per_node = 8 // cluster.worker_gpus
    curves = task_curves(tasks, cluster, cluster.workers + per_node)
    base = plan_cluster(curves, cluster)
    table = build_one_step_table(curves, cluster, base)
    assert set(table.node_lost) == {a.task for a in base.assignments if a.workers}
    for name, after in table.node_lost.items():
        direct = plan_cluster(curves, cluster.with_nodes(15), PlanRequest(base.allocation, frozenset({name})))
        assert after.allocation == direct.allocation
        assert sum(a.gpus for a in after.assignments) <= 120
        assert next(a for a in after.assignments if a.task == name).changed
    joined = table.node_joined
    assert joined.total_waf_tflops >= base.total_waf_tflops
    assert sum(a.gpus for a in joined.assignments) <= 136


def test_tasks_hit_takes_spare_nodes_first() -> None:
    tasks = case(1)[:2]
    cluster = Cluster(7, 8, A100, Granularity.NODE)
    base = plan_cluster(task_curves(tasks, cluster, cluster.workers), cluster)
    assert base.spare_workers == 1  # 4 + 2 nodes used
    assert tasks_hit(base, 1, 8) == frozenset()
    assert len(tasks_hit(base, 2, 8)) == 1


def test_apportion() -> None:
    assert apportion([1, 1, 1], 16) == (6, 5, 5)
    assert apportion([0.5, 1.5], 8) == (2, 6)
    assert sum(apportion([1.3, 6.7, 6.7], 17)) == 17
