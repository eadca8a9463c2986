"""The node agent against the dev cluster's real Redis, supervising real processes."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import DevCluster, free_port, pid_alive
from tests.system.agent_helpers import run_agent, torchrun, toy
from unicorn_core.config import AgentConfig, DetectConfig
from unicorn_core.protocol import (
    AgentAction,
    AgentCommand,
    CommandResult,
    ExceptionReport,
    FaultReport,
    GpuFaultKind,
    GpuHealthEvent,
    Heartbeat,
    IterationTiming,
    Message,
    ProcessExit,
    encode,
)

pytestmark = pytest.mark.system


def is_(cls: type[Message], **fields: object):  # type: ignore[no-untyped-def]
    def pred(m: Message) -> bool:
        return isinstance(m, cls) and all(getattr(m, k) == v for k, v in fields.items())

    return pred


def test_heartbeats_iterations_and_clean_exit(cluster: DevCluster, tmp_path: Path) -> None:
    with run_agent(
        cluster.redis_url, tmp_path, toy("--iterations", "20", "--iter-s", "0.05"), "--exit-with-training"
    ) as a:
        _, hb = a.wait_for(is_(Heartbeat))
        assert isinstance(hb, Heartbeat) and hb.agent_pid == a.proc.pid
        ttl = a.client.pttl(a.keys.heartbeat(a.job_id, a.node))
        assert 0 < ttl <= AgentConfig().heartbeat_ttl_s * 1000
        a.wait_for(is_(IterationTiming, iteration=20))
        _, ex = a.wait_for(is_(ProcessExit))
        assert isinstance(ex, ProcessExit) and ex.exit_code == 0 and ex.signal is None
        assert a.proc.wait(timeout=20) == 0
        # A clean exit removes the liveness key at once.
        assert a.client.exists(a.keys.heartbeat(a.job_id, a.node)) == 0
        its = [m for _, m in a.seen if isinstance(m, IterationTiming)]
        assert [m.iteration for m in its] == list(range(1, 21))
        assert "rank 0/1 started" in (a.run_dir / "train.log").read_text()


def test_exception_is_reported_before_the_exit(cluster: DevCluster, tmp_path: Path) -> None:
    with run_agent(
        cluster.redis_url, tmp_path, toy("--raise-at", "3", "--iter-s", "0.02"), "--exit-with-training"
    ) as a:
        _, exc = a.wait_for(is_(ExceptionReport))
        assert isinstance(exc, ExceptionReport)
        assert exc.exc_type == "builtins.RuntimeError" and "iteration 3" in exc.message
        assert "toy_loop.py" in exc.traceback
        _, ex = a.wait_for(is_(ProcessExit))
        assert isinstance(ex, ProcessExit) and ex.exit_code == 1
        assert "RuntimeError: injected failure" in ex.stderr_tail
        assert a.proc.wait(timeout=20) == 1
        kinds = [type(m).__name__ for _, m in a.seen]
        assert kinds.index("ExceptionReport") < kinds.index("ProcessExit")


def test_error_signature_in_output_becomes_a_fault(cluster: DevCluster, tmp_path: Path) -> None:
    line = "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered"
    with run_agent(
        cluster.redis_url, tmp_path, toy("--print-at", "2", "--line", line, "--iter-s", "0.02")
    ) as a:
        _, f = a.wait_for(is_(FaultReport))
        assert isinstance(f, FaultReport)
        assert f.status == "illegal_memory_access" and f.severity == "SEV2" and f.rank == 0
        assert "illegal memory access" in f.evidence


def test_torchrun_rank_killed_is_reported_with_its_signal(cluster: DevCluster, tmp_path: Path) -> None:
    with run_agent(cluster.redis_url, tmp_path, torchrun(2, "--iter-s", "0.05")) as a:
        a.wait_for(is_(IterationTiming, rank=1), timeout_s=60)
        _, hb = a.wait_for(lambda m: isinstance(m, Heartbeat) and len(m.pids) == 3)
        assert isinstance(hb, Heartbeat)
        rank_pids = set(hb.pids) - {a.proc.pid}
        # The rank with RANK=1 in its environment:
        victim = next(
            p
            for p in rank_pids
            if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()
            and b"LOCAL_RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()
        )
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        t_seen, ex = a.wait_for(is_(ProcessExit, pid=victim))
        assert isinstance(ex, ProcessExit) and ex.rank == 1 and ex.local_rank == 1
        assert ex.signal in (signal.SIGKILL, None)  # None only if torchrun reaped it first
        assert t_seen - t_kill < 10.0
        # torchrun notices, stops the other rank and exits non-zero: reported too.
        _, main_exit = a.wait_for(lambda m: isinstance(m, ProcessExit) and m.rank is None, timeout_s=60)
        assert isinstance(main_exit, ProcessExit) and main_exit.exit_code != 0
        for pid in rank_pids:
            deadline = time.monotonic() + 30
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not pid_alive(pid)


def test_commands_relaunch_checkpoint_and_stop(cluster: DevCluster, tmp_path: Path) -> None:
    with run_agent(cluster.redis_url, tmp_path, toy("--iter-s", "0.02")) as a:
        a.wait_for(is_(IterationTiming, iteration=3))
        a.command(AgentAction.RELAUNCH, toy("--iter-s", "0.02", "--iterations", "5"), command_id="re1")
        _, res = a.wait_for(is_(CommandResult, command_id="re1"))
        assert isinstance(res, CommandResult) and res.ok, res
        # The first command exits 0 on the relaunch's SIGTERM, the second after 5 iterations.
        deadline = time.monotonic() + 30
        while sum(isinstance(m, ProcessExit) and m.exit_code == 0 for _, m in a.seen) < 2:
            assert time.monotonic() < deadline, a.seen
            a.poll()
            time.sleep(0.05)
        a.command(AgentAction.CHECKPOINT_NOW, command_id="ck1")
        _, ck = a.wait_for(is_(CommandResult, command_id="ck1"))
        assert isinstance(ck, CommandResult) and not ck.ok  # nothing left running to signal
        a.command(AgentAction.STOP, command_id="st1")
        _, st = a.wait_for(is_(CommandResult, command_id="st1"))
        assert isinstance(st, CommandResult) and st.ok
        assert a.proc.wait(timeout=20) == 0
        # Handled commands are removed from the stream: a restarted agent will not redo them.
        assert a.client.xlen(a.keys.agent_commands(a.job_id, a.node)) == 0


def test_a_whole_jobs_agent_runs_its_stored_command_and_replaces_the_agent_before_it(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """One srun step starts every agent of a job with the same command line; each reads its
    node's training command, stored under its launch id (--await-launch). A later agent
    for the same run folder ends the first (SIGTERM: it stops its training and exits 0)
    before it starts its own."""
    launch = "plan-1/t/launch"
    with run_agent(cluster.redis_url, tmp_path, (), "--launch-id", launch, "--await-launch") as first:
        stored = AgentCommand(
            job_id=first.job_id,
            node=first.node,
            wall_time_s=time.time(),
            command_id=launch,
            action=AgentAction.RELAUNCH,
            argv=toy("--iter-s", "0.02"),
            deadline_s=60.0,
        )
        first.client.set(first.keys.agent_launch(first.job_id, first.node), encode(stored))
        _, it = first.wait_for(is_(IterationTiming, iteration=3))
        assert isinstance(it, IterationTiming) and it.launch_id == launch
        again = "plan-2/t/launch"
        with run_agent(
            cluster.redis_url,
            tmp_path,
            (),
            "--launch-id",
            again,
            "--await-launch",
            prefix=first.keys.prefix,
            run_dir=first.run_dir,
        ) as second:
            assert first.proc.wait(timeout=30) == 0  # ended by its successor, gracefully
            first.poll()
            assert any(isinstance(m, ProcessExit) and m.exit_code == 0 for _, m in first.seen)
            # No command is stored for the second launch: it says so, as its launch failing.
            _, res = second.wait_for(is_(CommandResult, command_id=again), timeout_s=60)
            assert isinstance(res, CommandResult) and not res.ok and "no training command" in res.detail
            assert second.proc.poll() is None


def test_garbage_command_changes_nothing(cluster: DevCluster, tmp_path: Path) -> None:
    with run_agent(cluster.redis_url, tmp_path, toy("--iter-s", "0.05")) as a:
        a.wait_for(is_(IterationTiming, iteration=2))
        a.client.xadd(a.keys.agent_commands(a.job_id, a.node), {"msg": b"\xc1 not msgpack"})
        a.command(AgentAction.CHECKPOINT_NOW, command_id="after-garbage")
        _, res = a.wait_for(is_(CommandResult, command_id="after-garbage"))
        assert isinstance(res, CommandResult) and res.ok  # the training process got SIGUSR1
        assert not any(isinstance(m, ProcessExit) for _, m in a.seen)


def test_injected_gpu_fault(cluster: DevCluster, tmp_path: Path) -> None:
    faults = tmp_path / "faults.jsonl"
    faults.write_text("")
    with run_agent(
        cluster.redis_url, tmp_path, toy("--iter-s", "0.05"), "--inject-gpu-faults", str(faults)
    ) as a:
        a.wait_for(is_(Heartbeat))
        with faults.open("a") as f:
            f.write("not json\n")
            f.write(json.dumps({"gpu": 2, "kind": "xid", "value": 79}) + "\n")
        _, ev = a.wait_for(is_(GpuHealthEvent))
        assert isinstance(ev, GpuHealthEvent)
        assert ev.gpu_index == 2 and ev.kind == GpuFaultKind.XID and ev.value == 79 and ev.injected


def test_flooding_rank_does_not_starve_heartbeats(cluster: DevCluster, tmp_path: Path) -> None:
    with run_agent(cluster.redis_url, tmp_path, toy("--flood", "--iter-s", "0.2")) as a:
        # Six beats (seq 0-5), however long a loaded machine takes to start the agent and its child.
        a.wait_for(lambda m: isinstance(m, Heartbeat) and m.seq >= 5, timeout_s=60)
        hb_times = [m.wall_time_s for _, m in a.seen if isinstance(m, Heartbeat)]
        gaps = sorted(b - a_ for a_, b in itertools.pairwise(hb_times))
        # Beats every 1 s; unicornd calls an agent lost after 1.5 s without one
        # (detect.heartbeat_timeout_s). A starved agent stretches every gap; a loaded machine
        # may stretch one, so one gap may reach 3 s and the others must stay under 2 s.
        assert gaps[-1] < 3.0 and gaps[-2] < 2.0, gaps
        assert (a.run_dir / "train.log").stat().st_size > 1_000_000


def _start_redis(port: int, tmp: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def test_agent_survives_redis_outage_and_loses_nothing(tmp_path: Path) -> None:
    port = free_port()
    server = _start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with run_agent(
            url, tmp_path, toy("--iter-s", "0.02", "--iterations", "150"), "--exit-with-training"
        ) as a:
            a.wait_for(is_(IterationTiming, iteration=5))
            # Freeze writes, read what the old server got, then lose it.
            a.client.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
            a.poll()
            server.terminate()
            server.wait(timeout=10)
            time.sleep(2.0)  # ~100 iterations happen while Redis is gone
            server = _start_redis(port, tmp_path)
            a.client = redis.Redis(port=port)
            a.wait_for(is_(ProcessExit), timeout_s=30)
            assert a.proc.wait(timeout=30) == 0
        # The old server's content plus what the agent buffered while Redis was gone.
        its = sorted({m.iteration for _, m in a.seen if isinstance(m, IterationTiming)})
        assert its == list(range(1, 151)), "a buffered iteration was lost"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_stopped_rank_is_named_as_a_hang(cluster: DevCluster, tmp_path: Path) -> None:
    # 0.3 s iterations: the hang factor's share of the bound below outweighs its slack
    with run_agent(cluster.redis_url, tmp_path, torchrun(2, "--iter-s", "0.3")) as a:
        a.wait_for(is_(IterationTiming, rank=1, iteration=15), timeout_s=60)
        _, hb = a.wait_for(lambda m: isinstance(m, Heartbeat) and len(m.pids) == 3)
        assert isinstance(hb, Heartbeat)
        victim = next(
            p
            for p in set(hb.pids) - {a.proc.pid}
            if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{p}/environ").read_bytes()
        )
        os.kill(victim, signal.SIGSTOP)
        try:
            t_stop = time.monotonic()
            t_seen, f = a.wait_for(is_(FaultReport, status="task_hang"))
            assert isinstance(f, FaultReport) and f.rank == 1 and "state T" in f.evidence
            its = [m.duration_s for _, m in a.seen if isinstance(m, IterationTiming)]
            mean = sorted(its)[len(its) // 2]
            # Detected within (learned hang factor, at most max_hang_factor, + 1) mean
            # iterations of the stop, plus slack for the agent's watch turns, Redis and this
            # poll on a loaded machine.
            assert t_seen - t_stop < (DetectConfig().max_hang_factor + 1) * mean + 1.5, (
                t_seen - t_stop,
                mean,
            )
        finally:
            os.kill(victim, signal.SIGCONT)
