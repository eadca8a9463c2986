"""unicornd end to end: real Slurm, real Redis, real torchrun training under real agents."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import msgspec
import pytest
import redis.asyncio as aioredis
from PIL import Image

from detect.statuses import ErrorStatus
from launcher.probe import find_agents
from tests.browser import open_in_chromium
from tests.conftest import DevCluster, free_port, http_receiver, private_cluster
from tests.prometheus import prometheus_server
from tests.system.coordinator import (
    DP2_MODEL,
    PLANNER_MODEL,
    Coordinator,
    coordinator,
    iterations,
    resumes,
    train_log,
    trainer_command,
)
from tests.system.megatron_job import tiers_env
from unicorn_core.keys import PAYLOAD_FIELD
from unicorn_core.protocol import (
    AgentAction,
    AgentCommand,
    CommandResult,
    FaultReport,
    GpuFaultKind,
    GpuHealthEvent,
    decode,
    encode,
)
from unicornd.leader import election
from unicornd.state import Incident, LadderStage, NodeHealth, Snapshot, TaskRecord, TaskState

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """4 nodes with 1 GPU each: every planned rank is a CPU process on this 2-core machine."""
    with private_cluster(tmp_path_factory, "cluster1", "--nodes", "4", "--gpus-per-node", "1") as c:
        yield c


# Every test runs at the default detection settings: up to 4 trainer ranks, their agents
# and checkpoint children share this 2-core machine, and time spent waiting for a CPU is not
# counted as a hang (detect/stats.py), so no override is needed to keep them quiet.
ENV: dict[str, str] = {}


def task(c: Coordinator, name: str, nodes: str, weight: float, tmp: Path, *extra: str) -> TaskRecord:
    job, held = c.hold_job(name, nodes)
    return TaskRecord(
        task_id=name,
        name=name,
        model=PLANNER_MODEL,
        command=trainer_command(tmp / f"ckpt-{name}", *extra),
        weight=weight,
        min_gpus=1,
        job_id=job,
        nodes=held,
    )


def inject(c: Coordinator, a: TaskRecord, node: str, status: str, severity: str, evidence: str) -> bytes:
    """Write an agent's fault report for ``a``'s rank 1 on ``node`` to its job's events stream
    (as the agent would); the entry id."""
    report = FaultReport(
        job_id=a.job_id or 0,
        node=node,
        wall_time_s=time.time(),
        status=status,
        severity=severity,
        rule="injected",
        rank=1,
        evidence=evidence,
    )
    with c.client() as r:
        return cast(bytes, r.xadd(c.keys.events(report.job_id), {PAYLOAD_FIELD: encode(report)}))


def inject_gpu(c: Coordinator, a: TaskRecord, node: str, kind: GpuFaultKind, value: float) -> bytes:
    """Write the NVML reading an agent's GPU monitor sends for ``node`` (device evidence,
    which confirms a GPU fault, unlike a line the training printed); the entry id."""
    event = GpuHealthEvent(
        job_id=a.job_id or 0,
        node=node,
        wall_time_s=time.time(),
        gpu_index=0,
        kind=kind,
        value=value,
        detail=f"{kind} {value:g} (injected by the test)",
        injected=True,
    )
    with c.client() as r:
        return cast(bytes, r.xadd(c.keys.events(event.job_id), {PAYLOAD_FIELD: encode(event)}))


def show_incidents(snap: Snapshot) -> None:
    """Print every incident whole: its node, rule, evidence and timeline."""
    for i in sorted(snap.incidents.values(), key=lambda i: i.opened_s):
        print(f"incident {i.incident_id}: node={i.node} rank={i.rank} rule={i.rule} severity={i.severity}")
        print(f"  evidence: {i.evidence}")
        for e in i.timeline:
            print(f"  {e.t_s:.3f} {e.stage.value} {e.detail}")


def running(name: str, past: int = 0):  # type: ignore[no-untyped-def]
    def pred(s: Snapshot) -> bool:
        t = s.tasks.get(name)
        return t is not None and t.state is TaskState.RUNNING and (t.last_iteration or 0) > past

    return pred


def unicornctl(c: Coordinator, *args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "unicornctl")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, env=c.env, check=False)


def node_reason(cluster: DevCluster, node: str) -> str:
    """Slurm's reason for the node's state ("" when it has none; sinfo prints "none")."""
    reason = cluster.slurm("sinfo", "-h", "-n", node, "-o", "%E").stdout.strip()
    return "" if reason == "none" else reason


def test_node_loss_drains_replans_and_resumes_smaller(cluster: DevCluster, tmp_path: Path) -> None:
    with coordinator(cluster, tmp_path, **ENV) as c:
        a = task(c, "a", "n1,n2", 1.0, tmp_path)
        b = task(c, "b", "n3,n4", 1.2, tmp_path)
        c.register(a)
        c.register(b)
        snap = c.wait(lambda s: running("a", 6)(s) and running("b", 6)(s), "both tasks training", 180)
        b_before = snap.tasks["b"]
        assert snap.tasks["a"].nodes == ("n1", "n2") and snap.tasks["a"].layout is not None
        assert snap.tasks["a"].layout.pp == 2

        t_kill = time.monotonic()
        cluster.script("kill-node", "n2")
        try:
            snap = c.wait(
                lambda s: s.nodes["n2"].health in (NodeHealth.DRAINING, NodeHealth.DRAINED), "n2 drained", 60
            )
            t_drained = time.monotonic() - t_kill
            mark = snap.tasks["a"].last_iteration or 0
            snap = c.wait(
                lambda s: s.tasks["a"].nodes == ("n1",) and running("a", mark)(s), "a resumed on n1", 180
            )
            t_resumed = time.monotonic() - t_kill
        finally:
            cluster.script("revive-node", "n2")
        assert node_reason(cluster, "n2").startswith("unicorn: lost_connection")
        # Confirmed out of band before the drain: the probe got no answer from n2's SSH port
        # (ssh_unreachable, after connect_timeout_s), or slurmctld marked n2 NOT_RESPONDING
        # while its agent was silent; whichever comes first.
        reason = node_reason(cluster, "n2")
        assert "ssh_unreachable" in reason or "slurm_not_responding" in reason, reason
        a_now = snap.tasks["a"]
        assert a_now.layout is not None and a_now.layout.world_size == 1
        # b was left alone: same nodes, same layout, never relaunched.
        assert snap.tasks["b"].nodes == b_before.nodes and snap.tasks["b"].layout == b_before.layout
        assert snap.tasks["b"].launched_s == b_before.launched_s
        incident = max((i for i in snap.incidents.values() if i.task_id == "a"), key=lambda i: i.opened_s)
        stages = [e.stage for e in incident.timeline]
        if not (LadderStage.ISOLATE in stages and LadderStage.RESUMED in stages):
            # Printed whole: pytest shortens an assertion's message, and CI keeps only the
            # test's output (stop 35's log cut the second incident's finding off).
            show_incidents(snap)
            print(c.tail(200))
        assert LadderStage.ISOLATE in stages and LadderStage.RESUMED in stages, "see the incidents above"
        # The loss curve continues: the relaunch resumed from a checkpoint, not step 0.
        log = train_log(c.keys.prefix, a.job_id or 0, "n1")
        starts = resumes(log)
        assert len(starts) >= 2 and starts[-1] >= 5, starts
        after = [it for it, _ in iterations(log) if it > starts[-1]]
        assert after and after[0] == starts[-1] + 1
        print(f"drained after {t_drained:.1f}s, resumed after {t_resumed:.1f}s")

        # The node comes back: the operator resumes it, it passes its check, a replan uses it.
        c.resume("n2")
        snap = c.wait(
            lambda s: s.nodes["n2"].health is NodeHealth.HEALTHY and "n2" in s.tasks["a"].nodes,
            "n2 rejoined task a",
            180,
        )
        c.wait(running("a", snap.tasks["a"].last_iteration or 0), "a training on 2 nodes again", 180)


def test_a_lost_data_parallel_replica_resumes_from_the_survivors_copy(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """DP2 on n1,n2 with n3,n4 drained, memory tiers per node: n2 is killed. The survivor's
    just-in-time snapshot of its last completed iteration holds everything the lost
    replica held, so the shrink to n1 (DP1) restores it, rank 1's shard read from its
    replica rank 0: no completed iteration is lost (the logging rank was n2's: its log
    ends at the last iteration both ranks completed)."""
    cluster.slurm("scontrol", "update", "nodename=n3,n4", "state=drain", "reason=test: no spare node")
    try:
        with coordinator(cluster, tmp_path, **ENV, **tiers_env(tmp_path)) as c:
            job, held = c.hold_job("dp", "n1,n2")
            dp = TaskRecord(
                task_id="dp", name="dp", model=DP2_MODEL, command=trainer_command(tmp_path / "ckpt-dp"),
                min_gpus=1, max_gpus=2, job_id=job, nodes=held,
            )  # fmt: skip
            c.register(dp)
            snap = c.wait(running("dp", 6), "dp training", 180)
            assert snap.tasks["dp"].layout is not None and snap.tasks["dp"].layout.dp == 2
            cluster.script("kill-node", "n2")
            try:
                c.wait(
                    lambda s: s.tasks["dp"].nodes == ("n1",) and running("dp", 0)(s), "dp resumed on n1", 180
                )
            finally:
                cluster.script("revive-node", "n2")
            completed = max(it for it, _ in iterations(train_log(c.keys.prefix, job, "n2")))
            log = train_log(c.keys.prefix, job, "n1")
            restored = re.findall(r"restored iteration (\d+) from the memory tiers: (.*)", log)
            assert restored, log[-3000:]
            iteration, sources = int(restored[-1][0]), restored[-1][1]
            assert iteration >= completed, (iteration, completed, sources)
            # From the survivor's replica, unless the kill fell after a snapshot the peer
            # already held (then both shards are real copies of that iteration).
            assert "shards [1] from replica rank 0" in sources or iteration % 5 == 0, sources
    finally:
        cluster.slurm("scontrol", "update", "nodename=n2,n3,n4", "state=resume", check=False)


INCIDENT_CAUSES = ("detection", "decision_drain", "transition", "recomputation")
"""The causes an incident's timeline books: they stop growing once the task is past its mark."""


