#!/usr/bin/env python3
"""What a plan solve in a worker thread leaves in unicornd's memory: prints one JSON object.

unicornd resolves each decision (the replan's solve, when the lookup table has no plan for
it) in a worker thread (``asyncio.to_thread``). glibc gives such a thread its own malloc
arena, which keeps the memory a solve freed. This bench starts one child process per
setting, each with the scale bench's cluster (``--nodes`` nodes of 8 GPUs, ``--jobs``
tasks, a plan basis, one node drained: the failure path's replan input), and measures
its RSS (``/proc/self/status``) after each of ``--solves`` solves in a thread pool of 4,
as unicornd's default executor has on this machine:

- ``per_thread_arenas``: glibc's default;
- ``one_arena``: after :func:`unicornd.daemon.one_malloc_arena`, what unicornd does.

Each figure is the RSS growth after a solve, against the RSS before the first one (after
a first solve on the main thread, so the snapshot and the imports are in memory).

Run: ``.venv/bin/python scripts/bench/malloc_arena.py [--nodes 4096] [--solves 4]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(nodes: int, jobs: int, solves: int, one_arena: bool) -> list[float]:
    import scale

    from unicorn_core.config import load_config
    from unicornd.daemon import one_malloc_arena
    from unicornd.replan import PlanContext, plan_for
    from unicornd.solvecache import SolveCache
    from unicornd.state import PlanBasis

    if one_arena and not one_malloc_arena():
        raise SystemExit("mallopt(M_ARENA_MAX) failed: not glibc?")
    cfg = load_config(None, env={})
    ctx = PlanContext.from_config(cfg)
    now = time.time()
    snap = scale.build_cluster(nodes, scale.jobs_for(nodes, jobs), cfg, ctx, now).snapshot
    failed = scale.failure_snapshot(snap.apply(plan_basis=PlanBasis(snap.calibration, now)))
    plan_for(failed, replace(ctx, solves=SolveCache()), now)  # on the main thread: warm
    gc.collect()
    before = _rss_mib()
    out = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(solves):
            pool.submit(plan_for, failed, replace(ctx, solves=SolveCache()), now).result()
            gc.collect()
            out.append(round(_rss_mib() - before, 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--solves", type=int, default=4)
    parser.add_argument("--child", choices=["default", "one"], default=None)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.nodes, args.jobs, args.solves, args.child == "one")))
        return
    row: dict[str, object] = {
        "bench": "malloc_arena",
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "nodes": args.nodes,
        "tasks": args.jobs,
    }
    for name, setting in (("per_thread_arenas", "default"), ("one_arena", "one")):
        argv = [sys.executable, __file__, "--nodes", str(args.nodes), "--jobs", str(args.jobs)]
        argv += ["--solves", str(args.solves), "--child", setting]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, check=True)
        row[f"rss_growth_mib_{name}"] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(row))


if __name__ == "__main__":
    main()
