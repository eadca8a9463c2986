"""From a decision's requests to what is committed: the one place a replan happens.

Decision functions ask for three things they cannot compute alone: a cluster-wide replan
(:class:`~unicornd.actions.Replan`), a new agent on a node (:class:`RestartAgent`,
whose argv depends on the task's layout and plan generation) and a roll back of its
ranks past bad data (:class:`RollBack`: the task's command rendered again with its
skipped ranges, sent as a ``relaunch``). :func:`resolve` replaces
both, purely, given the :class:`~unicornd.replan.PlanContext`: the replan by the
transition :func:`unicornd.replan.replan_decision` computes on the snapshot the decision
leaves (several requests in one decision make one replan), the restart by a
:class:`LaunchAgents` that first clears the gone agent's commands. It also clears
``finished_nodes`` of every task whose ranks the decision (re)starts, and counts the node
failures the decision records into the planner's calibration (:func:`unicornd.calibrate.counted`).

unicornd commits only resolved decisions, and ``unicornctl plan`` previews through the
same function, so a preview shows exactly what unicornd would do.
"""

from __future__ import annotations

from dataclasses import replace

from plan.planner import Plan
from unicorn_core.protocol import AgentAction
from unicornd import calibrate
from unicornd.actions import (
    Action,
    Decision,
    LaunchAgents,
    NodeArgv,
    Replan,
    RestartAgent,
    RollBack,
    SendCommand,
)
from unicornd.replan import PlanContext, replan_decision
from unicornd.state import Snapshot


def resolve(snapshot: Snapshot, decision: Decision, ctx: PlanContext, now_s: float) -> Decision:
    """``decision`` with its requests replaced (see the module docstring)."""
    resolved, _ = resolve_with_plan(snapshot, decision, ctx, now_s)
    return resolved


def resolve_with_plan(
    snapshot: Snapshot, decision: Decision, ctx: PlanContext, now_s: float
) -> tuple[Decision, Plan | None]:
    """:func:`resolve`, and the plan its replan chose (None: no replan, or no task)."""
    after = decision.applied_to(snapshot)
    actions: list[Action] = []
    notes: list[str] = []
    reasons: list[str] = []
    for action in decision.actions:
        if isinstance(action, Replan):
            reasons.append(action.reason)
        elif isinstance(action, RestartAgent):
            launch = _new_agent(after, action, ctx)
            if launch is None:
                notes.append(f"{action.action_id}: task {action.task_id} no longer runs on {action.node}")
            else:
                actions.append(launch)
        elif isinstance(action, RollBack):
            relaunch = _rolled_back(after, action, ctx)
            if relaunch is None:
                notes.append(f"{action.action_id}: task {action.task_id} no longer runs on {action.node}")
            else:
                actions.append(relaunch)
        else:
            actions.append(action)
    out = replace(decision, actions=tuple(actions), notes=(*decision.notes, *notes))
    plan = None
    if reasons:  # ``after`` is also what ``out`` leaves: only actions and notes changed
        plan, transition = replan_decision(after, ctx, now_s)
        why = f"replan: {'; '.join(dict.fromkeys(reasons))}"
        out = out.then(replace(transition, notes=(why, *transition.notes)))
    return calibrate.counted(snapshot, _restarted(snapshot, out), now_s), plan


def _new_agent(snap: Snapshot, action: RestartAgent, ctx: PlanContext) -> LaunchAgents | None:
    task = snap.tasks.get(action.task_id)
    if task is None or task.layout is None or action.node not in task.nodes:
        return None
    render = ctx.render_for(snap.gpus_per_node_of(task), task.generation)
    argv = tuple(render(task, task.layout, task.nodes)[action.node])
    return LaunchAgents(
        action.action_id, task.task_id, action.job_id, (NodeArgv(action.node, argv),), clear_commands=True
    )


def _rolled_back(snap: Snapshot, action: RollBack, ctx: PlanContext) -> SendCommand | None:
    """The task's command for ``action.node`` at its current layout and generation, rendered
    with every range it skips (the task record the decision leaves carries the new one)."""
    task = snap.tasks.get(action.task_id)
    if task is None or task.layout is None or action.node not in task.nodes:
        return None
    render = ctx.render_for(snap.gpus_per_node_of(task), task.generation)
    argv = tuple(render(task, task.layout, task.nodes)[action.node])
    return SendCommand(
        action_id=action.action_id,
        job_id=action.job_id,
        node=action.node,
        action=AgentAction.RELAUNCH,
        deadline_s=snap.policy.command_deadline_s,
        argv=argv,
    )


def _restarted(snapshot: Snapshot, decision: Decision) -> Decision:
    """Clear ``finished_nodes`` of the tasks whose ranks ``decision`` (re)starts (each task
    as ``decision`` leaves it: its own record, else the snapshot's)."""
    jobs: set[int] = set()
    for a in decision.actions:
        if isinstance(a, LaunchAgents) or (
            isinstance(a, SendCommand) and a.action in (AgentAction.RESTART_RANKS, AgentAction.RELAUNCH)
        ):
            jobs.add(a.job_id)
    if not jobs:
        return decision
    latest = {**snapshot.tasks, **{t.task_id: t for t in decision.tasks}}
    tasks = [replace(t, finished_nodes=()) for t in latest.values() if t.job_id in jobs and t.finished_nodes]
    return decision.then(Decision(tasks=tuple(tasks))) if tasks else decision
