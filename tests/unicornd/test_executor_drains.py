"""Drains of one reason committed one after the other go to Slurm in one call (a rack:
one slurmctld RPC), without changing the commit order of anything else; a failed group
call falls back to one call per drain, so each drain gets its own outcome."""

from __future__ import annotations

import time
from functools import partial

from tests.fakes.slurm import FakeSlurm
from tests.unicornd.redis_world import running_daemon, until
from unicorn_core.errors import CommandFailed
from unicornd.actions import Action, CheckNode, DrainNode, Replan
from unicornd.decide import on_operator_drain
from unicornd.executor import _drain_group
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
