#!/usr/bin/env python3
"""Built-in trainer benchmark: prints one JSON object (issue 5).

s_per_iteration: median seconds per iteration of ``unicorn-train`` (tiny GPT, world 4,
CPU/gloo) at DP4, TP2.DP2, PP2.DP2 and TP2.PP2, read from its Megatron-format log
lines, skipping the first ``--warmup`` iterations; ``ratio_vs_dp4`` compares layouts
within this one run (the machine is shared and noisy).

relaunch_s: a DP4 run saves at iteration 3 and exits; the benchmark then issues the
relaunch command at PP2.DP2 with ``--load`` and splits the time to the first new
iteration by phase, from rank 0's startup marks (wall clock):

- process_start: command issued -> ``main()`` entered (torchrun start, its rendezvous,
  worker spawn, interpreter start, click);
- import: torch and the trainer's modules;
- init_process_group: process group and device mesh (the workers' rendezvous);
- build: model stage, tensor/data-parallel wrapping, pipeline stage, optimizer;
- checkpoint_load: DCP load with resharding (DP4 -> PP2.DP2);
- first_iteration: the first training iteration after the load.

Usage: .venv/bin/python scripts/bench/trainer.py [--iterations 40] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
MODEL = (
    *("--layers=4", "--hidden=64", "--heads=4", "--seq=32", "--vocab=128"),
    *("--micro-batch=2", "--global-batch=16"),
)
LAYOUTS = {
    "DP4": ("--tp=1", "--pp=1"),
    "TP2.DP2": ("--tp=2", "--pp=1"),
    "PP2.DP2": ("--tp=1", "--pp=2"),
    "TP2.PP2": ("--tp=2", "--pp=2"),
}
ELAPSED = re.compile(r" iteration +(\d+)/ *\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+) \|")
STARTUP = re.compile(r"\[unicorn-train\] startup (\{.*\})")


def torchrun(nproc: int, *args: str, timeout_s: float = 300) -> str:
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", "-m", "launcher.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("UNICORN_HOOK_SOCKET", None)
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")
    return proc.stdout + proc.stderr


def seconds_per_iteration(layout: tuple[str, ...], iterations: int, warmup: int) -> float:
    out = torchrun(4, *MODEL, *layout, f"--iterations={iterations}", "--log-interval=1")
    times = [float(ms) / 1e3 for it, ms in ELAPSED.findall(out) if int(it) > warmup]
    if not times:
        raise SystemExit(f"no iteration lines after warm-up:\n{out[-3000:]}")
    return statistics.median(times)


def relaunch_phases(workdir: Path) -> dict[str, float]:
    ckpt = str(workdir / "ckpt")
    torchrun(4, *MODEL, *LAYOUTS["DP4"], "--iterations=6", f"--save-dir={ckpt}", "--exit-at-iteration=3")
    issued = time.time()
    out = torchrun(4, *MODEL, *LAYOUTS["PP2.DP2"], "--iterations=4", f"--load={ckpt}")
    match = STARTUP.search(out)
    if match is None or "resumed_from=3" not in out:
        raise SystemExit(f"relaunch did not resume from iteration 3:\n{out[-3000:]}")
    c = json.loads(match[1])
    phases = {
        "process_start": c["main_s"] - issued,
        "import": c["imported_s"] - c["main_s"],
        "init_process_group": c["initialized_s"] - c["imported_s"],
        "build": c["built_s"] - c["initialized_s"],
        "checkpoint_load": c["loaded_s"] - c["built_s"],
        "first_iteration": c["first_iteration_s"] - c["loaded_s"],
    }
    phases["total"] = c["first_iteration_s"] - issued
    return {k: round(v, 3) for k, v in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    per_it = {
        name: seconds_per_iteration(layout, args.iterations, args.warmup) for name, layout in LAYOUTS.items()
    }
    with tempfile.TemporaryDirectory(prefix="unicorn-bench-trainer-") as tmp:
        phases = relaunch_phases(Path(tmp))
    out = {
        "model": "layers=4 hidden=64 heads=4 seq=32 vocab=128 mb=2 gb=16",
        "world": 4,
        "device": "cpu/gloo",
        "iterations": args.iterations,
        "warmup": args.warmup,
        "s_per_iteration": {k: round(v, 4) for k, v in per_it.items()},
        "ratio_vs_dp4": {k: round(v / per_it["DP4"], 2) for k, v in per_it.items()},
        "relaunch_dp4_to_pp2dp2_s": phases,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