def test_prometheus_and_the_report_show_the_goodput_of_a_node_kill(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """A real Prometheus scrapes unicornd through a node kill, and its HTTP API gives the
    ledger's figures: each incident cause's lost GPU-seconds exactly as ``unicornctl goodput
    --json`` has them, and achieved WAF while the task trains. ``unicornctl report --html``
    of the same run renders in headless Chromium with the incident's stages and the WAF."""
    metrics_port = free_port()
    env = {"UNICORN_METRICS__LISTEN": f"127.0.0.1:{metrics_port}"}
    with (
        prometheus_server(tmp_path / "prometheus", [f"127.0.0.1:{metrics_port}"]) as prom,
        coordinator(cluster, tmp_path, **ENV, **env) as c,
    ):
        # All 4 nodes from the start: a job grown by expansion cannot shrink in the same run.
        a = task(c, "p", "n1,n2,n3,n4", 1.0, tmp_path)
        c.register(a)
        c.wait(running("p", 6), "p training", 180)
        cluster.script("kill-node", "n2")
        try:
            snap = c.wait(lambda s: s.nodes["n2"].health is not NodeHealth.HEALTHY, "n2 isolated", 60)
            mark = snap.tasks["p"].last_iteration or 0
            moved = running("p", mark + 5)
            c.wait(lambda s: "n2" not in s.tasks["p"].nodes and moved(s), "p past its mark", 180)
        finally:
            cluster.script("revive-node", "n2")

        def ledger() -> dict[str, float]:
            shown = unicornctl(c, "goodput", "--json")
            assert shown.returncode == 0, shown.stderr
            return {k: float(v) for k, v in json.loads(shown.stdout)["gpu_s"]["lost"].items()}

        def scraped() -> dict[str, float]:
            return {s.labels["cause"]: s.value for s in prom.query("unicorn_goodput_lost_gpu_seconds_total")}

        # The ledger is saved every 5 s and scraped every second: wait until both are past the
        # recovery, then the frozen causes must agree to the last bit.
        deadline = time.monotonic() + 60
        while True:
            want, got = ledger(), scraped()
            same = all(math.isclose(got.get(k, -1.0), want[k], rel_tol=1e-12) for k in INCIDENT_CAUSES)
            if same or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert same, (want, got)
        assert prom.targets_up() == [f"http://127.0.0.1:{metrics_port}/metrics"]
        # The node kill cost detection and transition time; the ledger booked GPU-seconds.
        assert want["detection"] > 0 and want["transition"] > 0, want
        total = prom.query("unicorn_goodput_gpu_seconds_total")
        productive = prom.query("unicorn_goodput_productive_gpu_seconds_total")
        assert len(total) == 1 and len(productive) == 1 and 0 < productive[0].value < total[0].value
        achieved = prom.query('unicorn_goodput_task_achieved_waf_tflops{task="p"}')
        assert len(achieved) == 1 and achieved[0].value > 0, achieved
        # W* now is the calibrated ideal. It is not an upper bound on the latest stretch's rate: the
        # calibration moves 0.3 of the way toward a faster stretch (CALIBRATE_UP), and the ledger
        # books the difference as negative sub_healthy. (CI once scraped 2134 vs 2262 after the
        # shrink, when the old layout's calibration was carried over: a new layout now starts its
        # own.) Over the run the ideal's work exceeds the achieved by the kill's losses: one
        # expression, so both sides come from one scrape.
        ideal = prom.query("unicorn_goodput_ideal_waf_tflops")
        assert len(ideal) == 1 and ideal[0].value > 0, ideal
        gap = prom.query("unicorn_goodput_ideal_wtflop - unicorn_goodput_achieved_wtflop")
        lost = prom.query("unicorn_goodput_lost_wtflop")
        assert len(gap) == 1 and gap[0].value > 0, (gap, lost)

        # The same run as the operator's page, rendered by a real browser.
        page = tmp_path / "report.html"
        made = unicornctl(c, "report", "--html", str(page))
        assert made.returncode == 0, made.stderr
        incident = next(
            i for i in c.wait(lambda _: True, "a snapshot").incidents.values() if i.task_id == "p"
        )
        with open_in_chromium(page, width=1280, height=2400) as shown:
            assert shown.console == (), shown.console
            with Image.open(shown.screenshot) as png:
                colours = png.convert("RGB").getcolors(maxcolors=1 << 16)
            assert colours is not None and len(colours) > 20  # not blank
            dom = shown.dom
        row = re.search(
            rf'<g class="incident" [^>]*data-incident="{re.escape(incident.incident_id)}">(.*?)</g>', dom
        )
        assert row is not None, dom
        stages = re.findall(r'data-stage="([a-z_]+)"', row.group(1))
        assert "isolate" in stages and "resumed" in stages, stages
        assert re.search(r'<polyline id="waf-achieved" class="series achieved" points="[\d., ]+"', dom)
        assert re.search(r'<tr class="out"><td>n2</td><td>draine[d]?', dom), "n2 out in the node table"
        c.resume("n2")
        c.wait(lambda s: s.nodes["n2"].health is NodeHealth.HEALTHY, "n2 back", 120)


def stragglers(snap: Snapshot, task_id: str | None) -> list[Incident]:
    """The straggler incidents of ``task_id`` (None: the reports, which name no task)."""
    return [i for i in snap.incidents.values() if i.status is ErrorStatus.STRAGGLER and i.task_id == task_id]


def test_a_straggler_is_replaced_by_the_spare_and_the_same_slow_rank_elsewhere_only_reported(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """Rank 1 of a data-parallel task on n1-n3 burns 3x its compute time (the trainer's
    test-only --slow-rank): its node is convicted on compute times (not the lock-step wall
    time), drained as a straggler and replaced by the idle n4 (the gain over the next
    failure interval beats the transition). The same rank, slow again on its new node, is
    the rank's own work: reported, nothing more drained."""
    with coordinator(cluster, tmp_path, **ENV) as c:
        job, held = c.hold_job("st", "n1,n2,n3")
        # One layer: the planner cannot pipeline it, so all three nodes are one stage (DP3).
        model = replace(PLANNER_MODEL, layers=1)
        a = TaskRecord(
            task_id="st",
            name="st",
            model=model,
            command=trainer_command(tmp_path / "ckpt-st", "--slow-rank=1", "--slow-factor=3"),
            min_gpus=1,
            max_gpus=3,
            job_id=job,
            nodes=held,
        )
        c.register(a)
        snap = c.wait(running("st", 2), "st training", 180)
        layout = snap.tasks["st"].layout
        assert layout is not None and (layout.pp, layout.dp) == (1, 3), layout
        try:
            snap = c.wait(
                lambda s: any(
                    i.status.value == "straggler" and i.task_id == "st" for i in s.incidents.values()
                ),
                "the straggler convicted and replaced",
                300,
            )
            inc = next(
                i for i in snap.incidents.values() if i.status.value == "straggler" and i.task_id == "st"
            )
            slow = inc.node
            assert slow in held, inc
            snap = c.wait(
                lambda s: "n4" in s.tasks["st"].nodes and running("st", 1)(s), "st on the spare n4", 180
            )
            assert slow not in snap.tasks["st"].nodes
            assert node_reason(cluster, slow).startswith("unicorn: straggler"), node_reason(cluster, slow)
            others = [n for n in ("n1", "n2", "n3", "n4") if n != slow]
            # Rank 1 is slow again on its new node: a report (an incident without a task).
            snap = c.wait(
                lambda s: any(i.node in others for i in stragglers(s, None)),
                "the same slow rank reported",
                300,
            )
            report = next(
                i for i in snap.incidents.values() if i.status.value == "straggler" and i.task_id is None
            )
            assert report.stage is LadderStage.DETECTED and "rank" in report.note, report
            assert all(snap.nodes[n].health is NodeHealth.HEALTHY for n in others)
            assert not any(node_reason(cluster, n) for n in others)
        finally:
            for n in ("n1", "n2", "n3"):
                cluster.slurm("scontrol", "update", f"nodename={n}", "state=resume", check=False)


def test_exception_restarts_in_place_without_drain(cluster: DevCluster, tmp_path: Path) -> None:
    with coordinator(cluster, tmp_path, **ENV) as c:
        marker = tmp_path / "fault-fired"
        a = task(
            c, "x", "n1,n2", 1.0, tmp_path,
            "--fail-at-iteration=12", "--fail-rank=1", "--fail-mode=raise", f"--fail-once-marker={marker}",
        )  # fmt: skip
        a = replace(a, max_gpus=2)  # stays on its 2 nodes: fewer ranks on 2 cores
        c.register(a)
        nodes = c.wait(running("x", 2), "x training", 180).tasks["x"].nodes
        snap = c.wait(lambda s: marker.exists() and bool(s.incidents), "the injected exception seen", 180)
        snap = c.wait(running("x", 13), "x past the fault", 180)
        inc = next(iter(snap.incidents.values()))
        assert inc.status.value in ("other_software_error", "exited_abnormally"), inc
        stages = [e.stage for e in inc.timeline]
        assert LadderStage.RESTART_PROCESSES in stages and LadderStage.ISOLATE not in stages
        assert snap.tasks["x"].nodes == nodes  # same nodes, nothing drained
        assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())
        assert not any(node_reason(cluster, n) for n in nodes)


def test_sev3_is_retried_in_place(cluster: DevCluster, tmp_path: Path) -> None:
    """Also: the operator hears of it (webhook alerts) and sees it (metrics endpoint)."""
    with http_receiver() as hook:
        metrics_port = free_port()
        alerts_env = {
            "UNICORN_ALERTS__WEBHOOK_URL": f"http://127.0.0.1:{hook.port}/unicorn",
            "UNICORN_METRICS__LISTEN": f"127.0.0.1:{metrics_port}",
        }
        with coordinator(cluster, tmp_path, **ENV, **alerts_env) as c:
            a = task(c, "y", "n3,n4", 1.0, tmp_path)
            c.register(a)
            nodes = c.wait(running("y", 6), "y training", 180).tasks["y"].nodes
            inject(
                c,
                a,
                "n4",
                "connection_refused_reset",
                "SEV3",
                "RuntimeError: Connection reset by peer (injected by the test)",
            )
            snap = c.wait(
                lambda s: any(i.stage is LadderStage.CLOSED for i in s.incidents.values()),
                "the retry closed",
                60,
            )
            inc = next(iter(snap.incidents.values()))
            stages = [e.stage for e in inc.timeline]
            assert LadderStage.RETRY_IN_PLACE in stages and LadderStage.RESTART_PROCESSES not in stages
            # What the operator sees, while unicornd runs and after it stopped.
            shown = unicornctl(c, "status", "--json", "--check")
            assert shown.returncode == 0, shown.stderr
            doc = json.loads(shown.stdout)["unicorn"]
            assert doc["daemon_alive"] and [t["task_id"] for t in doc["tasks"]] == ["y"]
            assert doc["tasks"][0]["state"] == "running" and doc["tasks"][0]["nodes"] == list(nodes)
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            scraped = urllib.request.urlopen(url, timeout=10).read().decode().splitlines()
            counted = [x for x in scraped if x.startswith("unicorn_incidents_total{") and "refused" in x]
            assert len(counted) == 1 and counted[0].endswith(" 1.0"), scraped
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and [a["kind"] for a in hook.bodies][-1:] != ["closed"]:
                time.sleep(0.2)
            assert [(a["kind"], a["incident_id"]) for a in hook.bodies] == [
                ("opened", inc.incident_id),
                ("closed", inc.incident_id),
            ], hook.bodies
            c.stop()
            assert unicornctl(c, "status", "--check").returncode == 1
            assert stages[-2:] == [LadderStage.RESUMED, LadderStage.CLOSED]
            assert snap.tasks["y"].nodes == nodes


def test_kill9_during_recovery_loses_nothing(cluster: DevCluster, tmp_path: Path) -> None:
    with coordinator(cluster, tmp_path, **ENV) as c:
        # The job holds all 4 nodes from the start, so the plan needs no resize before the
        # fault (a job grown by expansion cannot be resized again in the same run; see notes).
        a = task(c, "z", "n1,n2,n3,n4", 1.0, tmp_path)
        c.register(a)
        c.wait(running("z", 6), "z training", 180)
        cluster.script("kill-node", "n4")
        try:
            # Kill -9 unicornd as soon as the drain decision is persisted.
            c.wait(lambda s: s.nodes["n4"].health is not NodeHealth.HEALTHY, "n4 isolated", 60)
            assert c.stop(signal.SIGKILL) == -signal.SIGKILL
            killed_ms = time.time() * 1000
            c.start()
            snap = c.wait(
                lambda s: "n4" not in s.tasks["z"].nodes and running("z", 1)(s),
                "z resumed after restart",
                180,
            )
        finally:
            cluster.script("revive-node", "n4")
        with c.client() as r:
            done = [m.decode() for m in r.zrange(c.keys.actions_done_at(), 0, -1)]
            checked_ms = time.time() * 1000
            pending = r.xpending_range(c.keys.events(a.job_id or 0), "unicornd", min="-", max="+", count=1000)
        drains = [a for a in done if "/drain/" in a]
        assert drains == [next(a for a in done if "/drain/n4" in a)], done  # drained exactly once
        # Every event was handled and acknowledged, those pending at the kill included: what is
        # pending now is only what the live daemon is handling at this moment (written after the
        # kill, and in the last 30 s: a loaded machine's daemon may lag some seconds).
        cutoff = max(killed_ms, checked_ms - 30000)
        stale = [p for p in pending if int(p["message_id"].split(b"-")[0]) < cutoff]
        assert not stale, stale
        assert snap.nodes["n4"].health in (NodeHealth.DRAINING, NodeHealth.DRAINED)
        c.resume("n4")
        c.wait(lambda s: s.nodes["n4"].health is NodeHealth.HEALTHY, "n4 back", 120)


def kill_agent(job_id: int, node: str) -> int:
    """SIGKILL the agent of ``job_id`` on ``node`` (found by its exact command line)."""
    agents = find_agents(job_id, node)
    assert len(agents) == 1, agents
    os.kill(agents[0].pid, signal.SIGKILL)
    return agents[0].pid


def test_dead_agent_is_restarted_without_drain(cluster: DevCluster, tmp_path: Path) -> None:
    """A silent agent on a live node: the SSH probe finds the node up and the agent gone, so
    the agent is started again and the task's processes restarted; nothing is drained."""
    with coordinator(cluster, tmp_path, **ENV) as c:
        a = replace(task(c, "g", "n1,n2", 1.0, tmp_path), max_gpus=2)  # stays on its 2 nodes
        c.register(a)
        snap = c.wait(running("g", 6), "g training", 180)
        nodes = snap.tasks["g"].nodes
        kill_agent(a.job_id or 0, "n2")
        print(f"killed the agent of job {a.job_id} on n2 at {time.time():.3f}")

        # The ranks' peers fail first (connection reset); the silent agent is then probed.
        snap = c.wait(lambda s: bool(s.incidents), "the fault noticed", 60)
        mark = snap.tasks["g"].last_iteration or 0
        snap = c.wait(
            lambda s: running("g", mark)(s) and not any(i.is_open for i in s.incidents.values()),
            "g resumed",
            180,
        )
        inc = next(iter(snap.incidents.values()))
        with c.client() as r:
            done = sorted(m.decode() for m in r.zrange(c.keys.actions_done_at(), 0, -1))
        restarted = [d for d in done if "/restart_agent/" in d]
        assert restarted == [f"{inc.incident_id}/restart_processes/1/restart_agent/n2"], done
        assert any(f.endswith(":probe") for f in inc.finding_ids), inc.finding_ids
        stages = [e.stage for e in inc.timeline]
        assert LadderStage.RESTART_PROCESSES in stages and LadderStage.ISOLATE not in stages, stages
        assert snap.tasks["g"].nodes == nodes
        assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())
        assert not node_reason(cluster, "n2")
        assert len(find_agents(a.job_id or 0, "n2")) == 1  # a new one


