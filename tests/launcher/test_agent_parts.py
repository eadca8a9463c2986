"""Agent building blocks without Redis: hook datagrams, process status, output pump, outbox policy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import types
import unittest.mock
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from launcher import megatron as launcher_megatron
from launcher.hook import MAX_DATAGRAM, Hook
from launcher.nodecheck import Outcome, check_disk, check_injected
from launcher.outbox import Outbox
from launcher.supervisor import OutputPump, decode_wait_status, descendants, read_environ, read_zombie_status
from unicorn_core.keys import RedisKeys
from unicorn_core.protocol import (
    ExceptionReport,
    Heartbeat,
    IterationPhase,
    IterationTiming,
    ProcessExit,
    SlowStep,
    decode,
)


def test_hook_sends_protocol_datagrams(tmp_path: Path) -> None:
    path = tmp_path / "h.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    hook = Hook(str(path), job_id=9, node="n3", rank=2)
    hook.iteration(5, 0.25, samples=8, phase="checkpoint", loss=1.5)
    try:
        raise ValueError("boom")
    except ValueError as e:
        hook.exception(e)
    it = decode(server.recv(MAX_DATAGRAM))
    exc = decode(server.recv(MAX_DATAGRAM))
    assert isinstance(it, IterationTiming)
    assert (it.job_id, it.node, it.rank, it.iteration, it.phase, it.loss) == (
        9,
        "n3",
        2,
        5,
        IterationPhase.CHECKPOINT,
        1.5,
    )
    assert isinstance(exc, ExceptionReport)
    assert (
        exc.exc_type == "builtins.ValueError"
        and exc.message == "boom"
        and "raise ValueError" in exc.traceback
    )
    assert hook.sent == 2 and hook.dropped == 0
    server.close()


def test_hook_without_agent_is_a_noop_and_never_raises(tmp_path: Path) -> None:
    off = Hook(None, 0, "n", 0)
    off.iteration(1, 0.1)
    assert not off.enabled and off.sent == 0
    gone = Hook(str(tmp_path / "nobody.sock"), 0, "n", 0)
    gone.iteration(1, 0.1)
    gone.exception(RuntimeError("x"))
    assert gone.dropped == 2 and gone.sent == 0


def test_wait_status_decoding() -> None:
    assert decode_wait_status(0) == (0, None)
    assert decode_wait_status(3 << 8) == (3, None)
    assert decode_wait_status(signal.SIGKILL) == (None, signal.SIGKILL)


def test_zombie_status_is_read_before_reaping() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in descendants(os.getpid())
        assert read_zombie_status(child.pid) is None  # running
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        status = None
        while status is None and time.monotonic() < deadline:
            status = read_zombie_status(child.pid)
            time.sleep(0.01)
        assert status == (None, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert read_zombie_status(child.pid) is None  # reaped: gone


async def test_output_pump_logs_everything_and_cuts_long_lines(tmp_path: Path) -> None:
    reader = asyncio.StreamReader()
    lines: list[str] = []
    pump = OutputPump(reader, tmp_path / "out.log", lines.append, max_line=10, tail_lines=2)
    reader.feed_data(b"short\n" + b"y" * 25 + b"\nlast")
    reader.feed_eof()
    await pump.run()
    assert (tmp_path / "out.log").read_bytes() == b"short\n" + b"y" * 25 + b"\nlast"
    assert lines[0] == "short" and all(len(line) <= 10 for line in lines) and lines[-1] == "last"
    assert list(pump.tail) == lines[-2:]


def _outbox(capacity: int) -> Outbox:
    client = aioredis.Redis(host="127.0.0.1", port=1)  # never contacted: policy only
    return Outbox(client, RedisKeys("t"), job_id=1, node="n1", heartbeat_ttl_s=3, capacity=capacity)


def _it(i: int) -> IterationTiming:
    return IterationTiming(
        job_id=1, node="n1", wall_time_s=1.0, rank=0, iteration=i, duration_s=0.1, samples=None
    )


def _exit(pid: int) -> ProcessExit:
    return ProcessExit(
        job_id=1,
        node="n1",
        wall_time_s=1.0,
        rank=0,
        local_rank=0,
        pid=pid,
        exit_code=1,
        signal=None,
        error_file_text=None,
        stderr_tail="",
    )


async def test_outbox_drops_statistics_before_failures() -> None:
    box = _outbox(capacity=3)
    box.put(_exit(10))
    box.put(_it(1))
    box.put(_exit(11))
    box.put(_it(2))  # full: the oldest iteration timing goes, not an exit
    box.put(_exit(12))  # full again: iteration 2 goes
    assert [type(m).__name__ for m in box._queue] == ["ProcessExit", "ProcessExit", "ProcessExit"]
    assert box.stats.dropped["iter"] == 2
    box.put(_exit(13))  # only failures left: the oldest one is dropped, and counted
    assert [m.pid for m in box._queue] == [11, 12, 13]  # type: ignore[union-attr]
    assert box.stats.dropped["ProcessExit"] == 1
    hb = Heartbeat(job_id=1, node="n1", wall_time_s=1.0, agent_pid=1, pids=[], iteration=None, seq=0)
    box.put(hb)
    assert len(box) == 3  # heartbeats are kept aside, never queued


def test_node_check_pieces(tmp_path: Path) -> None:
    faults = tmp_path / "f.jsonl"
    assert check_injected(faults).outcome == Outcome.OK
    faults.write_text("garbage\n")
    assert check_injected(faults).outcome == Outcome.OK
    faults.write_text('{"gpu": 0, "kind": "xid", "value": 79}\n')
    assert check_injected(faults).outcome == Outcome.FAILED
    [ok] = check_disk([tmp_path], min_free_gib=0.0)
    [bad] = check_disk([tmp_path], min_free_gib=1e9)
    [missing] = check_disk([tmp_path / "nope"], min_free_gib=0.0)
    assert (ok.outcome, bad.outcome, missing.outcome) == (Outcome.OK, Outcome.FAILED, Outcome.FAILED)


def test_node_check_cli_exit_codes(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from unicornd.cli import cli

    runner = CliRunner()
    healthy = runner.invoke(cli, ["node-check", "--disk", str(tmp_path), "--min-free-gib", "0"])
    assert healthy.exit_code == 0, healthy.output
    faults = tmp_path / "f.jsonl"
    faults.write_text('{"gpu": 1, "kind": "ecc_uncorrectable", "value": 2}\n')
    sick = runner.invoke(cli, ["node-check", "--disk", str(tmp_path), "--inject-gpu-faults", str(faults)])
    assert sick.exit_code == 1 and "gpu 1: injected ecc_uncorrectable" in sick.output


def test_hook_announces_slow_steps_for_the_next_report(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    hook = Hook(str(path), job_id=1, node="n1", rank=0)
    hook.slow_step("eval")  # nothing reported yet: the first step
    hook.iteration(7, 0.1)
    hook.slow_step()
    first, _it, second = (decode(server.recv(MAX_DATAGRAM)) for _ in range(3))
    assert isinstance(first, SlowStep) and first.iteration == 0 and first.phase == IterationPhase.EVAL
    assert (
        isinstance(second, SlowStep) and second.iteration == 8 and second.phase == IterationPhase.CHECKPOINT
    )
    server.close()


def test_agent_rejects_and_counts_garbage_on_the_hook_socket(tmp_path: Path) -> None:
    from launcher.agent import Agent
    from unicorn_core.config import Config
    from unicorn_core.protocol import encode

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[])
    agent._on_hook_message(b"\xc1 not msgpack")
    agent._on_hook_message(b"")
    other_job = IterationTiming(
        job_id=6, node="n1", wall_time_s=1.0, rank=0, iteration=1, duration_s=0.1, samples=None
    )
    agent._on_hook_message(encode(other_job))  # a message for another job: not ours to forward
    hb = Heartbeat(job_id=5, node="n1", wall_time_s=1.0, agent_pid=1, pids=[], iteration=None, seq=0)
    agent._on_hook_message(encode(hb))  # a valid message of a kind ranks may not send
    assert agent.counters.hook_rejected == 3
    assert agent.counters.hook_wrong_envelope == 1
    assert agent.iteration is None  # nothing was accepted


def test_agent_answers_every_command_it_can_read_and_ignores_deposed_leaders(tmp_path: Path) -> None:
    """Rejected commands are answered (so unicornd decides on them at once); a command that
    raises is answered with the error; one from an older fencing token is not run."""
    import asyncio

    from launcher.agent import Agent
    from unicorn_core.config import Config
    from unicorn_core.protocol import AgentAction, AgentCommand, CommandResult, Message, encode

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[])
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]

    def cmd(cid: str, action: AgentAction, argv: list[str], fence: int, node: str = "n1") -> bytes:
        return encode(
            AgentCommand(
                job_id=5, node=node, wall_time_s=1.0, command_id=cid, action=action, argv=argv,
                deadline_s=5.0, fence=fence,
            )
        )  # fmt: skip

    async def main() -> None:
        await agent._handle_command(cmd("c1", AgentAction.RELAUNCH, [], 2))  # no argv: refused
        await agent._handle_command(cmd("c2", AgentAction.RESTART_RANKS, [], 2))  # nothing to restart
        await agent._handle_command(cmd("c3", AgentAction.STOP, [], 2, node="n9"))  # another node's
        await agent._handle_command(cmd("c4", AgentAction.RELAUNCH, ["x"], 1))  # a deposed leader's
        await agent._handle_command(b"\xc1 garbage")  # no id to answer to
        await agent._handle_command(cmd("c1", AgentAction.RELAUNCH, [], 2))  # sent again: not run again

    asyncio.run(main())
    results = [m for m in sent if isinstance(m, CommandResult)]
    assert [m.command_id for m in results] == ["c1", "c2", "c3", "c1"]
    assert results[-1].detail.startswith("again: rejected: relaunch without")
    answers = {m.command_id: m for m in results[:3]}
    assert not any(a.ok for a in answers.values())
    assert "without a training command" in answers["c1"].detail
    assert "no training command to restart" in answers["c2"].detail
    assert "this agent is job 5 on n1" in answers["c3"].detail
    assert agent.fence == 2 and agent.counters.commands_rejected == 3 and agent.counters.commands_done == 2


def test_run_queue_wait_is_read_from_proc_and_its_increase_is_the_largest() -> None:
    from launcher.agent import cpu_wait_increase, run_queue_wait_s

    own = run_queue_wait_s(os.getpid())
    assert own is not None and own >= 0.0
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert run_queue_wait_s(gone.pid) is None
    # pid 3 is new (no increase yet); pid 4 went back (a reused pid): never negative
    assert cpu_wait_increase({1: 1.0, 2: 5.0, 4: 9.0}, {1: 1.5, 2: 5.25, 3: 9.0, 4: 1.0}) == 0.5
    assert cpu_wait_increase({4: 9.0}, {4: 1.0}) == 0.0


def test_agent_reports_a_local_hang_only_when_a_rank_is_stopped(tmp_path: Path) -> None:
    """A rank asleep past its deadline may wait for a rank on another node that is only
    starved of CPU: the coordinator judges that; a stopped (state T) rank is reported here."""
    from launcher.agent import Agent
    from launcher.supervisor import RankInfo
    from unicorn_core.config import Config, DetectConfig
    from unicorn_core.protocol import FaultReport, Message

    agent = Agent(
        Config(detect=DetectConfig(warmup_iterations=0)), job_id=5, node="n1", run_dir=tmp_path, argv=[]
    )
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]
    rank = subprocess.Popen(["sleep", "30"])

    sup = types.SimpleNamespace(ranks={rank.pid: RankInfo(rank.pid, 0, 0, None)}, exited={})
    agent.supervisor = sup  # type: ignore[assignment]

    async def stall(stop: bool) -> list[Message]:
        sent.clear()
        agent.monitor = agent._new_monitor()
        start = time.monotonic() - 0.1
        for i in range(8):
            agent.monitor.observe(0, i, 0.01, now_s=start + i * 0.01)
        if stop:
            os.kill(rank.pid, signal.SIGSTOP)
        watch = asyncio.create_task(agent._watch_hangs())
        await asyncio.sleep(0.5)  # 50 x the deadline
        watch.cancel()
        assert not watch.done() or watch.cancelled()
        assert agent.monitor.check(time.monotonic()) is not None  # stalled, reported or not
        return [m for m in sent if isinstance(m, FaultReport)]

    try:
        assert asyncio.run(stall(stop=False)) == []
        reports = asyncio.run(stall(stop=True))
        assert len(reports) == 1, reports  # once per stalled iteration
        assert reports[0].status == "task_hang" and reports[0].rank == 0
        assert "stopped (state T): rank(s) [0]" in reports[0].evidence
    finally:
        rank.kill()
        rank.wait()


def _megatron_line(iteration: int, elapsed_ms: float, total: int = 100) -> str:
    return (
        f" [2026-11-24 00:20:21.595276] iteration {iteration:8d}/{total:8d} | consumed samples: "
        f"{iteration * 12:12d} | elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: "
        "8.000000E-04 | global batch size:    12 | lm loss: 5.556977E+00 | loss scale: 1.0 | "
        "grad norm: 1.501 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


def test_agent_follows_megatron_lm_log_lines_only_for_megatron_runs(tmp_path: Path) -> None:
    """An unmodified pretrain_gpt.py reports nothing through the hook: its own log line is
    its iteration report (as the node's highest rank, the one Megatron prints on), with
    the log interval as the span the hang monitor allows. The built-in trainer prints the
    same line but reports through the hook, so its lines are not counted twice."""
    from launcher.agent import Agent
    from launcher.supervisor import RankInfo
    from unicorn_core.config import Config
    from unicorn_core.protocol import Message

    megatron_argv = ["torchrun", "--nnodes=2", "-m", "launcher.mcore_ckpt", "pretrain_gpt.py", "--lr", "1"]

    def agent_for(argv: list[str]) -> tuple[Agent, list[Message]]:
        agent = Agent(Config(), job_id=5, node="n2", run_dir=tmp_path, argv=[], launch_id="act-1")
        sent: list[Message] = []
        agent._emit = sent.append  # type: ignore[method-assign]
        agent._follow_log(argv)
        return agent, sent

    agent, sent = agent_for(megatron_argv)
    agent._on_line(_megatron_line(1, 300.0))  # before the node's ranks are known: not attributed
    assert sent == [] and agent.counters.iterations_unattributed == 1
    agent.supervisor = types.SimpleNamespace(  # type: ignore[assignment]
        ranks={11: RankInfo(11, 2, 0, None), 12: RankInfo(12, 3, 1, None)}, exited={}
    )
    clock = [0.0]
    with unittest.mock.patch("launcher.agent.time.monotonic", lambda: clock[0]):
        for it in (10, 20, 30):  # one line per 10 iterations of 0.25 s
            clock[0] += 2.5
            agent._on_line(_megatron_line(it, 250.0))
    timings = [m for m in sent if isinstance(m, IterationTiming)]
    assert [(t.rank, t.iteration, t.span, t.launch_id) for t in timings] == [
        (3, 10, 1, "act-1"),
        (3, 20, 10, "act-1"),
        (3, 30, 10, "act-1"),
    ]
    t = timings[-1]
    assert (t.duration_s, t.interval_s, t.loss) == (0.25, 2.5, 5.556977)
    assert (t.grad_norm, t.loss_scale) == (1.501, 1.0)
    assert (t.consumed_samples, t.skipped_iterations, t.nan_iterations, t.samples) == (360, 0, 0, 12)
    assert agent.iteration == 30 and agent.monitor.ranks == (3,)
    agent._on_line(_megatron_line(5, 250.0))  # resumed from a checkpoint: a new interval
    assert [m for m in sent if isinstance(m, IterationTiming)][-1].span == 1

    # Saves: Megatron saves after every multiple of --save-interval; the agent announces the
    # next step as a checkpoint step (Megatron says it saves on rank 0 only). The last
    # iteration ends the run: its silence after it is no hang.
    saving, sent = agent_for([*megatron_argv, "--save-interval", "5", "--log-interval", "1"])
    saving.supervisor = agent.supervisor
    for it in (3, 4, 5, 6, 7):
        saving._on_line(_megatron_line(it, 250.0, total=8))
    slow = [(m.iteration, m.phase) for m in sent if isinstance(m, SlowStep)]
    assert slow == [(6, IterationPhase.CHECKPOINT)]
    phases = [(m.iteration, m.phase, m.final) for m in sent if isinstance(m, IterationTiming)]
    assert phases[2:] == [
        (5, IterationPhase.TRAIN, False),
        (6, IterationPhase.CHECKPOINT, False),
        (7, IterationPhase.TRAIN, False),
    ]
    saving._on_line(_megatron_line(8, 250.0, total=8))
    assert [m for m in sent if isinstance(m, IterationTiming)][-1].final
    assert saving.monitor.ranks == () and saving.iteration == 8
    schedule = launcher_megatron.Schedule.of(["--save-interval=7", "--persistent-save-interval", "9"])
    assert schedule == launcher_megatron.Schedule(log_interval=100, saves=(9,), eval_interval=None)

    trainer, sent = agent_for(["torchrun", "--no-python", "unicorn-train", "--tp=1"])
    trainer.supervisor = agent.supervisor
    trainer._on_line(_megatron_line(10, 250.0))
    assert sent == []


def test_a_rank_exit_of_unknown_status_is_settled_by_torchruns_exit(tmp_path: Path) -> None:
    """torchrun may reap a rank before the agent reads its status. After the run's final
    iteration such an exit waits for torchrun's, which is 0 only when every worker's was (a
    clean end is no failure); a failed torchrun, or none within the wait, leaves it
    unknown. Before the final iteration, or with an error file, it is reported at once."""
    from launcher.agent import Agent
    from launcher.supervisor import ExitInfo
    from unicorn_core.config import Config
    from unicorn_core.protocol import Message

    def rank(pid: int, error_file: str | None = None) -> ExitInfo:
        return ExitInfo(pid, pid - 100, 0, None, None, error_file, is_main=False)

    def main(code: int) -> ExitInfo:
        return ExitInfo(99, None, None, code, None, None, is_main=True)

    async def run(torchrun: ExitInfo | None, *, final: bool = True) -> list[tuple[int | None, int | None]]:
        agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[])
        agent._loop = asyncio.get_running_loop()
        agent._final_seen = final
        sent: list[Message] = []
        agent._emit = sent.append  # type: ignore[method-assign]
        agent._on_exit(rank(101), 1)
        agent._on_exit(ExitInfo(102, 2, 1, 1, None, None, is_main=False), 1)  # a known status: at once
        agent._on_exit(rank(104, '{"message": "RuntimeError: x"}'), 1)  # an exception: at once
        assert [(m.pid, m.exit_code) for m in sent if isinstance(m, ProcessExit)][-2:] == [
            (102, 1),
            (104, None),
        ]
        if torchrun is not None:
            agent._on_exit(torchrun, 1)
        else:
            with unittest.mock.patch("launcher.agent._UNSETTLED_EXIT_S", 0.01):
                agent._on_exit(rank(103), 1)
            await asyncio.sleep(0.05)
        return [(m.pid, m.exit_code) for m in sent if isinstance(m, ProcessExit) and m.pid not in (102, 104)]

    assert asyncio.run(run(main(0))) == [(101, 0), (99, 0)]
    assert asyncio.run(run(main(1))) == [(101, None), (99, 1)]
    assert asyncio.run(run(None)) == [(103, None)]  # 101 still waits (5 s), 103 timed out
    assert asyncio.run(run(main(0), final=False)) == [(101, None), (99, 0)]  # mid-run: at once


def test_exits_and_log_lines_carry_the_launch_that_started_their_ranks(tmp_path: Path) -> None:
    """The coordinator drops reports of ranks it replaced (unicornd.detector): an exit or a
    log line read after a restart moved the agent's launch id on is stamped with the launch
    that started those ranks, not the new one; the current ranks' with the current one."""
    from launcher.agent import Agent
    from launcher.supervisor import ExitInfo
    from unicorn_core.config import Config
    from unicorn_core.protocol import FaultReport, Message

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[], launch_id="plan-1/launch/5")
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]
    agent._launch_of[1] = "plan-1/launch/5"  # generation 1 was started under the first launch
    agent.launch_id = "a.1/restart_processes/1/n1"  # then a restart moved the agent on
    agent._on_exit(ExitInfo(101, 1, 0, None, 9, None, is_main=False), 1)  # an old rank's SIGKILL
    agent._on_line("[rank1]: RuntimeError: Connection reset by peer", "plan-1/launch/5")
    agent._on_line("[rank0]: RuntimeError: Connection reset by peer", None)  # another rank: no dedup
    stamps = [(type(m).__name__, m.launch_id) for m in sent if isinstance(m, ProcessExit | FaultReport)]
    assert stamps == [
        ("ProcessExit", "plan-1/launch/5"),
        ("FaultReport", "plan-1/launch/5"),
        ("FaultReport", "a.1/restart_processes/1/n1"),
    ], stamps


