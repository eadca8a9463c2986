"""plan_transition: from the current allocation to the planner's plan, as ordered actions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from detect.statuses import ErrorStatus
from launcher.render import Rendezvous, megatron_args, torchrun_argvs
from plan.hardware import gpu_spec
from plan.planner import Cluster, Granularity, plan_cluster, task_curves
from tests.unicornd.coord_world import (
    apply,
    finding,
    layout_for,
    of_kind,
    plan,
    render,
    requeued_and_running,
    task,
    world,
)
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.paths import etc_dir
from unicorn_core.protocol import AgentAction
from unicorn_core.taskspec import load_task_file
from unicornd.actions import Action, Decision, Grow, LaunchAgents, Requeue, SendCommand, Shrink
from unicornd.decide import on_finding, on_node_check, on_node_join
from unicornd.replan import plan_transition
from unicornd.state import LadderStage, NodeHealth, NodeRecord, RequeueWait, Snapshot, TaskRecord, TaskState

T0 = 1_700_000_000.0


def after_node_loss(node: str = "n2", **task_a: object) -> Snapshot:
    """Task a on n1,n2 and b on n3,n4 (8 nodes); ``node`` of a had an ECC error."""
    snap = world(8, [task("a", 1, ["n1", "n2"], **task_a), task("b", 2, ["n3", "n4"])])
    return apply(snap, on_finding(snap, finding("f1", 1, node, ErrorStatus.ECC_ERROR), T0))


def sends(d: Decision, action: AgentAction) -> list[str]:
    return [a.node for a in of_kind(d.actions, SendCommand) if a.action is action]  # type: ignore[union-attr]


def phase(action: Action) -> int:
    if isinstance(action, SendCommand):
        return {AgentAction.CHECKPOINT_NOW: 0, AgentAction.STOP: 1, AgentAction.RELAUNCH: 4}[action.action]
    return {Shrink: 2, Requeue: 2, Grow: 3, LaunchAgents: 4}[type(action)]


def assert_phase_order(d: Decision) -> None:
    phases = [phase(a) for a in d.actions]
    assert phases == sorted(phases), [a.action_id for a in d.actions]


def mentions(d: Decision, task_id: str, job_id: int) -> list[Action]:
    return [
        a for a in d.actions if getattr(a, "task_id", None) == task_id or getattr(a, "job_id", None) == job_id
    ]


def test_shrink_after_node_loss_checkpoints_first_and_leaves_the_other_task_alone() -> None:
    snap = after_node_loss()
    d = plan_transition(snap, plan({"a": 2, "b": 4}), render, T0 + 1)
    assert sends(d, AgentAction.CHECKPOINT_NOW) == ["n1"], "JIT checkpoint from the healthy node only"
    assert [(a.nodes) for a in of_kind(d.actions, Shrink)] == [("n1",)]  # type: ignore[union-attr]
    assert sends(d, AgentAction.RELAUNCH) == ["n1"]
    relaunch = of_kind(d.actions, SendCommand)[-1]
    assert relaunch.argv == tuple(render(snap.tasks["a"], layout_for(1), ("n1",))["n1"])  # type: ignore[union-attr]
    assert_phase_order(d)
    assert mentions(d, "b", 2) == [], "task b is untouched"
    new = apply(snap, d)
    assert new.tasks["a"].nodes == ("n1",) and new.tasks["a"].layout == layout_for(1)
    assert new.tasks["a"].resizes_this_run == 1 and new.tasks["a"].state is TaskState.LAUNCHING
    assert new.incidents["a.1"].stage is LadderStage.TRANSITION
    assert new.owner("n2") is None and new.plan_generation == 1
    assert plan_transition(snap, plan({"a": 2, "b": 4}), render, T0 + 1) == d, "deterministic"


def test_growing_into_a_free_node_uses_expansion_then_requeue_once_resized() -> None:
    snap = world(4, [task("a", 1, ["n1"]), task("b", 2, ["n3", "n4"])])
    d = plan_transition(snap, plan({"a": 4, "b": 4}), render, T0)
    assert [a.add for a in of_kind(d.actions, Grow)] == [("n2",)]  # type: ignore[union-attr]
    assert sends(d, AgentAction.RELAUNCH) == ["n1"]
    launches = of_kind(d.actions, LaunchAgents)
    assert [la.nodes for la in launches] == [("n2",)]  # type: ignore[union-attr]
    assert_phase_order(d)
    resized = replace(snap.tasks["a"], resizes_this_run=1)
    d = plan_transition(replace(snap, tasks={**snap.tasks, "a": resized}), plan({"a": 4, "b": 4}), render, T0)
    assert [r.nodes for r in of_kind(d.actions, Requeue)] == [("n1", "n2")]  # type: ignore[union-attr]
    assert not of_kind(d.actions, Grow) and not sends(d, AgentAction.RELAUNCH)
    assert not of_kind(d.actions, LaunchAgents), "agents start once the requeued job runs"
    after, launches = requeued_and_running(snap, d, T0)
    assert [la.nodes for la in launches] == [("n1", "n2")]  # type: ignore[union-attr]
    assert after.tasks["a"].requeue is None


def test_a_job_holding_gpus_grows_by_requeue_at_once() -> None:
    """Slurm refuses to expand a job holding GRES: no Grow is tried, the job is requeued
    onto all its planned nodes even with resizes to spare."""
    snap = world(4, [task("a", 1, ["n1"], job_gres="gres/gpu:4"), task("b", 2, ["n3", "n4"])])
    d = plan_transition(snap, plan({"a": 4, "b": 4}), render, T0)
    assert not of_kind(d.actions, Grow) and not sends(d, AgentAction.RELAUNCH)
    assert [r.nodes for r in of_kind(d.actions, Requeue)] == [("n1", "n2")]  # type: ignore[union-attr]
    assert mentions(d, "b", 2) == []
    # Shrinking the same job needs no requeue: only adding nodes is refused.
    d = plan_transition(snap, plan({"a": 0, "b": 8}), render, T0)
    assert [g.add for g in of_kind(d.actions, Grow)] == [("n1", "n2")]  # type: ignore[union-attr]
    snap = world(4, [task("a", 1, ["n1", "n2"], job_gres="gres/gpu:4"), task("b", 2, ["n3", "n4"])])
    d = plan_transition(snap, plan({"a": 2, "b": 4}), render, T0)
    assert [s.nodes for s in of_kind(d.actions, Shrink)] == [("n1",)]  # type: ignore[union-attr]
    assert not of_kind(d.actions, Requeue)


def test_a_task_whose_job_is_being_requeued_is_requeued_again_not_resized() -> None:
    """Its job is pending on its way back: a plan that drops one of its nodes sets the
    pending job's nodes anew (a shrink of a pending job fails: it holds no nodes)."""
    wait = RequeueWait("plan-3/a/requeue", deadline_s=T0 + 120, done_s=T0)
    snap = world(4, [task("a", 1, ["n1", "n2"], requeue=wait), task("b", 2, ["n3", "n4"])])
    d = plan_transition(snap, plan({"a": 2, "b": 4}), render, T0 + 1)
    assert not of_kind(d.actions, Shrink)
    assert [r.nodes for r in of_kind(d.actions, Requeue)] == [("n1",)]  # type: ignore[union-attr]


