"""A new agent never runs a command written for an agent before it.

An agent reads its command stream from the start. A command sent to a node whose agent
died before reading it (a restart sent while the node was being killed) stayed queued, and
the agent of a later launch on that node ran it: the soak bench saw a requeue back onto a
revived node restart its fresh ranks with a restart written three cycles earlier, on
another rendezvous port. Every launch now deletes what is queued for the node first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import redis

from tests.fakes.slurm import FakeSlurm, idle_node, running_job
from tests.unicornd.coord_world import task
from tests.unicornd.redis_world import running_daemon
from unicorn_core.errors import CommandFailed
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.protocol import AgentAction, AgentCommand, decode, encode
from unicorn_core.slurm.backend import StepHandle
from unicornd.actions import Decision, LaunchAgents, NodeArgv, Outcome, OutcomeStatus
from unicornd.daemon import Daemon
from unicornd.state import RequeueWait, Snapshot

PREFIX = "launchcmd"


async def test_a_launch_deletes_the_commands_queued_for_the_nodes_earlier_agents(redis_url: str) -> None:
    keys = RedisKeys(PREFIX)
    sync = redis.Redis.from_url(redis_url)
    stale = AgentCommand(
        job_id=7,
        node="n1",
        wall_time_s=time.time(),
        command_id="a.1/restart_processes/1/restart_ranks/n1",
        action=AgentAction.RESTART_RANKS,
        deadline_s=30.0,
    )
    sync.xadd(keys.agent_commands(7, "n1"), {PAYLOAD_FIELD: encode(stale)})
    sync.xadd(keys.agent_commands(7, "n2"), {PAYLOAD_FIELD: encode(stale)})  # another node: kept
    slurm = FakeSlurm([idle_node("n1"), idle_node("n2")], [running_job(7, ["n1", "n2"])], local_steps=True)
    try:
        launch = LaunchAgents("plan-3/t/requeue/launch", "t", 7, (NodeArgv("n1", ("true",)),))
        await _launch_on(slurm, redis_url, launch)
        assert sync.xlen(keys.agent_commands(7, "n1")) == 0
        assert sync.xlen(keys.agent_commands(7, "n2")) == 1
        assert [c[0] for c in slurm.calls if c[0] == "launch_step"] == ["launch_step"]
    finally:
        sync.close()


async def _launch_on(slurm: FakeSlurm, redis_url: str, launch: LaunchAgents) -> None:
    """Run a real unicornd on ``slurm`` and have its executor perform ``launch``; the steps
    it started are killed and unicornd stopped after."""
    async with running_daemon(slurm, redis_url, PREFIX, exits_cleanly=False) as daemon:
        await _perform(daemon, slurm, launch)


async def _perform(daemon: Daemon, slurm: FakeSlurm, launch: LaunchAgents) -> None:
    """``daemon``'s executor performs ``launch``; the steps it started are killed after."""
    try:
        await daemon.executor._launch(launch)
    finally:
        for step in slurm.steps:
            if step.process.returncode is None:
                step.process.kill()
            await step.process.wait()


class _RecordingSlurm(FakeSlurm):
    """Records each step's nodes, command line and options, and runs ``sleep`` instead of
    the agent; refuses to create a step on ``bad``."""

    def __init__(self, nodes: int, bad: str = "") -> None:
        names = [f"n{i}" for i in range(1, nodes + 1)]
        super().__init__([idle_node(n) for n in names], [running_job(7, names)], local_steps=True)
        self.bad = bad
        self.launched: list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = []

    async def launch_step(
        self, job_id: int, nodes: Sequence[str], argv: Sequence[str], **kw: Any
    ) -> StepHandle:
        self.launched.append((tuple(nodes), tuple(argv), tuple(kw.get("options", ()))))
        if self.bad in nodes:
            raise CommandFailed(("srun",), 1, "", f"srun: error: {self.bad}: step creation failed")
        return await super().launch_step(job_id, nodes, ("sleep", "30"), **kw)


def _on_nodes(count: int) -> LaunchAgents:
    return LaunchAgents(
        "plan-3/t/launch",
        "t",
        7,
        tuple(NodeArgv(f"n{i}", ("train", f"--node-rank={i - 1}")) for i in range(1, count + 1)),
    )


