#!/usr/bin/env python3
"""Soak under faults: recovery cycles while the coordinator and Redis are killed at random.

Starts a private dev cluster (5 nodes x 1 GPU) with Redis Sentinel (`dev-cluster up
--redis sentinel`: a primary, its replica, three sentinels), two unicornd on the same keys
kept running as systemd keeps them on two head nodes (`Restart=on-failure`,
``--restart-s`` later; :class:`tests.system.coordinator.Supervisor`), and two tasks of the
built-in trainer (real torchrun, gloo) on n1,n2 and n3,n4; n5 is a spare.

Each cycle (``--cycles``, seeded by ``--seed``) injects one fault into a random task:

- ``node_kill``: ``dev-cluster kill-node`` on one of its nodes (revived and resumed after
  the cycle, so it becomes the next spare);
- ``rank_crash``: SIGKILL of one of its ranks (an abnormal exit);
- ``hang``: SIGSTOP of one of its ranks;

and, ``--max-delay-s`` at most after the fault, one disruption: ``none``,
``leader_kill`` (SIGKILL of the leading unicornd), ``leader_pause`` (SIGSTOP past its
lease until the standby leads, then SIGCONT), ``redis_restart`` (SIGKILL of the Redis
primary and a restart on its append-only file) or ``sentinel_failover`` (SIGKILL of the
primary; the sentinels promote the replica; the old primary comes back as its replica).

After each cycle it checks:

- every task trains again (RUNNING, past its iteration at the fault, no open incident);
- ``events_lost``: the fault has no incident of its task opened after it;
- ``wrong_drains``: a node unicornd drained (Slurm's reason ``unicorn: ...``) that was
  not killed in the cycle;
- ``stale_commits_accepted``: commits counted under a paused leader's token after it was
  resumed (the commit script counts each accepted commit per token:
  ``<prefix>:unicornd:commits``);
- ``takeover_s`` (disruptions of the leader or of Redis): from the disruption to a live,
  running unicornd holding the lease and refreshing its liveness key.

At the end, ``double_actions``: actions performed twice. An action id that unicornd's
logs show done twice, with no unicornd exit between the two (a re-run after a leader's
death is the documented at-least-once; those are counted apart as
``reruns_after_leader_death``), and agent commands an agent ran twice (``command_done``
twice for one id in one agent's output).

Prints one JSON object: ``cycles``, ``cycles_ok``, ``faults`` and ``disruptions`` counts,
``leader_kills``, ``leader_pauses``, ``redis_restarts``, ``redis_failovers``,
``takeover_s_p95`` (and median, max, per disruption kind), ``events_lost``,
``double_actions``, ``stale_commits_accepted``, ``wrong_drains``, ``unicornd_exits``,
``recovery_s`` (fault to training again) per fault kind, and the per-cycle rows.

Run: ``nice -n 5 .venv/bin/python scripts/bench/soak.py --cycles 30`` (about 25 s a cycle).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from tests.conftest import DevCluster, start_cluster  # noqa: E402
from tests.system.coordinator import Coordinator, Supervisor, coordinator  # noqa: E402
from tests.system.test_unicornd import task  # noqa: E402
from unicorn_core.paths import AGENT_RUN_ROOT  # noqa: E402
from unicornd.state import Snapshot, TaskState  # noqa: E402

FAULTS: Final = ("node_kill", "rank_crash", "hang")
DISRUPTIONS: Final = ("none", "leader_kill", "leader_pause", "redis_restart", "sentinel_failover")
NODES: Final = 5
ENV: Final = {
    "UNICORN_RECOVERY__MIN_DRAINS_PER_WINDOW": "1000",
    "UNICORN_RECOVERY__RECOVERY_BUDGET": "1000",
    "UNICORN_RECOVERY__NO_PROGRESS_LIMIT": "1000",
    "UNICORN_RECOVERY__NODE_FAILURE_LIMIT": "1000",
}
"""The breakers meant for a real cluster's fault rate are opened, because the soak injects a
fault every 15-30 s: the drain limiter (one drain per 10 min on 5 nodes: the second node kill
would wait for an operator), the recovery budget (10 per task per hour), the no-progress
breaker (3 recoveries without passing the iteration of the first) and the node failure
limit (a node failing 3 times in 24 h is held). Each is tested on its own elsewhere."""


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class CycleFailed(Exception):
    pass


@dataclass(frozen=True)
class Sample:
    t: float
    ok: bool
    holder: str | None
    alive_pid: int | None
    alive_t: float
    commits: dict[int, int]


# --- what Redis says about the leader ----------------------------------------------------


def pid_of(holder: str | None) -> int | None:
    """The pid in a lease value ``<token>:<host>.<pid>``."""
    if not holder:
        return None
    tail = holder.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


def runnable(pid: int | None) -> bool:
    """Alive and not stopped (SIGSTOP) nor a zombie."""
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("T", "t", "Z", "X")


class Watch:
    """Polls the lease, the liveness key and the per-token commit counts every 0.1 s in a
    thread, through the sentinels (so it follows a failover). A failed read is kept as a
    sample too (``ok`` False): it marks when Redis was away."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._client: redis.Redis | None = None
        self._thread = threading.Thread(target=self._run, name="soak-watch", daemon=True)
        self._thread.start()

    def _read(self) -> Sample:
        if self._client is None:
            self._client = self.c.client()
        k = self.c.keys
        holder, alive = self._client.mget(k.leader(), k.daemon_liveness())
        commits = {int(t): int(n) for t, n in self._client.hgetall(k.commits()).items()}
        doc = json.loads(alive) if alive else {}
        return Sample(
            time.monotonic(),
            True,
            holder.decode() if isinstance(holder, bytes) else holder,
            doc.get("pid"),
            float(doc.get("t", 0.0)),
            commits,
        )

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.samples.append(self._read())
            except (redis.RedisError, OSError, ValueError):
                with contextlib.suppress(Exception):
                    if self._client is not None:
                        self._client.close()
                self._client = None
                self.samples.append(Sample(time.monotonic(), False, None, None, 0.0, {}))

    def latest(self) -> Sample:
        deadline = time.monotonic() + 30
        while True:
            good = [x for x in self.samples[-20:] if x.ok]
            if good and good[-1].t > time.monotonic() - 1.0:
                return good[-1]
            if time.monotonic() > deadline:
                raise CycleFailed("Redis unreadable for 30 s")
            time.sleep(0.1)

    def serving_since(self, t0: float, excluded: int | None, timeout_s: float = 60.0) -> float:
        """Seconds from ``t0`` to the first read where a runnable unicornd (not
        ``excluded``) holds the lease and has refreshed its liveness key since Redis was
        last seen away (or since ``t0``): a leader serving again on the Redis now there."""
        deadline = t0 + timeout_s
        wall0 = time.time() - (time.monotonic() - t0)
        away_wall = wall0
        seen = next((i for i, x in enumerate(self.samples) if x.t >= t0), len(self.samples))
        while time.monotonic() < deadline:
            for x in self.samples[seen:]:
                seen += 1
                if not x.ok:
                    away_wall = time.time() - (time.monotonic() - x.t)
                    continue
                pid = pid_of(x.holder)
                serving = pid is not None and pid != excluded and x.alive_pid == pid and x.alive_t > away_wall
                if serving and runnable(pid):
                    return x.t - t0
            time.sleep(0.1)
        raise CycleFailed(f"no unicornd leading {timeout_s:g} s after the disruption")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# --- faults ------------------------------------------------------------------------------


