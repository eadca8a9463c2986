"""Heterogeneous clusters: nodes of two GPU types are planned as two pools, and no task ever
runs on both types (issue 24 item 2)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plan.hardware import gpu_spec
from plan.objective import FailureModel
from tests.unicornd.coord_world import apply, render, task, world
from unicorn_core.errors import InvalidArgument
from unicornd.actions import Decision, LaunchAgents, Requeue, SendCommand, Shrink
from unicornd.decide import on_node_gpus, on_node_join
from unicornd.replan import PlanContext, gpu_type_specs, pool_snapshot, pools, replan_decision
from unicornd.state import NodeHealth, Snapshot, TaskRecord, TaskState

T0 = 1_700_000_000.0
CTX = PlanContext(gpu_spec("a100-80g"), FailureModel(24.0), lambda _gpn, _gen: render)


def typed(snap: Snapshot, kinds: dict[str, tuple[str, int]]) -> Snapshot:
    """``snap`` with each named node's (GPU type, GPUs) set as Slurm's GRES would say."""
    nodes = {n: replace(r, gpu_type=kinds[n][0], gpus=kinds[n][1]) for n, r in snap.nodes.items()}
    return replace(snap, nodes=nodes)


A100 = ("a100", 2)
H100 = ("h100", 2)


def mixed(tasks: list[TaskRecord]) -> Snapshot:
    """n1-n4 hold two A100s each, n5-n8 two H100s."""
    return typed(world(8, tasks), {f"n{i}": A100 if i <= 4 else H100 for i in range(1, 9)})


def nodes_after(snap: Snapshot, d: Decision) -> dict[str, tuple[str, ...]]:
    after = apply(snap, d)
    return {tid: t.nodes for tid, t in after.tasks.items()}


def kinds_of(snap: Snapshot, nodes: tuple[str, ...]) -> set[str]:
    return {snap.nodes[n].gpu_type for n in nodes}


def test_one_kind_of_node_is_one_pool_of_everything() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, [], state=TaskState.PENDING)])
    (pool,) = pools(snap)
    assert pool.nodes == ("n1", "n2", "n3", "n4") and pool.tasks == ("a", "b") and pool.placeable


def test_tasks_stay_on_their_type_and_new_ones_take_an_accepted_one() -> None:
    snap = mixed(
        [
            task("a", 1, ["n1", "n2"]),
            task("b", 2, [], state=TaskState.PENDING, gpu_types=("h100",)),
            task("c", 3, [], state=TaskState.PENDING, gpu_types=("a100",)),
            task("v", 4, [], state=TaskState.PENDING, gpu_types=("v100",)),
        ]
    )
    by_type = {p.gpu_type if p.placeable else "none": p.tasks for p in pools(snap)}
    assert by_type == {"a100": ("a", "c"), "h100": ("b",), "none": ("v",)}
    _, d = replan_decision(snap, CTX, T0)
    moved = nodes_after(snap, d)
    for tid in ("a", "b", "c"):
        assert moved[tid] and len(kinds_of(snap, moved[tid])) == 1, (tid, moved[tid])
    assert kinds_of(snap, moved["a"]) == kinds_of(snap, moved["c"]) == {"a100"}
    assert kinds_of(snap, moved["b"]) == {"h100"}
    assert moved["v"] == ()  # accepts no type the cluster has: no GPUs
    assert "n1" in moved["a"] and "n2" in moved["a"]
    assert any("pool" in n and "v100" not in n for n in d.notes)


def test_a_node_loss_never_brings_in_a_node_of_the_other_type() -> None:
    """a loses n2: it is planned on the A100s left (shrunk or given n3/n4), never on the idle
    H100s, however many there are."""
    snap = mixed([task("a", 1, ["n1", "n2"]), task("b", 2, ["n5", "n6"])])
    lost = replace(snap.nodes["n2"], health=NodeHealth.DRAINED)
    snap = replace(snap, nodes={**snap.nodes, "n2": lost})
    _, d = replan_decision(snap, CTX, T0)
    moved = nodes_after(snap, d)
    assert "n2" not in moved["a"] and kinds_of(snap, moved["a"]) == {"a100"}
    assert kinds_of(snap, moved["b"]) == {"h100"}
    touched = {a.node for a in d.actions if isinstance(a, SendCommand)}
    touched |= {n for a in d.actions if isinstance(a, LaunchAgents) for n in a.nodes}
    touched |= {n for a in d.actions if isinstance(a, (Shrink, Requeue)) for n in a.nodes}
    assert all(snap.nodes[n].gpu_type == "a100" for n in touched if n in moved["a"])


def test_a_task_across_two_types_is_brought_back_to_one() -> None:
    """A job Slurm placed on both types (before unicorn managed it) keeps the type most of
    its nodes are and leaves the other's."""
    snap = mixed([task("a", 1, ["n1", "n2", "n5"])])
    (pool,) = [p for p in pools(snap) if p.tasks]
    assert pool.gpu_type == "a100"
    sub = pool_snapshot(snap, pool)
    assert sub.nodes["n5"].held and not sub.nodes["n1"].held and sub.gpus_per_node == 2
    _, d = replan_decision(snap, CTX, T0)
    assert kinds_of(snap, nodes_after(snap, d)["a"]) == {"a100"}


def test_the_pool_picks_the_performance_model_of_its_type() -> None:
    assert CTX.gpu_for("h100").name == gpu_spec("h100-80g").name  # the only h100-* entry
    assert CTX.gpu_for("").name == CTX.gpu.name  # untyped GRES: [plan] gpu
    assert CTX.gpu_for("mystery").name == CTX.gpu.name
    ctx = replace(CTX, gpu_types=gpu_type_specs("a100=a100-40g, h100=h200-141g"))
    assert ctx.gpu_for("a100").name == gpu_spec("a100-40g").name
    assert ctx.gpu_for("h100").name == gpu_spec("h200-141g").name
    for bad in ("h100", "h100=", "h100=nonsense-1g"):
        with pytest.raises(InvalidArgument):
            gpu_type_specs(bad)


def test_a_task_accepting_a_type_the_cluster_lacks_gets_nothing_on_a_one_kind_cluster() -> None:
    """One kind of node (all A100): a task that accepts only H100s is not planned onto them."""
    snap = typed(
        world(4, [task("a", 1, ["n1"]), task("h", 2, [], state=TaskState.PENDING, gpu_types=("h100",))]),
        {f"n{i}": A100 for i in range(1, 5)},
    )
    groups = pools(snap)
    assert [(p.placeable, p.tasks) for p in groups] == [(True, ("a",)), (False, ("h",))]
    _, d = replan_decision(snap, CTX, T0)
    moved = nodes_after(snap, d)
    assert moved["h"] == () and moved["a"]


def test_a_node_joining_or_retyped_records_its_gpus_and_replans() -> None:
    snap = mixed([task("a", 1, ["n1", "n2"])])
    snap = replace(snap, nodes={n: r for n, r in snap.nodes.items() if n != "n8"})
    joined = apply(snap, on_node_join(snap, "n8", T0, gpus=(2, "h100")))  # (count, type)
    assert (joined.nodes["n8"].gpu_type, joined.nodes["n8"].gpus) == H100
    facts = {n: (r.gpus, r.gpu_type) for n, r in joined.nodes.items()}
    assert on_node_gpus(joined, facts, T0) == Decision()  # nothing changed: nothing decided
    d = on_node_gpus(joined, {**facts, "n4": (2, "h100")}, T0)
    assert [(r.name, r.gpu_type) for r in d.nodes] == [("n4", "h100")]
    assert [type(a).__name__ for a in d.actions] == ["Replan"]
