#!/usr/bin/env python3
"""End-to-end recovery: fault -> detected -> decided -> drained -> training again.

Starts a private dev cluster (4 nodes x 1 GPU) and, per trial, a fresh real unicornd
(its own Redis key prefix, so the drain limiter and history start empty) running one
task of the built-in trainer on n1,n2 (PP2, real torchrun, gloo). Faults, ``--trials``
each (default 10):

- ``node_loss``: ``dev-cluster kill-node n2`` (slurmd, steps, ranks and the node's sshd
  die). Time zero is the kill.
- ``rank_exception``: rank 1 raises at iteration ``--fail-at`` (once). Time zero is the
  moment the rank's once-marker file was written, just before it raises.

Per trial, from unicornd's persisted incident (timeline times are the daemon's clock, the
same machine's):

- ``detect_s``: time zero -> incident opened.
- ``decide_s``: incident opened -> the first ladder rung entered (decision persisted).
- ``drain_s``: time zero -> the drain executed in Slurm (the daemon's ``action_done``
  log line); node loss only.
- ``resumed_s``: time zero -> the incident's ``resumed`` entry (the first iteration
  reported by ranks the recovery started).
- ``iterations_lost``: the highest iteration reported before the fault minus the
  iteration training resumed from (``resumed_from`` in the surviving rank's log): the
  iterations computed again.

``--trainer megatron`` runs real Megatron-LM (``pretrain_gpt.py``, tiny GPT, mock data,
the memory tier; :mod:`tests.system.megatron_job`) instead of the built-in trainer. The
exception is injected by the test-only shim (rank 1 raises as iteration ``--fail-at``
starts). ``iterations_lost`` is then the highest iteration Megatron-LM printed before the
fault minus the iteration it loaded; each trial also reports ``layout_before``,
``layout_after`` and ``restored_from`` (the tiers the restore read: memory, peer, disk).

Prints one JSON object: per fault the median, p95 and max of each figure, and the raw lists.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import DevCluster, start_cluster  # noqa: E402
from tests.system.coordinator import (  # noqa: E402
    PLANNER_MODEL,
    Coordinator,
    coordinator,
    resumes,
    train_log,
    trainer_command,
)
from tests.system.megatron_job import (  # noqa: E402
    MEGATRON_LM,
    MODEL,
    PLAN_ENV,
    job_env,
    restored_from,
    runs,
    task_command,
    tiers_env,
)
from unicornd.state import Incident, LadderStage, Snapshot, TaskRecord, TaskState  # noqa: E402

ENV: dict[str, str] = {}  # default detection settings, as the e2e tests


def running(s: Snapshot, task: str, past: int) -> bool:
    t = s.tasks.get(task)
    return t is not None and t.state is TaskState.RUNNING and (t.last_iteration or 0) > past


def closed_incident(s: Snapshot) -> Incident | None:
    return next((i for i in s.incidents.values() if not i.is_open), None)


def stage_time(inc: Incident, stage: LadderStage) -> float | None:
    return next((e.t_s for e in inc.timeline if e.stage is stage), None)


def drain_done_s(log_path: Path, node: str) -> float | None:
    """Wall time of the daemon's ``action_done`` for the drain of ``node``."""
    for line in log_path.read_text(errors="replace").splitlines():
        if '"action_done"' in line and f"/drain/{node}" in line:
            stamp = json.loads(line)["timestamp"]
            return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


def start_task(c: Coordinator, name: str, tmp: Path, megatron: bool, *extra: str) -> TaskRecord:
    job, held = c.hold_job(name, "n1,n2")
    task = TaskRecord(
        task_id=name,
        name=name,
        model=MODEL if megatron else PLANNER_MODEL,
        command=task_command(tmp / f"ckpt-{name}", 100_000)
        if megatron
        else trainer_command(tmp / f"ckpt-{name}", *extra),
        framework="megatron" if megatron else "unicorn-train",
        min_gpus=1,
        max_gpus=2,  # stays on its two nodes until one fails
        job_id=job,
        nodes=held,
    )
    c.register(task)
    c.wait(lambda s: running(s, name, 6), f"{name} training", 300)
    return task


def measure(
    c: Coordinator, task: TaskRecord, t0: float, before: int, node: str | None, megatron: bool
) -> dict[str, Any]:
    snap0 = c.snapshot()
    layout_before = snap0.tasks[task.task_id].layout if snap0 else None
    snap = c.wait(lambda s: closed_incident(s) is not None and running(s, task.task_id, 0), "recovery", 300)
    inc = closed_incident(snap)
    assert inc is not None
    first_rung = next(e.t_s for e in inc.timeline if e.stage is not LadderStage.DETECTED)
    resumed = stage_time(inc, LadderStage.RESUMED)
    now = snap.tasks[task.task_id]
    drained = drain_done_s(c.log_path, node) if node else None
    out: dict[str, Any] = {
        "detect_s": inc.opened_s - t0,
        "decide_s": first_rung - inc.opened_s,
        "drain_s": None if drained is None else drained - t0,
        "resumed_s": None if resumed is None else resumed - t0,
    }
    if megatron:
        # Megatron-LM prints on its last rank: read every node's log for the latest start.
        starts = [r for n in now.nodes for r in runs(train_log(c.keys.prefix, task.job_id or 0, n))]
        last = next((r for r in reversed(starts) if r.loaded is not None), None)
        out["iterations_lost"] = None if last is None or last.loaded is None else max(0, before - last.loaded)
        out["layout_before"] = layout_before.describe() if layout_before else None
        out["layout_after"] = now.layout.describe() if now.layout else None
        out["restored_from"] = restored_from(last.tiers) if last else None
    else:
        starts_at = resumes(train_log(c.keys.prefix, task.job_id or 0, now.nodes[0]))
        out["iterations_lost"] = max(0, before - starts_at[-1]) if starts_at else None
    out["stages"] = [e.stage.value for e in inc.timeline]
    out["timeline"] = {e.stage.value: round(e.t_s - t0, 3) for e in inc.timeline}
    return out


