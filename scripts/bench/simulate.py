#!/usr/bin/env python3
"""Simulator benchmark (issue 8): prints one JSON object.

Accumulated-WAF ratios on Unicron's Table 3 case 5 (16 nodes x 8 A100-80G), over seeds
0..N-1 of trace-a and trace-b: unicorn / megatron, unicorn / per-task, per-task /
megatron and unicorn / the best static baseline (mean, min, max). ``lost_share``: the
mean fraction of each policy's ideal work lost to each cause. ``trace-b-repair-1-7d`` is a
sensitivity run, not a goal: trace-b with trace-a's uncompressed 1-7 day repairs.
Timing: wall time of one 8-week trace-a replay (all six policies, and unicorn alone),
median over the seeds, after the layout tables are built (``workload_build_s``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from plan.baselines import Baseline
from plan.hardware import gpu_spec
from plan.sim.engine import Cause, SimResult
from plan.sim.policies import POLICY_NAMES, Workload, build_workload
from plan.sim.report import plot_png, run_policies
from plan.sim.trace import DAY_S, TRACE_A, TRACE_B, EventKind, TraceSpec, generate_trace
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import load_tasks

GPU = "a100-80g"
CASE = "case5"


def spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.mean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def ratio(results: dict[str, SimResult], a: str, b: str) -> float:
    return results[a].accumulated_wtflop / results[b].accumulated_wtflop


def evaluate(spec: TraceSpec, work: Workload, seeds: int, plot: Path | None) -> dict[str, object]:
    rows: dict[str, list[float]] = {
        "unicorn_vs_megatron": [],
        "unicorn_vs_per_task": [],
        "per_task_vs_megatron": [],
    }
    rows["unicorn_vs_best_static"] = []
    lost: dict[str, dict[str, list[float]]] = {
        p: {c.value: [] for c in Cause} for p in ("unicorn", "megatron")
    }
    sev1, others = [], []
    for seed in range(seeds):
        trace = generate_trace(spec, seed)
        results = run_policies(trace, work, POLICY_NAMES)
        rows["unicorn_vs_megatron"].append(ratio(results, "unicorn", "megatron"))
        rows["unicorn_vs_per_task"].append(ratio(results, "unicorn", "per-task"))
        rows["per_task_vs_megatron"].append(ratio(results, "per-task", "megatron"))
        best_static = max((b.value for b in Baseline), key=lambda b: results[b].accumulated_wtflop)
        rows["unicorn_vs_best_static"].append(ratio(results, "unicorn", best_static))
        for p, causes in lost.items():
            for c in Cause:
                causes[c.value].append(results[p].lost_wtflop[c] / results[p].ideal_wtflop)
        counts = trace.counts()
        sev1.append(counts[EventKind.SEV1])
        others.append(counts[EventKind.SEV2] + counts[EventKind.SEV3])
        if plot is not None and seed == 0:
            plot_png(results, plot, f"{spec.name} (seed 0), Table 3 {CASE}, 16 x 8 {GPU}")
    out: dict[str, object] = {k: spread(v) for k, v in rows.items()}
    out["lost_share"] = {
        p: {c: round(statistics.mean(v), 4) for c, v in causes.items()} for p, causes in lost.items()
    }
    out["sev1_mean"] = round(statistics.mean(sev1), 1)
    out["other_failures_mean"] = round(statistics.mean(others), 1)
    out["_rows"] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--plot-dir", type=Path, default=None, help="write trace-a.png and trace-b.png here")
    args = parser.parse_args()
    tasks = load_tasks(etc_dir() / "tasks" / "cases" / f"{CASE}.toml")
    start = time.perf_counter()
    work = build_workload(tasks, 16, 8, gpu_spec(GPU))
    out: dict[str, object] = {"workload": CASE, "gpu": GPU, "nodes": 16, "seeds": args.seeds}
    out["workload_build_s"] = round(time.perf_counter() - start, 3)

    all_s, unicorn_s = [], []
    for seed in range(args.seeds):
        trace = generate_trace(TRACE_A, seed)
        t0 = time.perf_counter()
        run_policies(trace, work, POLICY_NAMES)
        t1 = time.perf_counter()
        run_policies(trace, work, ["unicorn"])
        all_s.append(t1 - t0)
        unicorn_s.append(time.perf_counter() - t1)
    out["sim_s_8_weeks_all_policies"] = round(statistics.median(all_s), 4)
    out["sim_s_8_weeks_unicorn"] = round(statistics.median(unicorn_s), 4)

    plots = args.plot_dir
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
    slow_repairs = replace(
        TRACE_B, name="trace-b-repair-1-7d", repair_min_s=1 * DAY_S, repair_max_s=7 * DAY_S
    )
    rows: dict[str, dict[str, list[float]]] = {}
    for spec in (TRACE_A, TRACE_B, slow_repairs):
        plot = plots / f"{spec.name}.png" if plots is not None and spec is not slow_repairs else None
        result = evaluate(spec, work, args.seeds, plot)
        rows[spec.name] = result.pop("_rows")  # type: ignore[assignment]
        out[spec.name] = result
    a, b = rows["trace-a"], rows["trace-b"]
    out["goals_met"] = {
        "trace-a unicorn/megatron >= 1.2": statistics.mean(a["unicorn_vs_megatron"]) >= 1.2,
        "trace-b unicorn/megatron >= 1.9": statistics.mean(b["unicorn_vs_megatron"]) >= 1.9,
        "unicorn > per-task on every seed": min(a["unicorn_vs_per_task"] + b["unicorn_vs_per_task"]) > 1,
        "8 weeks under 10 s": statistics.median(all_s) < 10,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
