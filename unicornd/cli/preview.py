"""What unicornd would do, computed and not applied: outlooks, ``plan --what-if-fail``.

An :class:`Outlook` follows one pure decision of :mod:`unicornd.decide` through the replan
it asks for, on a snapshot, and applies nothing: the preview of ``drain``/``resume``/
``incidents confirm`` without ``--yes``, and ``unicornctl plan --what-if-fail NODE``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import click

from detect.isolation import Confirmation
from detect.statuses import ErrorStatus, Severity
from plan.cli import plan as plan_group
from plan.planner import Plan
from unicorn_core.config import Config
from unicorn_core.errors import InvalidArgument, UnicornError
from unicorn_core.slurm.hostlist import compress
from unicornd.actions import Decision, Replan, action_to_dict
from unicornd.cli.common import UnknownTargetError, config_of, snapshot_of
from unicornd.cli.explain import explain_command
from unicornd.decide import LIVE_TASK_STATES, Finding, on_finding
from unicornd.replan import PlanContext, replan_decision
from unicornd.state import NodeHealth, Snapshot


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What unicornd would do with one input, computed and not applied.

    ``decision``: its pure decision on the snapshot. ``plan``/``transition``: the plan and
    the actions of the replan that decision asks for (None: it asks for none, or there is
    no task to plan). ``after``: the snapshot the replan would see.
    """

    decision: Decision
    after: Snapshot
    plan: Plan | None = None
    transition: Decision | None = None


def outlook(snap: Snapshot, decision: Decision, cfg: Config, now_s: float) -> Outlook:
    """Follow ``decision`` through the replan it asks for: the same pure
    :func:`unicornd.replan.replan_decision`, on the same snapshot and with the same
    configuration, that :func:`unicornd.decide.resolve` runs inside unicornd."""
    after = decision.applied_to(snap)
    if not any(isinstance(a, Replan) for a in decision.actions):
        return Outlook(decision, after)
    plan, transition = replan_decision(after, PlanContext.from_config(cfg), now_s)
    if plan is None:
        return Outlook(decision, after)
    return Outlook(decision, after, plan, transition)


def what_if_fail(snap: Snapshot, node: str, cfg: Config, now_s: float) -> Outlook:
    """What unicornd would do if ``node`` failed now: a confirmed SEV1 lost connection on it
    (what a dead node gives once SSH or Slurm confirms it), decided by
    :func:`unicornd.decide.on_finding`, then its replan. Raises InvalidArgument for a node
    unicornd does not know."""
    if node not in snap.nodes:
        raise InvalidArgument(
            f"unknown node {node!r}; unicornd knows: {compress(sorted(snap.nodes)) or 'none'}"
        )
    users = sorted(
        (t for t in snap.tasks.values() if node in t.nodes and t.state in LIVE_TASK_STATES),
        key=lambda t: t.task_id,
    )
    finding = Finding(
        finding_id=f"what-if/{node}",
        job_id=users[0].job_id if users else None,
        node=node,
        rank=None,
        status=ErrorStatus.LOST_CONNECTION,
        severity=Severity.SEV1,
        rule="what_if",
        evidence=f"unicornctl plan --what-if-fail {node}",
        confirmed_by=Confirmation.SSH,
    )
    return outlook(snap, on_finding(snap, finding, now_s), cfg, now_s)


def outlook_json(o: Outlook) -> dict[str, Any]:
    """``--json`` of an outlook: the decision, then (when a replan follows) the plan per task
    (GPUs, layout, nodes before and after) and the transition's actions in order."""
    doc: dict[str, Any] = {
        "decision": {
            "actions": [action_to_dict(a) for a in o.decision.actions],
            "notes": list(o.decision.notes),
        },
        "replan": o.plan is not None,
    }
    if o.plan is None or o.transition is None:
        return doc
    moved = {t.task_id: t for t in o.transition.tasks}
    by_name = {a.task: a for a in o.plan.assignments}
    tasks = []
    for t in sorted(o.after.tasks.values(), key=lambda t: t.task_id):
        a = by_name.get(t.name)
        if a is None:
            continue
        new = moved.get(t.task_id, t)
        tasks.append(
            {
                "task_id": t.task_id,
                "gpus": a.gpus,
                "previous_gpus": t.layout.world_size if t.layout else 0,
                "layout": new.layout.describe() if new.layout else None,
                "nodes": list(new.nodes),
                "previous_nodes": list(t.nodes),
                "changed": t.task_id in moved,
                "waf_tflops": round(a.waf_tflops, 2),
            }
        )
    healthy = sum(1 for n in o.after.nodes.values() if n.health is NodeHealth.HEALTHY and not n.held)
    doc["plan"] = {
        "generation": o.transition.plan_generation,
        "healthy_nodes": healthy,
        "total_waf_tflops": round(o.plan.total_waf_tflops, 2),
        "tasks": tasks,
    }
    doc["actions"] = [action_to_dict(a) for a in o.transition.actions]
    doc["notes"] = list(o.transition.notes)
    return doc