def test_kernel_evidence_from_the_probe_drains(cluster: DevCluster, tmp_path: Path) -> None:
    """The probe reads the node's kernel log: an Xid 79 there makes the silence a SEV1 GPU
    fault, so the node is drained with the kernel's words in the reason."""
    kern = cluster.state_dir / "nodes" / "n4" / "kern.log"
    with coordinator(cluster, tmp_path, **ENV) as c:
        a = replace(task(c, "k", "n3,n4", 1.0, tmp_path), max_gpus=2)
        c.register(a)
        c.wait(running("k", 6), "k training", 180)
        kern.write_text("[ 4711.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.\n")
        try:
            kill_agent(a.job_id or 0, "n4")
            snap = c.wait(
                lambda s: s.nodes["n4"].health in (NodeHealth.DRAINING, NodeHealth.DRAINED), "n4 drained", 60
            )
        finally:
            kern.write_text("")
        # The incident the kill opened (peers' connection resets, then the probe). Under load
        # a false hang may have opened and closed an earlier one (see the closing notes).
        (inc,) = [i for i in snap.incidents.values() if "n4" in i.isolated_nodes]
        assert inc.isolated_nodes == ("n4",) and any(f.endswith(":probe") for f in inc.finding_ids), inc
        deadline = time.monotonic() + 30  # the drain is committed before the executor runs it
        while not (reason := node_reason(cluster, "n4")) and time.monotonic() < deadline:
            time.sleep(0.2)
        expected = f"unicorn: gpu_driver_error {inc.incident_id} xid_79: kernel log of n4: "
        assert reason.startswith(expected), reason
        assert "GPU has fallen off the bus" in reason
        c.resume("n4")
        c.wait(lambda s: s.nodes["n4"].health is NodeHealth.HEALTHY, "n4 back", 120)


