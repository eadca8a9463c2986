#!/usr/bin/env python3
"""Planner benchmark: prints one JSON object (issue 6).

solve_ms: median wall time of one cluster-wide solve (gain arrays + DP + traceback) with
the layout tables already built (they are memoised per model and GPU type; their build
time is reported separately as tables_ms). lookup_ms: answering one node failure from
the prebuilt one-step table. optimal_rate: DP objective == brute force on random small
instances.

table3: Unicron's Table 3 cases on 16 nodes x 8 GPUs (node granularity), one entry per
case with the plan's WAF (weighted TFLOP/s) against

- each static baseline (``plan.baselines``: the share trimmed to a usable layout, then
  the workers trimming left idle handed out where they add the most F);
  ``idle_before_handout``: the workers the trimmed shares alone left idle;
- ``brute_force``: the best WAF over *every* allocation of at most 16 nodes (all of them
  enumerated, no pruning); ``plan_over_brute_force`` is 1 when the plan is optimal;
- ``ideal``: an upper bound no allocation reaches: each task's F replaced by its concave
  majorant (any worker count runs, at the efficiency interpolated between the task's
  real layouts) and workers divisible (water-filling by marginal F per worker).

waf_ratio_vs_best_baseline: plan WAF / the best baseline's, per case.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from plan.baselines import Baseline, baseline_allocation, baseline_shares, best_within
from plan.hardware import gpu_spec
from plan.lookup import build_one_step_table
from plan.objective import gains
from plan.planner import Cluster, Granularity, TaskCurve, plan_cluster, task_curves, waf_of
from plan.solver import FloatArray, brute_force, solve
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


def exhaustive_best(wafs: Sequence[FloatArray], workers: int) -> tuple[float, int]:
    """(best total F, allocations tried) over every allocation of at most ``workers``."""
    totals, values = np.zeros(1, dtype=np.int64), np.zeros(1)
    counts = np.arange(workers + 1)
    for waf in wafs:
        totals = (totals[:, None] + counts[None, :]).ravel()
        values = (values[:, None] + waf[: workers + 1][None, :]).ravel()
        keep = totals <= workers
        totals, values = totals[keep], values[keep]
    return float(values.max()), int(values.shape[0])


def concave_majorant_slopes(waf: FloatArray) -> list[tuple[float, int]]:
    """(F per worker, workers) of each piece of the least concave majorant of F (x = 0..n)."""
    hull: list[int] = []
    for x in range(waf.shape[0]):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or below the chord from a to x
            if (waf[b] - waf[a]) * (x - a) <= (waf[x] - waf[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(x)
    return [(float(waf[b] - waf[a]) / (b - a), b - a) for a, b in itertools.pairwise(hull)]


def ideal_waf(wafs: Sequence[FloatArray], workers: int) -> float:
    """Upper bound: concave majorants, divisible workers, filled by marginal F per worker."""
    pieces = sorted((p for waf in wafs for p in concave_majorant_slopes(waf)), reverse=True)
    total, left = 0.0, float(workers)
    for slope, width in pieces:
        if slope <= 0 or left <= 0:
            break
        take = min(float(width), left)
        total += slope * take
        left -= take
    return total


def table3_case(n: int, cluster: Cluster) -> dict[str, object]:
    tasks = load_tasks(TASKS / "cases" / f"case{n}.toml")
    curves = task_curves(tasks, cluster, cluster.workers)
    plan = plan_cluster(curves, cluster)
    wafs = [c.waf for c in curves]
    baselines: dict[str, dict[str, object]] = {}
    base_waf: dict[str, float] = {}
    for b in Baseline:
        shares = baseline_shares(tasks, cluster.workers, b)
        trimmed = [best_within(w, s) for w, s in zip(wafs, shares, strict=True)]
        alloc = baseline_allocation(tasks, wafs, cluster.workers, b)
        base_waf[b.value] = waf_of(curves, alloc)
        baselines[b.value] = {
            "waf": round(base_waf[b.value], 1),
            "plan_over": round(plan.total_waf_tflops / base_waf[b.value], 3),
            "workers": list(alloc),
            "idle_before_handout": cluster.workers - sum(trimmed),
        }
    best = max(base_waf, key=lambda k: base_waf[k])
    brute, tried = exhaustive_best(wafs, cluster.workers)
    ideal = ideal_waf(wafs, cluster.workers)
    return {
        "plan_waf": round(plan.total_waf_tflops, 1),
        "plan_workers": list(plan.allocation),
        "baselines": baselines,
        "best_baseline": best,
        "plan_over_best_baseline": baselines[best]["plan_over"],
        "brute_force_waf": round(brute, 1),
        "brute_force_allocations": tried,
        "plan_over_brute_force": round(plan.total_waf_tflops / brute, 4),
        "ideal_waf": round(ideal, 1),
        "plan_over_ideal": round(plan.total_waf_tflops / ideal, 4),
        "best_baseline_over_ideal": round(base_waf[best] / ideal, 4),
    }


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
    cluster = Cluster(16, 8, gpu, Granularity.NODE)
    table3 = {f"case{n}": table3_case(n, cluster) for n in range(1, 6)}
    out["table3"] = table3
    out["waf_ratio_vs_best_baseline"] = {k: v["plan_over_best_baseline"] for k, v in table3.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