def test_what_stopped_ranks_sent_before_a_restart_keeps_their_launch(tmp_path: Path) -> None:
    """An exception a rank sent through the hook just before it was stopped may still wait
    in the socket when the restart moves the agent's launch on: it is read first, so it is
    stamped with the launch of the ranks that sent it, and unicornd drops it as theirs."""
    import socket

    from launcher.agent import Agent
    from unicorn_core.config import Config
    from unicorn_core.protocol import ExceptionReport, Message, encode

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[], launch_id="plan-1/launch/5")
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]
    here, rank = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    here.setblocking(False)
    agent._sock = here
    try:
        rank.setblocking(False)
        queued = 0
        for i in range(300):  # as many as the socket holds (Linux: max_dgram_qlen)
            exc = ExceptionReport(
                job_id=5,
                node="n1",
                wall_time_s=1.0,
                rank=0,
                exc_type="RuntimeError",
                message=f"x{i}",
                traceback="",
            )
            try:
                rank.send(encode(exc))
            except BlockingIOError:
                break
            queued += 1
        agent._replace_ranks("a.1/restart_processes/1/n1")
    finally:
        agent._sock = None
        here.close()
        rank.close()
    stamps = {m.launch_id for m in sent if isinstance(m, ExceptionReport)}
    assert queued > 0 and len(sent) == queued and stamps == {"plan-1/launch/5"}
    assert agent.launch_id == "a.1/restart_processes/1/n1"