async def test_a_whole_jobs_agents_start_in_one_step_each_with_its_own_stored_command(redis_url: str) -> None:
    """Issue 20: one srun step (one slurmctld RPC, two head-node processes) for a 40-node
    job, not 40. Its agents share one command line; each node's training command is stored
    under the launch's id, and what an earlier agent left queued on each node is gone."""
    keys = RedisKeys(PREFIX)
    sync = redis.Redis.from_url(redis_url)
    try:
        stale = AgentCommand(
            job_id=7,
            node="n5",
            wall_time_s=time.time(),
            command_id="old",
            action=AgentAction.STOP,
            deadline_s=9.0,
        )
        sync.xadd(keys.agent_commands(7, "n5"), {PAYLOAD_FIELD: encode(stale)})
        slurm = _RecordingSlurm(40)
        await _launch_on(slurm, redis_url, _on_nodes(40))
        ((nodes, argv, options),) = slurm.launched
        assert nodes == tuple(f"n{i}" for i in range(1, 41))
        assert "--no-kill" in options and "--wait=0" in options  # a failed node ends only its agent
        script = argv[-1]
        assert (
            "--await-launch" in script
            and "--launch-id plan-3/t/launch" in script
            and script.count("--node ") == 1
        )
        assert '--node "$SLURMD_NODENAME"' in script  # its node, run folder and log are its own
        for i in (1, 17, 40):
            stored = decode(sync.get(keys.agent_launch(7, f"n{i}")) or b"")
            assert isinstance(stored, AgentCommand) and stored.action is AgentAction.RELAUNCH
            assert (stored.command_id, stored.node, stored.argv) == (
                "plan-3/t/launch",
                f"n{i}",
                ["train", f"--node-rank={i - 1}"],
            )
            assert 0 < sync.ttl(keys.agent_launch(7, f"n{i}")) <= 3600
        assert sync.xlen(keys.agent_commands(7, "n5")) == 0
    finally:
        sync.close()


async def test_a_step_slurm_refuses_fails_the_launch(redis_url: str) -> None:
    slurm = _RecordingSlurm(6, bad="n3")
    with pytest.raises(CommandFailed, match="n3: step creation failed"):
        await _launch_on(slurm, redis_url, _on_nodes(6))
    assert [len(nodes) for nodes, _, _ in slurm.launched] == [6] and not slurm.steps


async def test_an_agent_restarted_alone_leaves_the_whole_jobs_step_running(redis_url: str) -> None:
    """A node's agent replaced on its own (RestartAgent) is a step of that node; the step of
    the whole job, which runs the other nodes' agents, is not stopped (the new agent ends
    its predecessor on its node itself, launcher.supersede)."""
    slurm = _RecordingSlurm(3)
    async with running_daemon(slurm, redis_url, PREFIX, exits_cleanly=False) as daemon:
        try:
            await daemon.executor._launch(_on_nodes(3))
            await daemon.executor._launch(
                LaunchAgents("a.1/restart_agent/n2", "t", 7, (NodeArgv("n2", ("train",)),))
            )
            whole, alone = slurm.steps
            assert whole.nodes == ("n1", "n2", "n3") and alone.nodes == ("n2",)
            await asyncio.sleep(0.2)
            assert whole.process.returncode is None  # still running n1's and n3's agents
            await daemon.executor._launch(_on_nodes(3))  # the whole job again: both replaced
            assert whole.process.returncode is not None and alone.process.returncode is not None
        finally:
            for step in slurm.steps:
                if step.process.returncode is None:
                    step.process.kill()
                await step.process.wait()


class _ExitingSlurm(FakeSlurm):
    """Each node's step runs the command given for it (srun failing to create a step exits
    1 at once; a running agent does not exit)."""

    def __init__(self, runs: dict[str, tuple[str, ...]]) -> None:
        names = sorted(runs)
        super().__init__([idle_node(n) for n in names], [running_job(7, names)], local_steps=True)
        self.runs = runs

    async def launch_step(
        self, job_id: int, nodes: Sequence[str], argv: Sequence[str], **kw: Any
    ) -> StepHandle:
        return await super().launch_step(job_id, nodes, self.runs[nodes[0]], **kw)


@pytest.mark.parametrize(
    ("nodes", "node"), [(("n1",), "n1"), (("n1", "n2", "n3"), "")], ids=["one node", "whole job"]
)
async def test_an_srun_that_exits_at_once_fails_its_launch(
    redis_url: str, nodes: tuple[str, ...], node: str
) -> None:
    """The launch is done once its srun started; one that then exits non-zero within
    LAUNCH_WATCH_S is reported as the launch failing (on its node, for a one-node step; a
    decision's input), so the rung fails at once instead of after a heartbeat timeout of
    silence. A step that exits 0, or one still running, adds nothing."""
    slurm = _ExitingSlurm({"n1": ("sh", "-c", "exit 3"), "n2": ("sleep", "30"), "n3": ("true",)})
    launch = LaunchAgents("plan-3/t/launch", "t", 7, tuple(NodeArgv(n, ("agent",)) for n in nodes))
    clean = LaunchAgents("plan-3/t/launch", "t", 7, (NodeArgv("n3", ("agent",)),))
    running = LaunchAgents("plan-3/t/launch", "t", 7, (NodeArgv("n2", ("agent",)),))
    outcomes: list[Outcome] = []
    reported = asyncio.Event()
    async with running_daemon(slurm, redis_url, PREFIX, exits_cleanly=False) as daemon:
        real = daemon.core.decide

        async def spy(now_s: float, fn: Any) -> Any:
            if isinstance(fn, partial) and "outcome" in fn.keywords:
                outcomes.append(fn.keywords["outcome"])
                reported.set()
            return await real(now_s, fn)

        daemon.core.decide = spy  # type: ignore[method-assign]
        snap = daemon.core.snap  # the launch's task, on the three nodes (as a plan left it)
        daemon.core.snapshot = replace(snap, tasks={**snap.tasks, "t": task("t", 7, ("n1", "n2", "n3"))})
        try:
            await daemon.executor._launch(clean)
            await daemon.executor._launch(running)
            await daemon.executor._launch(launch)
            await asyncio.wait_for(reported.wait(), 10)
            await asyncio.sleep(0.3)  # n3's clean exit and n2's run must add nothing
            got = [(o.action_id, o.status, o.node) for o in outcomes]  # before the steps are killed
        finally:
            for step in slurm.steps:
                if step.process.returncode is None:
                    step.process.kill()
                await step.process.wait()
    assert got == [("plan-3/t/launch", OutcomeStatus.FAILED, node)]
    assert "exited 3 within" in outcomes[0].detail


