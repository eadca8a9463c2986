#!/usr/bin/env python3
"""What an agent's srun step costs the head node: prints one JSON object.

unicornd starts one ``srun --overlap`` step per node of a job (its agent), and each srun
stays alive, on the head node, for as long as its agent runs. This bench starts a private
dev cluster (``--nodes`` nodes), holds them in one job, and launches a long-running task
on every node twice, in the same run:

- ``per_node``: one ``srun --jobid J -w NODE --overlap`` per node (what unicornd does);
- ``one_step``: one ``srun --jobid J -w n[1-N] --ntasks-per-node=1 --overlap`` for all.

For each: the head node's processes and threads they hold (srun forks a helper per
step), their memory (PSS, from ``/proc/PID/smaps_rollup``: shared pages split among
the processes that share them), and the wall time until every task runs. ``*_per_node``
figures divide by the node count: what 4,096 nodes would hold is 4,096 times that for
``per_node``, and the ``one_step`` figure for each job. Nothing else runs on the cluster.

Run: ``.venv/bin/python scripts/bench/srun_cost.py [--nodes 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "dev-cluster"
HOLD_S = 600


def _env(state: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(SCRIPT), "--state-dir", str(state), "env"], check=True, capture_output=True, text=True
    ).stdout
    env = dict(os.environ)
    for line in out.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value.strip("'")
    return env


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (srun and the helper it forks)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out.append(int(k))
            todo.append(int(k))
    return out


def _usage(pids: list[int]) -> dict[str, float]:
    procs = threads = 0
    pss_kb = 0
    for pid in pids:
        try:
            threads += len(os.listdir(f"/proc/{pid}/task"))
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss_kb += int(line.split()[1])
            procs += 1
        except OSError:
            continue
    return {"processes": procs, "threads": threads, "pss_mib": round(pss_kb / 1024, 2)}


def _running(env: dict[str, str], job: int, tasks: int) -> bool:
    """``tasks`` steps of ``job`` run (squeue lists a step once it runs)."""
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", str(job), "-o", "%i"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    return sum(1 for ln in out.split() if ln.partition(".")[2].isdigit()) >= tasks


def _launch(env: dict[str, str], job: int, nodes: list[str], *, one_step: bool) -> dict[str, Any]:
    base = ["srun", f"--jobid={job}", "--overlap", "--quiet", "--kill-on-bad-exit=0"]
    t0 = time.monotonic()
    if one_step:
        cmds = [
            [*base, f"-w{','.join(nodes)}", f"-N{len(nodes)}", "--ntasks-per-node=1", "sleep", str(HOLD_S)]
        ]
    else:
        cmds = [[*base, f"-w{n}", "-N1", "-n1", "sleep", str(HOLD_S)] for n in nodes]
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in cmds]
    try:
        deadline = time.monotonic() + 60
        while not _running(env, job, len(cmds)):
            if time.monotonic() > deadline:
                raise SystemExit("steps did not start within 60 s")
            time.sleep(0.05)
        started_s = time.monotonic() - t0
        time.sleep(1.0)  # settled
        pids = [p.pid for p in procs]
        pids += [c for p in procs for c in _children(p.pid)]
        usage = _usage(pids)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    n = len(nodes)
    return {
        **usage,
        "started_s": round(started_s, 3),
        "processes_per_node": round(usage["processes"] / n, 2),
        "threads_per_node": round(usage["threads"] / n, 2),
        "pss_mib_per_node": round(usage["pss_mib"] / n, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="unicorn-bench-srun-") as d:
        state = Path(d) / "c"
        subprocess.run(
            [str(SCRIPT), "--state-dir", str(state), "up", "--nodes", str(args.nodes)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        try:
            env = _env(state)
            nodes = [f"n{i}" for i in range(1, args.nodes + 1)]
            job = int(
                subprocess.run(
                    ["sbatch", "--parsable", f"-N{args.nodes}", "--wrap", f"sleep {HOLD_S * 2}"],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.split(";")[0]
            )
            deadline = time.monotonic() + 60
            while (
                "RUNNING"
                not in subprocess.run(
                    ["squeue", "-h", "-j", str(job), "-o", "%T"],
                    check=False,
                    env=env,
                    capture_output=True,
                    text=True,
                ).stdout
            ):
                if time.monotonic() > deadline:
                    sys.exit("the holding job did not start")
                time.sleep(0.1)
            per_node = _launch(env, job, nodes, one_step=False)
            one_step = _launch(env, job, nodes, one_step=True)
            subprocess.run(["scancel", str(job)], env=env, check=False, capture_output=True)
        finally:
            subprocess.run([str(SCRIPT), "--state-dir", str(state), "down"], check=False, capture_output=True)
    print(
        json.dumps(
            {
                "bench": "srun_cost",
                "nodes": args.nodes,
                "per_node": per_node,
                "one_step": one_step,
                "pss_per_node_over_one_step": round(per_node["pss_mib"] / max(one_step["pss_mib"], 1e-9), 2),
                "processes_per_node_over_one_step": round(
                    per_node["processes"] / max(one_step["processes"], 1), 2
                ),
                "per_node_pss_gib_at_4096_nodes": round(per_node["pss_mib_per_node"] * 4096 / 1024, 2),
                "per_node_processes_at_4096_nodes": round(per_node["processes_per_node"] * 4096),
                "cpu_count": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
