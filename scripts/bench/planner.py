#!/usr/bin/env python3
"""Planner benchmark: prints one JSON object (issue 6).

solve_ms: median wall time of one cluster-wide solve (gain arrays + DP + traceback) with
the layout tables already built (they are memoised per model and GPU type; their build
time is reported separately as tables_ms). lookup_ms: answering one node failure from
the prebuilt one-step table. optimal_rate: DP objective == brute force on random small
instances. waf_ratio_vs_best_baseline: Unicron Table 3 cases on 16 x 8 GPUs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from plan.baselines import Baseline, baseline_allocation
from plan.hardware import gpu_spec
from plan.lookup import build_one_step_table
from plan.objective import gains
from plan.planner import Cluster, Granularity, TaskCurve, plan_cluster, task_curves, waf_of
from plan.solver import brute_force, solve
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import load_task_file, load_tasks

GPU = "a100-80g"
TASKS = etc_dir() / "tasks"


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def lookup_figures(curves: Sequence[TaskCurve], cluster: Cluster, digits: int) -> tuple[float, float]:
    """(ms to build the one-step table, ms to answer one node lost from a busy task)."""
    base = plan_cluster(curves, cluster)
    start = time.perf_counter()
    table = build_one_step_table(curves, cluster, base)
    build_ms = round((time.perf_counter() - start) * 1e3, digits)
    victim = next(a.task for a in base.assignments if a.workers)
    lookup_ms = median_ms(lambda: [table.after_node_lost(victim) for _ in range(1000)], 5) / 1000
    return build_ms, round(lookup_ms, 6)


def main() -> None:
    gpu = gpu_spec(GPU)
    rng = np.random.default_rng(0)
    out: dict[str, object] = {"gpu": GPU}

    # m = 6 tasks on 128 GPUs, GPU granularity (case 2: mixed 1.3B and 7B)
    small = Cluster(16, 8, gpu, Granularity.GPU)
    case2 = load_tasks(TASKS / "cases" / "case2.toml")
    start = time.perf_counter()
    curves6 = task_curves(case2, small, small.workers + 8)
    out["tables_ms_m6"] = round((time.perf_counter() - start) * 1e3, 1)
    out["solve_ms_m6_n128gpus"] = median_ms(lambda: plan_cluster(curves6, small), 21)

    # m = 100 tasks on 2048 nodes (16,384 GPUs), node granularity
    sizes = [load_task_file(TASKS / f"gpt3-{s}.toml") for s in ("1.3b", "7b", "13b", "175b")]
    tasks100 = tuple(
        replace(
            sizes[int(rng.integers(0, 4))],
            name=f"t{i}",
            weight=float(rng.choice([0.5, 0.8, 1.1, 1.4, 1.7, 2.0])),
        )
        for i in range(100)
    )
    big = Cluster(2048, 8, gpu, Granularity.NODE)
    start = time.perf_counter()
    curves100 = task_curves(tasks100, big, big.workers + 1)
    out["tables_ms_m100"] = round((time.perf_counter() - start) * 1e3, 1)
    out["solve_ms_m100_n2048nodes"] = median_ms(lambda: plan_cluster(curves100, big), 5)
    # worst case for the DP: every worker count useful (strictly increasing gains)
    dense = [np.sort(rng.random(2049)) for _ in range(100)]
    out["solve_ms_m100_n2048_dense_worst_case"] = median_ms(lambda: solve(dense, 2048), 3)

    # one-step look-up table
    out["lookup_build_ms_m6"], out["lookup_ms"] = lookup_figures(curves6, small, digits=2)
    out["lookup_build_ms_m100_n2048"], out["lookup_ms_m100"] = lookup_figures(curves100, big, digits=1)

    # optimality on 200 random small instances (random F with infeasible holes, currents, faults)
    optimal = 0
    for _ in range(200):
        workers, m = int(rng.integers(1, 9)), int(rng.integers(2, 5))
        g = []
        for _ in range(m):
            waf = rng.random(workers + 1) * 100 * (rng.random(workers + 1) < 0.7)
            waf[0] = 0
            now = int(rng.integers(0, workers + 1))
            g.append(
                gains(
                    waf,
                    current=now,
                    current_waf=float(waf[now]),
                    faulted=bool(rng.random() < 0.3),
                    running_s=float(rng.uniform(1, 1000)),
                    transition_s=float(rng.uniform(0, 2000)),
                )
            )
        optimal += bool(
            np.isclose(solve(g, workers).objective, brute_force(g, workers).objective, rtol=1e-12)
        )
    out["optimal_rate"] = optimal / 200

    # Table 3 cases, 128 GPUs, node granularity
    ratios: dict[str, dict[str, object]] = {}
    cluster = Cluster(16, 8, gpu, Granularity.NODE)
    for n in range(1, 6):
        tasks = load_tasks(TASKS / "cases" / f"case{n}.toml")
        curves = task_curves(tasks, cluster, cluster.workers)
        plan = plan_cluster(curves, cluster)
        wafs = [c.waf for c in curves]
        base = {
            b.value: waf_of(curves, baseline_allocation(tasks, wafs, cluster.workers, b)) for b in Baseline
        }
        best = max(base, key=lambda k: base[k])
        ratios[f"case{n}"] = {
            "ratio": round(plan.total_waf_tflops / base[best], 3),
            "best_baseline": best,
            "plan_gpus": [a.gpus for a in plan.assignments],
        }
    out["waf_ratio_vs_best_baseline"] = ratios
    print(json.dumps(out))


if __name__ == "__main__":
    main()