def test_moving_a_task_off_and_onto_nodes_at_once_requeues() -> None:
    snap = after_node_loss()
    snap = apply(snap, on_node_join(snap, "n2", T0))  # irrelevant returning node stays out of plans
    d = plan_transition(snap, plan({"a": 4, "b": 4}), render, T0 + 1)
    assert [r.nodes for r in of_kind(d.actions, Requeue)] == [("n1", "n5")]  # type: ignore[union-attr]
    assert sends(d, AgentAction.CHECKPOINT_NOW) == ["n1"]
    assert apply(snap, d).tasks["a"].resizes_this_run == 0


def test_a_task_that_lost_every_node_is_requeued_onto_new_ones() -> None:
    snap = world(8, [task("a", 1, ["n1"]), task("b", 2, ["n3", "n4"])])
    snap = apply(snap, on_finding(snap, finding("f", 1, "n1", ErrorStatus.LOST_CONNECTION), T0))
    d = plan_transition(snap, plan({"a": 2, "b": 4}), render, T0 + 1)
    assert sends(d, AgentAction.CHECKPOINT_NOW) == [], "no healthy rank left to checkpoint"
    assert [r.nodes for r in of_kind(d.actions, Requeue)] == [("n2",)]  # type: ignore[union-attr]


def test_a_task_given_nothing_is_stopped_and_held_pending() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"])])
    d = plan_transition(snap, plan({"a": 0, "b": 8}), render, T0)
    assert sorted(sends(d, AgentAction.STOP)) == ["n1", "n2"]
    assert [r.nodes for r in of_kind(d.actions, Requeue)] == [()]  # type: ignore[union-attr]
    assert [g.add for g in of_kind(d.actions, Grow)] == [("n1", "n2")]  # type: ignore[union-attr]
    assert_phase_order(d)
    new = apply(snap, d)
    assert new.tasks["a"].state is TaskState.PENDING and new.tasks["a"].nodes == ()
    assert (owner := new.owner("n1")) is not None and owner.task_id == "b"


