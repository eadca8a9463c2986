#!/usr/bin/env python3
"""Safety: unicorn must never take a healthy node or job down, and must still isolate bad ones.

Starts a private dev cluster (4 nodes x 1 GPU) and, per scenario, a fresh real unicornd
(own Redis key prefix) at the DEFAULT settings (no hang-factor override), with real
torchrun ranks of the built-in trainer:

- ``benign_fires``: every rank of a 2-node task prints every line of the benign corpora
  (``tests/detect/data/corpus/benign-*.toml``, and ``*-benign.toml`` of every held-out set:
  the sets ``sets.toml`` there lists, the last of them the blind set, of which only
  counts are reported) before it trains, through the agents' real output path. Counted:
  the agents' fault reports at SEV1/SEV2 on the job's stream; ``fired_rules`` names
  their rules.
- ``user_bug_drains``: rank 1 raises the same ``RuntimeError`` at iteration 5 of every
  launch. Counted: nodes drained. Also reported: how the task ended.
- ``unconfirmed_drains``: the agent on n2 is SIGSTOPped (the node stays reachable) until
  unicornd has replaced it. Counted: nodes drained.
- ``true_isolations`` of 2 faults injected: ``dev-cluster kill-node n2`` (a dead node);
  and a bad node n2 that stalls the job's collectives: its training ranks are SIGSTOPped
  whenever they run (so every restart stalls again, as on a node whose GPU or NIC hangs
  collectives), while a rank on n1 reports the NCCL timeouts it sees every 15 s, naming
  no culprit (the paired check's all-gather on n2 is corrupt,
  ``UNICORN_PAIRTEST_FAULT_NODE``). Counted: the faulty node drained and no other.
- ``false_alarms``: a fault-free run of ``--quiet-minutes`` (default 20) of a 2-node task
  with a CPU hog (a busy loop) beside it. Counted: incidents opened.
- ``healthy_nodes_drained``: over all scenarios, drains of nodes that were not the
  faulty node of their scenario.

Prints one JSON object; every count must be 0 except ``true_isolations`` (= faults injected).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launcher.probe import find_agents  # noqa: E402
from launcher.supervisor import process_state, rank_processes  # noqa: E402
from tests.conftest import DevCluster, start_cluster  # noqa: E402
from tests.system.coordinator import (  # noqa: E402
    PLANNER_MODEL,
    Coordinator,
    coordinator,
    trainer_command,
)
from unicorn_core.keys import PAYLOAD_FIELD  # noqa: E402
from unicorn_core.protocol import FaultReport, decode, encode  # noqa: E402
from unicornd.state import NodeHealth, Snapshot, TaskRecord, TaskState  # noqa: E402

CORPUS = REPO / "tests" / "detect" / "data" / "corpus"
HELD_OUT: tuple[str, ...] = tuple(tomllib.loads((CORPUS / "sets.toml").read_text())["held_out"])
"""The sets held out whole, in the order they were collected; the last is the blind set."""
PRINT_THEN_TRAIN = """\
import runpy, sys
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        print(line.rstrip("\\n"), flush=True)
sys.argv = [sys.argv[0], *sys.argv[2:]]
runpy.run_module("launcher.train", run_name="__main__")
"""


def running(s: Snapshot, name: str, past: int) -> bool:
    t = s.tasks.get(name)
    return t is not None and t.state is TaskState.RUNNING and (t.last_iteration or 0) > past


def drained(s: Snapshot) -> list[str]:
    return sorted(n.name for n in s.nodes.values() if n.health in (NodeHealth.DRAINING, NodeHealth.DRAINED))


def start(
    c: Coordinator, name: str, nodes: str, tmp: Path, *extra: str, command: tuple[str, ...] | None = None
) -> TaskRecord:
    job, held = c.hold_job(name, nodes)
    task = TaskRecord(
        task_id=name,
        name=name,
        model=PLANNER_MODEL,
        command=command or trainer_command(tmp / f"ckpt-{name}", *extra),
        min_gpus=1,
        max_gpus=len(held),
        job_id=job,
        nodes=held,
    )
    c.register(task)
    return task


def reset(cluster: DevCluster) -> None:
    for n in ("n1", "n2", "n3", "n4"):
        cluster.slurm("scontrol", "update", f"nodename={n}", "state=resume", check=False)


def benign(cluster: DevCluster, tmp: Path) -> dict[str, Any]:
    lines = []
    blind: set[str] = set()  # the blind set's lines: counted, their rules not named
    for path in [
        CORPUS / "benign-train.toml",
        CORPUS / "benign-heldout.toml",
        *(
            path
            for held_out in HELD_OUT  # the last, the blind set: counted, never printed
            for path in sorted(CORPUS.glob(f"{held_out}/*-benign.toml"))
        ),
    ]:
        texts = [str(e["text"]) for e in tomllib.loads(path.read_text())["line"]]
        lines += texts
        if path.parent.name == HELD_OUT[-1]:
            blind.update(t.replace("\n", " ") for t in texts)
    text = tmp / "benign.txt"
    text.write_text("".join(line.replace("\n", " ") + "\n" for line in lines))
    script = tmp / "print_then_train.py"
    script.write_text(PRINT_THEN_TRAIN)
    base = trainer_command(tmp / "ckpt-b")
    command = (base[0], str(script), str(text), *base[3:])
    with coordinator(cluster, tmp) as c:
        task = start(c, "b", "n1,n2", tmp, command=command)
        snap = c.wait(lambda s: running(s, "b", 5), "b training", 300)
        with c.client() as r:
            entries = r.xrange(c.keys.events(task.job_id or 0))
        reports = [decode(f[PAYLOAD_FIELD.encode()]) for _i, f in entries]
        fires = [m for m in reports if isinstance(m, FaultReport) and m.severity in ("SEV1", "SEV2")]
        sev3 = [m for m in reports if isinstance(m, FaultReport) and m.severity == "SEV3"]

        def of_blind(m: FaultReport) -> bool:
            return any(t in m.evidence for t in blind)

        return {
            "lines_printed_per_rank": len(lines),
            "benign_fires": len(fires),
            "benign_fires_sev3": len(sev3),
            "fired_rules": sorted({m.rule for m in fires + sev3 if not of_blind(m)}),
            "blind_set_fires": sum(1 for m in fires if of_blind(m)),
            # what fired, outside the blind set: (rule, severity, launch, the line's start)
            "fired": [[m.rule, m.severity, m.launch_id, m.evidence[:100]] for m in fires if not of_blind(m)],
            "incidents": len(snap.incidents),
            "incident_stages": [
                [i.rule, [e.stage.value for e in i.timeline]] for i in snap.incidents.values()
            ],
            "drained": drained(c.snapshot() or snap),
        }


def user_bug(cluster: DevCluster, tmp: Path) -> dict[str, Any]:
    extra = ("--fail-at-iteration=5", "--fail-rank=1", "--fail-mode=raise")
    with coordinator(cluster, tmp) as c:
        start(c, "u", "n1,n2", tmp, *extra)
        snap = c.wait(
            lambda s: (
                (t := s.tasks.get("u")) is not None and t.state in (TaskState.STOPPED, TaskState.FAILED)
            ),
            "the task with the bug to be stopped",
            600,
        )
        inc = next(iter(snap.incidents.values()), None)
        return {
            "user_bug_drains": len(drained(snap)),
            "task_state": snap.tasks["u"].state.value,
            "why": inc.note[:300] if inc else "",
        }


def stopped_agent(cluster: DevCluster, tmp: Path) -> dict[str, Any]:
    with coordinator(cluster, tmp) as c:
        task = start(c, "s", "n1,n2", tmp)
        snap = c.wait(lambda s: running(s, "s", 5), "s training", 300)
        (agent,) = find_agents(task.job_id or 0, "n2")
        os.kill(agent.pid, signal.SIGSTOP)
        past = snap.tasks["s"].last_iteration or 0
        try:
            snap = c.wait(
                lambda s: (
                    bool(s.incidents)
                    and all(not i.is_open for i in s.incidents.values())
                    and running(s, "s", past)
                ),
                "the agent replaced and training again",
                300,
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGCONT)
        inc = next(iter(snap.incidents.values()))
        return {
            "unconfirmed_drains": len(drained(snap)),
            "rule": inc.rule,
            "stages": [e.stage.value for e in inc.timeline],
        }


def node_kill(cluster: DevCluster, tmp: Path) -> dict[str, Any]:
    with coordinator(cluster, tmp) as c:
        start(c, "k", "n1,n2", tmp)
        c.wait(lambda s: running(s, "k", 5), "k training", 300)
        cluster.script("kill-node", "n2")
        try:
            snap = c.wait(lambda s: bool(drained(s)), "a drain", 120)
        finally:
            cluster.script("revive-node", "n2")
        return {"isolated": drained(snap) == ["n2"], "drained": drained(snap)}


def stall_ranks(job_id: int, node: str, stopped: set[int]) -> None:
    """SIGSTOP every training rank of ``job_id`` on ``node`` that runs (adds them to ``stopped``)."""
    for agent in find_agents(job_id, node):
        for pid, _env in rank_processes(agent.pid):
            if process_state(pid) not in (None, "T"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.add(pid)


def paired(cluster: DevCluster, tmp: Path) -> dict[str, Any]:
    env = {"UNICORN_PAIRTEST_FAULT_NODE": "n2"}
    stopped: set[int] = set()
    with coordinator(cluster, tmp, **env) as c:
        task = start(c, "p", "n1,n2,n3,n4", tmp)
        c.wait(lambda s: running(s, "p", 3), "p training", 300)
        deadline = time.monotonic() + 600
        n = 0
        snap = c.snapshot()
        try:
            while snap is not None and not drained(snap) and time.monotonic() < deadline:
                snap = _stall_and_report(c, task, n := n + 1, stopped)
        finally:
            for pid in stopped:  # whatever still lives of the stalled ranks (a reused pid is not stopped)
                if process_state(pid) == "T":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
        assert snap is not None
        incidents = sorted(snap.incidents.values(), key=lambda i: i.opened_s)
        return {
            "isolated": drained(snap) == ["n2"],
            "drained": drained(snap),
            "timeouts_reported": n,
            "ranks_stalled": len(stopped),
            "incidents": [
                {"rule": i.rule, "stages": [e.stage.value for e in i.timeline], "note": i.note}
                for i in incidents
            ],
        }


def _stall_and_report(c: Coordinator, task: TaskRecord, n: int, stopped: set[int]) -> Snapshot | None:
    """One round of the bad node: n2's ranks stalled, n1's rank reporting the timeout it sees,
    then 15 s of the ranks on n2 kept stalled (a restart starts new ones)."""
    job = task.job_id or 0
    stall_ranks(job, "n2", stopped)
    # a rank on n1 times out in its collectives, as the stalled peer causes
    report = FaultReport(
        job_id=job,
        node="n1",
        wall_time_s=time.time(),
        status="nccl_timeout",
        severity="SEV3",
        rule="nccl_watchdog_timeout",
        rank=0,
        evidence=f"[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={n})",
    )
    with c.client() as r:
        r.xadd(c.keys.events(report.job_id), {PAYLOAD_FIELD: encode(report)})
    t_next = time.monotonic() + 15
    snap = c.snapshot()
    while time.monotonic() < t_next and snap is not None and not drained(snap):
        time.sleep(0.5)
        stall_ranks(job, "n2", stopped)
        snap = c.snapshot()
    return snap


def trainers_running() -> list[int]:
    """Pids of built-in trainer processes (``-m launcher.train``) on this machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"launcher.train" in argv and b"-m" in argv:
                    pids.append(int(entry.name))
    return sorted(pids)