def test_a_relaunch_that_cannot_start_fails_its_rung_on_the_agents_answer(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """A relaunch whose executable is missing on the node (written as unicornd writes a plan's
    relaunch: same stream, same id scheme) is answered at once by the agent, and unicornd
    decides on that answer within seconds (10 s allowed on a loaded machine) instead of waiting
    for a stage timeout (180-600 s).
    The agent's command task survives; a command that cannot start drains nothing."""
    with coordinator(cluster, tmp_path, **ENV) as c:
        a = replace(task(c, "m", "n1,n2", 1.0, tmp_path), max_gpus=2)
        c.register(a)
        snap = c.wait(running("m", 4), "m training", 180)
        job, gen = a.job_id or 0, snap.tasks["m"].generation
        command_id = f"plan-{gen}/m/relaunch/n1"
        command = AgentCommand(
            job_id=job,
            node="n1",
            wall_time_s=time.time(),
            command_id=command_id,
            action=AgentAction.RELAUNCH,
            argv=["/nonexistent/bin/torchrun", "--nnodes=2", "train.py"],
            deadline_s=30.0,
        )
        answered = incident = None
        with c.client() as r:
            r.xadd(c.keys.agent_commands(job, "n1"), {PAYLOAD_FIELD: encode(command)})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (answered is None or incident is None):
                now = time.monotonic()
                if answered is None:
                    for _id, fields in r.xrange(c.keys.command_results(job)):
                        msg = decode(fields[PAYLOAD_FIELD.encode()])
                        if isinstance(msg, CommandResult) and msg.command_id == command_id:
                            answered, result = now, msg
                current = c.snapshot()
                inc_now = current.open_incident("m") if current is not None else None
                if (
                    incident is None
                    and inc_now is not None
                    and any(command_id in e.detail for e in inc_now.timeline)
                ):
                    incident = now
                time.sleep(0.05)
        assert answered is not None and incident is not None, c.tail()
        assert not result.ok and "nonexistent" in result.detail, result
        print(f"the answer in the incident's timeline {incident - answered:+.2f} s after it was seen")
        assert incident - answered <= 10.0
        snap = c.wait(
            lambda s: (
                (i := s.open_incident("m")) is not None and i.stage is LadderStage.ESCALATED_TO_OPERATOR
            ),
            "the operator asked",
            60,
        )
        inc = snap.open_incident("m")
        assert inc is not None and "not isolating" in inc.note, inc
        assert any("nonexistent" in e.detail for e in inc.timeline), inc.timeline
        assert not inc.isolated_nodes and all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())
        assert not node_reason(cluster, "n1") and not node_reason(cluster, "n2")
        # The agent still takes commands: the rung's restarts were answered too.
        with c.client() as r:
            answers = [decode(f[PAYLOAD_FIELD.encode()]) for _i, f in r.xrange(c.keys.command_results(job))]
        ids = {m.command_id for m in answers if isinstance(m, CommandResult)}
        assert f"{inc.incident_id}/restart_processes/1/restart_ranks/n1" in ids, ids
        # A command it cannot run is validated and answered, and the next one still is.
        empty = msgspec.structs.replace(
            command, command_id="test/empty-argv", argv=[], wall_time_s=time.time()
        )
        with c.client() as r:
            r.xadd(c.keys.agent_commands(job, "n1"), {PAYLOAD_FIELD: encode(empty)})
            deadline, reply = time.monotonic() + 30, None
            while reply is None and time.monotonic() < deadline:
                for _i, f in r.xrange(c.keys.command_results(job)):
                    m = decode(f[PAYLOAD_FIELD.encode()])
                    if isinstance(m, CommandResult) and m.command_id == "test/empty-argv":
                        reply = m
                time.sleep(0.1)
        assert reply is not None and not reply.ok and "without a training command" in reply.detail, reply


