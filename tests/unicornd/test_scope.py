"""unicornd manages only the nodes in [slurm]'s scope, and never the nodes of other users' jobs.

Decisions (pure): a node's jobs are recorded, another user's job keeps it out of every plan
and out of every drain unicorn decides by itself. Ingest: :func:`unicornd.inputs.observe`
is the one place nodes enter the snapshot. unicornd on a real Redis with a fake Slurm: its
snapshot holds only nodes in scope, a bad scope stops it at start, the executor and the
registration refuse nodes outside. unicornctl drain/resume refuse them with exit 2.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from click.testing import CliRunner

from detect.statuses import ErrorStatus
from plan.hardware import gpu_spec
from plan.objective import FailureModel
from tests.fakes.slurm import FakeSlurm, idle_node, running_job
from tests.unicornd.coord_world import GPN, apply, finding, of_kind, plan, render, task, world
from tests.unicornd.redis_world import until
from unicorn_core import redis_io
from unicorn_core.config import RedisConfig, load_config
from unicorn_core.errors import InvalidArgument
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import reset_logging
from unicorn_core.slurm.scope import Scope, ScopeError
from unicorn_core.slurm.types import NodeState
from unicornd.actions import CheckNode, DrainNode, NotifyOperator, Replan
from unicornd.agentusers import AgentUsers
from unicornd.cli import Caller, cli
from unicornd.cli.common import EXIT_UNKNOWN_NODE
from unicornd.cli.status import ClusterStatus, ownership
from unicornd.core import Core
from unicornd.daemon import Daemon
from unicornd.decide import (
    on_finding,
    on_node_check,
    on_node_jobs,
    on_node_join,
    on_node_slurm_down,
    on_operator_confirm_drain,
    on_operator_drain,
)
from unicornd.inputs import RESERVATION_REFRESH_S, SlurmWatch, observe
from unicornd.replan import PlanContext, plan_transition
from unicornd.state import LadderStage, NodeHealth, NodeRecord, Policy, Snapshot
from unicornd.store import Store, snapshot_from_json, snapshot_to_json

T0 = 1_700_000_000.0
PREFIX = "scopetest"


def shared() -> Snapshot:
    """Task a (job 7) on n1; n2 holds job 99, which is no task's; n3 is free."""
    snap = world(3, [task("a", 7, ["n1"])])
    return apply(snap, on_node_jobs(snap, {"n1": (7,), "n2": (99,)}, T0))


# --- decisions -----------------------------------------------------------------------


def test_jobs_are_recorded_and_only_other_users_jobs_make_a_node_not_ours() -> None:
    snap = shared()
    assert snap.nodes["n1"].jobs == (7,) and snap.nodes["n2"].jobs == (99,)
    assert snap.foreign_jobs("n1") == () and snap.foreign_jobs("n2") == (99,)
    assert snap.plannable() == ["n1", "n3"]
    assert on_node_jobs(snap, {"n1": (7,), "n2": (99,)}, T0 + 1).empty  # nothing new: no change
    # Job 99 becomes a task's (its wrapper registered): n2 is ours from then on.
    registered = snap.apply(tasks=[task("b", 99, ["n2"])])
    assert registered.foreign_jobs("n2") == () and "n2" in registered.plannable()


def test_a_node_freed_by_another_users_job_is_planned_again() -> None:
    snap = shared()
    d = on_node_jobs(snap, {"n1": (7,)}, T0 + 5)
    (replan,) = d.actions
    assert isinstance(replan, Replan) and "n2" in replan.reason
    after = apply(snap, d)
    assert after.nodes["n2"].jobs == () and after.plannable() == ["n1", "n2", "n3"]
    # A foreign job arriving on a free node is noted, and asks for no replan.
    d = on_node_jobs(after, {"n1": (7,), "n3": (120,)}, T0 + 6)
    assert not d.actions and any("n3" in n and "not ours" in n for n in d.notes)


def test_the_planner_never_gives_a_task_a_node_another_users_job_holds() -> None:
    snap = shared()
    d = plan_transition(snap, plan({"a": 4}), render, T0)  # a grows from 1 node to 2
    assert apply(snap, d).tasks["a"].nodes == ("n1", "n3")
    both = apply(snap, on_node_jobs(snap, {"n1": (7,), "n2": (99,), "n3": (100,)}, T0))
    with pytest.raises(InvalidArgument, match="free of other users' jobs"):
        plan_transition(both, plan({"a": 4}), render, T0)