def rank_pids(cluster: DevCluster, job: int) -> list[int]:
    """The built-in trainer's live rank processes of ``job`` (torchrun's workers: RANK set),
    the newest process of each rank only: ranks of a launch being replaced can still be
    exiting, and a fault injected into one of them would hit nothing that trains."""
    newest: dict[str, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        env = dict(kv.split("=", 1) for kv in raw if "=" in kv)
        ours = env.get("SLURM_CONF") == cluster.slurm_conf and env.get("UNICORN_JOB_ID") == str(job)
        if not (ours and "RANK" in env and b"launcher.train" in cmdline) or stat[0] in ("Z", "X", "T", "t"):
            continue
        started = int(stat[19])  # starttime, in clock ticks since boot
        if env["RANK"] not in newest or started > newest[env["RANK"]][0]:
            newest[env["RANK"]] = (started, int(entry.name))
    return sorted(pid for _, pid in newest.values())


def training(s: Snapshot, marks: dict[str, int]) -> bool:
    """Every task RUNNING past its mark, no incident open."""
    return all(
        (t := s.tasks.get(name)) is not None
        and t.state is TaskState.RUNNING
        and (t.last_iteration or 0) > mark
        for name, mark in marks.items()
    ) and not any(i.is_open for i in s.incidents.values())


def wait_snapshot(c: Coordinator, pred: Any, what: str, timeout_s: float) -> Snapshot:
    deadline = time.monotonic() + timeout_s
    snap = None
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            snap = c.snapshot()
            if snap is not None and pred(snap):
                return snap
        time.sleep(0.25)
    raise CycleFailed(f"timed out after {timeout_s:g} s waiting for {what}")


def unicorn_drained(cluster: DevCluster) -> dict[str, str]:
    """Nodes Slurm holds drained or draining by unicorn, with the reason."""
    out = cluster.slurm("sinfo", "-h", "-N", "-o", "%N|%T|%E").stdout
    found = {}
    for line in out.splitlines():
        node, state, reason = [*line.split("|", 2), "", ""][:3]
        if reason.startswith("unicorn:") and ("drain" in state or "down" in state):
            found[node] = reason
    return found


# --- one cycle ---------------------------------------------------------------------------


def cycle(*args: Any) -> dict[str, Any]:
    """:func:`run_cycle`; a failure names the cycle's fault and disruption."""
    row: dict[str, Any] = {}
    try:
        return run_cycle(row, *args)
    except CycleFailed as e:
        raise CycleFailed(f"{json.dumps(row)}: {e}") from e


def run_cycle(
    row: dict[str, Any],
    i: int,
    rng: random.Random,
    cluster: DevCluster,
    c: Coordinator,
    sup: Supervisor,
    watch: Watch,
    args: argparse.Namespace,
) -> dict[str, Any]:
    fault = rng.choice(FAULTS)
    disruption = rng.choice(DISRUPTIONS)
    snap = wait_snapshot(c, lambda s: training(s, {n: 0 for n in s.tasks}), "both tasks training", 240)
    name = rng.choice(sorted(snap.tasks))
    victim = snap.tasks[name]
    marks = {n: t.last_iteration or 0 for n, t in snap.tasks.items()}
    row.update(cycle=i, fault=fault, disruption=disruption, task=name)
    t_fault = time.time()
    m_fault = time.monotonic()
    killed: str | None = None
    if fault == "node_kill":
        killed = rng.choice(victim.nodes)
        cluster.script("kill-node", killed)
        row["node"] = killed
    else:
        pids = rank_pids(cluster, victim.job_id or 0)
        if not pids:
            raise CycleFailed(f"no rank process of {name} (job {victim.job_id}) found")
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGKILL if fault == "rank_crash" else signal.SIGSTOP)
        row["rank_pid"] = pid
    time.sleep(rng.uniform(0.0, args.max_delay_s))
    holder = watch.latest().holder
    leader = pid_of(holder)
    t0 = time.monotonic()
    row["disrupted_after_s"] = round(t0 - m_fault, 2)
    paused: int | None = None
    if disruption == "leader_kill" and leader:
        os.kill(leader, signal.SIGKILL)
    elif disruption == "leader_pause" and leader:
        paused = leader
        token = int(holder.split(":", 1)[0]) if holder else 0
        os.kill(leader, signal.SIGSTOP)
        row["takeover_s"] = round(watch.serving_since(t0, excluded=paused), 3)
        before = watch.latest().commits.get(token, 0)
        os.kill(paused, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while (proc := sup.by_pid(paused)) is not None and proc.poll() is None:
            if time.monotonic() > deadline:
                raise CycleFailed(f"the resumed leader {paused} did not exit in 30 s")
            time.sleep(0.1)
        time.sleep(0.5)
        after = watch.latest().commits.get(token, 0)
        row["stale_commits_accepted"] = after - before
        row["paused_exit"] = next((code for _, pid, code in sup.exits if pid == paused), None)
    elif disruption == "redis_restart":
        res = cluster.script("restart-redis", check=False)
        if res.returncode != 0:
            raise CycleFailed(f"restart-redis failed: {res.stderr[-500:]}")
    elif disruption == "sentinel_failover":
        res = cluster.script("failover-redis", "--no-wait-sync", check=False)
        if res.returncode != 0:
            raise CycleFailed(f"failover-redis failed: {res.stderr[-500:]}")
        row["failover_s"] = json.loads(res.stdout.strip().splitlines()[-1])["failover_s"]
    if disruption in ("leader_kill", "redis_restart", "sentinel_failover"):
        excluded = leader if disruption == "leader_kill" else None
        row["takeover_s"] = round(watch.serving_since(t0, excluded=excluded), 3)
    snap = wait_snapshot(c, lambda s: training(s, marks), "every task training again", args.timeout_s)
    row["recovery_s"] = round(time.monotonic() - m_fault, 2)
    incidents = [i for i in snap.incidents.values() if i.task_id == name and i.opened_s >= t_fault - 1.0]
    row["incident"] = [f"{i.incident_id}:{i.status}:{','.join(i.isolated_nodes)}" for i in incidents]
    row["event_lost"] = not incidents
    drained = unicorn_drained(cluster)
    row["wrong_drains"] = sorted(n for n in drained if n != killed)
    if killed is not None:
        row["killed_drained"] = killed in drained
        cluster.script("revive-node", killed)
        c.resume(killed)
        wait_snapshot(
            c, lambda s: s.nodes[killed].health.value == "healthy", f"{killed} back in service", 120
        )
    return row


# --- the logs ----------------------------------------------------------------------------


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def _stamp(doc: dict[str, Any]) -> float:
    try:
        return datetime.datetime.fromisoformat(str(doc["timestamp"]).replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        return 0.0


def action_runs(logs: list[Path], exits_wall: list[float]) -> tuple[int, int, list[str]]:
    """(actions done twice with no unicornd exit between, re-runs after an exit, the ids)."""
    done: dict[str, list[float]] = {}
    for path in logs:
        for doc in _json_lines(path):
            if doc.get("event") == "action_done" and "ran before a restart" not in str(doc.get("detail")):
                done.setdefault(str(doc.get("action")), []).append(_stamp(doc))
    doubles, reruns, ids = 0, 0, []
    for aid, times in done.items():
        times.sort()
        for a, b in itertools.pairwise(times):
            if any(a <= e <= b for e in exits_wall):
                reruns += 1
            else:
                doubles += 1
                ids.append(aid)
    return doubles, reruns, ids


def agent_command_doubles(outputs: list[Path]) -> list[str]:
    """Command ids an agent logged ``command_done`` for twice (one agent's output file)."""
    found = []
    for path in outputs:
        counts = Counter(
            str(d.get("command_id")) for d in _json_lines(path) if d.get("event") == "command_done"
        )
        found += [f"{path.name}:{cid}" for cid, n in counts.items() if n > 1]
    return found


def agent_outputs(prefix: str) -> list[Path]:
    """Every agent's output this run (``agent.out`` in its run folder, appended across
    relaunches; the coordinator's exit removes the folders)."""
    return sorted((AGENT_RUN_ROOT / prefix).glob("*/*/agent.out"))


def keep_logs(dest: Path, cluster: DevCluster, daemon_logs: list[Path], prefix: str) -> None:
    """unicornd's logs, the dev cluster's and the agents' outputs, copied to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in daemon_logs:
        with contextlib.suppress(OSError):
            shutil.copy(path, dest / path.name)
    with contextlib.suppress(OSError):
        shutil.copytree(cluster.state_dir / "log", dest / "cluster-log", dirs_exist_ok=True)
    for path in agent_outputs(prefix):
        with contextlib.suppress(OSError):
            shutil.copy(path, dest / f"agent-{path.parent.parent.name}-{path.parent.name}.out")
    log(f"logs kept in {dest}")


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    values = sorted(values)
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "p95": round(values[min(len(values) - 1, int(0.95 * len(values)))], 3),
        "max": round(values[-1], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay-s", type=float, default=4.0, help="fault -> disruption, at most")
    ap.add_argument("--restart-s", type=float, default=1.0, help="the supervisor's RestartSec")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per cycle, fault -> training again")
    ap.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        help="copy every log here when a cycle fails or loses its event",
    )
    args = ap.parse_args()
    if args.cycles < 1:
        ap.error("--cycles must be >= 1")
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    t_start = time.monotonic()
    outputs_seen: dict[Path, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as d:
        root = Path(d)
        root.chmod(0o755)
        os.environ["TMPDIR"] = str(root)
        cluster = start_cluster(
            root / "cluster", "--nodes", str(NODES), "--gpus-per-node", "1", "--redis", "sentinel"
        )
        try:
            with coordinator(cluster, root, **ENV) as c:
                sup = Supervisor(c, root, restart_s=args.restart_s)
                watch = Watch(c)
                try:
                    a = replace(task(c, "a", "n1,n2", 1.0, root), max_gpus=2)
                    b = replace(task(c, "b", "n3,n4", 1.0, root), max_gpus=2)
                    c.register(a)
                    c.register(b)
                    for i in range(args.cycles):
                        try:
                            row = cycle(i, rng, cluster, c, sup, watch, args)
                        except (CycleFailed, AssertionError) as e:
                            failures.append(f"cycle {i}: {e}")
                            log(f"cycle {i} FAILED: {e}")
                            if args.keep_logs is not None:
                                keep_logs(args.keep_logs, cluster, sup.logs, c.keys.prefix)
                            break
                        rows.append(row)
                        log(json.dumps(row))
                        if row["event_lost"] and args.keep_logs is not None:
                            keep_logs(args.keep_logs / f"cycle-{i}", cluster, sup.logs, c.keys.prefix)
                finally:
                    for path in agent_outputs(c.keys.prefix):
                        with contextlib.suppress(OSError):
                            outputs_seen[path] = path.read_text(errors="replace")
                    watch.stop()
                    exits = [time.time() - (time.monotonic() - t) for t, _, _ in sup.exits]
                    logs = list(sup.logs)
                    sup_exits = list(sup.exits)
                    sup_restarts = sup.restarts
                doubles, reruns, double_ids = action_runs(logs, exits)
        finally:
            cluster.script("down", check=False)
            scratch = root / "agent-outputs"
            scratch.mkdir(exist_ok=True)
            agent_files = []
            for n, text in enumerate(outputs_seen.values()):
                f = scratch / f"{n}-agent.out"
                f.write_text(text)
                agent_files.append(f)
            agent_doubles = agent_command_doubles(agent_files)
    takeovers = [r["takeover_s"] for r in rows if "takeover_s" in r]
    out: dict[str, Any] = {
        "bench": "soak",
        "cycles": len(rows),
        "cycles_asked": args.cycles,
        "cycles_failed": failures,
        "seed": args.seed,
        "faults": dict(Counter(r["fault"] for r in rows)),
        "disruptions": dict(Counter(r["disruption"] for r in rows)),
        "leader_kills": sum(r["disruption"] == "leader_kill" for r in rows),
        "leader_pauses": sum(r["disruption"] == "leader_pause" for r in rows),
        "redis_restarts": sum(r["disruption"] == "redis_restart" for r in rows),
        "redis_failovers": sum(r["disruption"] == "sentinel_failover" for r in rows),
        "takeover_s_p95": stats(takeovers).get("p95"),
        "takeover_s": stats(takeovers),
        "takeover_s_by_disruption": {
            k: stats([r["takeover_s"] for r in rows if r["disruption"] == k and "takeover_s" in r])
            for k in DISRUPTIONS[1:]
        },
        "events_lost": sum(r["event_lost"] for r in rows),
        "double_actions": doubles + len(agent_doubles),
        "double_action_ids": double_ids + agent_doubles,
        "reruns_after_leader_death": reruns,
        "stale_commits_accepted": sum(r.get("stale_commits_accepted", 0) for r in rows),
        "wrong_drains": sum(len(r["wrong_drains"]) for r in rows),
        "killed_nodes_drained": sum(bool(r.get("killed_drained")) for r in rows if r["fault"] == "node_kill"),
        "unicornd_exits": len(sup_exits),
        "unicornd_restarts": sup_restarts,
        "recovery_s_by_fault": {f: stats([r["recovery_s"] for r in rows if r["fault"] == f]) for f in FAULTS},
        "wall_s": round(time.monotonic() - t_start, 1),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
