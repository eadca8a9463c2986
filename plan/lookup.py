"""One-step reaction table: the plan after any single node loss or one node joining.

Built ahead of time from the current plan, so the coordinator's reaction to a SEV1
failure is a dictionary look-up instead of a solve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plan.planner import Cluster, Plan, PlanRequest, TaskCurve, plan_cluster
from unicorn_core.errors import InvalidArgument


@dataclass(frozen=True)
class OneStepTable:
    """Plans for every one-step change from ``base``."""

    base: Plan
    node_lost: dict[str, Plan]  # task whose node failed -> new plan (that task restarts)
    spare_lost: Plan | None  # a spare node failed; None when the base plan has no spare node
    node_joined: Plan

    def after_node_lost(self, task: str | None) -> Plan:
        """The plan after one node of ``task`` (``None``: a spare node) is lost."""
        if task is None:
            if self.spare_lost is None:
                raise InvalidArgument("the base plan has no spare node to lose")
            return self.spare_lost
        try:
            return self.node_lost[task]
        except KeyError:
            raise InvalidArgument(
                f"task {task!r} holds no node in the base plan; "
                f"tasks with nodes: {', '.join(self.node_lost) or 'none'}"
            ) from None


def build_one_step_table(
    curves: Sequence[TaskCurve], cluster: Cluster, base: Plan, request: PlanRequest | None = None
) -> OneStepTable:
    """Solve every one-step change from ``base`` (curves must cover one node more than ``cluster``).

    ``request`` supplies the failure and transition models; its ``current`` and
    ``faulted`` are replaced by the base plan's allocation and the failing task.
    """
    if cluster.nodes < 1:
        raise InvalidArgument("a one-step table needs at least one node")
    request = request or PlanRequest()
    current = base.allocation
    per_node = cluster.gpus_per_node // cluster.worker_gpus
    smaller = cluster.with_nodes(cluster.nodes - 1)

    def after(target: Cluster, faulted: frozenset[str]) -> Plan:
        step = PlanRequest(current, faulted, request.failure, request.transition)
        return plan_cluster(curves, target, step)

    node_lost = {a.task: after(smaller, frozenset({a.task})) for a in base.assignments if a.workers > 0}
    spare_lost = after(smaller, frozenset()) if base.spare_workers >= per_node else None
    joined = after(cluster.with_nodes(cluster.nodes + 1), frozenset())
    return OneStepTable(base, node_lost, spare_lost, joined)


def tasks_hit(base: Plan, lost_nodes: int, gpus_per_node: int) -> frozenset[str]:
    """Which tasks lose a node when ``lost_nodes`` nodes fail, spare nodes first, then the largest tasks."""
    if lost_nodes < 0:
        raise InvalidArgument(f"lost node count must be >= 0, got {lost_nodes}")
    remaining = lost_nodes - base.spare_workers * base.worker_gpus // gpus_per_node
    hit: set[str] = set()
    nodes_left = {a.task: a.gpus // gpus_per_node for a in base.assignments}
    while remaining > 0:
        candidates = [t for t, n in nodes_left.items() if n > 0]
        if not candidates:
            break
        largest = max(candidates, key=lambda t: (nodes_left[t], t))
        nodes_left[largest] -= 1
        hit.add(largest)
        remaining -= 1
    return frozenset(hit)