def test_a_confirmed_fault_on_a_node_shared_with_another_users_job_asks_the_operator() -> None:
    snap = world(2, [task("a", 7, ["n1", "n2"])])
    snap = apply(snap, on_node_jobs(snap, {"n1": (7,), "n2": (7, 99)}, T0))
    d = on_finding(snap, finding("f1", 7, "n2", ErrorStatus.ECC_ERROR), T0 + 1)
    assert not of_kind(d.actions, DrainNode)
    (notify,) = of_kind(d.actions, NotifyOperator)
    assert isinstance(notify, NotifyOperator) and "other users' jobs [99]" in notify.why
    after = apply(snap, d)
    (inc,) = after.incidents.values()
    assert inc.stage is LadderStage.ESCALATED_TO_OPERATOR and inc.pending_drain == "n2"
    # A person may still decide to drain it.
    confirmed = on_operator_confirm_drain(after, inc.incident_id, T0 + 2)
    drains = [a for a in confirmed.actions if isinstance(a, DrainNode)]
    assert [a.node for a in drains] == ["n2"]


def test_operator_drain_of_a_node_running_another_users_job_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"other users' jobs \[99\]"):
        on_operator_drain(shared(), "n2", "fan", T0)
    assert of_kind(on_operator_drain(shared(), "n3", "fan", T0).actions, DrainNode)


def test_a_held_node_that_came_back_under_another_users_job_is_not_drained() -> None:
    snap = shared()
    snap = snap.apply(nodes=[dataclasses.replace(snap.nodes["n2"], health=NodeHealth.DRAINED, held=True)])
    d = on_node_join(snap, "n2", T0 + 10)
    assert not of_kind(d.actions, DrainNode) and of_kind(d.actions, NotifyOperator)
    assert "n2" not in apply(snap, d).plannable()


# --- ingest --------------------------------------------------------------------------


def site() -> FakeSlurm:
    """gpu: g1 g2 g3 (g3 with feature h100); cpu: c1. Job 99 (someone else's) on g2 and c1."""
    return FakeSlurm(
        [
            idle_node("g1", partitions=("gpu",)),
            idle_node("g2", partitions=("gpu",)),
            idle_node("g3", partitions=("gpu",), features=("h100",)),
            idle_node("c1", partitions=("cpu",), gpus=0),
        ],
        [running_job(99, ["g2", "c1"], name="etl", user="bob")],
        reservations={"train": ("g1", "g3")},
    )


async def test_observe_lets_only_nodes_in_scope_through_with_their_jobs() -> None:
    view, _ = await observe(site(), Scope(partitions=("gpu",)))
    assert [n.name for n in view.nodes] == ["g1", "g2", "g3"] and [n.name for n in view.outside] == ["c1"]
    assert view.held == {"g2": (99,)}
    slurm = site()
    view, scope = await observe(slurm, Scope(reservation="train", reserved=frozenset()))
    assert [n.name for n in view.nodes] == ["g1", "g3"] and scope.reserved == frozenset({"g1", "g3"})
    view, _ = await observe(site(), Scope(feature="h100"))
    assert [n.name for n in view.nodes] == ["g3"]


# --- unicornd on a real Redis ----------------------------------------------------------


def _cfg(url: str, **extra: str) -> Any:
    return load_config(None, env={"UNICORN_REDIS__URL": url, "UNICORN_REDIS__KEY_PREFIX": PREFIX, **extra})


