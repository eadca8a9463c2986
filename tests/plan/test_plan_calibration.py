"""Calibration math (issue 21, item 2): bounded running means, shrinkage towards the analytic
model, calibrated layout choice and allocation, transition time and node MTBF."""

from __future__ import annotations

import math

import pytest

from plan.calibration import (
    Efficiency,
    LayoutTiming,
    Running,
    calibrated_table,
    efficiency,
    node_mtbf_h,
    observe,
    shrink,
    transition_s,
)
from plan.hardware import gpu_spec
from plan.perf import layout_table
from plan.planner import Cluster, Granularity, plan_cluster, task_curves
from unicorn_core.errors import InvalidArgument
from unicorn_core.model import ModelSpec
from unicorn_core.taskspec import TaskSpec

A100 = gpu_spec("a100-80g")
GPN = 2
MODEL = ModelSpec(layers=4, hidden=256, heads=4, sequence=128, vocabulary=1000, global_batch=240)


def measured(value: float, n: int, window: float = 1000.0) -> Running:
    est = None
    for _ in range(n):
        est = observe(est, value, 1.0, window)
    assert est is not None
    return est


def test_a_running_mean_is_exact_up_to_its_window_then_exponentially_weighted() -> None:
    est = None
    for v in (1.0, 2.0, 3.0, 4.0):
        est = observe(est, v, 1.0, 10.0)
    assert est == Running(2.5, 4.0, 4)
    assert observe(est, 10.0, 2.0, 10.0).mean == pytest.approx((1 + 2 + 3 + 4 + 2 * 10) / 6)
    full = measured(1.0, 10, window=10.0)
    after = observe(full, 11.0, 1.0, 10.0)  # past the window: weighs 1/10, memory stays bounded
    assert after.samples == 10.0 and after.mean == pytest.approx(2.0) and after.count == 11
    assert observe(full, 5.0, 50.0, 10.0).mean == 5.0  # a report heavier than the window replaces it
    with pytest.raises(InvalidArgument):
        observe(None, -1.0, 1.0, 10.0)
    with pytest.raises(InvalidArgument):
        observe(None, 1.0, 0.0, 10.0)


def test_shrinkage_is_the_prior_without_data_and_weighs_it_as_samples() -> None:
    assert shrink(60.0, 1.0, None) == 60.0
    assert shrink(60.0, 1.0, Running(30.0, 1.0)) == 45.0
    assert shrink(60.0, 0.0, Running(30.0, 1.0)) == 30.0
    assert transition_s(60.0, 3.0, Running(20.0, 1.0)) == 50.0


def test_a_measured_layout_moves_towards_measured_and_the_rest_of_the_model_follows() -> None:
    table = layout_table(MODEL, A100, GPN)
    best4 = table.best[4]
    slow = LayoutTiming(best4.layout, measured(2 * best4.iteration_s, 200))
    eff = efficiency(MODEL, A100, GPN, [slow], prior_samples=20.0)
    # (20 x 1.0 + 200 x 0.5) / 220: most of the way from the model to the measurement
    assert eff.of(best4.layout) == pytest.approx(120 / 220)
    assert eff.pooled == pytest.approx(120 / 220)  # a layout never measured borrows the pool
    few = efficiency(
        MODEL, A100, GPN, [LayoutTiming(best4.layout, measured(2 * best4.iteration_s, 2))], prior_samples=20.0
    )
    assert few.of(best4.layout) == pytest.approx(21 / 22)  # two iterations barely move it
    assert efficiency(MODEL, A100, GPN, [], prior_samples=20.0).trivial
    calibrated = calibrated_table(table, eff)
    assert calibrated.best[4].iteration_s == pytest.approx(best4.iteration_s * 220 / 120)
    assert calibrated.best[4].tflops == pytest.approx(best4.tflops * 120 / 220)


def test_a_slow_measured_layout_gives_way_to_one_measured_as_predicted() -> None:
    table = layout_table(MODEL, A100, GPN)
    first, second = table.ranked[4][:2]
    assert first.layout == table.best[4].layout
    timings = [
        LayoutTiming(first.layout, measured(2 * first.iteration_s, 200)),
        LayoutTiming(second.layout, measured(second.iteration_s, 200)),
    ]
    eff = efficiency(MODEL, A100, GPN, timings, prior_samples=20.0)
    assert eff.of(second.layout) > 0.9 > 0.6 > eff.of(first.layout)
    assert calibrated_table(table, eff).best[4].layout == second.layout
    assert calibrated_table(table, Efficiency()) is table


def test_a_task_measured_twice_as_slow_gets_fewer_nodes() -> None:
    cluster = Cluster(4, GPN, A100, Granularity.NODE)
    tasks = (TaskSpec("a", MODEL, weight=1.5), TaskSpec("b", MODEL))
    before = plan_cluster(task_curves(tasks, cluster, cluster.workers), cluster)
    assert before.workers_by_task() == {"a": 3, "b": 1}  # the heavier task gets more
    layout = layout_table(MODEL, A100, GPN).best[4]
    slow = LayoutTiming(layout.layout, measured(2 * layout.iteration_s, 500))
    eff = efficiency(MODEL, A100, GPN, [slow], prior_samples=20.0)
    curves = task_curves(tasks, cluster, cluster.workers, calibration={"a": eff})
    after = plan_cluster(curves, cluster)
    assert after.workers_by_task() == {"a": 1, "b": 3}
    (a,) = [x for x in after.assignments if x.task == "a"]
    assert a.estimate is not None and a.tflops == pytest.approx(curves[0].tflops[1])


def test_node_mtbf_is_the_prior_shrunk_by_the_failure_history() -> None:
    assert node_mtbf_h(672.0, 2.0, 0, 0.0) == 672.0
    assert node_mtbf_h(24.0, 2.0, 3, 40.0) == pytest.approx((48 + 40) / 5)
    assert node_mtbf_h(24.0, 2.0, 0, 480.0) == pytest.approx(264.0)  # time without failures raises it
    assert math.isinf(node_mtbf_h(24.0, 0.0, 0, 10.0))
    with pytest.raises(InvalidArgument):
        node_mtbf_h(0.0, 2.0, 0, 0.0)