def test_an_operator_confirms_the_drain_the_limiter_held(cluster: DevCluster, tmp_path: Path) -> None:
    """With a drain limit of 0, a SEV1 waits for the operator; `unicornctl incidents confirm
    ID --yes` releases it: the node is drained and the task replanned off it."""
    limits = {"UNICORN_RECOVERY__MIN_DRAINS_PER_WINDOW": "0", "UNICORN_RECOVERY__MAX_DRAIN_FRACTION": "0.1"}
    with coordinator(cluster, tmp_path, **ENV, **limits) as c:
        # At most its job's 2 nodes: Slurm refuses to requeue a job onto more nodes than it asked for.
        a = replace(task(c, "h", "n3,n4", 1.0, tmp_path), max_gpus=2)
        c.register(a)
        c.wait(running("h", 4), "h training", 180)
        # The same words printed by a rank would only restart it: only device evidence confirms.
        inject_gpu(c, a, "n4", GpuFaultKind.ECC_UNCORRECTABLE, 2)
        try:
            snap = c.wait(
                lambda s: (i := s.open_incident("h")) is not None and i.pending_drain == "n4",
                "the drain held for the operator",
                60,
            )
            inc = snap.open_incident("h")
            assert inc is not None and inc.stage is LadderStage.ESCALATED_TO_OPERATOR
            assert snap.nodes["n4"].health is NodeHealth.SUSPECT and not node_reason(cluster, "n4")
            shown = unicornctl(c, "incidents", "confirm", inc.incident_id)
            assert shown.returncode == 1 and "--yes" in shown.stderr, shown
            assert c.snapshot().nodes["n4"].health is NodeHealth.SUSPECT  # type: ignore[union-attr]
            done = unicornctl(c, "incidents", "confirm", inc.incident_id, "--yes")
            assert done.returncode == 0, done.stderr
            snap = c.wait(
                lambda s: (
                    s.nodes["n4"].health in (NodeHealth.DRAINING, NodeHealth.DRAINED)
                    and "n4" not in s.tasks["h"].nodes
                    and running("h", 5)(s)
                ),
                "n4 drained, h training without it",
                180,
            )
            assert node_reason(cluster, "n4").startswith("unicorn: ecc_error")
        finally:
            cluster.slurm("scontrol", "update", "nodename=n4", "state=resume", check=False)