def quiet(cluster: DevCluster, tmp: Path, minutes: float) -> dict[str, Any]:
    # Ranks an earlier scenario left behind would compete for the CPU: reported, not hidden.
    strays = trainers_running()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with coordinator(cluster, tmp) as c:
            start(c, "q", "n1,n2", tmp)
            c.wait(lambda s: running(s, "q", 5), "q training", 300)
            started = time.time()
            end = time.monotonic() + 60 * minutes
            while time.monotonic() < end:
                time.sleep(5)
            snap = c.snapshot()
            assert snap is not None
            incidents = sorted(snap.incidents.values(), key=lambda i: i.opened_s)
            return {
                "false_alarms": len(incidents),
                "alarm_rules": [f"{i.status.value}:{i.rule}" for i in incidents][:10],
                # what each alarm saw and what it did: the next diagnosis starts here
                "alarms": [
                    {
                        "after_s": round(i.opened_s - started, 1),
                        "evidence": i.evidence[:300],
                        "stages": [e.stage.value for e in i.timeline],
                    }
                    for i in incidents[:10]
                ],
                "drained": drained(snap),
                "last_iteration": snap.tasks["q"].last_iteration,
                "trainers_left_by_earlier_scenarios": len(strays),
                "load_avg_1m_end": round(os.getloadavg()[0], 2),
            }
    finally:
        hog.kill()
        hog.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quiet-minutes", type=float, default=20.0)
    ap.add_argument("--only", default="", help="comma-separated scenarios (default: all)")
    args = ap.parse_args()
    scenarios = ["benign", "user_bug", "stopped_agent", "node_kill", "paired", "quiet"]
    chosen = args.only.split(",") if args.only else scenarios
    if set(chosen) - set(scenarios):
        ap.error(f"unknown scenarios {sorted(set(chosen) - set(scenarios))}")
    t0 = time.monotonic()
    out: dict[str, Any] = {"bench": "safety", "quiet_minutes": args.quiet_minutes}
    # torchrun may still be removing its folders when the cluster is down: retry the cleanup.
    with tempfile.TemporaryDirectory(prefix="bench-safety-", ignore_cleanup_errors=True) as d:
        root = Path(d)
        root.chmod(0o755)
        os.environ["TMPDIR"] = str(root)
        cluster = start_cluster(root / "cluster", "--nodes", "4", "--gpus-per-node", "1")
        try:
            for name in chosen:
                tmp = root / name
                tmp.mkdir()
                fn = {"benign": benign, "user_bug": user_bug, "stopped_agent": stopped_agent,
                      "node_kill": node_kill, "paired": paired}.get(name)  # fmt: skip
                out[name] = quiet(cluster, tmp, args.quiet_minutes) if name == "quiet" else fn(cluster, tmp)  # type: ignore[misc]
                print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
                reset(cluster)
        finally:
            cluster.script("down", check=False)
            for _ in range(20):
                shutil.rmtree(root, ignore_errors=True)
                if not root.exists():
                    break
                time.sleep(0.5)
    faulty = {"node_kill": "n2", "paired": "n2"}
    out["benign_fires"] = out.get("benign", {}).get("benign_fires")
    out["user_bug_drains"] = out.get("user_bug", {}).get("user_bug_drains")
    out["unconfirmed_drains"] = out.get("stopped_agent", {}).get("unconfirmed_drains")
    out["false_alarms"] = out.get("quiet", {}).get("false_alarms")
    out["faults_injected"] = sum(1 for k in faulty if k in out)
    out["true_isolations"] = sum(1 for k in faulty if out.get(k, {}).get("isolated"))
    out["healthy_nodes_drained"] = sum(
        len([n for n in out[k].get("drained", []) if n != faulty.get(k)]) for k in chosen if k in out
    )
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
