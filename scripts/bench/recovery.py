#!/usr/bin/env python3
"""End-to-end recovery: fault -> detected -> decided -> drained -> training again.

Starts a private dev cluster (4 nodes x 1 GPU) and, per trial, a fresh real unicornd
(its own Redis key prefix, so the drain limiter and history start empty) running one
task of the built-in trainer on n1,n2 (PP2, real torchrun, gloo, at most 2 GPUs), its
checkpoint tiers per node in this run's folder (a killed node's memory is gone to the
others). Scenarios, ``--trials`` each (default 10); ``--faults node_loss`` is both
node-loss scenarios:

- ``node_loss_spare``: n3 and n4 idle. ``dev-cluster kill-node n2`` (slurmd, steps, ranks
  and the node's sshd die; its SSH port becomes a black hole) right after a rank reports
  iteration ``--kill-after`` + (7 x trial) mod 10, so the trials spread the kill over two
  snapshot cycles (the trainer snapshots into memory every 5 iterations here). The plan
  keeps the layout and requeues the job onto n1 and a spare node.
- ``node_loss_no_spare``: the same kill, with n3 and n4 drained in Slurm before unicornd
  starts, so no node can replace n2: the plan must shrink the task to n1 alone, at a new
  layout (PP2 -> PP1).
- ``node_loss_dp``: the same kill with no spare, of a data-parallel task (the planner sees
  :data:`DP2_MODEL`, for which DP2 is the best layout on two GPUs and beats one GPU; DDP
  replicas hold identical state). The survivor's just-in-time snapshot of the last
  completed iteration holds everything the lost replica held, so the shrink to n1
  (DP2 -> DP1) resumes from it: ``restored`` names the lost rank's shard as read from its
  replica, and at most the iteration in flight is lost.
- ``rank_exception``: rank 1 raises at iteration ``--fail-at`` (once). Time zero is the
  moment the rank's once-marker file was written, just before it raises.
- ``dp_rank_mid_iteration``: a data-parallel task on n1..n4 (TP1 PP1 DP4: the planner
  sees a one-layer model, :data:`DP_MODEL`) with ``--reuse-microbatches``;
  rank 2 (n3) SIGKILLs itself once it finished 1 of its micro-batches of iteration
  ``--fail-at`` (once; time zero: its once-marker). The survivors complete that iteration
  from their finished micro-batches plus rank 2's, save it and exit 4; unicornd restarts
  the task, which resumes right after it. (Not rank 0: the first node's torchrun holds
  the store the survivors agree on, and ends when its last rank dies.)
- ``loss_spike``: the task on n1,n2 with the trainer's test-only ``--corrupt-iterations``:
  the batch of iteration ``--spike-at`` (default 32, past the loss detector's 20 reports
  of warm-up) makes its loss and gradients jump. Time zero: the first report of that
  iteration (the spiking loss; wall time stamped by the rank's node). unicornd rolls the
  task back: the ranks restore the newest version older than it and skip its data.

Per trial, in seconds from the fault (time zero: the kill is issued; the marker), all on
this machine's wall clock: unicornd's JSON log lines, its persisted incident, the ranks'
own reports:

- ``first_finding_s``: the first finding unicornd logs for the task's job, whatever its
  source. For a node loss this is usually the surviving rank's connection reset (what the
  old ``detect_s`` measured), not the lost node.
- ``detect_s``: node loss: the heartbeat-loss finding for the killed node (unicornd's
  detector finds its agent silent and starts the out-of-band probe: the ``probing`` line;
  the ``finding`` line with source ``heartbeat`` when SSH probing is off). Exception: the
  exception's finding.
- ``confirm_s``: node loss: the killed node's finding confirmed out of band
  (``confirmed_by``: the SSH probe's timeout on the black hole, or slurmctld's
  NOT_RESPONDING while the agent is silent, whichever first).
- ``decide_s``: the finding that sets the recovery (the confirmed node loss; the
  exception) -> its decision committed with its actions (the ``decision`` line is written
  after the commit; for a node loss it holds the drain, the replan and the transition's
  actions, resolved in the same transaction).
- ``incident_opened_s``: the incident's ``opened_s``.
- ``drain_s``: the drain done in Slurm (``action_done``); node loss only.
- ``transition``: how the plan moved the task (``requeue``, ``shrink``, ``relaunch``),
  ``transition_s`` when that action was done, ``launched_s`` when the agents or relaunch
  commands for the new layout were out.
- ``rank_start``: the new rank 0's own marks (process start, torch imported, process group,
  model built, state restored, first iteration), from its startup line.
- ``resumed_s``: the incident's ``resumed`` entry (the first iteration reported by the
  ranks the recovery started).
- ``iteration_at_fault``: the highest iteration any rank reported (the hook's or the
  agent's ``IterationTiming`` on the job's events stream, stamped by the rank's node)
  at or before time zero. ``resumed_from``: the iteration the new ranks restored, and
  ``restored``: from where. ``iterations_lost`` = ``iteration_at_fault - resumed_from``:
  completed iterations computed again (the iteration in flight is not counted; never
  below 0: ``dp_rank_mid_iteration`` completes the iteration in flight, and
  ``in_flight_completed`` says so). ``microbatches_per_iteration``: from the ranks' reports
  (built-in trainer); ``recomputed_microbatches``: micro-batches computed again because of
  the fault: the lost iterations' and the iteration in flight's, all of them for a
  restart, only the lost replica's when the survivors completed it (their report's
  ``recomputed_microbatches``). ``iteration_s``: the ranks' median iteration time before
  the fault. ``loss_spike``: the spiking ranks train on until the roll back stops them, so
  ``iterations_past_fault`` counts the iterations they completed after the spike and
  ``iterations_lost`` = ``iteration_at_fault + iterations_past_fault - resumed_from``
  (every completed update the roll back throws away, the spike's own included);
  ``recomputed_microbatches`` = ``iterations_lost x microbatches_per_iteration`` (trained
  again: those iterations less the skipped spike, plus the one in flight when the ranks
  stopped); ``rollback_version``: the version unicornd's incident records (it must equal
  ``resumed_from``), ``skipped``: the range the relaunch skips.
- ``layout_before``/``layout_after``, ``nodes_before``/``nodes_after``, the incident's
  ``stages`` and ``timeline``; ``--events`` adds unicornd's log (findings, probes,
  decisions, actions) relative to time zero.

``--trainer megatron`` runs real Megatron-LM (``pretrain_gpt.py``, tiny GPT, mock data, the
memory tier; :mod:`tests.system.megatron_job`) instead of the built-in trainer (DP2 on
n1,n2). The exception is injected by the test-only shim (rank 1 raises as iteration
``--fail-at`` starts). ``resumed_from`` is then the iteration Megatron-LM loaded.

Every trial's row is kept (``raw``), failed ones with their error and what was measured
before it. Prints one JSON object: per scenario ``n``, ``ok``, ``failed`` and the
``failures``; each figure's median, p95 and max over the trials that measured it
(``measured`` says how many); the layouts seen; the raw rows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import DevCluster, start_cluster  # noqa: E402
from tests.system.coordinator import (  # noqa: E402
    DP2_MODEL,
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
from unicorn_core.errors import ProtocolError  # noqa: E402
from unicorn_core.keys import PAYLOAD_FIELD  # noqa: E402
from unicorn_core.model import ModelSpec  # noqa: E402
from unicorn_core.protocol import IterationPhase, IterationTiming, decode  # noqa: E402
from unicornd.state import Incident, LadderStage, Snapshot, TaskRecord, TaskState  # noqa: E402

ENV: dict[str, str] = {}  # default detection settings, as the e2e tests
SPARE: Final = "node_loss_spare"
NO_SPARE: Final = "node_loss_no_spare"
NO_SPARE_DP: Final = "node_loss_dp"
EXCEPTION: Final = "rank_exception"
DP_MID: Final = "dp_rank_mid_iteration"
SPIKE: Final = "loss_spike"
SCENARIOS: Final = (SPARE, NO_SPARE, NO_SPARE_DP, EXCEPTION, DP_MID, SPIKE)
KILLED: Final = "n2"
OTHERS: Final = "n3,n4"
DP_NODES: Final = "n1,n2,n3,n4"
DP_FAIL_RANK: Final = 2
DP_MODEL: Final = ModelSpec(layers=1, hidden=32, heads=4, sequence=16, vocabulary=64, global_batch=12)
"""What the planner sees for the data-parallel scenario: one layer, which no pipeline can
split, with ``min_gpus`` = its 4 nodes, so the plan is TP1 PP1 DP4 (for the trainer's own
12 layers it picks PP4, and for one layer without ``min_gpus`` a single GPU). The trainer
runs the layers of its command."""
FIGURES: Final = (
    "first_finding_s",
    "detect_s",
    "confirm_s",
    "decide_s",
    "incident_opened_s",
    "drain_s",
    "transition_s",
    "launched_s",
    "resumed_s",
    "iterations_lost",
    "recomputed_microbatches",
    "microbatches_per_iteration",
    "iterations_past_fault",
)
RANK_MARKS: Final = ("main_s", "imported_s", "initialized_s", "built_s", "loaded_s", "first_iteration_s")
_STARTUP = re.compile(r"\[unicorn-train\] startup (\{.*\})")
_RESTORED = re.compile(r"\[unicorn-train\] (restored iteration \d+ from .*|no complete version.*)")
_PLAN_NOTE = re.compile(r"^plan-(\d+): (\S+) (.+?) on (.+) \(([a-z+]+)\)$")


class TrialFailed(Exception):
    """The trial did not reach its end (training resumed); the message says where it stopped."""


def running(s: Snapshot, task: str, past: int) -> bool:
    t = s.tasks.get(task)
    return t is not None and t.state is TaskState.RUNNING and (t.last_iteration or 0) > past


def closed_incident(s: Snapshot) -> Incident | None:
    return next((i for i in s.incidents.values() if not i.is_open), None)


def escalated(s: Snapshot) -> Incident | None:
    return next((i for i in s.incidents.values() if i.stage is LadderStage.ESCALATED_TO_OPERATOR), None)


def wait(c: Coordinator, pred: Any, what: str, timeout_s: float) -> Snapshot:
    """Like ``c.wait``, but an incident escalated to the operator ends the trial at once."""
    deadline = time.monotonic() + timeout_s
    snap = None
    while time.monotonic() < deadline:
        snap = c.snapshot()
        if snap is not None:
            if pred(snap):
                return snap
            esc = escalated(snap)
            if esc is not None:
                raise TrialFailed(f"{what}: incident {esc.incident_id} escalated to the operator: {esc.note}")
        assert c.proc is not None
        if c.proc.poll() is not None:
            raise TrialFailed(f"{what}: unicornd exited {c.proc.returncode}")
        time.sleep(0.25)
    raise TrialFailed(f"timed out after {timeout_s:g} s waiting for {what}")


# --- unicornd's log ---------------------------------------------------------------------


def daemon_log(path: Path) -> list[dict[str, Any]]:
    """unicornd's JSON log lines, each with ``t``: its timestamp as Unix seconds."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
            stamp = doc["timestamp"]
            doc["t"] = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        out.append(doc)
    return out


