#!/usr/bin/env python3
"""Time `dev-cluster up` (nodes idle, Redis answers, a probe job has run) and `down` (pids gone).

Prints one JSON object. Uses a private state folder, so it runs beside any other cluster.
Usage: scripts/bench/dev_cluster.py [--runs N] [--nodes N] [--gpus-per-node G]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "dev-cluster"


def timed(*args: str) -> float:
    t0 = time.monotonic()
    subprocess.run([str(SCRIPT), *args], check=True, capture_output=True, timeout=120)
    return time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=4)
    a = p.parse_args()
    ups, downs = [], []
    with tempfile.TemporaryDirectory() as d:
        state = ["--state-dir", str(Path(d) / "c")]
        for _ in range(a.runs):
            ups.append(timed(*state, "up", "--nodes", str(a.nodes), "--gpus-per-node", str(a.gpus_per_node)))
            downs.append(timed(*state, "down"))
    print(
        json.dumps(
            {
                "bench": "dev_cluster",
                "nodes": a.nodes,
                "gpus_per_node": a.gpus_per_node,
                "runs": a.runs,
                "up_s_median": round(statistics.median(ups), 3),
                "up_s_max": round(max(ups), 3),
                "down_s_median": round(statistics.median(downs), 3),
                "down_s_max": round(max(downs), 3),
                "goal_up_s": 10.0,
                "machine": f"{platform.node()} {platform.machine()} cpus={__import__('os').cpu_count()}",
            }
        )
    )


if __name__ == "__main__":
    main()
