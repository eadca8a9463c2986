#!/usr/bin/env python3
"""How fast unicornd solves the one-step lookup table: prints one JSON object.

The table (:mod:`unicornd.lookup`) holds the plan of every single-node failure of the
committed snapshot: one full solve per planned task, and one for a spare, after each
change of the planner's inputs. While it is rebuilt, a failure's replan solves instead of
taking its plan (``lookup_hit_rate`` in ``scripts/bench/scale.py``), so its build time is
what the hit rate depends on. This bench builds the scale bench's cluster (``--nodes``
nodes of 8 GPUs, ``--jobs`` tasks laid out by the real planner, a plan basis) and, in one
run, on this machine with nothing else running:

- ``solve_ms_*``: one one-step solve (median over ``--plans`` of them, after a warm-up),
  computing every task's curve afresh (``no_memo``, as before session 20) and with the
  curves kept between solves (``memo``, what a worker does); both make the same plans
  (checked: ``same_plans``);
- ``build_s_workers_W``: the wall time of :class:`unicornd.lookup.Lookup`'s build of the
  whole table with W worker processes (spawned and warmed up first), each at the lowest CPU
  priority, as unicornd runs it.

The physical limit of a build is the solves' CPU time spread over the idle cores:
``plans * solve_ms_memo / cores``; ``build_vs_limit`` says how close the largest pool is.

Run: ``.venv/bin/python scripts/bench/lookup.py [--nodes 4096] [--jobs 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale  # noqa: E402  (the scale bench's cluster)

from unicorn_core.config import load_config  # noqa: E402
from unicornd.core import Core  # noqa: E402
from unicornd.lookup import Lookup, one_step_snapshots, structure  # noqa: E402
from unicornd.replan import CurveMemo, PlanContext, solve, solve_inputs  # noqa: E402
from unicornd.solvecache import SolveCache  # noqa: E402
from unicornd.state import PlanBasis, Snapshot  # noqa: E402


def _solve_ms(
    snap: Snapshot, ctx: PlanContext, plans: int, memo: CurveMemo | None
) -> tuple[float, list[Any]]:
    steps = one_step_snapshots(snap)[: plans + 1]
    out, times = [], []
    for tid, hyp in steps:
        inputs = solve_inputs(hyp, ctx, time.time())
        assert inputs is not None
        t = time.perf_counter()
        out.append((tid, solve(inputs, ctx, memo)))
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1000, out  # the first: warm-up (and the memo's fill)


async def _build_s(snap: Snapshot, ctx: PlanContext, workers: int) -> tuple[float, int]:
    warm_ctx = replace(ctx, solves=SolveCache())
    lookup = Lookup(cast(Core, SimpleNamespace(ctx=warm_ctx, committed=snap)), min_nodes=0, workers=workers)
    try:
        # Start and warm every worker (imports, first curves) on a throw-away build of the same
        # table, then time a build from an empty cache.
        await lookup._build(snap, structure(snap))
        fresh = replace(ctx, solves=SolveCache())
        lookup.core = cast(Core, SimpleNamespace(ctx=fresh, committed=snap))
        t = time.monotonic()
        await lookup._build(snap, structure(snap))
        return time.monotonic() - t, len(fresh.solves)
    finally:
        if lookup._pool is not None:
            lookup._pool.shutdown(wait=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--plans", type=int, default=20, help="one-step solves timed per variant")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cfg = load_config(None, env={})
    ctx = PlanContext.from_config(cfg)
    now = time.time()
    snap = scale.build_cluster(args.nodes, scale.jobs_for(args.nodes, args.jobs), cfg, ctx, now).snapshot
    snap = snap.apply(plan_basis=PlanBasis(snap.calibration, now))
    plain_ms, plain = _solve_ms(snap, ctx, args.plans, None)
    memo_ms, kept = _solve_ms(snap, ctx, args.plans, {})
    table = len(one_step_snapshots(snap))
    row: dict[str, Any] = {
        "bench": "lookup",
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "nodes": args.nodes,
        "tasks": len(snap.tasks),
        "table_plans": table,
        "solve_ms_no_memo": round(plain_ms, 1),
        "solve_ms_memo": round(memo_ms, 1),
        "memo_speedup": round(plain_ms / memo_ms, 2),
        "same_plans": plain == kept,
    }
    for w in args.workers:
        took, cached = asyncio.run(_build_s(snap, ctx, w))
        row[f"build_s_workers_{w}"] = round(took, 2)
        row[f"build_plans_workers_{w}"] = cached
    cores = min(max(args.workers), os.cpu_count() or 1)
    limit = table * memo_ms / 1000 / cores
    row["build_limit_s"] = round(limit, 2)
    row["build_vs_limit"] = round(row[f"build_s_workers_{max(args.workers)}"] / limit, 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