def first(lines: list[dict[str, Any]], pred: Any, after: float = 0.0) -> dict[str, Any] | None:
    return next((d for d in lines if d["t"] >= after and pred(d)), None)


def event_text(d: dict[str, Any]) -> str:
    """One log line, short: what the ``--events`` list shows."""
    ev = d.get("event")
    if ev == "finding":
        keys = ("node", "rank", "status", "rule", "source", "confirmed_by")
        return "finding " + " ".join(f"{k}={d[k]}" for k in keys if d.get(k) not in (None, "-"))
    if ev == "probing":
        return f"probing {d.get('node')} (heartbeat lost)"
    if ev == "probe":
        return f"probe {d.get('node')} reachable={d.get('reachable')} rule={d.get('rule')} s={d.get('s')}"
    if ev == "decision":
        return f"decision {str(d.get('note'))[:160]}"
    if ev == "action_done":
        return f"done {d.get('action')} {d.get('status')} s={d.get('s')}: {str(d.get('detail'))[:80]}"
    skip = ("event", "timestamp", "t", "level", "logger")
    return f"{ev} " + " ".join(f"{k}={v}" for k, v in d.items() if k not in skip)[:160]


_EVENT_KINDS: Final = frozenset(
    ("finding", "probing", "probe", "decision", "action_done", "action_failed", "operator_needed")
)