async def test_unicornd_keeps_only_nodes_in_scope_and_follows_other_users_jobs(redis_url: str) -> None:
    # A snapshot written before the scope was narrowed still names c1: it is forgotten.
    redis.Redis.from_url(redis_url).set(
        RedisKeys(PREFIX).state(), snapshot_to_json(world(0, []).apply(nodes=[NodeRecord("c1")]))
    )
    cfg = _cfg(redis_url, UNICORN_SLURM__PARTITIONS="gpu")
    slurm = site()
    client = redis_io.connect(cfg.redis, client_name="test-unicornd")
    daemon = Daemon(cfg, slurm, client)
    running = asyncio.create_task(daemon.run())
    try:
        await until(lambda: daemon.snapshot is not None)
        assert sorted(daemon.snap.nodes) == ["g1", "g2", "g3"]
        assert daemon.snap.foreign_jobs("g2") == (99,) and "g2" not in daemon.snap.plannable()
        # The executor never acts on a node outside the scope.
        with pytest.raises(InvalidArgument, match="outside"):
            await daemon.executor._drain_node(DrainNode("x/drain", "c1", "unicorn: test"))
        # A task whose job holds a node outside the scope is refused at registration.
        with pytest.raises(InvalidArgument, match="c1 is in cpu"):
            await daemon.requests._in_scope(task("t", 99, ["g2", "c1"]))
        await daemon.requests._in_scope(task("t", 98, ["g1", "g2"]))
        # Job 99 ends: g2 is free, and plannable again at the next poll.
        await slurm.cancel(99)
        await until(lambda: daemon.snap.nodes["g2"].jobs == ())
        assert "g2" in daemon.snap.plannable()
        assert not slurm.calls[1:]  # the cancel above was the only change to Slurm
    finally:
        daemon._stop.set()
        await asyncio.wait_for(running, 30)
        await client.aclose()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"UNICORN_SLURM__PARTITIONS": "gpu,nope"},
            "['nope'], which Slurm does not have; its partitions: cpu, gpu",
        ),
        ({"UNICORN_SLURM__RESERVATION": "gone"}, "unknown Slurm reservation 'gone'"),
    ],
)
async def test_a_bad_scope_stops_unicornd_at_start(
    redis_url: str, extra: dict[str, str], message: str
) -> None:
    cfg = _cfg(redis_url, **extra)
    client = redis_io.connect(cfg.redis, client_name="test-unicornd")
    try:
        with pytest.raises(ScopeError) as ei:
            await asyncio.wait_for(Daemon(cfg, site(), client).run(), 30)
        assert message in str(ei.value)
        keys = RedisKeys(PREFIX)
        assert not redis.Redis.from_url(redis_url).exists(keys.state(), keys.state_meta())  # nothing written
    finally:
        await client.aclose()


# --- unicornctl ----------------------------------------------------------------------


