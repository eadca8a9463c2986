#!/usr/bin/env python3
"""unicornd at cluster scale: N emulated node agents against a real Redis and a real unicornd.

For each N in ``--sizes`` (8 GPUs a node; ``N // 16`` jobs, at most ``--jobs``) it starts a
private redis-server, commits a cluster whose jobs the real planner laid out, starts
unicornd, lets N agents heartbeat (1 Hz) and train for ``--duration-s`` while single-node
faults arrive at ``--fault-rate`` a minute and ``--burst`` whole racks of ``--rack-size``
nodes die at once, and measures. Prints ONE JSON object: one row per N, the curves, and
each metric's growth exponent against N (the slope of a least-squares line through
log(metric) over log(N): 1 is linear, 2 quadratic; null with fewer than two values).

What is real
------------
- **redis-server** (private, append-only file with ``appendfsync everysec``, as the dev
  cluster runs it) and every key, stream and message of the protocol
  (:mod:`unicorn_core.keys`, :mod:`unicorn_core.protocol`).
- **unicornd**: :class:`unicornd.daemon.Daemon` with all its root tasks (ingest through the
  consumer group, detector, ticker, Slurm watch, decide/resolve/commit, the executor, the
  leader lease, liveness), run in its own process by ``scale_daemon.py`` exactly as
  :func:`unicornd.daemon.run_daemon` runs it, configured through ``UNICORN_*`` variables.
  The planner in it is the real one (every SEV1 drain replans the whole cluster).
- The cluster state unicornd starts from: tasks on the nodes the real planner gave them
  (:func:`unicornd.replan.replan_decision`), committed by :class:`unicornd.store.Store`.

What is emulated, and why
-------------------------
- **Slurm** (``scale_slurm.py``): 4,096 slurmd do not fit on one machine. A scripted
  backend answers every SlurmBackend call after latencies measured on the dev cluster
  (:class:`scale_slurm.SlurmTimings` cites each) and hands unicornd's real parser the JSON
  ``sinfo``/``squeue --json`` of Slurm 22.05.8 would print; it starts a real process per
  ``srun`` step. Node deaths follow the fault schedule; slurmctld marks them NOT_RESPONDING
  5.5 s later (dev cluster: 4.9-6.3 s with SlurmdTimeout=3).
- **Node agents** (``scale_agents.py``): 4,096 Python agents do not fit either. One
  process writes every agent's messages (each tick's in one pipeline) and answers
  commands after fixed delays; no torchrun, no ranks, no checkpoints. A job's step time
  is the performance model's for the layout unicornd committed for it, read again at each
  launch and relaunch (:func:`step_time_of`), so the calibration measures what the
  planner predicts: the calibration's own behaviour is tested elsewhere, and a step time
  that ignores the layout made it reshuffle the cluster on false evidence.
- **Registration**: tasks are committed already running (a registration is MUNGE-signed,
  and munged is not part of this bench).
- Configuration differs from the defaults only where the emulation needs it: no SSH probe
  (``[ssh] enabled = false``: there are no nodes to log in to; silence is confirmed by
  Slurm's NOT_RESPONDING, the documented fallback), no per-job Redis users
  (``agent_acl = false``), and the breakers meant for a real cluster's fault rate opened
  (drain limiter, budget, no-progress, node failure limit), as the soak bench does,
  because faults arrive here every few seconds. ``[leader] lease_s`` is 30 s instead of
  3 s: at 4,096 nodes a loop stall at start lost the default lease and ended unicornd
  before anything could be measured; ``lease_kept_at_default`` says whether the default
  would have held.

Measured per N, over the window: event-loop lag (a task in unicornd that sleeps 50 ms
and records how late it wakes), events handled per second (agent entries unicornd's group
read and acknowledged, i.e. committed, from ``XINFO GROUPS``) against those offered, and the
backlog left; CPU (share of one core) of unicornd, of this generator and of Redis, the time
unicornd's main thread waited for a CPU (the machine is shared: contention, not work), and
RSS; Redis ``used_memory`` and commands per second (``INFO``); every commit's snapshot
bytes, serialisation and total time (:attr:`unicornd.store.Store.on_commit`).

Latencies are measured from the moment unicornd could know of a fault (``evidence``: the
fault's message written to Redis; for a dead node, its last heartbeat plus
``detect.heartbeat_timeout_s``) to the commit of the decision that opened its incident
(``fault_to_decision``) and to the first side effect of that incident's actions (an agent
command written, or a Slurm call: ``fault_to_first_action``); ``*_from_injection`` adds the
detection delay. Plan latency: ``plan_full_solve_ms`` times the function every replan
calls (:func:`unicornd.replan.replan_decision`) in this process after the run, on
unicornd's last committed snapshot with one node drained. unicornd counts its own replans
(:class:`unicornd.replan.SolveCache`): those whose plan its one-step lookup had solved
ahead (:mod:`unicornd.lookup`, ``replans_cached``, ``plan_lookup_hit_ms``) and those it
solved (``replans_solved``, ``plan_solve_in_unicornd_ms``); ``lookup_hit_rate`` is the
first share, over the whole run (a rack lost at once is one step the table does not
foresee: its replans are solved). ``lookup_hit_rate_one_step`` leaves out only the misses whose
state was more than one step from the newest table's (``lookup_misses`` gives each miss's
reason; a miss for want of a table, or of one on the current basis, still counts): the
single-node failures the table is built for, the share issue 20 asks of it.

Run (2 cores: the generator, Redis and unicornd share them; run it niced; the rows give
the load average, and ``unicornd_runqueue_wait_share`` how much of it unicornd felt):
``nice -n 10 .venv/bin/python scripts/bench/scale.py --quick`` (N = 64, 256; ~1 min),
``nice -n 10 .venv/bin/python scripts/bench/scale.py --duration-s 60 --fault-rate 12``
(N = 64 to 4,096; ~7 min). Everything runs in one temporary folder, removed at the end;
only the processes it started are stopped, by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import pickle
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, cast

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.append(str(HERE))  # after the packages: scripts/bench/ckpt.py must not shadow ckpt

import redis.asyncio as aioredis  # noqa: E402
from scale_agents import AgentTimings, Fault, Fleet, InjectedFault, Job, deaths, fault_schedule  # noqa: E402
from scale_daemon import LAG_PERIOD_S, slurm_stream, t0_key  # noqa: E402
from scale_slurm import SlurmTimings  # noqa: E402

from plan.perf import estimate_layout  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from unicorn_core import redis_io  # noqa: E402
from unicorn_core.config import Config, load_config  # noqa: E402
from unicorn_core.errors import RedisCallError, UnicornError  # noqa: E402
from unicorn_core.keys import RedisKeys  # noqa: E402
from unicorn_core.taskspec import load_task_file  # noqa: E402
from unicornd.replan import PlanContext, replan_decision  # noqa: E402
from unicornd.solvecache import SolveCache  # noqa: E402
from unicornd.state import NodeHealth, NodeRecord, Snapshot, TaskRecord, TaskState  # noqa: E402
from unicornd.store import Store, read_snapshot  # noqa: E402

SIZES: Final = (64, 256, 1024, 4096)
QUICK_SIZES: Final = (64, 256)
GPUS_PER_NODE: Final = 8
NODES_PER_JOB: Final = 16
FIRST_JOB: Final = 5001
PREFIX: Final = "scale"
MODELS: Final = ("gpt3-1.3b", "gpt3-7b", "gpt3-13b")
"""The jobs' models, in turn (``etc/tasks``)."""
DAEMON_START_S: Final = 240.0
REDIS_LATENCY_THRESHOLD_MS: Final = 100
LATE_MS: Final = 100.0
"""Loop-lag samples from this long are attributed to garbage collections that overlap them."""
"""Redis's latency monitor records its stalls from this long (``LATENCY LATEST``)."""
LEASE_S: Final = 30.0
"""``[leader] lease_s`` here (default 3 s): one unicornd, no takeover measured, and with the
default a loop stall over ~2 s (seen at start with 4,096 nodes) loses the lease and ends
unicornd; ``lease_kept_at_default`` says whether the default would have held."""
DEFAULT_LEASE_STALL_MS: Final = 2000.0
"""The longest loop stall the default lease survives (it renews every 1 s and lasts 3 s)."""
STOP_S: Final = 45.0
STOP_LOOPS_S: Final = 5.0
GROWTH_METRICS: Final = (
    "loop_lag_p99_ms",
    "events_per_s",
    "unicornd_cpu_core_share",
    "unicornd_rss_mib",
    "redis_used_memory_mib",
    "redis_ops_per_s",
    "commit_bytes_p50",
    "commit_ms_p50",
    "commit_ms_p95",
    "commits_per_s",
    "fault_to_decision_p95_s",
    "fault_to_first_action_p95_s",
    "plan_full_solve_ms",
)


