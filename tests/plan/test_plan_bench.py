"""The planner bench's yardsticks: exhaustive search and the ideal (an upper bound)."""

from __future__ import annotations

import numpy as np
import pytest

from plan.solver import brute_force
from tests.bench_script import load_bench

BENCH = load_bench("planner")


def test_exhaustive_search_tries_every_allocation_and_finds_the_best() -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        workers, m = int(rng.integers(0, 7)), int(rng.integers(1, 4))
        wafs = [rng.random(workers + 1) * (rng.random(workers + 1) < 0.7) for _ in range(m)]
        best, tried = BENCH.exhaustive_best(wafs, workers)
        assert best == pytest.approx(brute_force(wafs, workers).objective)
        assert tried == sum(
            1 for alloc in np.ndindex(*([workers + 1] * m)) if sum(alloc) <= workers
        )  # C(workers + m, m)


def test_ideal_is_an_upper_bound_and_tight_for_concave_curves() -> None:
    rng = np.random.default_rng(6)
    for _ in range(50):
        workers, m = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        wafs = [np.concatenate(([0.0], rng.random(workers) * 10)) for _ in range(m)]
        best, _ = BENCH.exhaustive_best(wafs, workers)
        assert BENCH.ideal_waf(wafs, workers) >= best - 1e-9
    concave = [np.array([0.0, 3.0, 5.0, 6.0]), np.array([0.0, 4.0, 4.5, 4.6])]
    assert BENCH.ideal_waf(concave, 3) == pytest.approx(BENCH.exhaustive_best(concave, 3)[0])  # 4 + 3 + 2
    # holes are bridged: 0 -> 4 workers at 2 per worker, half of it used
    assert BENCH.ideal_waf([np.array([0.0, 0.0, 0.0, 0.0, 8.0])], 2) == pytest.approx(4.0)


def test_table3_case_reports_the_plan_against_every_yardstick() -> None:
    from plan.hardware import gpu_spec
    from plan.planner import Cluster, Granularity

    case = BENCH.table3_case(3, Cluster(16, 8, gpu_spec("a100-80g"), Granularity.NODE))
    assert case["plan_over_brute_force"] == 1.0
    assert case["plan_over_ideal"] <= 1.0
    assert case["best_baseline_over_ideal"] <= case["plan_over_ideal"]
    assert set(case["baselines"]) == {"equally", "weighted", "sized"}
