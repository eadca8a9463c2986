#!/usr/bin/env python3
"""Detection latency, false alarms and agent overhead on the real dev cluster.

Starts a private dev cluster (2 nodes), holds both nodes with one batch job, launches
one ``unicorn-agent`` per node through ``srun --overlap`` running a 2-node torchrun job
(gloo, one rank per node, an all-reduce per iteration), and runs the coordinator's real
detection path in this process: events read from Redis through the consumer group
(:class:`unicornd.ingest.StreamIngest`) into :class:`unicornd.detector.Detector`.

Faults, ``--trials`` each (the default 20):

- ``process_exit``: SIGKILL the rank on n2; latency = kill -> finding.
- ``exception``: the rank on n2 raises at a chosen iteration; latency = the rank's
  report time (``wall_time_s``, stamped by the hook as the exception propagates, same
  machine clock) -> finding.
- ``hang``: SIGSTOP the rank on n2; delay = the end of that rank's last completed
  iteration (its own ``IterationTiming`` stamp, same machine clock) -> the first hang
  finding (the agent's local monitor or the coordinator's), divided by the learned mean
  iteration time. This checks the configuration, it does not measure a capability:
  the detector declares a hang after ``k`` x the mean of silence, ``k`` being
  ``detect.hang_factor`` learned up to ``max_hang_factor`` (reported per trial as
  ``hang_factor_in_force``: the coordinator's, ``max_hang_factor`` for 16 iterations
  past a launch's warm-up; the agent's monitor, which reports a stopped rank and
  comes first, has no lenient start), so the figure is ``k`` plus reporting latency
  (``over_deadline`` = delay / (``k`` x mean)). The delay from the SIGSTOP itself is
  reported too (``from_stop_over_mean``): it is shorter by the part of an iteration the
  rank had done when stopped.
- ``node_loss``: ``dev-cluster kill-node n2``; latency = kill -> heartbeat finding.

Every trial's row is kept (``raw``); a trial that fails (no finding in time) is a row
with its error, counted in ``failed`` and listed in ``failures``: the statistics cover
the trials that succeeded, never silently fewer than were run.

Then ``false_alarms``: a fault-free run of ``--quiet-s`` seconds with noise (a CPU hog
process on this 2-core machine, and a checkpoint command every 20 s that makes one
step ``--ckpt-s`` slower), counting every finding. And ``agent_overhead_pct``: the
same compute loop run alternately with and without the agent (``--overhead-pairs``
pairs), throughput ratio in one run.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from detect import load_classifier  # noqa: E402
from unicorn_core import redis_io  # noqa: E402
from unicorn_core.config import load_config  # noqa: E402
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys  # noqa: E402
from unicorn_core.protocol import (  # noqa: E402
    AgentAction,
    AgentCommand,
    ExceptionReport,
    Heartbeat,
    IterationTiming,
    Message,
    SlowStep,
    encode,
)
from unicorn_core.slurm.cli import CliSlurm  # noqa: E402
from unicornd.detector import Detector, JobEvidence  # noqa: E402
from unicornd.ingest import StreamIngest  # noqa: E402

DEV = REPO / "scripts" / "dev-cluster"
TOY = REPO / "scripts" / "workloads" / "toy_loop.py"
BIN = Path(sys.executable).parent
NODES = ("n1", "n2")


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0, "p50": None, "p95": None, "max": None}
    return {
        "n": len(xs),
        "p50": round(statistics.median(xs), 4),
        "p95": round(p95(xs), 4),
        "max": round(max(xs), 4),
    }


def proc_stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command name (``[0]`` is the state)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_s(stat: list[str]) -> float:
    """User + system CPU seconds from :func:`proc_stat`'s fields."""
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def rank_sched(pid: int) -> dict[str, Any] | None:
    """A training rank's state, main-thread run and run-queue wait (schedstat) and process CPU
    seconds; None for a process that is not a rank (torchrun) or is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        if b"\0RANK=" not in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
            return None
        run_ns, wait_ns = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
        stat = proc_stat(pid)
        return {
            "state": stat[0],
            "run_s": int(run_ns) / 1e9,
            "wait_s": int(wait_ns) / 1e9,
            "cpu_s": cpu_s(stat),
        }
    return None


def agent_cpu_s(pid: int, children: dict[int, float]) -> float | None:
    """CPU seconds (user + system) of process ``pid`` and of its children that run the
    checkpoint process (``launcher.ckptagent``), not the training; None when ``pid`` is gone.

    ``children`` (pid -> CPU seconds last read) is kept by the caller across samples: a child
    that has ended (the agent stops it before it exits) still counts with its last reading,
    so the sum never goes down (it did, and a short run's steady share came out negative)."""
    try:
        total = cpu_s(proc_stat(pid))
    except (OSError, ValueError, IndexError):
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = proc_stat(int(entry.name))
            if int(stat[1]) == pid and b"launcher.ckptagent" in (entry / "cmdline").read_bytes():
                children[int(entry.name)] = cpu_s(stat)
    return total + sum(children.values())


class Bench:
    def __init__(self, args: argparse.Namespace, state: Path) -> None:
        self.args = args
        self.state = state
        self.env: dict[str, str] = {}
        self.findings: list[tuple[float, float, JobEvidence]] = []
        """(monotonic, wall clock, finding)"""
        self.last_report: dict[tuple[str, int], float] = {}
        """(node, rank) -> the wall-clock stamp of the rank's latest IterationTiming (its last step's end)"""
        self.heartbeats: dict[str, Heartbeat] = {}
        self.agents: dict[str, Any] = {}
        self.job_id = 0
        self.port = 29500 + os.getpid() % 1000
        self.generation = 0
        self.exception_latency = float("nan")
        self.trace: Any = None
        """``--trace`` file: one JSON line per timing, slow-step notice, command and finding."""

    def dev(self, *a: str) -> str:
        return subprocess.run(
            [str(DEV), "--state-dir", str(self.state), *a], check=True, capture_output=True, text=True
        ).stdout

    async def on_message(self, msg: Message, now: float, _entry_id: str, _stream: str) -> None:
        if isinstance(msg, Heartbeat):
            self.heartbeats[msg.node] = msg
        if isinstance(msg, IterationTiming):
            self.last_report[(msg.node, msg.rank)] = msg.wall_time_s
        found = self.detector.on_message(msg, now)
        if self.trace is not None and isinstance(msg, IterationTiming | SlowStep):
            self.record(now, type(msg).__name__, node=msg.node, rank=msg.rank, iteration=msg.iteration,
                        phase=str(msg.phase), duration_s=getattr(msg, "duration_s", None))  # fmt: skip
        if found and isinstance(msg, ExceptionReport):
            # Same machine, same wall clock: the hook's stamp -> the coordinator's finding.
            self.exception_latency = time.time() - msg.wall_time_s
        for f in found:
            self.finding(now, f)

    def record(self, now: float, kind: str, **fields: Any) -> None:
        if self.trace is not None:
            self.trace.write(json.dumps({"t": round(now, 6), "kind": kind, **fields}) + "\n")

    def finding(self, now: float, f: JobEvidence) -> None:
        self.findings.append((now, time.time(), f))
        self.record(now, "finding", node=f.evidence.node, rank=f.evidence.rank, source=f.evidence.source,
                    status=str(f.classification.status), evidence=f.classification.evidence)  # fmt: skip

    async def checker(self) -> None:
        while True:
            now = time.monotonic()
            for f in self.detector.check(now):
                self.finding(now, f)
            await asyncio.sleep(0.01)

    def train_argv(self, node_rank: int, extra: list[str]) -> list[str]:
        return [
            str(BIN / "torchrun"),
            "--nnodes=2",
            f"--node-rank={node_rank}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={self.port + self.generation}",
            "--max-restarts=0",
            str(TOY),
            "--iter-s",
            str(self.args.iter_s),
            "--fault-rank",
            "1",
            *extra,
        ]

    async def start_agents(self, extra: list[str]) -> None:
        self.generation += 1
        for i, node in enumerate(NODES):
            argv = [
                str(BIN / "unicorn-agent"),
                "--job-id",
                str(self.job_id),
                "--node",
                node,
                "--run-dir",
                str(self.state / "runs" / f"{node}-{self.generation}"),
                "--",
                *self.train_argv(i, extra),
            ]
            if self.args.agent_logs is not None:  # the agent's JSON log lines, appended per node
                log = self.args.agent_logs / f"agent-{node}.log"
                argv = ["/bin/sh", "-c", 'exec "$@" 2>>"$0"', str(log), *argv]
            self.agents[node] = await self.slurm.launch_step(self.job_id, [node], argv, capture=False)
            self.detector.expect_agent(self.job_id, node, time.monotonic())

    async def stop_agents(self) -> None:
        for node, step in list(self.agents.items()):
            self.detector.forget_agent(self.job_id, node)
            with contextlib.suppress(Exception):
                await step.stop(grace_s=10.0)
        self.agents.clear()
        self.detector.forget_job(self.job_id)
        self.heartbeats.clear()

    async def wait_training(self, min_iteration: int, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hb = self.heartbeats.get("n2")
            it = self.detector.last_iteration(self.job_id)
            if hb is not None and len(hb.pids) >= 2 and it is not None and it >= min_iteration:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("training did not start")

    def rank_pid(self) -> int:
        hb = self.heartbeats["n2"]
        for pid in hb.pids:
            with contextlib.suppress(OSError):
                if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                    return pid
        raise RuntimeError(f"rank 1 not among {hb.pids}")

    async def wait_finding(
        self, since: float, pred: Any, timeout_s: float = 30.0
    ) -> tuple[float, float, JobEvidence]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, wall, f in self.findings:
                if t >= since and pred(f):
                    return t, wall, f
            await asyncio.sleep(0.005)
        raise RuntimeError(
            f"no finding after {timeout_s}s; have {[(f.classification.status) for _, _, f in self.findings]}"
        )

    async def trial(self, kind: str) -> dict[str, Any]:
        """One fault: its row, ``value`` being the figure the summary reports (seconds, or
        a multiple of the mean iteration time for a hang)."""
        extra: list[str] = []
        if kind == "exception":
            extra = ["--raise-at", "40"]
        await self.start_agents(extra)
        try:
            await self.wait_training(20)
            self.findings.clear()
            if kind == "process_exit":
                pid = self.rank_pid()
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                t, _, _ = await self.wait_finding(
                    t0, lambda f: f.evidence.source == "exit" and f.evidence.node == "n2"
                )
                return {"value": round(t - t0, 4)}
            if kind == "exception":
                await self.wait_finding(0, lambda f: f.evidence.source == "exception")
                return {"value": round(self.exception_latency, 4)}
            if kind == "hang":
                return await self.hang_trial()
            if kind == "node_loss":
                t0 = time.monotonic()
                self.dev("kill-node", "n2")
                try:
                    t, _, _ = await self.wait_finding(
                        t0, lambda f: f.evidence.source == "heartbeat" and f.evidence.node == "n2"
                    )
                finally:
                    self.dev("revive-node", "n2")
                    await self.wait_node_back()
                return {"value": round(t - t0, 4)}
            raise ValueError(kind)
        finally:
            await self.stop_agents()

    async def hang_trial(self) -> dict[str, Any]:
        """SIGSTOP rank 1 (on n2): delay from the end of its last completed iteration (its
        own report's stamp) to the first hang finding, over the learned mean iteration time."""
        pid = self.rank_pid()
        monitor = self.detector._jobs[self.job_id].monitor
        mean = monitor.mean_s() or self.args.iter_s
        factor = monitor.effective_hang_factor()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            t, wall, f = await self.wait_finding(t0, lambda f: str(f.classification.status) == "task_hang")
            last = self.last_report.get(("n2", 1))  # stopped: no report of it comes after t0
        finally:
            os.kill(pid, signal.SIGCONT)
        if last is None:
            raise RuntimeError("no iteration report of rank 1 on n2 before the stop")
        delay = wall - last
        return {
            "value": round(delay / mean, 4),
            "delay_s": round(delay, 4),
            "mean_iteration_s": round(mean, 4),
            "hang_factor_in_force": round(factor, 3),
            "over_deadline": round(delay / (factor * mean), 4),
            "from_stop_over_mean": round((t - t0) / mean, 4),
            "found_by": f.evidence.source,
        }

    async def wait_node_back(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                await self.slurm.resume("n2")
            info = await self.slurm.get_node("n2")
            job = await self.slurm.get_job(self.job_id)
            if info.usable is False and "n2" in job.nodes and info.state.value in ("ALLOCATED", "MIXED"):
                return
            if "n2" in job.nodes and info.state.value in ("ALLOCATED", "MIXED") and not info.flags:
                return
            await asyncio.sleep(0.5)
        raise RuntimeError("n2 did not come back into the job")

    async def sample_ranks(self) -> None:
        """``--trace``: every 0.1 s, each rank's cumulative run-queue wait and CPU time (/proc)."""
        while True:
            for node, hb in list(self.heartbeats.items()):
                for pid in hb.pids:
                    sample = rank_sched(pid)
                    if sample is not None:
                        self.record(time.monotonic(), "sched", node=node, pid=pid, **sample)
            await asyncio.sleep(0.1)

    async def quiet_run(self) -> dict[str, Any]:
        await self.start_agents(
            ["--compute", str(self.args.quiet_compute), "--ckpt-s", str(self.args.ckpt_s)]
        )
        hog = await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass")
        sampler = asyncio.create_task(self.sample_ranks()) if self.trace is not None else None
        try:
            await self.wait_training(5)
            self.findings.clear()
            t_end = time.monotonic() + self.args.quiet_s
            n_ckpt = 0
            while time.monotonic() < t_end:
                await asyncio.sleep(min(20.0, max(0.0, t_end - time.monotonic())))
                if time.monotonic() < t_end:
                    n_ckpt += 1
                    self.record(time.monotonic(), "checkpoint_now", id=f"ck{n_ckpt}")
                    for node in NODES:
                        await self.command(node, AgentAction.CHECKPOINT_NOW, f"ck{n_ckpt}")
            alarms = [f for _, _, f in self.findings]
            return {
                "false_alarms": len(alarms),
                "false_alarm_detail": [
                    f"{f.classification.status}:{f.evidence.source}:{f.evidence.node}: "
                    f"{f.classification.evidence}"
                    for f in alarms
                ][:10],
                "quiet_s": self.args.quiet_s,
                "slow_checkpoint_steps": n_ckpt,
                "last_iteration": self.detector.last_iteration(self.job_id),
            }
        finally:
            if sampler is not None:
                sampler.cancel()
            hog.kill()
            await hog.wait()
            await self.stop_agents()

    async def command(self, node: str, action: AgentAction, cid: str) -> None:
        cmd = AgentCommand(
            job_id=self.job_id,
            node=node,
            wall_time_s=time.time(),
            command_id=cid,
            action=action,
            deadline_s=30,
        )
        await self.client.xadd(self.keys.agent_commands(self.job_id, node), {PAYLOAD_FIELD: encode(cmd)})

    def overhead(self) -> dict[str, Any]:
        """Training-loop time of the same compute loop with and without the agent, alternated.

        The loop reports every iteration through the hook when it runs under the agent;
        its own ``loop_s`` excludes process start-up, so the ratio is the agent's cost to
        training throughput. Median of the per-pair ratios. On 2 cores the ratio moves with
        the machine's noise and a short loop pays the agent's start: ``_steady`` times the
        same iterations from a third of the loop on, on both sides (once the agent and its
        checkpoint process have started; a real run pays the start once). The agent's own CPU
        (it and its checkpoint process, from ``/proc``) is reported too: per wall second
        from 1 s after their start (``agent_cpu_share_steady``), and in that first second.
        """
        steady_from = max(1, self.args.overhead_iters // 3)
        loop = [
            sys.executable, str(TOY), "--compute", str(self.args.overhead_compute), "--iter-s", "0",
            "--iterations", str(self.args.overhead_iters), "--steady-from", str(steady_from),
        ]  # fmt: skip

        def loop_s(argv: list[str], log: Path | None) -> tuple[float, float]:
            out = subprocess.run(
                argv, check=True, env={**os.environ, **self.env}, capture_output=True, text=True
            )
            return loop_s_in(out.stdout if log is None else log.read_text())

        def loop_s_in(text: str) -> tuple[float, float]:
            """(the whole loop's seconds, its seconds from iteration ``steady_from`` on)."""
            last = text.rsplit("loop_s=", 1)[1]
            return float(last.split(maxsplit=1)[0]), float(last.split("steady_s=", 1)[1].split(maxsplit=1)[0])

        shares: list[float] = []
        """Per run under the agent: CPU the agent and its checkpoint process used from 1 s after
        the start to their last sample, per wall second (a share of one core)."""
        starts: list[float] = []
        """Per run under the agent: their CPU seconds in the first second (start-up)."""

        def agent_loop_s(argv: list[str], log: Path) -> tuple[float, float]:
            proc = subprocess.Popen(
                argv, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            t0 = time.monotonic()
            samples: list[tuple[float, float]] = []
            children: dict[int, float] = {}
            while proc.poll() is None:
                cpu = agent_cpu_s(proc.pid, children)
                if cpu is not None:
                    samples.append((time.monotonic() - t0, cpu))
                if time.monotonic() - t0 > _AGENT_RUN_LIMIT_S:  # the agent did not end with its training
                    proc.kill()
                    proc.wait()
                    why = f"agent run {log.parent.name} still running after {_AGENT_RUN_LIMIT_S:g} s"
                    raise RuntimeError(why)
                time.sleep(0.25)
            if proc.returncode != 0:
                raise RuntimeError(f"agent run exited {proc.returncode}")
            first = next((s for s in samples if s[0] >= 1.0), None)
            if first is not None and samples[-1][0] > first[0]:
                shares.append((samples[-1][1] - first[1]) / (samples[-1][0] - first[0]))
                starts.append(first[1])
            return loop_s_in(log.read_text())

        ratios: list[float] = []
        steady_ratios: list[float] = []
        with_agent: list[float] = []
        without: list[float] = []
        for i in range(self.args.overhead_pairs):
            run_dir = self.state / "runs" / f"overhead-{i}"
            agent = [
                str(BIN / "unicorn-agent"), "--job-id", "999", "--node", "n1", "--exit-with-training",
                "--run-dir", str(run_dir), "--", *loop,
            ]  # fmt: skip
            if i % 2 == 0:
                a = agent_loop_s(agent, run_dir / "train.log")
                b = loop_s(loop, None)
            else:
                b = loop_s(loop, None)
                a = agent_loop_s(agent, run_dir / "train.log")
            with_agent.append(a[0])
            without.append(b[0])
            ratios.append(a[0] / b[0])
            steady_ratios.append(a[1] / b[1])
        return {
            "agent_overhead_pct": round(100 * (statistics.median(ratios) - 1), 2),
            # the same, timed from iteration steady_from on (the same iterations on both sides):
            # the agent's cost once it and its checkpoint process have started
            "agent_overhead_pct_steady": round(100 * (statistics.median(steady_ratios) - 1), 2),
            "overhead_steady_from_iteration": steady_from,
            "overhead_loop_s": {
                "with_agent": [round(x, 3) for x in with_agent],
                "without": [round(x, 3) for x in without],
            },
            # the agent's own steady cost, free of the machine's noise: CPU per wall second of
            # the agent and its checkpoint process from 1 s after their start (median of runs),
            # and their CPU seconds in that first second
            "agent_cpu_share_steady": round(statistics.median(shares), 4) if shares else None,
            "agent_cpu_s_first_second": round(statistics.median(starts), 3) if starts else None,
        }

    async def run(self) -> dict[str, Any]:
        self.dev("up", "--nodes", "2", "--gpus-per-node", "1", "--cpus-per-node", "2")
        self.env.update(json.loads(self.dev("env", "--json")))
        prefix = f"bench{os.getpid()}"
        self.env["UNICORN_REDIS__KEY_PREFIX"] = prefix
        os.environ.update(self.env)
        cfg = load_config(None)
        self.keys = RedisKeys(prefix)
        self.client = redis_io.connect(cfg.redis)
        self.slurm = CliSlurm(timeout_s=cfg.slurm.command_timeout_s)
        self.detector = Detector(cfg.detect, cfg.agent, load_classifier())
        self.job_id = await self.slurm.submit_batch(
            "#!/bin/sh\nsleep 100000\n", ["-N", "2", "--no-kill", "-J", "bench-hold", "-o", "/dev/null"]
        )
        deadline = time.monotonic() + 30
        while (await self.slurm.get_job(self.job_id)).state.value != "RUNNING":
            if time.monotonic() > deadline:
                raise RuntimeError("holder job did not start")
            await asyncio.sleep(0.2)
        ingest = StreamIngest(self.client, self.keys.events(self.job_id), "bench", self.on_message)
        tasks = [asyncio.create_task(ingest.run()), asyncio.create_task(self.checker())]
        out: dict[str, Any] = {
            "machine": os.uname().nodename,
            "cpus": os.cpu_count(),
            "trials": self.args.trials,
            "heartbeat_interval_s": cfg.agent.heartbeat_interval_s,
            "heartbeat_timeout_s": cfg.detect.heartbeat_timeout_s,
            "hang_factor": cfg.detect.hang_factor,
            "iter_s": self.args.iter_s,
        }
        try:
            results: dict[str, list[dict[str, Any]]] = {}
            for kind in self.args.faults if self.args.trials > 0 else []:
                results[kind] = []
                for i in range(self.args.trials):
                    try:
                        row = {"trial": i, "ok": True, "error": None, **await self.trial(kind)}
                    except Exception as e:  # a failed trial is a row, counted and kept
                        row = {"trial": i, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    results[kind].append(row)
            for kind, rows in results.items():
                out[kind] = {
                    "trials": len(rows),
                    "failed": sum(1 for r in rows if not r["ok"]),
                    "failures": [f"#{r['trial']}: {r['error']}" for r in rows if not r["ok"]],
                    **summary([r["value"] for r in rows if r["ok"]]),  # n: the trials that succeeded
                }
                if kind == "hang":
                    for key in ("over_deadline", "from_stop_over_mean", "hang_factor_in_force"):
                        out[kind][key] = summary([r[key] for r in rows if r["ok"]])
                out[kind]["raw"] = rows
            if "process_exit" in results:
                out["process_exit_p95_s"] = out["process_exit"]["p95"]
            if "exception" in results:
                out["exception_p95_s"] = out["exception"]["p95"]
            if "hang" in results:
                out["hang_detect_over_iter"] = out["hang"]["p95"]
            if "node_loss" in results:
                out["node_loss_p95_s"] = out["node_loss"]["p95"]
            if self.args.quiet_s > 0:
                out.update(await self.quiet_run())
            if self.args.overhead_pairs > 0:
                out.update(self.overhead())
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.slurm.cancel(self.job_id)
            await self.client.aclose()
        return out


_AGENT_RUN_LIMIT_S = 300.0
"""An overhead run under the agent takes seconds; one still running after this is a defect."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument(
        "--faults", nargs="+", default=["process_exit", "exception", "hang", "node_loss"],
        choices=["process_exit", "exception", "hang", "node_loss"],
    )  # fmt: skip
    ap.add_argument("--iter-s", type=float, default=0.1, help="sleep per toy iteration")
    ap.add_argument("--quiet-s", type=float, default=600.0)
    ap.add_argument("--ckpt-s", type=float, default=1.0, help="extra time of a checkpoint step")
    ap.add_argument("--quiet-compute", type=int, default=4, help="matmuls per quiet-run iteration")
    ap.add_argument("--overhead-pairs", type=int, default=10)
    ap.add_argument(
        "--trace",
        type=Path,
        help="write every timing, slow-step notice, command and finding here (JSON lines)",
    )
    ap.add_argument("--agent-logs", type=Path, help="append each agent's log (stderr) to DIR/agent-NODE.log")
    ap.add_argument("--overhead-iters", type=int, default=300)
    ap.add_argument("--overhead-compute", type=int, default=150, help="matmuls per overhead iteration")
    args = ap.parse_args()
    if args.agent_logs is not None:
        args.agent_logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="unicorn-bench-") as tmp:
        state = Path(tmp) / "cluster"
        Path(tmp).chmod(0o755)
        os.environ["TMPDIR"] = tmp  # torchrun's torchelastic_* folders go with the run
        bench = Bench(args, state)
        try:
            with contextlib.ExitStack() as stack:
                if args.trace is not None:
                    bench.trace = stack.enter_context(args.trace.open("w"))
                out = asyncio.run(bench.run())
        finally:
            subprocess.run([str(DEV), "--state-dir", str(state), "down"], capture_output=True, check=False)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
