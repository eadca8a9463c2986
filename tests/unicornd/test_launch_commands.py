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
from unicorn_core.protocol import AgentAction, AgentCommand, encode
from unicorn_core.slurm.backend import StepHandle
from unicornd.actions import LaunchAgents, NodeArgv, Outcome, OutcomeStatus
from unicornd.executor import LAUNCH_CONCURRENCY
from unicornd.state import RequeueWait

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
        try:
            await daemon.executor._launch(launch)
        finally:
            for step in slurm.steps:
                if step.process.returncode is None:
                    step.process.kill()
                await step.process.wait()


class _SlowSlurm(FakeSlurm):
    """Each step takes a while to start (slurmctld's step creation); counts how many are
    being started at once, and refuses to start one on ``bad``."""

    def __init__(self, nodes: int, bad: str = "") -> None:
        names = [f"n{i}" for i in range(1, nodes + 1)]
        super().__init__([idle_node(n) for n in names], [running_job(7, names)], local_steps=True)
        self.bad = bad
        self.in_flight = 0
        self.most = 0

    async def launch_step(
        self, job_id: int, nodes: Sequence[str], argv: Sequence[str], **kw: Any
    ) -> StepHandle:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.02)
            if nodes[0] == self.bad:
                raise CommandFailed(("srun",), 1, "", f"srun: error: {self.bad}: step creation failed")
            return await super().launch_step(job_id, nodes, argv, **kw)
        finally:
            self.in_flight -= 1


def _on_nodes(count: int) -> LaunchAgents:
    return LaunchAgents(
        "plan-3/t/launch", "t", 7, tuple(NodeArgv(f"n{i}", ("true",)) for i in range(1, count + 1))
    )


async def test_a_large_launch_starts_its_agents_a_bounded_number_at_a_time(redis_url: str) -> None:
    slurm = _SlowSlurm(40)
    await _launch_on(slurm, redis_url, _on_nodes(40))
    started = sorted(c[2][0] for c in slurm.calls if c[0] == "launch_step")
    assert started == sorted(f"n{i}" for i in range(1, 41))
    assert slurm.most == LAUNCH_CONCURRENCY  # overlapped, never more than the bound


async def test_a_node_whose_launch_fails_fails_the_action_but_not_the_other_nodes(redis_url: str) -> None:
    slurm = _SlowSlurm(6, bad="n3")
    with pytest.raises(CommandFailed, match="n3: step creation failed"):
        await _launch_on(slurm, redis_url, _on_nodes(6))
    assert sorted(s.nodes[0] for s in slurm.steps) == ["n1", "n2", "n4", "n5", "n6"]


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


async def test_an_srun_that_exits_at_once_fails_its_launch_on_that_node_only(redis_url: str) -> None:
    """The launch is done once its sruns started; one that then exits non-zero within
    LAUNCH_WATCH_S is reported as the launch failing on its node (a decision's input), so
    the rung fails at once instead of after a heartbeat timeout of silence."""
    slurm = _ExitingSlurm({"n1": ("sh", "-c", "exit 3"), "n2": ("sleep", "30"), "n3": ("true",)})
    launch = LaunchAgents(
        "plan-3/t/launch", "t", 7, tuple(NodeArgv(n, ("agent",)) for n in ("n1", "n2", "n3"))
    )
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
            await daemon.executor._launch(launch)
            await asyncio.wait_for(reported.wait(), 10)
            await asyncio.sleep(0.3)  # n3's clean exit and n2's run must add nothing
            got = [(o.action_id, o.status, o.node) for o in outcomes]  # before the steps are killed
        finally:
            for step in slurm.steps:
                if step.process.returncode is None:
                    step.process.kill()
                await step.process.wait()
    assert got == [("plan-3/t/launch", OutcomeStatus.FAILED, "n1")]
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