# --- one trial --------------------------------------------------------------------------


def start_task(
    c: Coordinator,
    name: str,
    tmp: Path,
    megatron: bool,
    *extra: str,
    data_parallel: bool = False,
    model: ModelSpec | None = None,
) -> TaskRecord:
    """The task on n1,n2 (``data_parallel``: on n1..n4, planned for the trainer's own shape);
    ``model``: what the planner sees instead of the default."""
    job, held = c.hold_job(name, DP_NODES if data_parallel else "n1,n2")
    task = TaskRecord(
        task_id=name,
        name=name,
        model=model or (MODEL if megatron else DP_MODEL if data_parallel else PLANNER_MODEL),
        command=task_command(tmp / f"ckpt-{name}", 100_000)
        if megatron
        else trainer_command(tmp / f"ckpt-{name}", *extra),
        framework="megatron" if megatron else "unicorn-train",
        min_gpus=len(held) if data_parallel else 1,
        max_gpus=len(held),  # stays on its nodes until one fails
        job_id=job,
        nodes=held,
    )
    c.register(task)
    wait(c, lambda s: running(s, name, 6), f"{name} training", 300)
    return task


def train_reports(c: Coordinator, job: int, last: int | None = None) -> list[IterationTiming]:
    """The train-phase iteration reports of ``job``'s ranks on its events stream (the
    ``last`` entries only, when given), oldest first."""
    with c.client() as r:
        key = c.keys.events(job)
        entries = r.xrange(key) if last is None else list(reversed(r.xrevrange(key, count=last)))
    out: list[IterationTiming] = []
    for _id, fields in entries:
        try:
            msg = decode(fields[PAYLOAD_FIELD.encode()])
        except (ProtocolError, KeyError):
            continue
        if isinstance(msg, IterationTiming) and msg.phase is IterationPhase.TRAIN:
            out.append(msg)
    return out


