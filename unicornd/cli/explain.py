"""``unicornctl plan --explain``: the planner's inputs, predicted next to measured.

For every task unicornd plans: its iteration time and TFLOP/s per GPU at its current layout
(the analytic model's, the measured mean, and the calibrated value the planner uses), its
transition time (the fixed restart-plus-reload prior, the measured mean, the planned
value), and for the cluster the node MTBF (the configured prior, node-hours per failure
found, the planned value). Then the GPUs each task gets from the calibrated planner and
from the analytic one, so an operator sees what the calibration changed. Computed from
unicornd's snapshot by the same pure functions unicornd plans with; applies nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import click

from plan.planner import Plan
from unicorn_core.errors import UnicornError
from unicornd.calibrate import Compared, Explanation, explain
from unicornd.cli.common import config_of, snapshot_of
from unicornd.replan import PlanContext, plan_for, planned_tasks
from unicornd.state import PLAN_BASIS_REFRESH_S, Snapshot


def explanation(
    snap: Snapshot, ctx: PlanContext, now_s: float
) -> tuple[Explanation, Plan | None, Plan | None]:
    """The inputs of every planned task, the calibrated plan and the analytic one (the
    calibrated one also where ``[plan] calibrate = false`` has unicornd plan analytically)."""
    tasks = planned_tasks(snap)
    expl = explain(snap, tasks, gpu=ctx.gpu, assume=ctx.assume, prior=ctx.failure, plan=ctx.plan, now_s=now_s)
    measured = replace(ctx, plan=replace(ctx.plan, calibrate=True))
    return expl, plan_for(snap, measured, now_s), plan_for(snap, ctx, now_s, calibrated=False)


def _compared(c: Compared, digits: int = 4) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, digits)

    return {
        "predicted": r(c.predicted),
        "measured": r(c.measured),
        "observations": c.observations,
        "planned": r(c.planned),
    }


def _gpus(plan: Plan | None) -> dict[str, int]:
    return {} if plan is None else {a.task: a.gpus for a in plan.assignments}


def explanation_json(expl: Explanation, calibrated: Plan | None, analytic: Plan | None) -> dict[str, Any]:
    """``--json``: one document (``gpu``, ``node_mtbf_h``, ``tasks`` with ``iteration_s``,
    ``tflops_per_gpu`` and ``transition_s`` each as predicted/measured/observations/planned)."""
    planned, plain = _gpus(calibrated), _gpus(analytic)
    return {
        "gpu": expl.gpu,
        "node_mtbf_h": _compared(expl.node_mtbf_h, 2),
        "node_failures": expl.node_failures,
        "node_hours": round(expl.node_hours, 3),
        "tasks": [
            {
                "task_id": t.task_id,
                "name": t.name,
                "layout": t.layout,
                "gpus": t.gpus,
                "planned_gpus": planned.get(t.name),
                "analytic_gpus": plain.get(t.name),
                "iteration_s": _compared(t.iteration_s, 6),
                "tflops_per_gpu": _compared(t.tflops_per_gpu, 3),
                "transition_s": _compared(t.transition_s, 3),
            }
            for t in expl.tasks
        ],
    }


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _row(head: str, what: str, c: Compared) -> str:
    measured = _num(c.measured) + (f" ({c.observations})" if c.measured is not None else "")
    return f"{head:<44} {what:<15} {_num(c.predicted):>10} {measured:>16} {_num(c.planned):>10}"


def render_explanation(expl: Explanation, calibrated: Plan | None, analytic: Plan | None) -> str:
    """The human view of :func:`explanation_json`: one row per input, the columns
    PREDICTED (the model, the configured constants), MEASURED (mean, and how many reports,
    transitions or failures behind it) and PLANNED (what the planner uses)."""
    lines = [
        f"planner inputs on {expl.gpu}: predicted by the model, measured, planned with",
        f"{'TASK / LAYOUT / GPUS':<44} {'INPUT':<15} {'PREDICTED':>10} {'MEASURED (N)':>16} {'PLANNED':>10}",
    ]
    for t in expl.tasks:
        head = f"{t.task_id}  {t.layout or '-'}  {t.gpus} GPUs"
        lines.append(_row(head, "iteration_s", t.iteration_s))
        lines.append(_row("", "tflops_per_gpu", t.tflops_per_gpu))
        lines.append(_row("", "transition_s", t.transition_s))
    hours = f"cluster ({expl.node_failures} failures in {expl.node_hours:.1f} node-h)"
    lines.append(_row(hours, "node_mtbf_h", expl.node_mtbf_h))
    planned, plain = _gpus(calibrated), _gpus(analytic)
    if planned:
        shares = ", ".join(f"{name} {gpus} ({plain.get(name, 0)})" for name, gpus in planned.items())
        lines.append(f"plan GPUs, calibrated (analytic only): {shares}")
    else:
        lines.append("no task to plan")
    return "\n".join(lines)


def explain_command(ctx: click.Context, *, as_json: bool) -> None:
    """``plan --explain [--json]`` on unicornd's live snapshot (exit 1 unreadable, 3 no state)."""
    snap = snapshot_of(ctx)
    cfg = config_of(ctx)
    try:
        expl, calibrated, analytic = explanation(snap, PlanContext.from_config(cfg), time.time())
    except UnicornError as e:
        raise click.ClickException(f"cannot plan: {e}") from None
    basis = snap.plan_basis
    if as_json:
        doc = explanation_json(expl, calibrated, analytic)
        doc["unicornd_plans_with"] = _plans_with(cfg.plan.calibrate)
        doc["plan_basis_t_s"] = basis.t_s if basis is not None else None
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(render_explanation(expl, calibrated, analytic))
        click.echo(f"unicornd plans with the {_plans_with(cfg.plan.calibrate)} inputs ([plan] calibrate)")
        if basis is not None:
            age = max(0.0, time.time() - basis.t_s)
            click.echo(
                f"the plan uses the measurements as of {age:.0f} s ago (its plan basis, renewed "
                f"every {PLAN_BASIS_REFRESH_S:g} s while they move); the rows above are today's"
            )


def _plans_with(calibrate: bool) -> str:
    return "calibrated" if calibrate else "analytic"
