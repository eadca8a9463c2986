"""Drains of one reason committed one after the other go to Slurm in one call (a rack:
one slurmctld RPC), without changing the commit order of anything else; a failed group
call falls back to one call per drain, so each drain gets its own outcome."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from functools import partial

import pytest

from tests.fakes.slurm import FakeSlurm, idle_node, running_job
from tests.unicornd.redis_world import running_daemon, until
from unicorn_core.errors import CommandFailed
from unicornd.actions import Action, CheckNode, Decision, DrainNode, NotifyOperator, Replan, Requeue
from unicornd.decide import on_operator_drain
from unicornd.executor import MAX_ACTIONS_IN_FLIGHT, CheckFailed, _drain_group
from unicornd.state import NodeHealth
from unicornd.store import Owed

PREFIX = "drains"


def owed(*actions: Action) -> list[Owed]:
    return [Owed(a.action_id, a) for a in actions]


def drain(node: str, reason: str = "rack 7", *, down: bool = False) -> DrainNode:
    return DrainNode(f"d/{node}/{reason}/{down}", node, reason, down=down)


def test_adjacent_drains_of_one_reason_form_one_group() -> None:
    queue = owed(drain("n1"), drain("n2"), drain("n3"), Replan("r", "x"), drain("n4"))
    assert [o.action.action_id for o in _drain_group(queue, 0, {}, set())] == [
        "d/n1/rack 7/False",
        "d/n2/rack 7/False",
        "d/n3/rack 7/False",
    ]
    assert len(_drain_group(queue, 3, {}, set())) == 1  # not a drain: alone
    assert len(_drain_group(queue, 4, {}, set())) == 1  # after the replan: not joined to n1-n3


def test_a_group_stops_at_another_reason_kind_node_or_busy_or_running_drain() -> None:
    assert len(_drain_group(owed(drain("n1"), drain("n2", "ecc")), 0, {}, set())) == 1
    assert len(_drain_group(owed(drain("n1"), drain("n2", down=True)), 0, {}, set())) == 1
    assert len(_drain_group(owed(drain("n1"), drain("n1", "other")), 0, {}, set())) == 1
    busy = {"node:n2"}  # e.g. a node check running on n2: its drain waits, n1's need not
    assert len(_drain_group(owed(drain("n1"), drain("n2"), drain("n3")), 0, {}, busy)) == 1
    running = {"d/n2/rack 7/False": object()}
    assert len(_drain_group(owed(drain("n1"), drain("n2")), 0, running, set())) == 1
    check = CheckNode("c/n2", "n2")
    assert len(_drain_group(owed(check, drain("n1")), 0, {}, set())) == 1


async def _drain_rack(slurm: FakeSlurm, redis_url: str, nodes: tuple[str, ...]) -> None:
    async with running_daemon(slurm, redis_url, PREFIX) as daemon:
        now = time.time()
        await daemon.core.decide(
            now, partial(on_operator_drain, node=",".join(nodes), reason="rack 7", now_s=now)
        )
        await until(lambda: all(daemon.snap.nodes[n].health is NodeHealth.DRAINED for n in nodes))
        await until(lambda: not daemon.executor.in_flight())


async def test_a_rack_is_drained_in_one_slurm_call(redis_url: str) -> None:
    slurm = FakeSlurm(["n1", "n2", "n3", "n4"])
    await _drain_rack(slurm, redis_url, ("n2", "n3", "n4"))
    assert slurm.calls == [("drain_nodes", ("n2", "n3", "n4"), "unicorn: operator: rack 7")]


async def test_a_failed_group_call_falls_back_to_one_call_per_drain(redis_url: str) -> None:
    slurm = FakeSlurm(["n1", "n2", "n3"])
    slurm.fail("drain_nodes", CommandFailed(("scontrol", "update"), 1, "", "slurm_update error: busy"))
    await _drain_rack(slurm, redis_url, ("n2", "n3"))
    reason = "unicorn: operator: rack 7"
    assert slurm.calls == [
        ("drain_nodes", ("n2", "n3"), reason),
        ("drain", "n2", reason),
        ("drain", "n3", reason),
    ]


async def test_at_most_max_actions_in_flight_run_at_once_and_the_rest_follow(redis_url: str) -> None:
    """Found by the scale bench's hour at 4,096 nodes: a burst of actions each holding a
    Redis connection ran redis-py's pool (100) dry, and a failed lease check ended
    unicornd. Actions that share no resource (operator notices, here) may run together,
    but at most MAX_ACTIONS_IN_FLIGHT at once; every one still runs."""
    slurm = FakeSlurm(["n1", "n2"])
    count = MAX_ACTIONS_IN_FLIGHT + 8
    async with running_daemon(slurm, redis_url, PREFIX) as daemon:
        real = daemon.executor._perform
        now_in, peak, ran = 0, 0, 0
        full = asyncio.Event()  # every slot taken once: on a loaded machine a fixed sleep may end first

        async def slow(owed: Owed) -> None:
            nonlocal now_in, peak, ran
            now_in += 1
            peak = max(peak, now_in)
            if now_in >= MAX_ACTIONS_IN_FLIGHT:
                full.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(full.wait(), 10)
            await asyncio.sleep(0.05)
            now_in -= 1
            await real(owed)
            ran += 1

        daemon.executor._perform = slow  # type: ignore[method-assign]
        notices = tuple(NotifyOperator(f"notice/{i}", None, f"notice {i}") for i in range(count))
        await daemon.core.decide(time.time(), lambda _s: Decision(actions=notices))
        await until(lambda: ran == count, 60)
    assert peak == MAX_ACTIONS_IN_FLIGHT


async def test_a_stop_that_a_library_swallows_still_ends_the_executor(redis_url: str) -> None:
    """Seen once at stop in the 4,096-node hour: ``shutdown_stuck: ['executor']``, the
    executor's loop waiting again after it was cancelled. A library's timeout that expires
    as the task is cancelled can swallow the CancelledError (asyncio.wait_for and
    async-timeout on Python 3.11); the loop now ends on the request its task still counts."""
    async with running_daemon(FakeSlurm(["n1"]), redis_url, PREFIX) as daemon:
        real = daemon.core.store.owed
        entered = asyncio.Event()

        async def swallowing_owed() -> list[Owed]:
            entered.set()
            with contextlib.suppress(asyncio.CancelledError):  # the race: the request is lost
                await asyncio.sleep(30)
            return await real()

        daemon.core.store.owed = swallowing_owed  # type: ignore[method-assign]
        daemon.core.wake.set()
        await asyncio.wait_for(entered.wait(), 10)
    # running_daemon asserts the exit status is 0 (1 after shutdown_stuck)


DOWN_STEP = "srun: error: Unable to create step for job 7: Required node not available (down): n2"


async def test_a_check_slurm_cannot_run_convicts_only_a_node_slurmctld_marks_lost(redis_url: str) -> None:
    """Found by the 4,096-node hour: a dead node's restarted agent was "never heard from",
    its node check failed with srun's "Required node not available (down)", and the
    incident went to the operator with nothing drained (80 times in the hour). srun failing
    to run the check convicts the node when slurmctld marks it NOT_RESPONDING or DOWN (the
    confirmation Slurm's view gives a silent agent); on a node Slurm holds up it says
    nothing."""
    lost = dataclasses.replace(idle_node("n2"), flags=frozenset({"NOT_RESPONDING"}))
    slurm = FakeSlurm(["n1", lost, "n3"])
    slurm.check_exit_code, slurm.check_stderr = 1, DOWN_STEP
    async with running_daemon(slurm, redis_url, PREFIX) as daemon:
        with pytest.raises(CheckFailed) as convicted:
            await daemon.executor._check_node(CheckNode("i/check/n2", "n2", job_id=7))
        assert convicted.value.nodes == ("n2",) and "NOT_RESPONDING" in str(convicted.value)
        with pytest.raises(CheckFailed) as unknown:
            await daemon.executor._check_node(CheckNode("i/check/n1", "n1", job_id=7))
        assert unknown.value.nodes == ()
        slurm.fail("get_node", CommandFailed(("scontrol", "show", "node"), 1, "", "slurmctld down"))
        with pytest.raises(CheckFailed) as unreadable:
            await daemon.executor._check_node(CheckNode("i/check/n2b", "n2", job_id=7))
        assert unreadable.value.nodes == ()


async def test_a_requeue_waiting_for_its_job_to_start_lets_later_allocation_changes_run(
    redis_url: str,
) -> None:
    """Found by the 4,096-node hour: a replan's 102 requeues ran one at a time, each holding
    the allocation while it waited ~2.5 s for its job to start, so a drain committed after
    them waited 7 minutes. A requeue holds the allocation only until its job is placed; a
    second requeue of the same job still waits for the first (the job is its resource)."""
    slurm = FakeSlurm(["n1", "n2", "n3", "n4"], jobs=[running_job(7, ("n1", "n2")), running_job(8, ("n3",))])
    slurm.requeue_start_s = 10.0  # far longer than committing, taking up and placing all four, even loaded
    actions = (
        Requeue("r/7", "t7", 7, ("n1", "n2")),
        Requeue("r/8", "t8", 8, ("n3",)),
        DrainNode("d/n4", "n4", "test"),
        Requeue("r/7-again", "t7", 7, ("n1",)),
    )
    async with running_daemon(slurm, redis_url, PREFIX) as daemon:
        t0 = time.monotonic()
        await daemon.core.decide(time.time(), lambda _s: Decision(actions=actions))
        await until(lambda: any(c[0] == "drain" and c[1] == "n4" for c in slurm.calls), 30)
        placed_all = time.monotonic() - t0
        assert placed_all < slurm.requeue_start_s, placed_all  # before the first requeue's wait ended
        requeues = [c for c in slurm.calls if c[0] == "requeue"]
        assert [c[1] for c in requeues] == [7, 8]  # 7 again waits for 7's first requeue
        slurm.requeue_start_s = 0.0  # the waits under way go on; 7 again need not wait 10 s more
        # 7 again: two waits in a row; nothing is in flight between 7's end and its start
        await until(
            lambda: sum(c[0] == "requeue" for c in slurm.calls) == 3 and not daemon.executor.in_flight(), 60
        )
    assert [c[1:] for c in slurm.calls if c[0] == "requeue"] == [
        (7, ("n1", "n2")),
        (8, ("n3",)),
        (7, ("n1",)),
    ]


async def test_a_requeue_that_holds_its_job_keeps_the_allocation_to_the_end(redis_url: str) -> None:
    """A requeue with no nodes names nowhere its job may start: later allocation changes
    wait for its end, as before."""
    slurm = FakeSlurm(["n1", "n2", "n3"], jobs=[running_job(7, ("n1", "n2"))])
    slurm.requeue_start_s = 1.5
    async with running_daemon(slurm, redis_url, PREFIX) as daemon:
        t0 = time.monotonic()
        actions = (Requeue("r/7", "t7", 7, ()), DrainNode("d/n3", "n3", "test"))
        await daemon.core.decide(time.time(), lambda _s: Decision(actions=actions))
        await until(lambda: any(c[0] == "drain" for c in slurm.calls), 20)
        assert time.monotonic() - t0 >= slurm.requeue_start_s