def wait_iteration(c: Coordinator, job: int, iteration: int, timeout_s: float = 120.0) -> None:
    """Until some rank of ``job`` reported ``iteration`` (polled every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(m.iteration >= iteration for m in train_reports(c, job, last=50)):
            return
        time.sleep(0.02)
    raise TrialFailed(f"iteration {iteration} not reported within {timeout_s:g} s")


def rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def analyse(
    c: Coordinator,
    row: dict[str, Any],
    task: TaskRecord,
    t0: float,
    node: str | None,
    megatron: bool,
    events: bool,
) -> None:
    """Fill ``row`` with everything the logs, the state and the streams hold (also for a
    trial that failed part way: what happened until then)."""
    job = task.job_id or 0
    lines = daemon_log(c.log_path)
    after = [d for d in lines if d["t"] >= t0]
    findings = [d for d in after if d.get("event") == "finding" and d.get("job_id") == job]
    f0 = findings[0] if findings else None
    row["first_finding_s"] = rel(f0["t"], t0) if f0 else None
    row["first_finding"] = event_text(f0) if f0 else None
    trigger: dict[str, Any] | None
    decided: dict[str, Any] | None = None
    if node is not None:
        lost = first(
            after,
            lambda d: (
                d.get("job_id") == job
                and d.get("node") == node
                and (
                    d.get("event") == "probing"
                    or (d.get("event") == "finding" and d.get("source") == "heartbeat")
                )
            ),
        )
        row["detect_s"] = rel(lost["t"], t0) if lost else None
        trigger = next(
            (d for d in findings if d.get("node") == node and d.get("confirmed_by") not in (None, "-")), None
        )
        row["confirm_s"] = rel(trigger["t"], t0) if trigger else None
        row["confirmed_by"] = trigger.get("confirmed_by") if trigger else None
        if trigger is not None:
            decided = first(
                after,
                lambda d: d.get("event") == "decision" and f"isolate {node} " in str(d.get("note")),
                trigger["t"],
            )
    else:
        trigger = f0
        row["detect_s"] = row["first_finding_s"]
        if trigger is not None:
            prefix = f"{task.task_id}."
            decided = first(
                after,
                lambda d: d.get("event") == "decision" and str(d.get("note")).startswith(prefix),
                trigger["t"],
            )
    row["decide_s"] = None if trigger is None or decided is None else round(decided["t"] - trigger["t"], 4)
    row["decision"] = str(decided.get("note"))[:200] if decided else None
    drain = first(
        after,
        lambda d: (
            d.get("event") == "action_done" and node is not None and f"/drain/{node}" in str(d.get("action"))
        ),
    )
    row["drain_s"] = rel(drain["t"], t0) if drain else None
    row["transition"], row["transition_s"], row["launched_s"] = transition_of(after, task.task_id, t0)
    if events:
        row["events"] = [
            f"{d['t'] - t0:+.3f} {event_text(d)}"
            for d in lines
            if d["t"] >= t0 - 1.0 and d.get("event") in _EVENT_KINDS
        ]
    snap = c.snapshot()
    if snap is None or task.task_id not in snap.tasks:
        return
    now = snap.tasks[task.task_id]
    row["nodes_after"] = list(now.nodes)
    row["layout_after"] = now.layout.describe() if now.layout else None
    inc = max(
        (i for i in snap.incidents.values() if i.task_id == task.task_id),
        key=lambda i: i.opened_s,
        default=None,
    )
    if inc is not None:
        row["incident_opened_s"] = rel(inc.opened_s, t0)
        resumed = next((e.t_s for e in inc.timeline if e.stage is LadderStage.RESUMED), None)
        row["resumed_s"] = rel(resumed, t0)
        row["stages"] = " > ".join(e.stage.value for e in inc.timeline)
        row["timeline"] = [f"{e.stage.value}@{e.t_s - t0:+.3f}" for e in inc.timeline]
    # Reported by the end of the fault (the kill script's return): n2 is dead by then.
    t_end = t0 + float(row.get("kill_s") or 0.0)
    before = [m for m in train_reports(c, job) if m.wall_time_s <= t_end]
    row["iteration_at_fault"] = max((m.iteration for m in before), default=None)
    durations = [m.duration_s for m in before if m.iteration > 2]  # past the warm-up
    row["iteration_s"] = round(statistics.median(durations), 3) if durations else None
    logs = {n: train_log(c.keys.prefix, job, n) for n in now.nodes}
    resumed_from: int | None = None
    if megatron:
        starts = [r for n in now.nodes for r in runs(logs[n])]
        last = next((r for r in reversed(starts) if r.loaded is not None), None)
        resumed_from = None if last is None else last.loaded
        row["restored"] = restored_from(last.tiers) if last else None
    else:
        # Rank 0 prints where it resumed and, at its first iteration, its startup marks.
        # torchrun's c10d rendezvous ranks nodes in arrival order: rank 0 of the run the
        # recovery started is on the node whose latest startup line came after the fault.
        latest: tuple[float, str, dict[str, float]] | None = None
        for n, text in logs.items():
            marks = _STARTUP.findall(text)
            clock = json.loads(marks[-1]) if marks else None
            if clock and clock.get("main_s", 0) > t0 and (latest is None or clock["main_s"] > latest[0]):
                latest = (clock["main_s"], n, clock)
        if latest is not None:
            head = logs[latest[1]]
            starts_at = resumes(head)
            resumed_from = starts_at[-1] if starts_at else None
            restored = _RESTORED.findall(head)
            row["restored"] = restored[-1][:400] if restored else None
            row["rank_start"] = {k: rel(latest[2].get(k) or None, t0) for k in RANK_MARKS}
    row["resumed_from"] = resumed_from
    at_fault = row["iteration_at_fault"]
    row["iterations_lost"] = (
        None if at_fault is None or resumed_from is None else max(0, at_fault - resumed_from)
    )
    per_iteration = next((m.microbatches for m in reversed(before) if m.microbatches), None)
    row["microbatches_per_iteration"] = per_iteration
    completed = [
        m.recomputed_microbatches
        for m in train_reports(c, job)
        if m.wall_time_s > t0 and m.recomputed_microbatches is not None
    ]
    row["in_flight_completed"] = bool(completed) and (resumed_from or 0) > (at_fault or 0)
    row["recomputed_microbatches"] = recomputed(row, per_iteration, completed)


def recomputed(row: dict[str, Any], per_iteration: int | None, completed: list[int]) -> int | None:
    """Micro-batches computed again because of the fault: the lost iterations' and the
    iteration in flight's, or only the lost replica's of the iteration in flight when the
    survivors completed it (``completed``: their reports' counts)."""
    lost = row.get("iterations_lost")
    if per_iteration is None or lost is None:
        return None
    if row.get("in_flight_completed"):
        return int(lost * per_iteration + max(completed))
    return int((lost + 1) * per_iteration)


def transition_of(
    lines: list[dict[str, Any]], task_id: str, t0: float
) -> tuple[str | None, float | None, float | None]:
    """How the first plan after time zero moved the task (its note: ``requeue``, ``shrink``,
    ...; ``shrink->requeue`` when Slurm refused the shrink and unicornd requeued instead),
    when that Slurm action was done and when the new ranks' agents or relaunch commands
    were out (relative to ``t0``)."""
    plan = None
    for d in lines:
        m = _PLAN_NOTE.match(str(d.get("note", ""))) if d.get("event") == "decision" else None
        if m and m[2] == task_id:
            plan = m
            break
    if plan is None:
        return None, None, None
    base = f"plan-{plan[1]}/{task_id}/"
    how = plan[5]
    done = [d for d in lines if d.get("event") == "action_done" and str(d.get("action", "")).startswith(base)]
    if any(str(d["action"]).endswith("/shrink") and d.get("status") == "unsupported" for d in done):
        how += "->requeue"
    moved = [
        d
        for d in done
        if str(d["action"]).rsplit("/", 1)[-1] in ("requeue", "shrink", "grow") and d.get("status") == "done"
    ]
    launch = [d for d in done if "/launch" in str(d["action"]) or "/relaunch/" in str(d["action"])]
    return (
        how,
        rel(max(d["t"] for d in moved), t0) if moved else None,
        rel(max(d["t"] for d in launch), t0) if launch else None,
    )


def trial_env(tmp: Path, megatron: bool, snapshot_every: int | None, **extra: str) -> dict[str, str]:
    """unicornd's environment (the agents and ranks inherit it): checkpoint tiers of this
    trial only, one per node; for Megatron-LM the job's path to it and the CPU shim."""
    env = {**ENV, **tiers_env(tmp)}
    if snapshot_every is not None:
        env["UNICORN_CKPT__SNAPSHOT_EVERY"] = str(snapshot_every)
    if not megatron:
        return {**env, **extra}
    return {**env, **PLAN_ENV, **job_env(**extra)}


def all_idle(cluster: DevCluster, timeout_s: float = 60.0) -> None:
    """Until every node is idle in Slurm (the node killed by the last trial back, its job
    gone): a trial must start on n1,n2 with n3,n4 free."""
    deadline = time.monotonic() + timeout_s
    states: list[str] = []
    while time.monotonic() < deadline:
        states = cluster.slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
        if all(line.split()[-1] == "idle" for line in states if line.strip()):
            return
        time.sleep(0.5)
    raise TrialFailed(f"nodes not idle after {timeout_s:g} s: {states}")


@contextlib.contextmanager
def no_spare(cluster: DevCluster, on: bool) -> Iterator[None]:
    """n3 and n4 out of service (drained in Slurm) for the block: unicornd starts with them
    drained, so the plan has no node to replace a lost one."""
    if on:
        cluster.slurm(
            "scontrol", "update", f"nodename={OTHERS}", "state=drain", "reason=bench: no spare node"
        )
    try:
        yield
    finally:
        if on:
            cluster.slurm("scontrol", "update", f"nodename={OTHERS}", "state=resume", check=False)


def node_loss_trial(
    cluster: DevCluster,
    tmp: Path,
    i: int,
    spare: bool,
    megatron: bool,
    opts: argparse.Namespace,
    *,
    data_parallel: bool = False,
) -> dict[str, Any]:
    row: dict[str, Any] = {"trial": i, "ok": False, "error": None}
    name = f"{'sp' if spare else 'dp' if data_parallel else 'ns'}{i}"
    try:
        all_idle(cluster)
        with (
            no_spare(cluster, not spare),
            coordinator(cluster, tmp, **trial_env(tmp, megatron, opts.snapshot_every)) as c,
        ):
            task = start_task(c, name, tmp, megatron, model=DP2_MODEL if data_parallel else None)
            note_before(c, name, row)
            # Killed right after an iteration spread over two snapshot cycles across trials
            # (the loss depends on where the kill falls between snapshots).
            kill_after = opts.kill_after + (7 * i) % 10
            row["kill_after_iteration"] = kill_after
            if tuple(row.get("nodes_before", ())) != ("n1", KILLED):
                raise TrialFailed(f"the task runs on {row.get('nodes_before')}, not on n1,{KILLED}")
            wait_iteration(c, task.job_id or 0, kill_after)
            t0, mono0 = time.time(), time.monotonic()
            try:
                cluster.script("kill-node", KILLED)
                row["kill_s"] = round(time.time() - t0, 3)  # the script's own time: n2 is dead by then
                try:
                    wait(
                        c,
                        lambda s: closed_incident(s) is not None and running(s, name, 0),
                        "training again",
                        opts.timeout_s,
                    )
                    row["ok"] = True
                except TrialFailed as e:
                    row["error"] = str(e)
                analyse(c, row, task, t0, KILLED, megatron, opts.events)
                clock_check(row, t0, mono0)
            finally:
                cluster.script("revive-node", KILLED)
    except Exception as e:  # a broken trial is a row too
        row["ok"] = False
        row["error"] = row["error"] or f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        cluster.slurm("scontrol", "update", f"nodename={KILLED}", "state=resume", check=False)
    if row["ok"] and spare is False and row.get("layout_after") == row.get("layout_before"):
        row["ok"] = False
        row["error"] = "no spare, yet the layout did not change"
    return row


def exception_trial(
    cluster: DevCluster, tmp: Path, i: int, megatron: bool, opts: argparse.Namespace
) -> dict[str, Any]:
    marker = tmp / f"fired-{i}"
    fail_at = opts.fail_at
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
    return marker_trial(
        cluster, tmp, i, opts, f"ex{i}", extra, megatron=megatron, inject=inject,
        what=f"rank 1 did not raise at iteration {fail_at}",
    )  # fmt: skip


def note_before(c: Coordinator, task_id: str, row: dict[str, Any]) -> None:
    """The task's nodes and layout before the fault, into the trial's row."""
    snap = c.snapshot()
    if snap is not None:
        row["nodes_before"] = list(snap.tasks[task_id].nodes)
        layout = snap.tasks[task_id].layout
        row["layout_before"] = layout.describe() if layout else None


def marker_trial(
    cluster: DevCluster,
    tmp: Path,
    i: int,
    opts: argparse.Namespace,
    name: str,
    extra: tuple[str, ...],
    *,
    megatron: bool = False,
    inject: dict[str, str] | None = None,
    data_parallel: bool = False,
    what: str,
) -> dict[str, Any]:
    """One trial whose fault a rank fires itself and marks with ``tmp/fired-<i>`` (its mtime
    is time zero): start the task, wait for the marker (``what`` says what did not happen
    when it never comes), then for the task to train again, and analyse."""
    row: dict[str, Any] = {"trial": i, "ok": False, "error": None}
    marker = tmp / f"fired-{i}"
    try:
        all_idle(cluster)
        env = trial_env(tmp, megatron, opts.snapshot_every, **(inject or {}))
        with coordinator(cluster, tmp, **env) as c:
            task = start_task(c, name, tmp, megatron, *extra, data_parallel=data_parallel)
            note_before(c, task.task_id, row)
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not marker.exists():
                raise TrialFailed(f"{what} within 120 s")
            seen, mono_seen = time.time(), time.monotonic()
            t0 = marker.stat().st_mtime
            try:
                wait(
                    c,
                    lambda s: closed_incident(s) is not None and running(s, task.task_id, 0),
                    "training again",
                    opts.timeout_s,
                )
                row["ok"] = True
            except TrialFailed as e:
                row["error"] = str(e)
            analyse(c, row, task, t0, None, megatron, opts.events)
            if not data_parallel:
                row["marker_seen_s"] = round(seen - t0, 3)  # polled every 50 ms: within [0, ~0.1]
            clock_check(row, seen, mono_seen)
            if not data_parallel and row["ok"] and not -0.05 <= seen - t0 <= 1.0:
                row["ok"] = False
                row["error"] = f"the marker was seen {seen - t0:+.3f} s after its mtime: time zero unreliable"
            if data_parallel and row["ok"] and not row.get("in_flight_completed"):
                row["ok"] = False
                row["error"] = "the survivors did not complete the iteration in flight"
    except Exception as e:
        row["ok"] = False
        row["error"] = row["error"] or f"{type(e).__name__}: {str(e)[:300]}"
    return row


def dp_rank_trial(cluster: DevCluster, tmp: Path, i: int, opts: argparse.Namespace) -> dict[str, Any]:
    """``dp_rank_mid_iteration``: rank 2 of a data-parallel task SIGKILLs itself mid-iteration;
    the survivors (``--reuse-microbatches``) complete and save that iteration."""
    extra = (
        "--reuse-microbatches",
        f"--fail-at-iteration={opts.fail_at}",
        f"--fail-rank={DP_FAIL_RANK}",
        "--fail-mode=kill",
        "--fail-after-microbatches=1",
        f"--fail-once-marker={tmp / f'fired-{i}'}",
    )
    return marker_trial(
        cluster, tmp, i, opts, f"dp{i}", extra, data_parallel=True,
        what=f"rank {DP_FAIL_RANK} did not fail at iteration {opts.fail_at}",
    )  # fmt: skip


def first_report(c: Coordinator, job: int, iteration: int, timeout_s: float = 300.0) -> float:
    """The wall time of the first report of ``iteration`` by a rank of ``job`` (polled every
    20 ms; the reports carry the rank's own time stamp)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stamps = [m.wall_time_s for m in train_reports(c, job, last=50) if m.iteration == iteration]
        if stamps:
            return min(stamps)
        time.sleep(0.02)
    raise TrialFailed(f"iteration {iteration} not reported within {timeout_s:g} s")


def rolled_back(s: Snapshot) -> Incident | None:
    """The closed incident that rolled a task back (None until one is)."""
    return next((i for i in s.incidents.values() if not i.is_open and i.rollback is not None), None)


def spike_trial(cluster: DevCluster, tmp: Path, i: int, opts: argparse.Namespace) -> dict[str, Any]:
    """``loss_spike``: the batch of iteration ``--spike-at`` is corrupted (the built-in
    trainer's ``--corrupt-iterations``); unicornd rolls the task back past it."""
    row: dict[str, Any] = {"trial": i, "ok": False, "error": None}
    at = opts.spike_at
    try:
        all_idle(cluster)
        with coordinator(cluster, tmp, **trial_env(tmp, False, opts.snapshot_every)) as c:
            task = start_task(c, f"ls{i}", tmp, False, f"--corrupt-iterations={at}")
            job = task.job_id or 0
            note_before(c, task.task_id, row)
            t0 = first_report(c, job, at)
            seen, mono_seen = time.time(), time.monotonic()
            try:
                wait(
                    c,
                    lambda s: rolled_back(s) is not None and running(s, task.task_id, 0),
                    "training again after the roll back",
                    opts.timeout_s,
                )
                row["ok"] = True
            except TrialFailed as e:
                row["error"] = str(e)
            analyse(c, row, task, t0, None, False, opts.events)
            spike_figures(c, row, job, at)
            clock_check(row, seen, mono_seen)
    except Exception as e:
        row["ok"] = False
        row["error"] = row["error"] or f"{type(e).__name__}: {str(e)[:300]}"
    return row


def spike_figures(c: Coordinator, row: dict[str, Any], job: int, at: int) -> None:
    """The roll back's own figures (the module doc: ``loss_spike``), replacing the generic
    lost and recomputed counts; a trial whose records disagree fails."""
    snap = c.snapshot()
    inc = rolled_back(snap) if snap is not None else None
    if inc is None or inc.rollback is None:
        if row["ok"]:
            row["ok"], row["error"] = False, "no roll back recorded"
        return
    rb = inc.rollback
    row["rollback_version"], row["skipped"] = rb.version, rb.skipped
    replaced = [m.iteration for m in train_reports(c, job) if not m.launch_id.startswith(rb.launch)]
    last_old = max(replaced, default=at)
    row["iteration_at_fault"] = at
    row["iterations_past_fault"] = max(0, last_old - at)
    resumed_from = row.get("resumed_from")
    per_iteration = row.get("microbatches_per_iteration")
    lost = None if resumed_from is None else max(at, last_old) - resumed_from
    row["iterations_lost"] = lost
    row["recomputed_microbatches"] = None if lost is None or per_iteration is None else lost * per_iteration
    if row["ok"] and (rb.first, rb.last) != (at, at):
        row["ok"], row["error"] = False, f"rolled back past {rb.skipped}, not {at}-{at}"
    elif row["ok"] and (rb.version is None or rb.version != resumed_from):
        row["ok"], row["error"] = False, f"the incident says version {rb.version}, the ranks {resumed_from}"


def clock_check(row: dict[str, Any], wall0: float, mono0: float) -> None:
    """Every time here is wall clock: a step of it during the trial (the VM's clock being
    corrected) would shift the figures. Fails the trial when wall and monotonic time
    disagree by more than 0.2 s since (``wall0``, ``mono0``)."""
    step = (time.time() - wall0) - (time.monotonic() - mono0)
    row["clock_step_s"] = round(step, 3)
    if row["ok"] and abs(step) > 0.2:
        row["ok"] = False
        row["error"] = f"the wall clock stepped {step:+.3f} s during the trial"


# --- summaries ---------------------------------------------------------------------------


def summary(values: list[Any]) -> dict[str, Any]:
    xs = sorted(float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool))
    if not xs:
        return {"measured": 0, "median": None, "p95": None, "max": None}
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return {
        "measured": len(xs),
        "median": round(statistics.median(xs), 3),
        "p95": round(p95, 3),
        "max": round(xs[-1], 3),
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every trial counts: ``n`` is all of them, failed ones are counted with their error;
    a figure's statistics cover the trials that measured it (``measured``)."""
    out: dict[str, Any] = {
        "n": len(rows),
        "ok": sum(1 for r in rows if r["ok"]),
        "failed": sum(1 for r in rows if not r["ok"]),
        "failures": [f"#{r['trial']}: {r['error']}" for r in rows if not r["ok"]],
    }
    for key in FIGURES:
        out[key] = summary([r.get(key) for r in rows])
    out["rank_start"] = {k: summary([(r.get("rank_start") or {}).get(k) for r in rows]) for k in RANK_MARKS}
    out["layouts"] = sorted({f"{r.get('layout_before')} -> {r.get('layout_after')}" for r in rows})
    out["transitions"] = sorted({str(r.get("transition")) for r in rows})
    out["confirmed_by"] = sorted({str(r.get("confirmed_by")) for r in rows if "confirmed_by" in r})
    out["stage_paths"] = sorted({str(r.get("stages")) for r in rows})
    out["raw"] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--fail-at", type=int, default=14, help="iteration at which rank 1 raises")
    ap.add_argument(
        "--spike-at",
        type=int,
        default=32,
        help="loss_spike: the corrupted iteration (after the loss detector's 20 reports of warm-up)",
    )
    ap.add_argument(
        "--faults",
        default="node_loss,rank_exception",
        help=f"comma-separated: {', '.join(SCENARIOS)}, or node_loss for both node-loss scenarios",
    )
    ap.add_argument("--trainer", choices=("unicorn-train", "megatron"), default="unicorn-train")
    ap.add_argument(
        "--snapshot-every",
        type=int,
        default=None,
        help="the trainer's memory snapshot interval (UNICORN_CKPT__SNAPSHOT_EVERY; default: the config's)",
    )
    ap.add_argument(
        "--kill-after",
        type=int,
        default=11,
        help="node loss: kill after this iteration + (7 x trial) mod 10 (spread over the snapshot cycle)",
    )
    ap.add_argument("--timeout-s", type=float, default=180.0, help="per trial, fault -> training again")
    ap.add_argument(
        "--events", action="store_true", help="keep unicornd's log (relative to the fault) in each row"
    )
    ap.add_argument(
        "--slurm",
        default="22.05",
        help="Slurm release of the bench's cluster: 22.05 (the host's) or 24.11 (dev-cluster's chroot)",
    )
    args = ap.parse_args()
    megatron = args.trainer == "megatron"
    if megatron and not (MEGATRON_LM / "pretrain_gpt.py").exists():
        ap.error(f"Megatron-LM's pretrain_gpt.py not found under {MEGATRON_LM} (set UNICORN_MEGATRON_LM)")
    wanted = [f.strip() for f in args.faults.split(",") if f.strip()]
    expanded = [s for f in wanted for s in ((SPARE, NO_SPARE) if f == "node_loss" else (f,))]
    unknown = set(expanded) - set(SCENARIOS)
    if unknown or args.trials < 1:
        ap.error(f"unknown faults {sorted(unknown)} or --trials < 1")
    if megatron and NO_SPARE_DP in expanded:
        ap.error(f"{NO_SPARE_DP} needs the built-in trainer (its DDP replicas' just-in-time snapshots)")
    if megatron and DP_MID in expanded:
        ap.error(f"{DP_MID} needs the built-in trainer (--reuse-microbatches)")
    if megatron and SPIKE in expanded:
        ap.error(f"{SPIKE} needs the built-in trainer (--corrupt-iterations)")
    scenarios = list(dict.fromkeys(expanded))
    t_start = time.monotonic()
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as d:
        root = Path(d)
        root.chmod(0o755)
        os.environ["TMPDIR"] = str(root)  # torchrun's torchelastic_* folders go with the run
        cluster = start_cluster(
            root / "cluster", "--nodes", "4", "--gpus-per-node", "1", "--slurm", args.slurm
        )
        slurm_version = cluster.slurm("sinfo", "--version").stdout.strip()  # e.g. "slurm-wlm 24.11.5"
        try:
            for i in range(args.trials):
                for scenario in scenarios:
                    tmp = root / f"{scenario}-{i}"
                    tmp.mkdir()
                    if scenario == EXCEPTION:
                        row = exception_trial(cluster, tmp, i, megatron, args)
                    elif scenario == DP_MID:
                        row = dp_rank_trial(cluster, tmp, i, args)
                    elif scenario == SPIKE:
                        row = spike_trial(cluster, tmp, i, args)
                    else:
                        row = node_loss_trial(
                            cluster,
                            tmp,
                            i,
                            scenario == SPARE,
                            megatron,
                            args,
                            data_parallel=scenario == NO_SPARE_DP,
                        )
                    results[scenario].append(row)
                    brief = {k: v for k, v in row.items() if k not in ("events", "timeline")}
                    print(f"{scenario} #{i}: {json.dumps(brief)}", file=sys.stderr, flush=True)
        finally:
            cluster.script("down", check=False)
    out: dict[str, Any] = {
        "bench": "recovery",
        "trainer": args.trainer,
        "trials": args.trials,
        "slurm": slurm_version,
        "fail_at": args.fail_at,
        "spike_at": args.spike_at,
        "snapshot_every": args.snapshot_every,
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    for scenario, rows in results.items():
        out[scenario] = summarise(rows)
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