def trial_env(tmp: Path, megatron: bool, **extra: str) -> dict[str, str]:
    """unicornd's environment (the agents and ranks inherit it): for Megatron-LM the job's
    path to it and the CPU shim, and checkpoint tiers of this trial only."""
    if not megatron:
        return {**ENV, **extra}
    return {**ENV, **tiers_env(tmp), **PLAN_ENV, **job_env(**extra)}


def node_loss_trial(cluster: DevCluster, tmp: Path, i: int, megatron: bool) -> dict[str, Any]:
    with coordinator(cluster, tmp, **trial_env(tmp, megatron)) as c:
        task = start_task(c, f"nl{i}", tmp, megatron)
        snap = c.snapshot()
        before = (snap.tasks[task.task_id].last_iteration or 0) if snap else 0
        t0 = time.time()
        cluster.script("kill-node", "n2")
        try:
            out = measure(c, task, t0, before, "n2", megatron)
        finally:
            cluster.script("revive-node", "n2")
    cluster.slurm("scontrol", "update", "nodename=n2", "state=resume", check=False)
    return out


def exception_trial(cluster: DevCluster, tmp: Path, i: int, fail_at: int, megatron: bool) -> dict[str, Any]:
    marker = tmp / f"fired-{i}"
    if megatron:
        inject = {
            "TEST_MEGATRON_RAISE_AT": str(fail_at - 1),
            "TEST_MEGATRON_RAISE_RANK": "1",
            "TEST_MEGATRON_RAISE_ONCE": str(marker),
        }
        extra: tuple[str, ...] = ()
    else:
        inject = {}
        extra = (
            f"--fail-at-iteration={fail_at}",
            "--fail-rank=1",
            "--fail-mode=raise",
            f"--fail-once-marker={marker}",
        )
    with coordinator(cluster, tmp, **trial_env(tmp, megatron, **inject)) as c:
        task = start_task(c, f"ex{i}", tmp, megatron, *extra)
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = marker.stat().st_mtime
        out = measure(c, task, t0, fail_at - 1, None, megatron)
    return out


def summary(values: list[float | None]) -> dict[str, float | None]:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"median": None, "p95": None, "max": None}
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return {"median": round(statistics.median(xs), 3), "p95": round(p95, 3), "max": round(xs[-1], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--fail-at", type=int, default=14, help="iteration at which rank 1 raises")
    ap.add_argument("--faults", default="node_loss,rank_exception")
    ap.add_argument("--trainer", choices=("unicorn-train", "megatron"), default="unicorn-train")
    args = ap.parse_args()
    megatron = args.trainer == "megatron"
    if megatron and not (MEGATRON_LM / "pretrain_gpt.py").exists():
        ap.error(f"Megatron-LM's pretrain_gpt.py not found under {MEGATRON_LM} (set UNICORN_MEGATRON_LM)")
    faults = args.faults.split(",")
    unknown = set(faults) - {"node_loss", "rank_exception"}
    if unknown or args.trials < 1:
        ap.error(f"unknown faults {sorted(unknown)} or --trials < 1")
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as d:
        root = Path(d)
        root.chmod(0o755)
        os.environ["TMPDIR"] = str(root)  # torchrun's torchelastic_* folders go with the run
        cluster = start_cluster(root / "cluster", "--nodes", "4", "--gpus-per-node", "1")
        results: dict[str, list[dict[str, Any]]] = {f: [] for f in faults}
        try:
            for i in range(args.trials):
                for fault in faults:
                    tmp = root / f"{fault}-{i}"
                    tmp.mkdir()
                    if fault == "node_loss":
                        results[fault].append(node_loss_trial(cluster, tmp, i, megatron))
                    else:
                        results[fault].append(exception_trial(cluster, tmp, i, args.fail_at, megatron))
                    print(f"{fault} #{i}: {results[fault][-1]}", file=sys.stderr, flush=True)
        finally:
            cluster.script("down", check=False)
    out: dict[str, Any] = {
        "bench": "recovery",
        "trainer": args.trainer,
        "trials": args.trials,
        "fail_at": args.fail_at,
    }
    for fault, rows in results.items():
        out[fault] = {
            key: summary([r[key] for r in rows])
            for key in ("detect_s", "decide_s", "drain_s", "resumed_s", "iterations_lost")
        }
        out[fault]["raw"] = [{k: v for k, v in r.items() if k != "stages"} for r in rows]
        out[fault]["stage_paths"] = sorted({" > ".join(r["stages"]) for r in rows})
        if megatron:
            for key in ("layout_before", "layout_after", "restored_from"):
                out[fault][key] = sorted({str(r[key]) for r in rows})
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
