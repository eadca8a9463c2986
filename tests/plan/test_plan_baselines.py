"""Static baselines: shares trimmed to a usable layout, then the idle workers handed out."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from plan.baselines import Baseline, baseline_allocation, baseline_shares, best_within, hand_out_leftovers
from plan.hardware import gpu_spec
from plan.planner import Cluster, Granularity, plan_cluster, task_curves, waf_of
from unicorn_core.errors import InvalidArgument
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import load_tasks

A100 = gpu_spec("a100-80g")
CASES = etc_dir() / "tasks" / "cases"


def best_extras_brute_force(wafs: list[np.ndarray], floors: tuple[int, ...], idle: int) -> float:
    best = 0.0
    for extra in itertools.product(range(idle + 1), repeat=len(wafs)):
        if sum(extra) <= idle:
            total = sum(float(w[best_within(w, k + e)]) for w, k, e in zip(wafs, floors, extra, strict=True))
            best = max(best, total)
    return best


def test_idle_workers_go_where_they_add_most() -> None:
    # task 0 runs on 1, 2 or 4 workers; task 1 on 1 or 3; 2 idle workers after the shares
    wafs = [np.array([0.0, 1.0, 2.0, 0.0, 5.0]), np.array([0.0, 1.0, 0.0, 2.5, 0.0])]
    assert hand_out_leftovers(wafs, (2, 1), 5) == (4, 1)  # +3 for task 0 beats +1.5 for task 1
    assert hand_out_leftovers(wafs, (1, 1), 4) == (1, 3)  # 1 -> 3 on task 1 (+1.5) beats 1 -> 2 (+1)
    assert hand_out_leftovers(wafs, (2, 1), 3) == (2, 1)  # nothing idle
    # a worker no task can use stays idle
    assert hand_out_leftovers([np.array([0.0, 1.0, 0.0])], (1,), 2) == (1,)


def test_hand_out_is_the_exact_optimum_and_keeps_every_floor() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        m, workers = int(rng.integers(1, 4)), int(rng.integers(1, 9))
        wafs = [rng.random(workers + 1) * (rng.random(workers + 1) < 0.6) for _ in range(m)]
        for w in wafs:
            w[0] = 0.0
        shares = [int(s) for s in rng.multinomial(int(rng.integers(0, workers + 1)), [1 / m] * m)]
        floors = tuple(best_within(w, s) for w, s in zip(wafs, shares, strict=True))
        out = hand_out_leftovers(wafs, floors, workers)
        assert sum(out) <= workers
        assert all(o >= f for o, f in zip(out, floors, strict=True))
        total = sum(float(w[k]) for w, k in zip(wafs, out, strict=True))
        assert total == pytest.approx(best_extras_brute_force(wafs, floors, workers - sum(floors)))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("kind", list(Baseline))
def test_table3_baselines_leave_no_usable_worker_idle(n: int, kind: Baseline) -> None:
    tasks = load_tasks(CASES / f"case{n}.toml")
    cluster = Cluster(16, 8, A100, Granularity.NODE)
    curves = task_curves(tasks, cluster, cluster.workers)
    wafs = [c.waf for c in curves]
    shares = baseline_shares(tasks, cluster.workers, kind)
    trimmed = tuple(best_within(w, s) for w, s in zip(wafs, shares, strict=True))
    alloc = baseline_allocation(tasks, wafs, cluster.workers, kind)
    assert all(a >= t for a, t in zip(alloc, trimmed, strict=True))
    assert waf_of(curves, alloc) >= waf_of(curves, trimmed)
    assert waf_of(curves, alloc) <= plan_cluster(curves, cluster).total_waf_tflops + 1e-9
    # no single idle worker count, given to any one task, would add F
    idle = cluster.workers - sum(alloc)
    for i, w in enumerate(wafs):
        assert w[best_within(w, alloc[i] + idle)] <= w[alloc[i]]


def test_case1_equal_shares_of_7b_tasks_now_match_the_plan() -> None:
    # 16 nodes / 6 tasks: shares of 3 run on 2 (a 7B layout needs 1, 2, 4, 8 or 16 nodes),
    # the 4 nodes left over make two tasks 4-node ones, which is the planner's optimum.
    tasks = load_tasks(CASES / "case1.toml")
    cluster = Cluster(16, 8, A100, Granularity.NODE)
    curves = task_curves(tasks, cluster, cluster.workers)
    alloc = baseline_allocation(tasks, [c.waf for c in curves], cluster.workers, Baseline.EQUALLY)
    assert sorted(alloc) == [2, 2, 2, 2, 4, 4]
    assert waf_of(curves, alloc) == pytest.approx(plan_cluster(curves, cluster).total_waf_tflops)


def test_hand_out_rejects_what_does_not_fit() -> None:
    wafs = [np.array([0.0, 1.0, 2.0])]
    with pytest.raises(InvalidArgument):
        hand_out_leftovers(wafs, (3,), 3)
    with pytest.raises(InvalidArgument):
        hand_out_leftovers(wafs, (2,), 1)
    with pytest.raises(InvalidArgument):
        hand_out_leftovers(wafs, (1, 1), 2)
