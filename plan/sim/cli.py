"""``unicornctl simulate``: replay a failure trace against the policies (offline, no cluster).

``simulate --trace {trace-a,trace-b,FILE} --workload {case1..case5,FILE} [--policy NAME]...
[--seed N] [--plot FILE.png] [--json]``. A built-in trace is generated from the seed; a
FILE is a CSV trace (schema in :mod:`plan.sim.trace`, ``etc/traces/README.md``). A
workload is a Unicron Table 3 case or a task list file. Without ``--policy`` the six
policies of the comparison run (unicorn, megatron, oobleck, varuna, bamboo, per-task);
the static allocations (equally, weighted, sized) run when named. ``megatron`` is always
run: it is the reference of the ratios. Every policy's ``fraction_of_ideal`` is its
accumulated WAF over the ideal's (the same tasks, no failures, best layouts).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import click

from plan.hardware import gpu_spec
from plan.sim.costs import MegatronCosts, UnicornCosts
from plan.sim.policies import DEFAULT_POLICY_NAMES, POLICY_NAMES, build_workload
from plan.sim.report import REFERENCE, plot_png, run_policies, summary_json, summary_text
from plan.sim.trace import BUILTIN_TRACES, Trace, generate_trace, load_trace_csv
from unicorn_core.errors import ConfigError, UnicornError
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import TaskSpec, load_tasks

DEFAULT_GPU = "a100-80g"
_CASE = re.compile(r"case[1-5]")


def _workload_tasks(value: str) -> tuple[TaskSpec, ...]:
    path = etc_dir() / "tasks" / "cases" / f"{value}.toml" if _CASE.fullmatch(value) else Path(value)
    return load_tasks(path)


def _trace(value: str, nodes: int, seed: int) -> Trace:
    spec = BUILTIN_TRACES.get(value)
    if spec is not None:
        return generate_trace(replace(spec, nodes=nodes), seed)
    path = Path(value)
    if not path.exists():
        known = ", ".join(BUILTIN_TRACES)
        raise ConfigError(f"--trace {value!r} is neither a built-in trace ({known}) nor an existing file")
    return load_trace_csv(path, nodes, seed)


@click.command("simulate")
@click.option("--trace", "trace_name", required=True, metavar="{trace-a,trace-b,FILE}", help="Failure trace.")
@click.option("--workload", required=True, metavar="{case1..case5,FILE}", help="Table 3 case or task list.")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(POLICY_NAMES),
    help="Policy to simulate; repeat for more (default: the six of the comparison).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of trace generation / node picks.")
@click.option(
    "--nodes", type=click.IntRange(min=1), default=16, show_default=True, help="Nodes in the cluster."
)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--gpu", "gpu_name", default=DEFAULT_GPU, show_default=True, help="GPU type (etc/gpus.toml).")
@click.option(
    "--spare-nodes",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Hot spares left out of the fixed allocations (megatron, per-task, baselines).",
)
@click.option(
    "--checkpoint-interval-min",
    type=click.FloatRange(min=0, min_open=True),
    default=MegatronCosts().checkpoint_interval_s / 60,
    show_default=True,
    help="Persistent checkpoint interval of megatron and the static baselines.",
)
@click.option(
    "--snapshot-every",
    type=click.IntRange(min=0),
    default=UnicornCosts().snapshot_every,
    show_default=True,
    help="unicorn's memory snapshot interval in iterations ([ckpt] snapshot_every); 0: Young/Daly.",
)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def simulate(
    *,
    trace_name: str,
    workload: str,
    policies: tuple[str, ...],
    seed: int,
    nodes: int,
    gpus_per_node: int,
    gpu_name: str,
    spare_nodes: int,
    checkpoint_interval_min: float,
    snapshot_every: int,
    plot_path: Path | None,
    as_json: bool,
) -> None:
    """Accumulated weighted achieved FLOP/s of each policy over a failure trace (Unicron Fig. 11)."""
    names = list(policies or DEFAULT_POLICY_NAMES)
    if REFERENCE not in names:
        names.append(REFERENCE)
    try:
        gpu = gpu_spec(gpu_name)
        tasks = _workload_tasks(workload)
        trace = _trace(trace_name, nodes, seed)
        work = build_workload(tasks, nodes, gpus_per_node, gpu)
        megatron = replace(MegatronCosts(), checkpoint_interval_s=checkpoint_interval_min * 60)
        unicorn = UnicornCosts(snapshot_every=snapshot_every or None)
        run = partial(
            run_policies, trace, work, names, unicorn=unicorn, megatron=megatron, spare_nodes=spare_nodes
        )
        if as_json or not sys.stderr.isatty():
            results = run()
        else:
            length = len(trace.events) * len(names)
            with click.progressbar(length=length, label="simulating", file=sys.stderr) as bar:
                results = run(progress=bar.update)
        if plot_path is not None:
            plot_png(results, plot_path, f"{trace.name} (seed {seed}), {workload}")
    except UnicornError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        out = summary_json(trace, results, work)
        out["workload"] = workload
        out["seed"] = seed
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(summary_text(trace, results))
        if plot_path is not None:
            click.echo(f"plot written to {plot_path}")