def test_a_pending_task_is_started_on_its_nodes() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("c", 3, [], state=TaskState.PENDING)])
    d = plan_transition(snap, plan({"a": 4, "c": 4}), render, T0)
    assert [type(a) for a in d.actions] == [Requeue]
    assert of_kind(d.actions, Requeue)[0].nodes == ("n3", "n4")  # type: ignore[union-attr]
    assert apply(snap, d).tasks["c"].state is TaskState.LAUNCHING
    assert apply(snap, d).tasks["c"].requeue is not None
    _, launches = requeued_and_running(snap, d, T0)
    assert [la.action_id for la in launches] == ["plan-1/c/requeue/launch"]


def test_an_unchanged_plan_changes_nothing() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"])])
    d = plan_transition(snap, plan({"a": 4, "b": 4}), render, T0)
    assert d.actions == () and d.tasks == () and d.plan_generation == 1


def test_returning_and_held_nodes_are_never_planned() -> None:
    snap = after_node_loss()
    snap = apply(snap, on_node_join(snap, "n2", T0 + 5))
    assert snap.nodes["n2"].health is NodeHealth.RETURNING
    d = plan_transition(snap, plan({"a": 2, "b": 12}), render, T0 + 6)
    used = {n for a in of_kind(d.actions, Grow) for n in a.add}  # type: ignore[union-attr]
    assert "n2" not in used and len(used) == 4
    snap = apply(snap, on_node_check(snap, "n2", True, T0 + 7))
    assert snap.nodes["n2"].health is NodeHealth.HEALTHY


@pytest.mark.parametrize(
    ("gpus", "match"),
    [
        ({"a": 2}, r"missing \['b'\]"),
        ({"a": 2, "b": 4, "zz": 2}, r"unknown \['zz'\]"),
        ({"a": 4, "b": 12}, "only 7 are healthy"),
    ],
)
def test_plans_that_do_not_fit_the_snapshot_are_refused(gpus: dict[str, int], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        plan_transition(after_node_loss(), plan(gpus), render, T0)


def test_render_must_cover_exactly_the_planned_nodes() -> None:
    def partial(t: TaskRecord, layout: Layout, nodes: tuple[str, ...]) -> dict[str, list[str]]:
        return {nodes[0]: ["x"]}

    snap = world(4, [task("a", 1, ["n1"]), task("b", 2, ["n3"])])
    with pytest.raises(InvalidArgument, match="render gave argv"):
        plan_transition(snap, plan({"a": 4, "b": 2}), partial, T0)


def test_a_task_without_a_job_cannot_get_gpus() -> None:
    snap = world(4, [replace(task("c", 3, [], state=TaskState.PENDING), job_id=None)])
    with pytest.raises(InvalidArgument, match="no Slurm job"):
        plan_transition(snap, plan({"c": 2}), render, T0)


def test_real_planner_and_real_render_fit_together() -> None:
    """The planner's plan for real GPT-3 tasks turns into torchrun commands via launcher.render."""
    gpus_per_node = 8
    specs = [load_task_file(etc_dir() / "tasks" / f) for f in ("gpt3-1.3b.toml", "gpt3-7b.toml")]
    records = [
        TaskRecord(
            s.name, s.name, s.model, ("unicorn-train",), s.weight, s.min_gpus, s.max_gpus, job_id=i + 1
        )
        for i, s in enumerate(specs)
    ]
    nodes = [NodeRecord(f"g{i}") for i in range(1, 7)]
    snap = replace(world(0, records), gpus_per_node=gpus_per_node).apply(nodes=nodes)
    cluster = Cluster(len(nodes), gpus_per_node, gpu_spec("a100-80g"), Granularity.NODE)
    new_plan = plan_cluster(task_curves([r.spec() for r in records], cluster, cluster.workers), cluster)

    def real_render(t: TaskRecord, layout: Layout, on: tuple[str, ...]) -> dict[str, list[str]]:
        argvs = torchrun_argvs(
            layout, nodes=on, gpus_per_node=gpus_per_node, rendezvous=Rendezvous(on[0], 29500)
        )
        return {n: [*argv, "pretrain_gpt.py", *megatron_args(layout, t.model)] for n, argv in argvs.items()}

    d = plan_transition(snap, new_plan, real_render, T0)
    new, relaunched = requeued_and_running(snap, d, T0, real_render)
    for a in new_plan.assignments:
        rec = new.tasks[a.task]
        assert len(rec.nodes) * gpus_per_node == a.gpus
        assert (rec.layout is None) == (a.estimate is None)
        if a.estimate is not None:
            assert rec.layout == a.estimate.layout and rec.state is TaskState.LAUNCHING
    launched = [*of_kind(d.actions, LaunchAgents), *relaunched]
    assert sum(len(la.nodes) for la in launched) == sum(  # type: ignore[union-attr]
        len(t.nodes) for t in new.tasks.values()
    )