def test_unicornctl_drain_and_resume_refuse_a_node_outside_the_scope(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm = site()

    async def fake_backend(_cfg: object) -> FakeSlurm:
        return slurm

    monkeypatch.setattr("unicornd.cli.operator.make_backend", fake_backend)
    keys = RedisKeys(PREFIX)
    r = redis.Redis.from_url(redis_url)
    r.set(keys.state(), snapshot_to_json(world(0, []).apply(nodes=[NodeRecord("g1"), NodeRecord("g2")])))
    r.set(keys.daemon_liveness(), json.dumps({"pid": 1, "t": time.time()}), px=60_000)
    env = {
        "UNICORN_REDIS__URL": redis_url,
        "UNICORN_REDIS__KEY_PREFIX": PREFIX,
        "UNICORN_CONFIG": "",
        "UNICORN_SLURM__PARTITIONS": "gpu",
    }
    root = Caller(uid=0, user="root", gids=frozenset())
    for args in (["drain", "c1", "--reason", "x", "--yes"], ["resume", "c1", "--yes"]):
        try:
            result = CliRunner().invoke(cli, args, env=env, obj={"caller": root})
        finally:
            reset_logging()
        assert result.exit_code == EXIT_UNKNOWN_NODE, result.output
        assert "node c1 is in cpu, not in [slurm] partitions = ['gpu']" in result.stderr
        assert "outside unicorn's scope" in result.stderr and "nothing changed" in result.stderr
    assert not r.exists(keys.operator_control()) and slurm.calls == []
    # A name Slurm does not have at all stays an unknown node.
    try:
        result = CliRunner().invoke(cli, ["drain", "zz", "--reason", "x"], env=env, obj={"caller": root})
    finally:
        reset_logging()
    assert result.exit_code == EXIT_UNKNOWN_NODE and "unknown node 'zz'" in result.stderr


def test_status_shows_nodes_outside_the_scope_and_those_that_are_not_ours() -> None:
    slurm = site()
    snap = world(0, []).apply(nodes=[NodeRecord("g1"), NodeRecord("g2", jobs=(99,)), NodeRecord("g3")])
    st = ClusterStatus(list(slurm.nodes.values()), [], True, "", True, snap, scope=Scope(partitions=("gpu",)))
    seen = {n.name: ownership(st, n) for n in st.nodes}
    assert seen == {"g1": ("ours", []), "g2": ("not ours", [99]), "g3": ("ours", []), "c1": ("outside", [])}


ROOT = Caller(uid=0, user="root", gids=frozenset())


def test_status_shows_the_nodes_slurm_holds_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """unicornd's view of Slurm's NOT_RESPONDING/DOWN at its last poll (idle such nodes are
    left out of every plan) is in ``unicornctl status``, text and JSON."""
    slurm = site()
    snap = world(0, []).apply(nodes=[NodeRecord("g1"), NodeRecord("g2", slurm_down=True), NodeRecord("g3")])
    st = ClusterStatus(list(slurm.nodes.values()), [], True, "", True, snap, scope=Scope(partitions=("gpu",)))

    async def gathered(_cfg: object) -> ClusterStatus:
        return st

    monkeypatch.setattr(importlib.import_module("unicornd.cli.status"), "gather_status", gathered)
    env: dict[str, str] = {}
    try:
        text = CliRunner().invoke(cli, ["status"], env=env, obj={"caller": ROOT})
        doc = CliRunner().invoke(cli, ["status", "--json"], env=env, obj={"caller": ROOT})
    finally:
        reset_logging()
    assert text.exit_code == 0, text.output
    assert "  Slurm holds down (NOT_RESPONDING/DOWN): g2\n" in text.output
    health = json.loads(doc.output)["unicorn"]["node_health"]
    assert {n: h["slurm_down"] for n, h in health.items()} == {"g1": False, "g2": True, "g3": False}


# --- the Slurm poll (SlurmWatch) ---------------------------------------------------------


async def _watch(redis_url: str, slurm: FakeSlurm, snap: Snapshot, scope: Scope) -> tuple[SlurmWatch, Any]:
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(PREFIX)
    core = Core(
        Store(client, keys, Policy()), PlanContext(gpu_spec("a100-80g"), FailureModel(24.0), render_for)
    )
    await core.start(snap)
    return SlurmWatch(core, slurm, AgentUsers(client, keys, RedisConfig()), None, scope), client


def render_for(_gpn: int, _gen: int) -> Any:
    return render


async def test_a_node_that_comes_back_under_another_users_job_joins_only_once_it_left(redis_url: str) -> None:
    """g2 was drained by unicorn; Slurm resumed it and job 99 (bob's) took it at once. Its
    join check would have waited for bob's allocation, failed and left it out of every plan
    for good; the poll defers its join until bob's job is gone. g4, new and under bob's job
    too, is not taken into the snapshot before then either."""
    slurm = site()
    slurm.nodes["g4"] = idle_node("g4", partitions=("gpu",))
    slurm.jobs[99] = running_job(99, ["g2", "g4"], name="etl", user="bob")
    snap = world(0, []).apply(
        nodes=[NodeRecord("g1"), NodeRecord("g2", health=NodeHealth.DRAINED, reason="x"), NodeRecord("g3")]
    )
    watch, client = await _watch(redis_url, slurm, snap, Scope(partitions=("gpu",)))
    try:
        await watch.poll()
        core = watch.core
        assert core.snap.nodes["g2"].health is NodeHealth.DRAINED and core.snap.nodes["g2"].jobs == (99,)
        assert "g4" not in core.snap.nodes
        assert not [o for o in await core.store.owed() if isinstance(o.action, CheckNode)]
        await slurm.cancel(99)
        await watch.poll()
        assert core.snap.nodes["g2"].health is NodeHealth.RETURNING and core.snap.nodes["g2"].jobs == ()
        assert core.snap.nodes["g4"].health is NodeHealth.RETURNING
        checks = sorted(o.action.node for o in await core.store.owed() if isinstance(o.action, CheckNode))
        assert checks == ["g2", "g4"]
    finally:
        await client.aclose()


async def test_a_joining_nodes_replan_sees_the_jobs_of_this_same_poll(redis_url: str) -> None:
    """Without the node check, g2's join plans at once: the foreign job 99 that appeared on
    g3 in the same poll must already keep g3 out of that plan (jobs are recorded first)."""
    slurm = FakeSlurm([idle_node(n, partitions=("gpu",)) for n in ("g1", "g2", "g3")])
    slurm.jobs[7] = running_job(7, ["g1"])
    slurm.jobs[99] = running_job(99, ["g3"], name="etl", user="bob")
    snap = world(0, [task("a", 7, ["g1"])]).apply(
        nodes=[NodeRecord("g1", jobs=(7,)), NodeRecord("g2", health=NodeHealth.DRAINED), NodeRecord("g3")]
    )
    snap = dataclasses.replace(snap, policy=dataclasses.replace(snap.policy, node_check_on_join=False))
    watch, client = await _watch(redis_url, slurm, snap, Scope())
    watch.core.store.policy = snap.policy
    try:
        await watch.poll()
        core = watch.core
        assert core.snap.nodes["g3"].jobs == (99,) and core.snap.nodes["g2"].health is NodeHealth.HEALTHY
        assert "g3" not in core.snap.tasks["a"].nodes
    finally:
        await client.aclose()


async def test_the_reservation_is_read_again_only_now_and_then_and_its_end_stops_no_poll(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm = site()
    clock = [1000.0]
    monkeypatch.setattr("unicornd.inputs.time.monotonic", lambda: clock[0])
    scope = Scope(reservation="train", reserved=frozenset({"g1", "g3"}))
    watch, client = await _watch(redis_url, slurm, world(0, []), scope)
    try:
        for _ in range(5):
            await watch.poll()
        assert slurm.queries.count("reservation_nodes") == 1  # not once a second
        assert sorted(watch.core.snap.nodes) == ["g1", "g3"]
        del slurm.reservations["train"]  # the reservation ended
        clock[0] += RESERVATION_REFRESH_S
        slurm.jobs[7] = running_job(7, ["g1"], name="etl", user="bob")
        await watch.poll()
        assert slurm.queries.count("reservation_nodes") == 2
        assert watch.scope.reserved == frozenset({"g1", "g3"})  # the last nodes read, kept
        assert watch.core.snap.nodes["g1"].jobs == (7,)  # and the poll went on
    finally:
        await client.aclose()


# --- Slurm's view of a node that stopped responding ---------------------------------------


def test_an_idle_node_slurm_holds_down_is_no_new_capacity() -> None:
    """slurmctld marks idle n3 NOT_RESPONDING: Slurm would start no job there, so a plan
    must not give it to a task (a requeue onto it would wait for a start that never
    comes). Its health is unchanged, and n1, where task a runs, stays a's even when down
    (slurmd can die on a node that trains on). n3 responding again is plannable but asks
    for no replan (a flapping node must not cost a solve per flap). A node the poll did
    not list keeps what it had."""
    snap = world(4, [task("a", 7, ["n1"])])
    every = {"n1", "n2", "n3", "n4"}
    d = on_node_slurm_down(snap, every, {"n1", "n3"}, T0)
    assert not d.actions and any("n3" in n for n in d.notes)
    down = apply(snap, d)
    assert down.nodes["n3"].slurm_down and down.nodes["n3"].health is NodeHealth.HEALTHY
    assert down.plannable() == ["n1", "n2", "n4"]
    grown = apply(down, plan_transition(down, plan({"a": 6}), render, T0)).tasks["a"].nodes
    assert grown == ("n1", "n2", "n4")
    assert on_node_slurm_down(down, every, {"n1", "n3"}, T0 + 1).empty  # nothing new: no change
    restored = snapshot_from_json(snapshot_to_json(down), down.policy)
    assert restored.nodes["n3"].slurm_down  # kept across a restart
    assert on_node_slurm_down(down, {"n1", "n2"}, {"n1"}, T0 + 2).empty  # n3 not polled: unchanged
    d = on_node_slurm_down(down, every, {"n1"}, T0 + 2)
    assert not d.actions and any("n3 up again" in n for n in d.notes)
    assert apply(down, d).plannable() == ["n1", "n2", "n3", "n4"]


def test_a_task_that_shrinks_lets_its_node_slurm_holds_down_go_first() -> None:
    """Task a runs on n1, n2; n1 (its first node) is held down by Slurm. Shrunk to one node,
    a keeps n2, and n1 goes to nobody: b, growing, gets n3."""
    snap = world(3, [task("a", 7, ["n1", "n2"]), task("b", 8, [])])
    snap = apply(snap, on_node_slurm_down(snap, {"n1", "n2", "n3"}, {"n1"}, T0))
    after = apply(snap, plan_transition(snap, plan({"a": 2, "b": 2}), render, T0))
    assert after.tasks["a"].nodes == ("n2",) and after.tasks["b"].nodes == ("n3",)


def test_a_task_that_gains_nodes_leaves_its_node_slurm_holds_down_while_a_free_one_is_left() -> None:
    """Task a runs on n1, n2; Slurm holds n1 down. Growing to three nodes gives its job a new
    allocation (a resize or a requeue), which Slurm would never start on n1: n1 gives way to
    a free node. With no free node left it is kept (the plan counted it). Keeping its nodes
    as they are, a keeps n1 (slurmd can die on a node that trains on)."""
    snap = world(4, [task("a", 7, ["n1", "n2"])])
    snap = apply(snap, on_node_slurm_down(snap, {"n1", "n2", "n3", "n4"}, {"n1"}, T0))
    grown = apply(snap, plan_transition(snap, plan({"a": 3 * GPN}), render, T0)).tasks["a"].nodes
    assert "n1" not in grown and sorted(grown) == ["n2", "n3", "n4"]
    snap3 = world(3, [task("a", 7, ["n1", "n2"])])
    snap3 = apply(snap3, on_node_slurm_down(snap3, {"n1", "n2", "n3"}, {"n1"}, T0))
    assert sorted(
        apply(snap3, plan_transition(snap3, plan({"a": 3 * GPN}), render, T0)).tasks["a"].nodes
    ) == [
        "n1",
        "n2",
        "n3",
    ]
    assert plan_transition(snap, plan({"a": 2 * GPN}), render, T0).empty  # unchanged: a keeps n1


async def test_the_poll_records_which_nodes_slurm_holds_down(redis_url: str) -> None:
    slurm = FakeSlurm([idle_node(n, partitions=("gpu",)) for n in ("g1", "g2", "g3")])
    slurm.jobs[7] = running_job(7, ["g1"])
    snap = world(0, [task("a", 7, ["g1"])]).apply(
        nodes=[NodeRecord("g1", jobs=(7,)), NodeRecord("g2"), NodeRecord("g3")]
    )
    watch, client = await _watch(redis_url, slurm, snap, Scope())
    try:
        slurm.set_node("g2", flags=frozenset({"NOT_RESPONDING"}))
        slurm.set_node("g3", state=NodeState.DOWN)
        await watch.poll()
        core = watch.core
        assert [n for n, rec in sorted(core.snap.nodes.items()) if rec.slurm_down] == ["g2", "g3"]
        assert core.snap.plannable() == ["g1"] and core.snap.tasks["a"].nodes == ("g1",)
        slurm.set_node("g2", flags=frozenset())
        await watch.poll()
        assert core.snap.plannable() == ["g1", "g2"]
    finally:
        await client.aclose()


def test_a_node_that_joins_while_slurm_holds_it_down_is_no_capacity_for_its_own_replan() -> None:
    """With ``node_check_on_join`` off, a join is healthy at once and replans. A node the same
    poll saw NOT_RESPONDING joins recorded down, so that replan does not plan onto it (the
    poll's own down pass came after the join); up at the join, it is plannable at once."""
    snap = world(2, [task("a", 7, ["n1"])])
    snap = dataclasses.replace(snap, policy=dataclasses.replace(snap.policy, node_check_on_join=False))
    for down, plannable in ((True, ["n1", "n2"]), (False, ["n1", "n2", "n3"])):
        d = on_node_join(snap, "n3", T0, gpus=(8, "a100-80g"), slurm_down=down)
        after = apply(snap, d)
        assert after.nodes["n3"].health is NodeHealth.HEALTHY and after.nodes["n3"].slurm_down is down
        assert after.plannable() == plannable and any(isinstance(a, Replan) for a in d.actions)


def test_a_returning_node_whose_check_passed_is_up_whatever_the_last_poll_said() -> None:
    """A resumed node is NOT_RESPONDING for a moment; a poll then may have marked it down
    just before its node check (run there through srun) passed: the join's replan uses it."""
    snap = world(2, [task("a", 7, ["n1"])])
    snap = snap.apply(nodes=[NodeRecord("n2", health=NodeHealth.RETURNING, slurm_down=True, joins=1)])
    d = on_node_check(snap, "n2", True, T0)
    after = apply(snap, d)
    assert after.nodes["n2"].health is NodeHealth.HEALTHY and not after.nodes["n2"].slurm_down
    assert "n2" in after.plannable() and any(isinstance(a, Replan) for a in d.actions)