_ACTION_FIELDS = ("action", "node", "job_id", "nodes", "add", "reason", "why")


def _action_text(doc: dict[str, Any]) -> str:
    parts = [doc["kind"]]
    for key in _ACTION_FIELDS:
        value = doc.get(key)
        if value in (None, "", [], ()):
            continue
        shown = compress(value) if key in ("nodes", "add") else value
        parts.append(f"{key}={shown!r}" if key in ("reason", "why") else f"{key}={shown}")
    return " ".join(parts)


def render_outlook(o: Outlook, title: str) -> str:
    """The human view of :func:`outlook_json`."""
    doc = outlook_json(o)
    lines = [title]
    lines += [f"  decides: {_action_text(a)}" for a in doc["decision"]["actions"]]
    lines += [f"  note: {n}" for n in doc["decision"]["notes"]]
    plan = doc.get("plan")
    if plan is None:
        lines.append("  no replan follows")
        return "\n".join(lines)
    lines.append(
        f"  then plans generation {plan['generation']} on {plan['healthy_nodes']} healthy nodes "
        f"(total WAF {plan['total_waf_tflops']:.1f} TFLOP/s):"
    )
    for t in plan["tasks"]:
        was = (
            f"  (was {t['previous_gpus']} GPUs on {compress(t['previous_nodes']) or '-'})"
            if t["changed"]
            else ""
        )
        lines.append(
            f"    {t['task_id']:<12} {t['gpus']:>4} GPUs  {t['layout'] or '-':<28} "
            f"nodes {compress(t['nodes']) or '-'}{was}"
        )
    lines += [f"  acts: {_action_text(a)}" for a in doc["actions"]] or ["  acts: nothing (no task changes)"]
    return "\n".join(lines)


def _what_if(ctx: click.Context, node: str, *, as_json: bool) -> None:
    snap = snapshot_of(ctx)
    cfg = config_of(ctx)
    try:
        seen = what_if_fail(snap, node, cfg, time.time())
    except InvalidArgument as e:
        raise UnknownTargetError(str(e)) from None
    except UnicornError as e:
        raise click.ClickException(f"cannot plan: {e}") from None
    if as_json:
        click.echo(json.dumps({"node": node, **outlook_json(seen)}, indent=2))
    else:
        click.echo(render_outlook(seen, f"if {node} failed now (SEV1 lost connection), unicornd:"))


def plan_command() -> click.Group:
    """:mod:`plan.cli`'s offline ``plan`` plus ``--what-if-fail NODE`` and ``--explain`` on
    unicornd's live snapshot (the planner library cannot read unicornd's state, so the options
    are added here)."""
    offline = plan_group.callback
    assert offline is not None
    what_if = click.Option(
        ["--what-if-fail", "what_if_fail"],
        metavar="NODE",
        default=None,
        help="Instead: the plan unicornd would apply if NODE failed now (live state; applies nothing). "
        "Exit 2 for an unknown node, 3 without unicornd state.",
    )
    explain = click.Option(
        ["--explain", "explain"],
        is_flag=True,
        default=False,
        help="Instead: for each task unicornd plans, the model's predicted iteration time, "
        "throughput and transition time (and the node MTBF) next to the measured ones and the "
        "values the planner uses (live state; applies nothing). Exit 1 for unreadable state, "
        "3 without unicornd state.",
    )

    @click.pass_context
    def callback(ctx: click.Context, /, what_if_fail: str | None, explain: bool, **options: Any) -> None:
        if what_if_fail is None and not explain:
            ctx.invoke(offline, **options)
            return
        given = [
            name
            for name in options
            if name != "as_json" and ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        ]
        if what_if_fail is not None and explain:
            given.append("explain")
        if given or ctx.invoked_subcommand is not None:
            extra = ", ".join(given) or ctx.invoked_subcommand
            option = "--what-if-fail" if what_if_fail is not None else "--explain"
            raise click.UsageError(f"{option} plans the live cluster; it takes only --json (got {extra})")
        if explain:
            explain_command(ctx, as_json=bool(options["as_json"]))
        else:
            assert what_if_fail is not None
            _what_if(ctx, what_if_fail, as_json=bool(options["as_json"]))

    return click.Group(
        name="plan",
        commands=plan_group.commands,
        callback=callback,
        params=[*plan_group.params, what_if, explain],
        invoke_without_command=True,
        help=plan_group.help,
        short_help=plan_group.short_help,
    )