def test_ranks_are_the_top_most_processes_with_rank_variables() -> None:
    """A rank's own children (Megatron-LM's rank 0 runs make; data loaders fork workers)
    inherit RANK but are not ranks: their ends must not read as a rank's."""
    from launcher.supervisor import rank_processes

    script = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    # bash (the launcher, no rank variables of its own) -> python (the rank) -> sleep (its child)
    launcher = subprocess.Popen(
        ["bash", "-c", f'RANK=3 LOCAL_RANK=1 {sys.executable} -c "{script}" & wait'], env={**os.environ}
    )
    try:
        deadline = time.monotonic() + 10
        while len(descendants(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        rank, child = descendants(launcher.pid)[:2]
        assert rank_processes(launcher.pid) == [(rank, {"RANK": "3", "LOCAL_RANK": "1"})]
        assert "RANK" in read_environ(child, ("RANK",))  # the child has it too, and is no rank
    finally:
        for pid in reversed(descendants(launcher.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def test_megatron_saves_and_evaluations_are_timed_by_the_wall_clock_and_announced() -> None:
    """Megatron stops its interval timer while it saves or evaluates, so the line after a
    save prints a training step's time; the silence before it holds the save. The agent
    times reports by the gaps between lines and announces the step that will hold a save,
    so a slow save (8 s against 1 s steps) is no hang, at the first save and every one
    after it."""
    from launcher.agent import Agent
    from launcher.supervisor import RankInfo
    from unicorn_core.config import Config, DetectConfig
    from unicorn_core.protocol import Message

    argv = ["torchrun", "-m", "launcher.mcore_ckpt", "pretrain_gpt.py", "--save-interval", "5",
            "--log-interval", "1", "--eval-interval", "7", "--eval-iters", "2"]  # fmt: skip
    agent = Agent(
        Config(detect=DetectConfig(warmup_iterations=0)), job_id=5, node="n2", run_dir=Path("/x"), argv=[]
    )
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]
    agent._follow_log(argv)
    agent.supervisor = types.SimpleNamespace(ranks={11: RankInfo(11, 1, 0, None)}, exited={})  # type: ignore[assignment]
    clock = [100.0]
    with unittest.mock.patch("launcher.agent.time.monotonic", lambda: clock[0]):
        t = 100.0
        for it in range(1, 18):
            # 1 s steps; a save after every multiple of 5 takes 8 s, an evaluation after 7 and 14 3 s
            t += (
                1.0
                + (8.0 if (it - 1) % 5 == 0 and it > 1 else 0.0)
                + (3.0 if (it - 1) % 7 == 0 and it > 1 else 0.0)
            )
            clock[0] = t
            agent._on_line(_megatron_line(it, 1000.0, total=100))
            if it in (10, 15):  # right after a saving iteration's line: silence for 6 s (< the save's 8 s)
                assert agent.monitor.check(t + 6.0) is None, it
    timings = {m.iteration: m for m in sent if isinstance(m, IterationTiming)}
    assert timings[6].phase is IterationPhase.CHECKPOINT and timings[6].duration_s == pytest.approx(9.0)
    assert timings[8].phase is IterationPhase.EVAL and timings[8].duration_s == pytest.approx(4.0)
    assert timings[7].phase is IterationPhase.TRAIN and timings[7].duration_s == pytest.approx(1.0)
    assert timings[1].duration_s == 1.0  # the first line of a run: Megatron's own time
    announced = [(m.iteration, m.phase) for m in sent if isinstance(m, SlowStep)]
    assert announced == [
        (6, IterationPhase.CHECKPOINT), (8, IterationPhase.EVAL), (11, IterationPhase.CHECKPOINT),
        (15, IterationPhase.EVAL), (16, IterationPhase.CHECKPOINT),
    ]  # fmt: skip
    # A real stall after a training step is still one: 1 s steps, 2 x deadline.
    assert agent.monitor.check(clock[0] + 30.0) is not None


def test_a_line_that_reports_an_exit_the_agent_saw_corroborates_it_and_one_it_did_not_see_is_sev3(
    tmp_path: Path,
) -> None:
    """A launcher's line about an exit soon after the agent saw one (ProcessExit) corroborates
    it and is sent at its severity (unicornd absorbs the exit's own finding, a secondary
    torchrun summary, into an open incident: this line is what moves the ladder). A line about
    an exit the agent did not see (a worker torchrun restarted before the agent found it, a
    process the training code started, or no process at all) is sent at SEV3."""
    from launcher.agent import EXIT_LINE_WINDOW_S, Agent
    from launcher.supervisor import ExitInfo
    from unicorn_core.config import Config
    from unicorn_core.protocol import FaultReport, Message

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[])
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]
    srun = "[rank0]: srun: error: node7: tasks 10-11: Exited with exit code 1"
    summary = "[default1]:torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    agent._on_line(srun)  # no exit seen
    gen = agent._generation
    agent._on_exit(ExitInfo(101, 1, 0, 1, None, None, is_main=False), gen)  # rank 1 exits 1
    agent._on_line(summary)  # right after it
    agent._last_exit_s -= EXIT_LINE_WINDOW_S + 1  # long after that exit
    agent._on_line("[default0]:torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
    # Exits the agent caused (a rank of a launch it replaced) or that were clean (code 0)
    # corroborate nothing. Found by the safety bench: a restart's own SIGTERM of the old
    # ranks made the exit lines the new ranks printed within 30 s SEV2.
    agent._on_exit(ExitInfo(102, 0, 0, None, 15, None, is_main=False), gen - 1)
    agent._on_exit(ExitInfo(103, 0, 0, 0, None, None, is_main=False), gen)
    agent._on_line("[default2]:torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
    faults = [m for m in sent if isinstance(m, FaultReport)]
    assert [(f.status, f.severity, f.rank) for f in faults] == [
        ("exited_abnormally", "SEV3", 0),
        ("exited_abnormally", "SEV2", 1),
        ("exited_abnormally", "SEV3", 0),
        ("exited_abnormally", "SEV3", 2),
    ], faults
    assert agent.counters.exit_lines_seen == 4


def test_a_copy_of_a_kernel_or_node_tool_report_in_rank_output_is_not_sent(tmp_path: Path) -> None:
    """A rank cannot witness a driver's Xid or a DCGM verdict; its copy of one (the training
    code ran the tool, or printed the text) is logged and counted, never sent (even a SEV3
    report opens an incident that climbs when no iteration follows). The same fault in the
    CUDA runtime's words, from the process itself, is sent at its severity, also right after
    a copy that matched the same rule."""
    from launcher.agent import Agent
    from unicorn_core.config import Config
    from unicorn_core.protocol import FaultReport, Message

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[])
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]
    agent._on_line("[rank0]: NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.")
    agent._on_line("[rank1]:|    -> NVLINK system       | Failure                                       |")
    agent._on_line(
        "[rank1]: RuntimeError: CUDA error: uncorrectable NVLink error detected during the execution"
    )
    faults = [m for m in sent if isinstance(m, FaultReport)]
    assert [(f.status, f.severity, f.rank) for f in faults] == [("nvlink_error", "SEV1", 1)], faults
    assert agent.counters.node_reports_copied == 2


def test_an_exception_line_without_its_traceback_is_sent_at_sev3(tmp_path: Path) -> None:
    """An uncaught exception prints its traceback: its last line is sent at its severity. A
    generic exception line that ends no traceback (a handler logging str(e) and going on,
    a thread's shutdown message) is sent at SEV3. A specific rule (CUDA out of memory)
    keeps its severity without a traceback."""
    from launcher.agent import Agent
    from unicorn_core.config import Config
    from unicorn_core.protocol import FaultReport, Message

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[])
    sent: list[Message] = []
    agent._emit = sent.append  # type: ignore[method-assign]
    agent._on_line("[rank0]: RuntimeError: cannot join current thread")
    agent._on_line("[rank1]: Traceback (most recent call last):")
    agent._on_line('[rank1]:   File "train.py", line 41, in step')
    agent._on_line("[rank1]: ValueError: shapes (4, 16) and (8, 16) not aligned")
    agent._on_line("[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    faults = [m for m in sent if isinstance(m, FaultReport)]
    assert [(f.status, f.severity, f.rank) for f in faults] == [
        ("other_software_error", "SEV3", 0),
        ("other_software_error", "SEV2", 1),
        ("other_software_error", "SEV2", 2),
    ], faults
    assert faults[2].rule != "python_exception"
    assert agent.counters.exception_lines_without_traceback == 1
    # A rank that prints the error it then raises: the SEV3 copy must not hide (as a repeat of
    # the same rule and rank) the SEV2 line that ends the traceback right after it.
    sent.clear()
    for line in (
        "[rank3]: ValueError: bad shard 7",
        "[rank3]: Traceback (most recent call last):",
        '[rank3]:   File "t.py", line 1, in <module>',
        "[rank3]: ValueError: bad shard 7",
    ):
        agent._on_line(line)
    assert [m.severity for m in sent if isinstance(m, FaultReport)] == ["SEV3", "SEV2"]


async def test_a_background_task_that_raises_is_logged_when_it_ends() -> None:
    """The agent's tasks (heartbeats, commands, hangs...) run until it stops; one that raised
    was seen only then. A ``ValueError`` in the hang task ended the stopped-rank reports
    of every run unnoticed (session 26): it is logged, with its name, as it ends."""
    import structlog.testing

    from launcher.agent import _log_task_end

    async def hangs() -> None:
        raise ValueError("max() arg is an empty sequence")

    async def cancelled() -> None:
        await asyncio.sleep(3600)

    with structlog.testing.capture_logs() as logs:
        failed = asyncio.create_task(hangs(), name="hangs")
        stopped = asyncio.create_task(cancelled(), name="commands")
        for t in (failed, stopped):
            t.add_done_callback(_log_task_end)
        await asyncio.sleep(0)
        stopped.cancel()
        await asyncio.gather(failed, stopped, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
    seen = [(e["event"], e["task"], e["log_level"]) for e in logs]
    assert seen == [("agent_task_failed", "hangs", "error")]
    assert "empty sequence" in logs[0]["error"]


async def test_the_hang_watch_survives_its_own_bug(tmp_path: Path) -> None:
    """A turn of the hang watch that raises is logged once per kind and the watch goes on:
    it also samples the ranks' CPU waits, which every heartbeat carries (the coordinator
    excuses a starved node's silence with them)."""
    import structlog.testing

    from launcher.agent import Agent
    from unicorn_core.config import Config

    agent = Agent(Config(), job_id=5, node="n1", run_dir=tmp_path, argv=[])
    turns: list[float] = []

    def turn(next_sample: float) -> float:
        turns.append(next_sample)
        if len(turns) <= 3:
            raise ValueError("max() arg is an empty sequence")
        return next_sample

    agent._check_hang = turn  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        watch = asyncio.create_task(agent._watch_hangs())
        deadline = time.monotonic() + 10
        try:
            while len(turns) <= 5:  # turns of 20 ms
                assert time.monotonic() < deadline and not watch.done(), turns
                await asyncio.sleep(0.02)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
    assert len(turns) > 5 and watch.cancelled()  # went on after three failed turns, until stopped
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["hang_check_failed"]