# --- pure helpers ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def growth_exponent(xs: Sequence[float], ys: Sequence[float | None]) -> float | None:
    """Least-squares slope of log(y) over log(x): y ~ x^k gives k. Points with a missing or
    non-positive y are left out; None with fewer than two points left."""
    pts = [
        (math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y is not None and y > 0 and x > 0
    ]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def jobs_for(nodes: int, max_jobs: int) -> int:
    """How many jobs a cluster of ``nodes`` runs: one per 16 nodes, at most ``max_jobs``."""
    return max(1, min(max_jobs, nodes // NODES_PER_JOB))


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class Match:
    """What became of one injected fault: the incident that took it in, when the decision
    on it was committed and when the first of that decision's actions took effect (wall
    times; None: not seen)."""

    fault: InjectedFault
    incident: str | None
    decided_wall: float | None
    acted_wall: float | None


def _caused_by(finding: str, f: InjectedFault) -> bool:
    """The finding id names the fault: its message's stream entry (``<entry>:<source>``),
    or, for a dead node, the node's silence (``heartbeat:<job>:<node>:...``, Slurm's
    ``slurm:<node>:...``; see :mod:`unicornd.inputs`)."""
    if f.entry_id:
        return finding.startswith(f"{f.entry_id}:")
    return any(finding.startswith((f"heartbeat:{f.job_id}:{n}:", f"slurm:{n}:")) for n in f.nodes)


def first_effect(
    actions: Sequence[Sequence[Any]],
    after: float,
    commands: Sequence[Mapping[str, Any]],
    slurm_calls: Sequence[Mapping[str, Any]],
) -> float | None:
    """When the first of ``actions`` (``[id, kind, node, job]``, decided at ``after``) took
    effect: its agent command written, or its Slurm call made (None: none did)."""
    ids = {str(a[0]) for a in actions}
    times = [float(c["t"]) for c in commands if c["id"] in ids]
    wanted = set()
    for aid, kind, node, job in actions:
        if kind == "drain_node":
            wanted |= {("drain", node), ("down", node)}
        elif kind == "check_node":
            wanted.add(("node_check", node))
        elif kind in ("shrink", "grow", "requeue"):
            wanted.add((kind, job))
        elif kind == "launch_agents":
            wanted.add(("launch", aid))
    for c in slurm_calls:
        if float(c["t"]) < after:
            continue
        keys = {(c["op"], c["job"]), (c["op"], c["launch"]), *((c["op"], n) for n in c["nodes"])}
        if keys & wanted:
            times.append(float(c["t"]))
    return min(times) if times else None


def match_faults(
    faults: Sequence[InjectedFault],
    commits: Sequence[Mapping[str, Any]],
    commands: Sequence[Mapping[str, Any]],
    slurm_calls: Sequence[Mapping[str, Any]],
) -> tuple[list[Match], list[Mapping[str, Any]]]:
    """Each fault with the first commit whose incidents took in a finding it caused, and
    that commit's first effect; and the incidents opened by findings no fault caused
    (``commits``: what ``scale_daemon.Recorder.follow`` recorded)."""
    ordered = sorted(commits, key=lambda c: float(c["t"]))
    out = []
    explained: set[str] = set()
    for f in faults:
        hit = None
        for c in ordered:
            if float(c["t"]) < f.at_wall - 0.05:
                continue
            inc = next((i for i in c["incidents"] if any(_caused_by(x, f) for x in i["findings"])), None)
            if inc is not None:
                hit = (c, inc)
                break
        if hit is None:
            out.append(Match(f, None, None, None))
            continue
        c, inc = hit
        decided = float(c["t"])
        explained.add(str(inc["id"]))
        out.append(
            Match(f, str(inc["id"]), decided, first_effect(c["actions"], decided, commands, slurm_calls))
        )
    opened = [i | {"t": c["t"]} for c in ordered for i in c["incidents"] if i["new"]]
    return out, [i for i in opened if i["id"] not in explained]


# --- processes ---------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def runqueue_wait_s(pid: int) -> float:
    """Seconds process ``pid``'s main thread waited runnable for a CPU (``/proc/PID/schedstat``)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (scripts/bootstrap installs it)")
    folder.mkdir(parents=True)
    port = free_port()
    server = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return server, port
        except OSError:
            if time.monotonic() > deadline:
                stop(server)
                raise
            time.sleep(0.05)


def stop(p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait_s: float = 10.0) -> int:
    """Signal the process we started (by its pid), wait, SIGKILL if it does not end."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return p.returncode


def child_env(
    port: int, lookup_min_nodes: int | None = None, stream_retention_s: float | None = None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICORN_")}
    if lookup_min_nodes is not None:
        env["UNICORN_PLAN__LOOKUP_MIN_NODES"] = str(lookup_min_nodes)
    if stream_retention_s is not None:
        env["UNICORN_REDIS__STREAM_RETENTION_S"] = str(stream_retention_s)
    env.update(
        {
            "UNICORN_REDIS__URL": f"redis://127.0.0.1:{port}/0",
            "UNICORN_REDIS__KEY_PREFIX": PREFIX,
            "UNICORN_REDIS__AGENT_ACL": "false",
            "UNICORN_SSH__ENABLED": "false",
            "UNICORN_RECOVERY__MIN_DRAINS_PER_WINDOW": "100000",
            "UNICORN_RECOVERY__RECOVERY_BUDGET": "100000",
            "UNICORN_RECOVERY__NO_PROGRESS_LIMIT": "100000",
            "UNICORN_RECOVERY__NODE_FAILURE_LIMIT": "100000",
            "UNICORN_LOG__LEVEL": "info",
            "UNICORN_LEADER__LEASE_S": str(LEASE_S),
        }
    )
    return env


# --- the cluster unicornd starts from ------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    snapshot: Snapshot
    nodes: tuple[str, ...]
    jobs: dict[int, tuple[str, ...]]
    job_task: dict[int, str]
    iter_s: dict[int, float]
    samples: dict[int, int]


def build_cluster(n_nodes: int, n_jobs: int, cfg: Config, ctx: PlanContext, now: float) -> Cluster:
    """``n_jobs`` tasks registered on equal shares of the nodes (1/32 of them left spare),
    laid out by the real planner and committed as running on the nodes it chose."""
    names = tuple(f"n{i:04d}" for i in range(1, n_nodes + 1))
    specs = [load_task_file(REPO / "etc" / "tasks" / f"{m}.toml") for m in MODELS]
    spare = max(1, n_nodes // 32)
    per = max(1, (n_nodes - spare) // n_jobs)
    tasks = {}
    for j in range(n_jobs):
        spec = specs[j % len(specs)]
        tid = f"t{j:03d}"
        tasks[tid] = TaskRecord(
            tid,
            tid,
            spec.model,
            ("python", "pretrain_gpt.py"),
            min_gpus=spec.min_gpus,
            job_id=FIRST_JOB + j,
            nodes=names[j * per : (j + 1) * per],
        )
    pending = Snapshot(tasks, {n: NodeRecord(n) for n in names}, GPUS_PER_NODE, policy=cfg.recovery)
    plan, decision = replan_decision(pending, ctx, now)
    planned = decision.applied_to(pending)
    estimates = {a.task: a.estimate for a in plan.assignments} if plan is not None else {}
    running: dict[str, TaskRecord] = {}
    for t in planned.tasks.values():
        if not t.nodes or t.layout is None:
            continue  # the planner gave it nothing: left out of the bench
        running[t.task_id] = replace(
            t,
            state=TaskState.RUNNING,
            resizes_this_run=0,
            launched_s=now - 600,
            last_iteration=100,
            last_iteration_s=now,
        )
    held = {n: (t.job_id,) for t in running.values() if t.job_id is not None for n in t.nodes}
    nodes = {n: replace(r, jobs=cast(tuple[int, ...], held.get(n, ()))) for n, r in planned.nodes.items()}
    snap = replace(planned, tasks=running, nodes=nodes)
    jobs = {cast(int, t.job_id): t.nodes for t in running.values()}
    iter_s = {}
    samples = {}
    for t in running.values():
        est = estimates.get(t.name)
        iter_s[cast(int, t.job_id)] = est.iteration_s if est is not None else 2.0
        samples[cast(int, t.job_id)] = t.model.global_batch
    return Cluster(
        snap, names, jobs, {cast(int, t.job_id): t.task_id for t in running.values()}, iter_s, samples
    )


def step_time_of(ctx: PlanContext, gpus_per_node: int) -> Callable[[bytes], float | None]:
    """A stored task record (``{"o": n, "r": record}``) -> the performance model's step
    time of its layout (None: no layout, or a record this bench cannot read)."""

    def step_time(raw: bytes) -> float | None:
        try:
            doc = json.loads(raw)
            task = TaskRecord.from_dict(doc["r"])
        except (ValueError, KeyError, TypeError, UnicornError):
            return None
        if task.layout is None:
            return None
        try:
            return estimate_layout(task.model, task.layout, ctx.gpu, gpus_per_node, ctx.assume).iteration_s
        except UnicornError:
            return None

    return step_time


def failure_snapshot(snap: Snapshot) -> Snapshot:
    """``snap`` with one node of its largest running task drained (the failure path's replan input)."""
    tasks = [
        t for t in snap.tasks.values() if t.state in (TaskState.RUNNING, TaskState.RECOVERING) and t.nodes
    ]
    if not tasks:
        return snap
    victim = max(tasks, key=lambda t: (len(t.nodes), t.task_id)).nodes[-1]
    rec = snap.nodes[victim]
    return snap.apply(nodes=[replace(rec, health=NodeHealth.DRAINED, reason="bench: drained")])


def time_full_solve(snap: Snapshot, ctx: PlanContext, repeats: int = 5) -> list[float]:
    """Milliseconds of :func:`unicornd.replan.replan_decision` solving (after one warm-up
    call; each with an empty solve cache, so every call solves)."""
    failed = failure_snapshot(snap)
    replan_decision(failed, replace(ctx, solves=SolveCache()), time.time())
    out = []
    for _ in range(repeats):
        fresh = replace(ctx, solves=SolveCache())
        t = time.perf_counter()
        replan_decision(failed, fresh, time.time())
        out.append((time.perf_counter() - t) * 1000)
    return out


# --- one size ------------------------------------------------------------------------------


def daemon_sample(pid: int) -> tuple[float, float, float, float] | None:
    """(wall time, CPU s, run-queue wait s, RSS MiB) of process ``pid``; None once it is gone."""
    try:
        return time.time(), cpu_s(pid), runqueue_wait_s(pid), rss_mib(pid)
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Sample:
    wall: float
    self_cpu_s: float
    redis: dict[str, Any]
    entries_read: int
    backlog: int
    heartbeats: int
    iterations: int
    events: int
    live_agents: int


async def _groups(client: aioredis.Redis, streams: Sequence[str]) -> tuple[int, int]:
    """Over ``streams``: the entries unicornd has handled (delivered to its group and
    acknowledged, i.e. committed), and those it has not (undelivered or pending)."""
    read = backlog = 0
    for s in streams:
        try:
            groups = await redis_io.call(("XINFO", "GROUPS", s), client.xinfo_groups(s))
        except RedisCallError:  # a stream no one wrote yet
            continue
        for g in groups:
            pending = int(g.get("pending") or 0)
            read += int(g.get("entries-read") or 0) - pending
            backlog += int(g.get("lag") or 0) + pending
    return read, backlog


async def _sample(client: aioredis.Redis, fleet: Fleet, streams: Sequence[str]) -> Sample:
    info = cast(dict[str, Any], await redis_io.call(("INFO",), client.info()))
    read, backlog = await _groups(client, streams)
    c = fleet.counters
    return Sample(
        time.time(),
        cpu_s(os.getpid()),
        info,
        read,
        backlog,
        c.heartbeats,
        c.iterations,
        c.events,
        fleet.live_agents(),
    )


def logged_errors(path: Path) -> dict[str, int]:
    """How often unicornd logged each error event (its log is JSON lines)."""
    counts: Counter[str] = Counter()
    seen: set[str] = set()
    for line in path.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            counts["(not json)"] += 1
            continue
        if isinstance(doc, dict) and doc.get("level") in ("error", "critical"):
            what = str(doc.get("event", "?")).split("\n", 1)[0][:80]
            if what not in seen and len(seen) < 20:  # each kind's first in full, on stderr
                seen.add(what)  # (the run's folder, its log with it, is removed at the end)
                log(f"unicornd logged: {line[:4000]}")
            if what == "root_task_ended":  # why unicornd ended: worth its words
                what = f"{what}: {doc.get('task')}: {str(doc.get('error'))[:160]}"
            elif what == "shutdown_stuck":
                what = f"{what}: {doc.get('tasks')}"
            counts[what] += 1
    return dict(counts)


def spawn_daemon(folder: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """``scale_daemon.py`` in its own session, its output in ``folder/unicornd.log``."""
    with (folder / "unicornd.log").open("wb") as log_file:
        return subprocess.Popen(
            [sys.executable, str(HERE / "scale_daemon.py"), str(folder / "spec.json")],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )


async def _commit(cfg: Config, snap: Snapshot) -> None:
    client = redis_io.connect(cfg.redis, client_name="scale-bench")
    try:
        await Store(client, RedisKeys(cfg.redis.key_prefix), cfg.recovery).commit(snap)
    finally:
        await client.aclose()


async def _last_snapshot(cfg: Config) -> Snapshot | None:
    client = redis_io.connect(cfg.redis, client_name="scale-bench")
    try:
        return await read_snapshot(client, RedisKeys(cfg.redis.key_prefix), cfg.recovery)
    finally:
        await client.aclose()


def run_size(n_nodes: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One N: a fresh Redis and unicornd, the window measured, everything stopped."""
    redis_proc, port = start_redis(folder / "redis")
    daemon: subprocess.Popen[bytes] | None = None
    try:
        env = child_env(port, args.lookup_min_nodes, args.stream_retention_s)
        if args.tracemalloc_every_s > 0:  # tracing slows every allocation: no timeout for it
            env["UNICORN_REDIS__SOCKET_TIMEOUT_S"] = "60"
        cfg = load_config(None, env=env)
        ctx = PlanContext.from_config(cfg)
        cluster = build_cluster(n_nodes, jobs_for(n_nodes, args.jobs), cfg, ctx, time.time())
        asyncio.run(_commit(cfg, cluster.snapshot))
        schedule = fault_schedule(
            args.seed + n_nodes,
            cluster.nodes,
            args.duration_s,
            rate_per_min=args.fault_rate,
            bursts=args.burst,
            rack_size=args.rack_size,
        )
        spec = {
            "nodes": list(cluster.nodes),
            "jobs": {str(j): list(ns) for j, ns in cluster.jobs.items()},
            "gpus_per_node": GPUS_PER_NODE,
            "slurm_timings": dataclasses.asdict(SlurmTimings()),
            "deaths": deaths(schedule),
            "out": str(folder / "daemon.json"),
            "tracemalloc_every_s": args.tracemalloc_every_s,
            "tracemalloc_frames": args.tracemalloc_frames,
            "malloc_trim_every_s": args.malloc_trim_every_s,
        }
        (folder / "spec.json").write_text(json.dumps(spec))
        daemon = spawn_daemon(folder, env)
        log(f"N={n_nodes}: {len(cluster.jobs)} jobs planned, unicornd started")
        row, fleet, status = asyncio.run(_drive(n_nodes, args, cfg, ctx, cluster, daemon, schedule))
        log(f"N={n_nodes}: unicornd stopped ({status}); analysing")
        out = folder / "daemon.json"
        dump = json.loads(out.read_text()) if out.exists() else {}
        row.update(_analyse(row, fleet, dump, status, args.tail_s))
        final = asyncio.run(_last_snapshot(cfg))
        log(f"N={n_nodes}: timing the full solve")
        solve = time_full_solve(final, ctx) if final is not None else []
        row["plan_full_solve_ms"] = _r(statistics.median(solve)) if solve else None
        row["plan_full_solve_ms_max"] = _r(max(solve)) if solve else None
        row["unicornd_errors"] = logged_errors(folder / "unicornd.log")
        if args.keep_log is not None:  # a diagnostic: the run's folder is removed at the end
            args.keep_log.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / "unicornd.log", args.keep_log / f"unicornd-{n_nodes}.log")
        return row
    finally:
        if daemon is not None:
            stop(daemon, signal.SIGKILL)
        stop(redis_proc)


async def _drive(
    n_nodes: int,
    args: argparse.Namespace,
    cfg: Config,
    ctx: PlanContext,
    cluster: Cluster,
    daemon: subprocess.Popen[bytes],
    schedule: Sequence[Fault],
) -> tuple[dict[str, Any], Fleet, int]:
    """The agents run while unicornd starts, through the window and the tail; unicornd is
    stopped (SIGINT, as an operator would) before they stop, so their silence is no finding."""
    keys = RedisKeys(cfg.redis.key_prefix)
    client = redis_io.connect(cfg.redis, client_name="scale-bench")
    jobs = [
        Job(j, cluster.job_task[j], ns, GPUS_PER_NODE, 100, cluster.iter_s[j], cluster.samples[j])
        for j, ns in cluster.jobs.items()
    ]
    fleet = Fleet(
        client,
        keys,
        jobs,
        heartbeat_interval_s=cfg.agent.heartbeat_interval_s,
        heartbeat_ttl_s=cfg.agent.heartbeat_ttl_s,
        heartbeat_timeout_s=cfg.detect.heartbeat_timeout_s,
        events_stream=slurm_stream(PREFIX),
        seed=args.seed,
        step_time=step_time_of(ctx, GPUS_PER_NODE),
    )
    loops = [
        asyncio.create_task(fleet.tick_loop(), name="ticks"),
        asyncio.create_task(fleet.write_loop(), name="writes"),
        asyncio.create_task(fleet.commands_loop(), name="commands"),
        asyncio.create_task(fleet.slurm_loop(), name="slurm-events"),
    ]
    try:
        row = await _measure(n_nodes, args, cluster, fleet, client, keys, daemon, schedule)
    finally:
        status = await asyncio.to_thread(stop, daemon, signal.SIGINT, STOP_S)
        for t in loops:
            t.cancel()
        _, stuck = await asyncio.wait(loops, timeout=STOP_LOOPS_S)
        if stuck:  # a cancelled read that does not return: close its connection under it
            log(f"N={n_nodes}: agent loops not ended after cancel: {[t.get_name() for t in stuck]}")
            for t in stuck:
                t.print_stack(file=sys.stderr)
            await client.connection_pool.disconnect(inuse_connections=True)
            await asyncio.wait(stuck, timeout=STOP_LOOPS_S)
        await asyncio.wait_for(client.aclose(), STOP_LOOPS_S)
    return row, fleet, status


async def _measure(
    n_nodes: int,
    args: argparse.Namespace,
    cluster: Cluster,
    fleet: Fleet,
    client: aioredis.Redis,
    keys: RedisKeys,
    daemon: subprocess.Popen[bytes],
    schedule: Sequence[Fault],
) -> dict[str, Any]:
    deadline = time.monotonic() + DAEMON_START_S
    started = time.monotonic()
    while not await redis_io.call(("EXISTS",), client.exists(keys.daemon_liveness())):
        if daemon.poll() is not None:
            raise SystemExit(f"unicornd exited {daemon.returncode} at start (N={n_nodes})")
        if time.monotonic() > deadline:
            raise SystemExit(f"unicornd did not start within {DAEMON_START_S:g} s (N={n_nodes})")
        await asyncio.sleep(0.2)
    startup_s = time.monotonic() - started
    log(f"N={n_nodes}: unicornd up after {startup_s:.1f} s; warm-up {args.warmup_s:g} s")
    # Redis records its own stalls of 100 ms or more (fork, AOF write and fsync, slow commands).
    await redis_io.call(
        ("CONFIG", "SET"), client.config_set("latency-monitor-threshold", REDIS_LATENCY_THRESHOLD_MS)
    )
    await asyncio.sleep(args.warmup_s)
    t0 = time.time() + 0.2
    await redis_io.call(("SET",), client.set(t0_key(PREFIX), repr(t0)))
    faults = asyncio.create_task(fleet.faults_loop(schedule, t0))
    streams = [s for j in cluster.jobs for s in (keys.events(j), keys.command_results(j))]
    await asyncio.sleep(max(0.0, t0 - time.time()))
    first = await _sample(client, fleet, streams)
    proc = [s for s in [daemon_sample(daemon.pid)] if s is not None]
    redis_mem: list[float] = []
    live: list[int] = []
    died_s = None
    while time.time() < t0 + args.duration_s:
        if daemon.poll() is not None:
            died_s = time.time() - t0
            log(f"N={n_nodes}: unicornd exited {daemon.returncode} {died_s:.0f} s into the window")
            break
        live.append(fleet.live_agents())
        memory = await redis_io.call(("INFO", "memory"), client.info("memory"))
        redis_mem.append(float(memory["used_memory"]) / 2**20)
        await asyncio.sleep(1.0)
        proc += [s for s in [daemon_sample(daemon.pid)] if s is not None]
    last = await _sample(client, fleet, streams)
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xlen(stream)
    stream_entries = sum(await redis_io.call(("XLEN", *streams[:2]), pipe.execute()))
    latency = await redis_io.call(("LATENCY", "LATEST"), client.execute_command("LATENCY", "LATEST"))
    log(f"N={n_nodes}: window over; tail {args.tail_s:g} s")
    await asyncio.sleep(args.tail_s)  # decisions on the last faults
    faults.cancel()
    await asyncio.gather(faults, return_exceptions=True)
    span = max(1e-9, last.wall - first.wall)
    ri, rf = first.redis, last.redis
    p_span = max(1e-9, proc[-1][0] - proc[0][0]) if proc else 1.0
    rss = [p[3] for p in proc]
    offered = (last.events - first.events) / span
    read = (last.entries_read - first.entries_read) / span
    agents = statistics.fmean(live) if live else float(last.live_agents)
    return {
        "nodes": n_nodes,
        "gpus": n_nodes * GPUS_PER_NODE,
        "jobs": len(cluster.jobs),
        "window": (first.wall, last.wall),
        "window_s": _r(span, 1),
        "unicornd_startup_s": _r(startup_s, 2),
        "events_per_s": _r(read, 1),
        "events_offered_per_s": _r(offered, 1),
        "events_backlog_end": last.backlog,
        "events_sustained": last.backlog <= max(offered, 1.0) * 2,
        "heartbeats_per_s": _r((last.heartbeats - first.heartbeats) / span, 1),
        "heartbeats_per_s_target": _r(agents / fleet.hb_interval_s, 1),
        "agents_live_mean": _r(agents, 1),
        "iterations_per_s": _r((last.iterations - first.iterations) / span, 2),
        "generator_cpu_core_share": _r((last.self_cpu_s - first.self_cpu_s) / span),
        "generator_late_tick_share": _r(fleet.counters.late_ticks / max(1, fleet.counters.ticks)),
        "generator_write_delay_max_ms": _r(fleet.counters.write_delay_max_s * 1000, 1),
        "generator_tick_late_max_ms": _r(max((v for _t, v in fleet.counters.late), default=0.0) * 1000, 1),
        "unicornd_cpu_core_share": _r((proc[-1][1] - proc[0][1]) / p_span) if proc else None,
        "unicornd_runqueue_wait_share": _r((proc[-1][2] - proc[0][2]) / p_span) if proc else None,
        "unicornd_died_in_window_s": _r(died_s, 1),
        "unicornd_rss_mib": _r(rss[-1] if rss else None, 1),
        "unicornd_rss_max_mib": _r(max(rss) if rss else None, 1),
        "unicornd_rss_growth_mib_per_h": _r((rss[-1] - rss[0]) / p_span * 3600 if len(rss) > 1 else None, 1),
        "unicornd_rss_growth_mib_per_h_second_half": _slope_per_h(
            [(p[0], p[3]) for p in proc], proc[0][0], proc[-1][0]
        )
        if proc
        else None,
        # robust to transient peaks (a trim returns them within a minute): the slope of the
        # 5-minute minima over the second half, and each minute's (min, max); added after
        # the hour of 2026-11-29 (session 28), whose least-squares slope rose with two peaks
        # near its end
        "unicornd_rss_floor_growth_mib_per_h_second_half": _slope_per_h(
            _minima([(p[0], p[3]) for p in proc], 300.0), proc[0][0], proc[-1][0]
        )
        if proc
        else None,
        "unicornd_rss_mib_by_minute": [
            [_r(lo, 1), _r(hi, 1)] for lo, hi in _by_minute([(p[0], p[3]) for p in proc])
        ],
        "redis_used_memory_mib": _r(redis_mem[-1] if redis_mem else None, 1),
        "redis_used_memory_mib_at": {
            f"{round(100 * q)}%": _r(redis_mem[int(q * (len(redis_mem) - 1))], 1) for q in (0.25, 0.5, 0.75)
        }
        if redis_mem
        else None,
        "redis_stream_entries": stream_entries,
        "redis_ops_per_s": _r(
            (int(rf["total_commands_processed"]) - int(ri["total_commands_processed"])) / span, 1
        ),
        "redis_cpu_core_share": _r(
            (
                float(rf["used_cpu_sys"])
                + float(rf["used_cpu_user"])
                - float(ri["used_cpu_sys"])
                - float(ri["used_cpu_user"])
            )
            / span
        ),
        "redis_aof_rewrites": int(rf.get("aof_rewrites", 0)) - int(ri.get("aof_rewrites", 0)),
        "redis_aof_delayed_fsync": int(rf.get("aof_delayed_fsync", 0)) - int(ri.get("aof_delayed_fsync", 0)),
        "redis_latest_fork_ms": _r(int(rf.get("latest_fork_usec", 0)) / 1000, 1),
        "redis_latency_max_ms": {
            (e.decode() if isinstance(e, bytes) else str(e)): int(worst)
            for e, _at, _latest, worst, *_ in cast(list[list[Any]], latency or [])
        },
        "load_avg_1m": _r(os.getloadavg()[0], 2),
    }


def _analyse(
    row: Mapping[str, Any],
    fleet: Fleet,
    dump: Mapping[str, Any],
    status: int,
    tail_s: float,
) -> dict[str, Any]:
    """The window's figures from unicornd's own records (``dump``) and the agents' (``fleet``)."""
    w0, w1 = row["window"]
    lag = [v * 1000 for t, v in dump.get("lag", []) if w0 <= t <= w1]
    before = [v * 1000 for t, v in dump.get("lag", []) if t < w0]
    stall_max = max([*lag, *before], default=0.0)
    commits = [c for c in dump.get("commits", []) if w0 <= c[0] <= w1]
    matches, unexplained = match_faults(
        fleet.faults, dump.get("incidents", []), fleet.commands, dump.get("slurm_calls", [])
    )
    on_jobs = [m for m in matches if m.fault.job_id is not None]
    decided = [m for m in on_jobs if m.decided_wall is not None]

    def since(ms: Sequence[Match], attr: str, origin: str) -> list[float]:
        out = []
        for m in ms:
            end = getattr(m, attr)
            start = m.fault.evidence_wall if origin == "evidence" else m.fault.at_wall
            if end is not None and start is not None:
                out.append(max(0.0, end - start))
        return out

    by_kind: dict[str, Any] = {}
    for kind in sorted({m.fault.kind for m in on_jobs}):
        ms = [m for m in on_jobs if m.fault.kind == kind]
        by_kind[kind] = {
            "faults": len(ms),
            "decided": sum(m.decided_wall is not None for m in ms),
            "decision_p95_s": _r(percentile(since(ms, "decided_wall", "evidence"), 0.95)),
            "first_action_p95_s": _r(percentile(since(ms, "acted_wall", "evidence"), 0.95)),
            "decision_from_injection_p95_s": _r(percentile(since(ms, "decided_wall", "injection"), 0.95)),
        }
    in_window = [i for i in unexplained if w0 <= float(i["t"]) <= w1 + tail_s]
    cluster_jobs = {job.task_id: job.job_id for job in fleet.jobs.values()}
    full_gcs = [g for g in dump.get("gcs", []) if w0 <= g[0] <= w1 and g[1] == 2]
    # A lag sample covers [t - period - lag, t]: a collection inside it held the loop then.
    gc_spans = sorted((g[0], g[0] + g[2]) for g in dump.get("gcs", []) if w0 - 1 <= g[0] <= w1)
    late = [(t, v) for t, v in dump.get("lag", []) if w0 <= t <= w1 and v * 1000 >= LATE_MS]
    late_with_gc = sum(1 for t, v in late if any(a < t and b > t - LAG_PERIOD_S - v for a, b in gc_spans))
    return {
        "loop_lag_p50_ms": _r(percentile(lag, 0.5), 2),
        "loop_lag_p99_ms": _r(percentile(lag, 0.99), 2),
        "loop_lag_max_ms": _r(max(lag) if lag else None, 1),
        "startup_loop_lag_max_ms": _r(max(before) if before else None, 1),
        "lease_kept_at_default": stall_max < DEFAULT_LEASE_STALL_MS,
        "gc_full_per_min": _r(len(full_gcs) / max(1e-9, w1 - w0) * 60, 2),
        "gc_full_ms_p50": _r(percentile([g[2] * 1000 for g in full_gcs], 0.5), 1),
        "gc_full_ms_max": _r(max((g[2] * 1000 for g in full_gcs), default=None), 1),
        "gc_full_share_of_window": _r(sum(g[2] for g in full_gcs) / max(1e-9, w1 - w0), 4),
        "loop_lag_samples_over_100ms": len(late),
        "python_slope_per_h_per_h": _slope_per_h(dump.get("blocks", []), w0, w1),
        **_heap(dump, w0, w1),
        # the bench's own samples, kept in unicornd's process (scale_daemon.Recorder): part of its RSS
        "bench_recorder_mib_end": _r((dump.get("recorder_bytes") or 0) / 2**20, 2),
        "object_types": {str(when): dict(top[:15]) for when, top in dump.get("object_types", [])},
        **({"tracemalloc_growth": _trace_growth(dump["tracemalloc"])} if dump.get("tracemalloc") else {}),
        "loop_lag_over_100ms_during_gc_share": _r(late_with_gc / len(late)) if late else None,
        "commits_per_s": _r(len(commits) / max(1e-9, w1 - w0), 2),
        "commit_bytes_p50": percentile([c[1] for c in commits], 0.5),
        "commit_bytes_max": max((c[1] for c in commits), default=None),
        "commit_ms_p50": _r(percentile([c[3] * 1000 for c in commits], 0.5), 2),
        "commit_ms_p95": _r(percentile([c[3] * 1000 for c in commits], 0.95), 2),
        "commit_serialise_ms_p50": _r(percentile([c[2] * 1000 for c in commits], 0.5), 2),
        "commit_cpu_core_share": _r(sum(c[3] for c in commits) / max(1e-9, w1 - w0)),
        # a fault is one injection (a rack is one); it hits each job whose nodes it takes once:
        # faults_on_jobs and faults_decided count those hits, so a rack can make them exceed it
        "faults_injected": len({m.fault.fault_id for m in matches}),
        "faults_on_jobs": len(on_jobs),
        "faults_decided": len(decided),
        "faults_without_decision": len(on_jobs) - len(decided),
        "spurious_incidents": len(in_window),
        "spurious_rules": sorted({str(i["rule"]) for i in in_window}),
        "spurious_examples": [
            {
                "t_s": _r(float(i["t"]) - w0, 1),
                "task": i["task"],
                "job_before_60s": _job_history(fleet, cluster_jobs.get(str(i["task"])), float(i["t"])),
                "rule": i["rule"],
                "evidence": i.get("evidence", ""),
                "generator_late_max_ms_5s_before": _r(
                    max(
                        (v * 1000 for t, v in fleet.counters.late if float(i["t"]) - 5 <= t <= float(i["t"])),
                        default=0.0,
                    ),
                    1,
                ),
                "loop_lag_max_ms_5s_before": _r(
                    max(
                        (v * 1000 for t, v in dump.get("lag", []) if float(i["t"]) - 5 <= t <= float(i["t"])),
                        default=None,
                    ),
                    1,
                ),
            }
            for i in in_window[:12]
        ],
        "fault_to_decision_p50_s": _r(percentile(since(decided, "decided_wall", "evidence"), 0.5)),
        "fault_to_decision_p95_s": _r(percentile(since(decided, "decided_wall", "evidence"), 0.95)),
        "fault_to_decision_from_injection_p95_s": _r(
            percentile(since(decided, "decided_wall", "injection"), 0.95)
        ),
        "fault_to_first_action_p95_s": _r(percentile(since(decided, "acted_wall", "evidence"), 0.95)),
        "fault_to_first_action_from_injection_p95_s": _r(
            percentile(since(decided, "acted_wall", "injection"), 0.95)
        ),
        "faults_by_kind": by_kind,
        "commands_received": dict(fleet.counters.commands),
        "generator_errors": dict(fleet.errors),
        "step_time_changes": fleet.step_time_changes,
        "redis_pool_in_use_max": max((int(n) for _t, n in dump.get("redis_pool_in_use", [])), default=None),
        "redis_pool_in_use_last": [
            [_r(float(t) - w0, 0), int(n)] for t, n in dump.get("redis_pool_in_use", [])[-12:]
        ],
        "unicornd_exit_status": status,
        "unicornd_failure": dump.get("error") or None,
        **_lookup(dump, w0),
    }


def _job_history(fleet: Fleet, job_id: int | None, t: float) -> list[str]:
    """What the job's agents were told and what Slurm did to it in the 60 s before ``t``
    (seconds before ``t``): whether a spurious incident followed a planned change. 60 s,
    not 10: a stall is called after its deadline, and session 19's hour had stalls of
    30-43 s whose start a 10 s look-back missed."""
    if job_id is None:
        return []
    seen = [(c["t"], f"{c['action']} {c['node']}") for c in fleet.commands if c["job"] == job_id]
    seen += [(w, f"slurm {op} ({n} nodes)") for w, j, op, n in fleet.slurm_events if j == job_id]
    return [f"-{t - w:.1f}s {what}" for w, what in sorted(seen) if t - 60 <= w <= t][-20:]


def _minima(samples: Sequence[tuple[float, float]], bucket_s: float) -> list[tuple[float, float]]:
    """(bucket's middle, its smallest value) per ``bucket_s`` of (time, value) samples."""
    if not samples:
        return []
    t0 = samples[0][0]
    buckets: dict[int, float] = {}
    for t, v in samples:
        k = int((t - t0) // bucket_s)
        buckets[k] = min(v, buckets.get(k, v))
    return [(t0 + (k + 0.5) * bucket_s, v) for k, v in sorted(buckets.items())]


def _by_minute(samples: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(smallest, largest) value per minute of (time, value) samples."""
    if not samples:
        return []
    t0 = samples[0][0]
    out: dict[int, tuple[float, float]] = {}
    for t, v in samples:
        k = int((t - t0) // 60)
        lo, hi = out.get(k, (v, v))
        out[k] = (min(lo, v), max(hi, v))
    return [out[k] for k in sorted(out)]


def _slope_per_h(blocks: Sequence[Sequence[float]], w0: float, w1: float) -> float | None:
    """The slope per hour of (time, value) samples over the window's second half (after the
    per-rank windows filled), by least squares: Python's allocated blocks, or RSS."""
    mid = (w0 + w1) / 2
    pts = [(float(t), float(b)) for t, b in blocks if mid <= t <= w1]
    if len(pts) < 3:
        return None
    mt = statistics.fmean(t for t, _ in pts)
    mb = statistics.fmean(b for _, b in pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    return _r(sum((t - mt) * (b - mb) for t, b in pts) / var * 3600, 0) if var > 0 else None


def _heap(dump: Mapping[str, Any], w0: float, w1: float) -> dict[str, Any]:
    """Where unicornd's memory is (``scale_daemon``'s heap samples): each part at the window's
    end (MiB) and its slope over the second half (MiB/h): RSS; glibc's ``arena`` (its sbrk
    heap's size), ``uordblks`` (in use there), ``fordblks`` (free there); resident
    ``heap_rss`` (the sbrk heap), ``anon_other_rss`` (pymalloc's arenas, mmapped chunks,
    stacks), ``file_rss`` (code). And the trims' durations (the whole run's)."""
    fields: list[str] = list(dump.get("heap_fields") or [])
    rows = [r for r in dump.get("heap") or [] if w0 <= r[0] <= w1]
    trims = [t * 1000 for t in dump.get("trims_s") or []]
    out: dict[str, Any] = {
        "malloc_trims": len(trims),
        "malloc_trim_ms_p50": _r(percentile(trims, 0.5), 2) if trims else None,
        "malloc_trim_ms_max": _r(max(trims), 2) if trims else None,
    }
    if not rows or "arena" not in fields:
        return out
    col = {f: i for i, f in enumerate(fields)}
    names = ("rss", "arena", "hblkhd", "uordblks", "fordblks", "heap_rss", "anon_other_rss", "file_rss")
    parts = {f: [(r[0], r[col[f]] / 2**20) for r in rows] for f in names if f in col}
    out["heap_mib_end"] = {k: _r(v[-1][1], 1) for k, v in parts.items()}
    out["heap_mib_per_h_second_half"] = {k: _slope_per_h(v, w0, w1) for k, v in parts.items()}
    return out


def _trace_growth(snaps: Sequence[Sequence[Any]], top: int = 12) -> list[dict[str, Any]]:
    """``--tracemalloc-every-s``: what grew between consecutive snapshots (written by
    unicornd's forked children), by allocating call site (oldest frame first), biggest
    first. Each file is removed once read (tens of MB each at 4,096 nodes); one that cannot
    be read is skipped."""
    out: list[dict[str, Any]] = []
    last: tracemalloc.Snapshot | None = None
    for t, path in snaps:
        try:
            snap = tracemalloc.Snapshot.load(path)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
        finally:
            Path(path).unlink(missing_ok=True)
        if last is not None:
            growth = [
                {
                    "kib": _r(s.size_diff / 1024, 1),
                    "blocks": s.count_diff,
                    "at": [f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno}" for f in s.traceback],
                }
                for s in snap.compare_to(last, "traceback")
                if s.size_diff > 0
            ][:top]
            traced = sum(trace.size for trace in snap.traces)
            out.append({"t": t, "traced_mib": _r(traced / 2**20, 1), "top": growth})
        last = snap
    return out


def _lookup(dump: Mapping[str, Any], w0: float) -> dict[str, Any]:
    """The one-step lookup (:mod:`unicornd.lookup`) as unicornd counted it over the whole
    run: replans whose plan was in the cache (a hit) or solved then (a miss), their plan
    times, the table's builds (in unicornd's worker process), and each miss's reason
    (:func:`unicornd.replan.miss_reason`; ``t_s`` from the measured window's start)."""
    solves = dump.get("solves") or {}
    table = dump.get("lookup") or {}
    hits, misses = int(solves.get("hits", 0)), int(solves.get("misses", 0))
    hit_ms = [s * 1000 for s in solves.get("hit_s", [])]
    miss_ms = [s * 1000 for s in solves.get("miss_s", [])]
    builds = [float(s) for s in table.get("build_s", [])]
    missed = [(float(t), str(why)) for t, why in solves.get("missed", [])]
    # Misses beyond one step: the replan's state was not one node out from the newest
    # table's (two faults seconds apart, a rack, tasks changed or newly faulted): no
    # one-step table holds it. Every other miss (one step but not built yet, no table, a
    # basis the table has not caught up with) counts against the single-node rate.
    beyond = int(
        solves.get("misses_beyond_one_step", sum(why.startswith("beyond one step") for _, why in missed))
    )
    one_step_misses = max(0, misses - beyond)  # a solve that raised was noted, not counted
    return {
        "replans_cached": hits,
        "replans_solved": misses,
        "lookup_hit_rate": _r(hits / (hits + misses)) if hits + misses else None,
        "lookup_hit_rate_one_step": _r(hits / (hits + one_step_misses)) if hits + one_step_misses else None,
        "lookup_misses_one_step": one_step_misses,
        "lookup_misses_beyond_one_step": beyond,
        "plan_lookup_hit_ms": _r(percentile(hit_ms, 0.5)),
        "plan_solve_in_unicornd_ms": _r(percentile(miss_ms, 0.5)),
        "lookup_builds": len(builds),
        "lookup_build_s_p50": _r(percentile(builds, 0.5)),
        "lookup_plans_solved_ahead": table.get("solved"),
        "lookup_plans_reused": table.get("reused"),
        "lookup_failures": table.get("failures"),
        "lookup_misses": [{"t_s": _r(t - w0, 1), "why": why} for t, why in missed],
    }


# --- main ------------------------------------------------------------------------------------


def summary(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    xs = [float(r["nodes"]) for r in rows]
    curves = {m: [r.get(m) for r in rows] for m in GROWTH_METRICS}
    exponents = {m: _r(growth_exponent(xs, cast(list[float | None], curves[m])), 3) for m in GROWTH_METRICS}
    for r in rows:
        r.pop("window", None)
    return {
        "bench": "scale",
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_end": _r(os.getloadavg()[0], 2)},
        "config": {
            "sizes": [r["nodes"] for r in rows],
            "gpus_per_node": GPUS_PER_NODE,
            "max_jobs": args.jobs,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "fault_rate_per_min": args.fault_rate,
            "rack_bursts": args.burst,
            "rack_size": args.rack_size,
            "seed": args.seed,
            "lookup_min_nodes": args.lookup_min_nodes,
            "stream_retention_s": args.stream_retention_s,
            "slurm_timings_s": dataclasses.asdict(SlurmTimings()),
            "agent_timings_s": dataclasses.asdict(AgentTimings()),
        },
        "emulated": {
            "slurm": "scripted backend (scale_slurm.py): dev-cluster latencies, real parser on 22.05 JSON",
            "agents": "one process, one pipeline per 50 ms tick for all agents; real messages, keys, streams",
            "registration": "tasks committed running (planned by the real planner); no MUNGE",
            "config": "ssh probe off, agent_acl off, recovery breakers opened, leader lease 30 s",
        },
        "plan": {
            "lookup_on_failure_path": True,
            "lookup_note": "unicornd.lookup solves every single-node failure's plan ahead in a worker "
            "process (clusters of 512 nodes or more); a replan takes a cached plan when its inputs "
            "match (lookup_hit_rate, plan_lookup_hit_ms), else solves (plan_solve_in_unicornd_ms); "
            "plan_full_solve_ms is timed offline on unicornd's last snapshot",
        },
        "curves": curves,
        "growth_exponents": exponents,
        "sizes": list(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(SIZES),
        help="node counts, comma-separated (default 64,256,1024,4096)",
    )
    ap.add_argument("--duration-s", type=float, default=60.0, help="measurement window per size")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="after unicornd is up, before measuring")
    ap.add_argument(
        "--tail-s", type=float, default=10.0, help="after the window: decisions on the last faults"
    )
    ap.add_argument("--jobs", type=int, default=200, help="at most this many jobs (one per 16 nodes)")
    ap.add_argument(
        "--fault-rate", type=float, default=6.0, help="single-node faults a minute (whole cluster)"
    )
    ap.add_argument("--burst", type=int, default=1, help="whole racks lost at once, per size's window")
    ap.add_argument("--rack-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lookup-min-nodes",
        type=int,
        default=None,
        help="unicornd's [plan] lookup_min_nodes (default: its default, 512; a huge value: no lookup)",
    )
    ap.add_argument(
        "--stream-retention-s",
        type=float,
        default=None,
        help="unicornd's [redis] stream_retention_s (default: its default, 600 s)",
    )
    ap.add_argument(
        "--tracemalloc-every-s",
        type=float,
        default=0.0,
        help="diagnostic: unicornd's memory growth by call site, a tracemalloc snapshot this often "
        "from the window's start (slows unicornd: not for figures)",
    )
    ap.add_argument("--tracemalloc-frames", type=int, default=4, help="frames per call site (with the above)")
    ap.add_argument(
        "--malloc-trim-every-s",
        type=float,
        default=None,
        help="unicornd's malloc_trim period (default: its default; 0: never), to compare",
    )
    ap.add_argument(
        "--keep-log",
        type=Path,
        default=None,
        help="diagnostic: copy unicornd's log of each N into this folder (unicornd-N.log)",
    )
    ap.add_argument("--quick", action="store_true", help="N = 64 and 256 only, 20 s each (a smoke run)")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the curves (log-log) into this PNG")
    ap.add_argument(
        "--from-json", type=Path, default=None, help="draw --plot from this earlier output instead of running"
    )
    args = ap.parse_args()
    if args.from_json is not None:
        if args.plot is None:
            ap.error("--from-json needs --plot")
        plot_png(json.loads(args.from_json.read_text()), args.plot)
        return
    # SIGTERM (a timeout, an operator) ends the run through the finally blocks that stop
    # this run's unicornd and redis-server and remove its folder.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.sizes = list(QUICK_SIZES)
        args.duration_s = min(args.duration_s, 20.0)
        args.warmup_s = min(args.warmup_s, 5.0)
        args.tail_s = min(args.tail_s, 5.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="unicorn-bench-scale-") as d:
        for n in args.sizes:
            rows.append(run_size(n, args, Path(d) / f"n{n}"))
    doc = summary(rows, args)
    print(json.dumps(doc))
    if args.plot is not None:
        plot_png(doc, args.plot)


PLOTTED = (
    ("loop_lag_p99_ms", "event-loop lag p99 (ms)", 100.0),
    ("events_per_s", "events handled /s", None),
    ("unicornd_cpu_core_share", "unicornd CPU (cores)", 1.0),
    ("unicornd_rss_mib", "unicornd RSS (MiB)", None),
    ("redis_used_memory_mib", "Redis memory (MiB)", None),
    ("redis_ops_per_s", "Redis ops /s", None),
    ("commit_bytes_p50", "commit bytes p50", None),
    ("commit_ms_p95", "commit ms p95", None),
    ("fault_to_decision_p95_s", "fault -> decision p95 (s)", 1.0),
    ("fault_to_first_action_p95_s", "fault -> first action p95 (s)", None),
    ("plan_full_solve_ms", "full plan solve (ms)", None),
)
"""(curve, axis label, issue 20's goal drawn as a dashed line or None)."""


def plot_png(doc: dict[str, Any], path: Path) -> None:
    """Each curve against N on log-log axes, its growth exponent in the title (matplotlib,
    imported here only, as the simulator's report does)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row["nodes"] for row in doc["sizes"]]
    fig, axes = plt.subplots(3, 4, figsize=(14, 9))
    flat = list(axes.flat)
    for ax, (key, label, goal) in zip(flat, PLOTTED, strict=False):
        values = doc["curves"].get(key, [])
        points = [(n, v) for n, v in zip(sizes, values, strict=False) if v is not None and v > 0]
        if points:
            ax.plot([n for n, _ in points], [v for _, v in points], marker="o")
        if goal is not None:
            ax.axhline(goal, linestyle="--", color="grey", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        exponent = doc.get("growth_exponents", {}).get(key)
        ax.set_title(f"{label}\nexponent {exponent}" if exponent is not None else label, fontsize=9)
        ax.set_xlabel("nodes (8 GPUs each)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in flat[len(PLOTTED) :]:
        ax.axis("off")
    fig.suptitle(f"unicornd at scale ({doc['machine']['cpus']} cores; dashed: issue 20's goals)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
