"""Builders for the coordinator's decision tests: a small cluster, tasks, findings, plans."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from detect.isolation import CONFIRMED_BY, Confirmation
from detect.statuses import ErrorStatus, Severity, default_severity
from plan.memory import MemoryEstimate
from plan.perf import LayoutEstimate
from plan.planner import Assignment, Plan
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
from unicornd.actions import Action, Decision, LaunchAgents, Outcome, OutcomeStatus, Requeue
from unicornd.decide import Finding, on_job_running, on_outcome
from unicornd.launch import Render
from unicornd.state import NodeRecord, Policy, Snapshot, TaskRecord, TaskState

GPN = 2
"""GPUs per node of the test cluster."""

MODEL = ModelSpec(layers=4, hidden=256, heads=4, sequence=128, vocabulary=1000, global_batch=240)


def layout_for(nodes: int) -> Layout:
    return Layout(tp=1, pp=1, dp=nodes * GPN, micro_batch=1, global_batch=240)


def task(
    task_id: str, job_id: int, nodes: Sequence[str], *, state: TaskState = TaskState.RUNNING, **kw: object
) -> TaskRecord:
    fields: dict[str, object] = {
        "task_id": task_id,
        "name": task_id,
        "model": MODEL,
        "command": ("unicorn-train", "--iterations", "100"),
        "job_id": job_id,
        "state": state,
        "layout": layout_for(len(nodes)) if nodes else None,
        "nodes": tuple(nodes),
        "last_iteration": 10,
    }
    fields.update(kw)
    return TaskRecord(**fields)  # type: ignore[arg-type]


def world(
    n_nodes: int, tasks: Iterable[TaskRecord], policy: Policy | None = None, *, first: int = 1
) -> Snapshot:
    """``n_nodes`` healthy nodes n<first>..; the tasks on the nodes they name."""
    tasks = tuple(tasks)
    nodes = {f"n{i}": NodeRecord(f"n{i}") for i in range(first, first + n_nodes)}
    return Snapshot(
        tasks={t.task_id: t for t in tasks},
        nodes=nodes,
        gpus_per_node=GPN,
        policy=policy or Policy(),
    )


def finding(
    finding_id: str,
    job_id: int | None,
    node: str,
    status: ErrorStatus,
    *,
    rank: int | None = 0,
    rank_died: bool = False,
    secondary: bool = False,
    severity: Severity | None = None,
    confirmed_by: str | None = None,
) -> Finding:
    """A finding; ``confirmed_by`` None: confirmed as the real source would for its status
    (``ssh`` for a lost node, ``nvml`` for GPU faults, ``node_check`` otherwise; nothing
    for statuses that never isolate), so ladder tests exercise the ladder. Pass "" for the
    training's own, unconfirmed output."""
    sev = severity or default_severity(status)
    assert sev is not None
    if confirmed_by is None:
        confirmed_by = typical_confirmation(status)
    return Finding(
        finding_id=finding_id,
        job_id=job_id,
        node=node,
        rank=rank,
        status=status,
        severity=sev,
        rule=f"rule-{status.value}",
        evidence=f"evidence for {status.value}",
        rank_died=rank_died,
        secondary=secondary,
        confirmed_by=confirmed_by,
    )


def typical_confirmation(status: ErrorStatus) -> str:
    """What confirms a node fault of ``status`` in practice ("" when nothing can)."""
    options = CONFIRMED_BY.get(status, frozenset())
    for source in (Confirmation.SSH, Confirmation.NVML, Confirmation.NODE_CHECK):
        if source in options:
            return source.value
    return ""


def apply(snapshot: Snapshot, decision: Decision) -> Snapshot:
    return decision.applied_to(snapshot)


def of_kind(actions: Iterable[Action], kind: type[Action]) -> list[Action]:
    return [a for a in actions if isinstance(a, kind)]


def plan(gpus_by_task: Mapping[str, int]) -> Plan:
    """A plan giving each task ``gpus`` GPUs at a pure data-parallel layout."""
    assignments = []
    for name, gpus in gpus_by_task.items():
        estimate = None
        if gpus:
            memory = MemoryEstimate(1.0, 1.0, 2.0)
            estimate = LayoutEstimate(layout_for(gpus // GPN), 1.0, 10.0, 10.0 / gpus, 0.5, memory, True)
        assignments.append(
            Assignment(name, gpus // GPN, gpus, estimate, 10.0 if gpus else 0.0, 10.0, 0, True)
        )
    workers = sum(a.workers for a in assignments)
    return Plan(tuple(assignments), workers, 0, GPN, 10.0 * len(assignments), 1.0)


def render(task: TaskRecord, layout: Layout, nodes: tuple[str, ...]) -> dict[str, list[str]]:
    """A stand-in for launcher.render: one argv per node, naming its rank and the layout."""
    return {
        node: ["torchrun", f"--nnodes={len(nodes)}", f"--node-rank={rank}", *task.command, layout.describe()]
        for rank, node in enumerate(nodes)
    }


def requeued_and_running(
    snapshot: Snapshot, decision: Decision, now_s: float, render_with: Render = render
) -> tuple[Snapshot, list[LaunchAgents]]:
    """Apply ``decision``; every requeue it owes is done and its job runs again: the snapshot
    after, and the agent launches that follow (what unicornd does across those outcomes)."""
    snap = apply(snapshot, decision)
    launches: list[LaunchAgents] = []
    for rq in [a for a in decision.actions if isinstance(a, Requeue) and a.nodes]:
        snap = apply(snap, on_outcome(snap, Outcome(rq.action_id, rq.kind, OutcomeStatus.DONE), now_s))
        d = on_job_running(snap, rq.job_id, now_s + 1, now_s + 1, lambda _gen: render_with)
        launches += [a for a in d.actions if isinstance(a, LaunchAgents)]
        snap = apply(snap, d)
    return snap, launches
