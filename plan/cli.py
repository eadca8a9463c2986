"""``unicornctl plan``: offline planning from task files (no cluster, no Redis).

``plan --tasks FILE [--tasks FILE ...] --nodes N --gpus-per-node G`` allocates the
cluster across the tasks. Each ``--tasks`` file is a single task or a task list
(``[[task]]`` tables, see ``unicorn_core.taskspec``); the option may be repeated and the
tasks of all files are planned together. ``--fail`` then applies one event to that plan:
an integer loses that many nodes (spare nodes first, then nodes of the largest tasks),
a task name loses one node of that task (answered from the one-step look-up table).

``plan estimate --model FILE --gpus N --gpu TYPE`` prints the best layout of one task.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from plan.baselines import Baseline, baseline_allocation
from plan.hardware import GpuSpec, gpu_spec
from plan.lookup import build_one_step_table, tasks_hit
from plan.objective import DEFAULT_NODE_MTBF_H, FailureModel
from plan.perf import Infeasible, LayoutEstimate, best_layout
from plan.planner import Cluster, Granularity, Plan, PlanRequest, plan_cluster, task_curves, waf_of
from unicorn_core.errors import UnicornError
from unicorn_core.layout import Layout
from unicorn_core.taskspec import TaskSpec, check_unique_names, load_task_file, load_tasks

DEFAULT_GPU = "a100-80g"

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]


def _layout_json(layout: Layout) -> dict[str, JsonValue]:
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "micro_batch": layout.micro_batch,
        "global_batch": layout.global_batch,
        "vpp": layout.vpp,
        "recompute": layout.recompute,
        "distributed_optimizer": layout.distributed_optimizer,
    }


def _estimate_json(est: LayoutEstimate) -> dict[str, JsonValue]:
    return {
        "layout": _layout_json(est.layout),
        "describe": est.layout.describe(),
        "iteration_s": round(est.iteration_s, 4),
        "tflops_per_gpu": round(est.tflops_per_gpu, 2),
        "mfu": round(est.mfu, 4),
        "mem_gib": round(est.memory.total_gib, 2),
    }


def _plan_json(plan: Plan) -> dict[str, JsonValue]:
    tasks: list[JsonValue] = []
    for a in plan.assignments:
        entry: dict[str, JsonValue] = {
            "name": a.task,
            "workers": a.workers,
            "gpus": a.gpus,
            "previous_gpus": a.previous_workers * plan.worker_gpus,
            "changed": a.changed,
            "tflops": round(a.tflops, 2),
            "waf_tflops": round(a.waf_tflops, 2),
        }
        entry["estimate"] = _estimate_json(a.estimate) if a.estimate is not None else None
        tasks.append(entry)
    return {
        "tasks": tasks,
        "total_waf_tflops": round(plan.total_waf_tflops, 2),
        "spare_gpus": plan.spare_workers * plan.worker_gpus,
        "objective_tflop": round(plan.objective_tflop, 1),
    }


def _plan_text(plan: Plan, title: str, show_changes: bool) -> list[str]:
    lines = [title]
    for a in plan.assignments:
        layout = a.estimate.layout.describe() if a.estimate else "-"
        iteration = f"{a.estimate.iteration_s:8.2f} s" if a.estimate else "       - "
        prev = a.previous_workers * plan.worker_gpus
        change = (
            f"  (was {prev} GPUs{', restarted' if a.changed and prev == a.gpus else ''})"
            if a.changed and show_changes
            else ""
        )
        lines.append(
            f"  {a.task:24s} {a.gpus:5d} GPUs  {layout:36s} {iteration}"
            f"  WAF {a.waf_tflops:9.1f} TFLOP/s{change}"
        )
    lines.append(
        f"  total WAF {plan.total_waf_tflops:.1f} TFLOP/s; spare GPUs {plan.spare_workers * plan.worker_gpus}"
    )
    return lines


def _gpu(name: str) -> GpuSpec:
    try:
        return gpu_spec(name)
    except UnicornError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpu") from exc


@dataclass(frozen=True)
class _Event:
    lost_nodes: int
    task: str | None  # the named task, when --fail names one


def _parse_fail(value: str, tasks: Sequence[TaskSpec]) -> _Event:
    if value.isdigit():
        return _Event(int(value), None)
    names = [t.name for t in tasks]
    if value not in names:
        raise click.BadParameter(
            f"{value!r} is neither a node count nor a task ({', '.join(names)})", param_hint="--fail"
        )
    return _Event(1, value)


@click.group("plan", invoke_without_command=True)
@click.option(
    "--tasks",
    "task_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Task file or task list ([[task]] tables); repeat for more.",
)
@click.option("--nodes", type=click.IntRange(min=1), help="Nodes in the cluster.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--gpu", "gpu_name", default=DEFAULT_GPU, show_default=True, help="GPU type (see etc/gpus.toml)."
)
@click.option(
    "--granularity",
    type=click.Choice([g.value for g in Granularity]),
    default=Granularity.NODE.value,
    show_default=True,
    help="Unit of allocation.",
)
@click.option(
    "--fail", "fail", default=None, metavar="NODE_COUNT_OR_TASK", help="Apply a failure to the plan."
)
@click.option(
    "--node-mtbf-h",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_NODE_MTBF_H,
    show_default=True,
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def plan(
    ctx: click.Context,
    *,
    task_files: tuple[Path, ...],
    nodes: int | None,
    gpus_per_node: int,
    gpu_name: str,
    granularity: str,
    fail: str | None,
    node_mtbf_h: float,
    as_json: bool,
) -> None:
    """Allocate workers across tasks to maximise weighted achieved FLOP/s (Unicron Eq. 2-4)."""
    if ctx.invoked_subcommand is not None:
        return
    if not task_files or nodes is None:
        raise click.UsageError("--tasks and --nodes are required (or run a subcommand: estimate)")
    gpu = _gpu(gpu_name)
    try:
        tasks = tuple(t for path in task_files for t in load_tasks(path))
        check_unique_names(tasks, "--tasks")
    except UnicornError as exc:
        raise click.ClickException(str(exc)) from exc
    event = _parse_fail(fail, tasks) if fail is not None else None
    if event is not None and event.lost_nodes >= nodes:
        raise click.BadParameter(f"cannot lose {event.lost_nodes} of {nodes} nodes", param_hint="--fail")

    cluster = Cluster(nodes, gpus_per_node, gpu, Granularity(granularity))
    per_node = gpus_per_node // cluster.worker_gpus
    request = PlanRequest(failure=FailureModel(node_mtbf_h))
    curves = task_curves(tasks, cluster, cluster.workers + per_node)
    base = plan_cluster(curves, cluster, request)
    wafs = [c.waf[: cluster.workers + 1] for c in curves]
    baselines = {
        b.value: waf_of(curves, baseline_allocation(tasks, wafs, cluster.workers, b)) for b in Baseline
    }

    out: dict[str, JsonValue] = {
        "gpu": gpu.name,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "granularity": granularity,
        "plan": _plan_json(base),
        "baselines_waf_tflops": {k: round(v, 2) for k, v in baselines.items()},
    }
    lines = _plan_text(
        base, f"plan for {nodes} x {gpus_per_node} {gpu.name} ({granularity} granularity):", False
    )
    lines.append("  baselines: " + ", ".join(f"{k} {v:.1f}" for k, v in baselines.items()) + " TFLOP/s")

    if event is not None:
        if event.task is not None:
            after = build_one_step_table(curves, cluster, base, request).after_node_lost(event.task)
            hit = frozenset({event.task})
        else:
            hit = tasks_hit(base, event.lost_nodes, gpus_per_node)
            step = PlanRequest(base.allocation, hit, request.failure, request.transition)
            after = plan_cluster(curves, cluster.with_nodes(nodes - event.lost_nodes), step)
        out["event"] = {"lost_nodes": event.lost_nodes, "tasks_hit": list[JsonValue](sorted(hit))}
        out["after"] = _plan_json(after)
        what = ", ".join(sorted(hit)) or "spare nodes only"
        lines.append("")
        lines.extend(_plan_text(after, f"after losing {event.lost_nodes} node(s) ({what}):", True))
    click.echo(json.dumps(out, indent=2) if as_json else "\n".join(lines))


@plan.command("estimate")
@click.option(
    "--model", "model_file", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Task file."
)
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs used, exactly.")
@click.option("--gpu", "gpu_name", required=True, help="GPU type (see etc/gpus.toml), e.g. h100-80g.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def estimate(model_file: Path, gpus: int, gpu_name: str, gpus_per_node: int, as_json: bool) -> None:
    """Best Megatron layout of one task on N GPUs, or why none fits (exit status 1)."""
    gpu = _gpu(gpu_name)
    try:
        task = load_task_file(model_file)
    except UnicornError as exc:
        raise click.ClickException(str(exc)) from exc
    result = best_layout(task.model, gpus, gpu, gpus_per_node)
    head: dict[str, JsonValue] = {
        "task": task.name,
        "gpus": gpus,
        "gpu": gpu.name,
        "gpus_per_node": gpus_per_node,
    }
    if isinstance(result, Infeasible):
        if as_json:
            click.echo(json.dumps({**head, "feasible": False, "reason": result.reason}, indent=2))
        else:
            click.echo(f"{task.name} on {gpus} x {gpu.name}: infeasible: {result.reason}")
        click.get_current_context().exit(1)
    if as_json:
        click.echo(json.dumps({**head, "feasible": True, **_estimate_json(result)}, indent=2))
        return
    click.echo(
        f"{task.name} on {gpus} x {gpu.name}: {result.layout.describe()}\n"
        f"  iteration {result.iteration_s:.3f} s, {result.tflops_per_gpu:.1f} TFLOP/s per GPU, "
        f"MFU {result.mfu:.1%}, {result.memory.total_gib:.1f} of {gpu.hbm_gib:g} GiB per GPU"
    )