async def test_a_step_that_ends_while_its_job_is_requeued_is_no_launch_failure(redis_url: str) -> None:
    """Slurm ends the steps of a job unicorn requeues: not a failed launch."""
    slurm = _ExitingSlurm({"n1": ("sh", "-c", "sleep 0.3; exit 143")})
    outcomes: list[object] = []
    async with running_daemon(slurm, redis_url, PREFIX, exits_cleanly=False) as daemon:
        real = daemon.core.decide

        async def spy(now_s: float, fn: Any) -> Any:
            if isinstance(fn, partial) and "outcome" in fn.keywords:
                outcomes.append(fn.keywords["outcome"])
            return await real(now_s, fn)

        daemon.core.decide = spy  # type: ignore[method-assign]
        snap = daemon.core.snap
        waiting = task("t", 7, ("n1",), requeue=RequeueWait("plan-4/t/requeue", time.time() + 60))
        daemon.core.snapshot = replace(snap, tasks={**snap.tasks, "t": waiting})
        try:
            await daemon.executor._launch(LaunchAgents("plan-3/t/launch", "t", 7, (NodeArgv("n1", ("a",)),)))
            await asyncio.wait_for(slurm.steps[0].process.wait(), 10)
            await asyncio.sleep(0.3)
        finally:
            for step in slurm.steps:
                if step.process.returncode is None:
                    step.process.kill()
                await step.process.wait()
    assert outcomes == []


async def test_the_agents_grace_for_a_first_beat_starts_when_the_launch_is_performed(redis_url: str) -> None:
    """Found by the 4,096-node hour: a launch waited behind its job's resize for longer than
    the 30 s grace a new agent has for its first beat, and its agents were "never heard
    from" before they had been started. unicornd's executor tells its detector as it
    performs a launch, and the grace counts from then."""
    slurm = _RecordingSlurm(2)
    launch = _on_nodes(2)
    async with running_daemon(slurm, redis_url, PREFIX, exits_cleanly=False) as daemon:
        snap = Snapshot(tasks={"t": task("t", 7, ("n1", "n2"))}, nodes={}, gpus_per_node=8)
        committed = time.monotonic() - 60.0  # committed a minute ago, queued since
        daemon.detector.follow(snap, snap, Decision(actions=(launch,)), committed)
        await _perform(daemon, slurm, launch)
        assert not daemon.detector.silent(7, "n1", committed + 65.0)
        assert daemon.detector.silent(7, "n1", time.monotonic() + 31.0)


async def test_an_ended_step_is_forgotten_unless_a_later_launch_replaced_it(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor keeps each (job, node)'s agent step to stop it when a new launch replaces
    it. Found by the 4,096-node hour's memory: an ended step stayed for unicornd's life, one
    entry for every node a job ever ran an agent on. A step that ends, within the launch
    watch or after it, is forgotten; a running one, or one that replaced it, stays."""
    monkeypatch.setattr("unicornd.executor.LAUNCH_WATCH_S", 0.2)
    # n2's step ends after the watch and after n3's launch, n3's runs on
    slurm = _ExitingSlurm({"n1": ("true",), "n2": ("sleep", "3"), "n3": ("sleep", "30")})
    async with running_daemon(slurm, redis_url, PREFIX, exits_cleanly=False) as daemon:
        steps = daemon.executor.steps
        try:
            for node in ("n1", "n2", "n3"):
                await daemon.executor._launch(
                    LaunchAgents(f"plan-3/t/{node}", "t", 7, (NodeArgv(node, ("a",)),))
                )
            assert {(7, "n2"), (7, "n3")} <= set(steps)  # n1's may have ended already
            ended = [s for s in slurm.steps if s.nodes[0] in ("n1", "n2")]
            await asyncio.wait_for(asyncio.gather(*(s.process.wait() for s in ended)), 10)
            await asyncio.sleep(0.2)  # the watches see the ends
            assert set(steps) == {(7, "n3")}
            # n3's step, replaced by a later launch there, ends: the new one stays.
            old = steps[(7, "n3")]
            await daemon.executor._launch(LaunchAgents("plan-4/t/n3", "t", 7, (NodeArgv("n3", ("a",)),)))
            assert old.process.returncode is not None  # stopped by the replacing launch
            await asyncio.sleep(0.3)
            assert set(steps) == {(7, "n3")} and steps[(7, "n3")] is not old
        finally:
            for step in slurm.steps:
                if step.process.returncode is None:
                    step.process.kill()
                await step.process.wait()