def _election(c: Coordinator) -> tuple[str | None, int, list[str]]:
    """What ``unicornctl status`` reads: leader, fencing token, standbys."""

    async def read() -> tuple[str | None, int, list[str]]:
        client = aioredis.Redis.from_url(c.env["UNICORN_REDIS__URL"])
        try:
            return await election(client, c.keys)
        finally:
            await client.aclose()

    return asyncio.run(read())


def _until(pred, what: str, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_the_standby_completes_a_recovery_when_the_leader_is_killed(
    cluster: DevCluster, tmp_path: Path
) -> None:
    with coordinator(cluster, tmp_path, **ENV) as c:
        standby = c.spawn(tmp_path / "standby.log")
        try:
            _until(lambda: len(_election(c)[2]) == 1, "a standby", 30)
            leader, token, (waiting,) = _election(c)
            assert leader is not None and token >= 1 and waiting != leader
            shown = unicornctl(c, "status", "--json")
            doc = json.loads(shown.stdout)["unicorn"]
            assert (doc["leader"], doc["fence"], doc["standbys"]) == (leader, token, [waiting]), doc
            a = replace(task(c, "s", "n1,n2", 1.0, tmp_path), max_gpus=2)
            c.register(a)
            c.wait(running("s", 4), "s training", 180)
            inject(c, a, "n2", "other_software_error", "SEV2", "RuntimeError: injected by the test")
            c.wait(lambda s: s.open_incident("s") is not None, "the restart decided", 60)
            assert c.stop(signal.SIGKILL) == -signal.SIGKILL  # the leader dies mid-recovery
            killed = time.monotonic()
            c.proc = standby
            _until(lambda: _election(c)[0] == waiting, "the standby leading", 30)
            took = time.monotonic() - killed
            print(f"standby leads {took:.2f} s after the leader was killed")
            # lease_s + one renewal interval + polling and scheduling on a loaded machine
            assert took <= 3.0 + 1.0 + 5.0, took
            assert _election(c)[1] == token + 1
            snap = c.wait(
                lambda s: (
                    bool(s.incidents)
                    and not any(i.is_open for i in s.incidents.values())
                    and running("s", 5)(s)
                ),
                "the standby completed the recovery",
                180,
            )
            inc = next(iter(snap.incidents.values()))
            assert LadderStage.RESTART_PROCESSES in [e.stage for e in inc.timeline]
            assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())
        finally:
            if standby.poll() is None:
                standby.send_signal(signal.SIGINT)
                standby.wait(30)


def test_a_new_leader_drains_a_node_that_died_during_the_takeover_without_the_agents_grace(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """The leader is killed and a node dies with it. The standby knows from the agents'
    heartbeat keys how long each has been silent (unicornd/seed.py), so the dead node is
    confirmed and drained at once, not after a new agent's 30 s grace."""
    with coordinator(cluster, tmp_path, **ENV) as c:
        standby = c.spawn(tmp_path / "standby.log")
        try:
            _until(lambda: len(_election(c)[2]) == 1, "a standby", 30)
            _leader, _token, (waiting,) = _election(c)
            a = replace(task(c, "t", "n1,n2", 1.0, tmp_path), max_gpus=2)
            c.register(a)
            c.wait(running("t", 4), "t training", 180)
            assert c.stop(signal.SIGKILL) == -signal.SIGKILL
            cluster.script("kill-node", "n2")
            try:
                c.proc = standby
                _until(lambda: _election(c)[0] == waiting, "the standby leading", 30)
                leading = time.monotonic()
                c.wait(lambda s: s.nodes["n2"].health is not NodeHealth.HEALTHY, "n2 isolated", 60)
                took = time.monotonic() - leading
            finally:
                cluster.script("revive-node", "n2")
            print(f"n2 isolated {took:.1f} s after the standby took over")
            assert "liveness_seeded" in (tmp_path / "standby.log").read_text()
            # The heartbeat timeout (1.5 s) and the out-of-band confirmation (SSH connect
            # timeout 5 s, or slurmctld's NOT_RESPONDING), far below the 30 s grace.
            assert took < 20, took
            assert node_reason(cluster, "n2").startswith("unicorn: lost_connection")
            c.resume("n2")
            c.wait(lambda s: s.nodes["n2"].health is NodeHealth.HEALTHY, "n2 back", 120)
        finally:
            if standby.poll() is None:
                standby.send_signal(signal.SIGINT)
                standby.wait(30)


def test_a_paused_leader_that_resumes_is_fenced_off(cluster: DevCluster, tmp_path: Path) -> None:
    with coordinator(cluster, tmp_path, **ENV) as c:
        standby = c.spawn(tmp_path / "standby.log")
        try:
            _until(lambda: len(_election(c)[2]) == 1, "a standby", 30)
            _old, token, (waiting,) = _election(c)
            a = replace(task(c, "p", "n3,n4", 1.0, tmp_path), max_gpus=2)
            c.register(a)
            c.wait(running("p", 3), "p training", 180)
            assert c.proc is not None
            c.proc.send_signal(signal.SIGSTOP)  # paused (a long GC, a hung disk) past its lease
            _until(lambda: _election(c)[0] == waiting, "the standby leading", 30)
            state = c.snapshot()
            c.proc.send_signal(signal.SIGCONT)
            code = c.proc.wait(timeout=30)  # its renewal or its next commit is refused: it exits
            assert code == 1, c.tail()
            log = c.tail(200)
            assert "lost the lease" in log or "commit refused" in log or "fenced off" in log, log
            assert _election(c)[:2] == (waiting, token + 1)
            c.proc = standby
            after = c.wait(
                running("p", (state.tasks["p"].last_iteration or 0) if state else 0), "p still training", 60
            )
            assert after.tasks["p"].nodes == ("n3", "n4")
        finally:
            if standby.poll() is None:
                standby.send_signal(signal.SIGINT)
                standby.wait(30)


def test_state_and_pending_events_survive_a_redis_crash(cluster: DevCluster, tmp_path: Path) -> None:
    """Redis runs with an append-only file (appendfsync everysec): SIGKILLed and started
    again, it still holds unicornd's state and an event no one had read; the agents' Redis
    users (kept in Redis's config, not its data) are made again when unicornd starts, so
    the running agents go on reporting."""
    with coordinator(cluster, tmp_path, **ENV) as c:
        a = replace(task(c, "d", "n1,n2", 1.0, tmp_path), max_gpus=2)
        c.register(a)
        c.wait(running("d", 3), "d training", 180)
        assert c.stop(signal.SIGKILL) == -signal.SIGKILL  # nobody reads the events for a while
        evidence = "ConnectionResetError: written before the Redis crash (injected by the test)"
        entry = inject(c, a, "n2", "connection_refused_reset", "SEV3", evidence)
        state = c.snapshot()
        assert state is not None
        restarted = cluster.script("restart-redis", check=False)
        assert restarted.returncode == 0, restarted.stderr
        with c.client() as r:
            assert c.snapshot() == state
            assert [e[0] for e in r.xrange(c.keys.events(a.job_id or 0), entry, entry)] == [entry]
        c.start()
        snap = c.wait(
            lambda s: any("before the Redis crash" in i.evidence for i in s.incidents.values()),
            "the event written before the crash decided",
            60,
        )
        mark = snap.tasks["d"].last_iteration or 0
        c.wait(running("d", mark + 3), "the agents reporting again", 120)


def test_a_collective_timeout_drains_the_node_the_paired_check_names_not_the_reporter(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """Rank 1 on n1 keeps reporting NCCL timeouts; n1 is not the culprit and nothing out of
    band names one. With restarts used up (0 here), unicornd runs the paired check across
    the job's 4 nodes on the real cluster; n2 (planted bad: its all-gather is corrupt) is
    convicted and drained, n1 is not, and the task trains again without n2."""
    quick = {
        "UNICORN_RECOVERY__MAX_RETRIES_IN_PLACE": "0",
        "UNICORN_RECOVERY__MAX_PROCESS_RESTARTS": "0",
        "UNICORN_PAIRTEST_FAULT_NODE": "n2",
    }
    with coordinator(cluster, tmp_path, **ENV, **quick) as c:
        a = replace(task(c, "q", "n1,n2,n3,n4", 1.0, tmp_path), max_gpus=4)
        c.register(a)
        c.wait(running("q", 3), "q training", 240)
        inject(c, a, "n1", "nccl_timeout", "SEV3", "Watchdog caught collective operation timeout (injected)")
        snap = c.wait(
            lambda s: s.nodes["n2"].health in (NodeHealth.DRAINING, NodeHealth.DRAINED),
            "the paired check to convict n2",
            240,
        )
        (inc,) = [i for i in snap.incidents.values() if i.task_id == "q"]
        assert inc.isolated_nodes == ("n2",), inc
        assert any("paired check" in e.detail for e in inc.timeline), inc.timeline
        assert snap.nodes["n1"].health is NodeHealth.HEALTHY and not node_reason(cluster, "n1")
        deadline = time.monotonic() + 30
        while not (reason := node_reason(cluster, "n2")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reason.startswith(f"unicorn: nccl_timeout {inc.incident_id}") and "check" in reason, reason
        snap = c.wait(running("q", (snap.tasks["q"].last_iteration or 0)), "q training without n2", 240)
        assert "n2" not in snap.tasks["q"].nodes
        c.resume("n2")
        c.wait(lambda s: s.nodes["n2"].health is NodeHealth.HEALTHY, "n2 back", 120)
