"""``unicornctl``: the operator's view of the cluster unicorn manages.

Read-only commands talk to Slurm and Redis directly. Mutating commands (``drain``,
``resume``, ``incidents confirm``) are typed requests to unicornd on its operators'
control stream, never scontrol calls, so plans follow; only operators may send them (root,
Slurm's SlurmUser, or members of ``slurm.operators_group``). ``plan --what-if-fail NODE``
runs unicornd's own decision and planner on its live snapshot and applies nothing.

The verbs live by group: :mod:`~unicornd.cli.status` (``status``, ``tasks``,
``incidents``), :mod:`~unicornd.cli.operator` (``drain``, ``resume``, ``incidents
confirm``), :mod:`~unicornd.cli.preview` (outlooks, ``plan --what-if-fail``),
:mod:`~unicornd.cli.goodput` (``goodput``), :mod:`~unicornd.cli.report` (``report --html``),
:mod:`~unicornd.cli.common` (config, snapshot, exit codes); ``task`` is
:mod:`unicornd.taskcli`, ``classify``/``simulate``/``plan`` the libraries' own commands.
``node-check`` is an alias of the compute-node command ``unicorn-node-check``
(:mod:`launcher.nodecheck`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click

from detect.cli import classify as classify_command
from launcher.nodecheck import NODE_CHECK_HELP, node_check_options, run_node_check
from plan.sim.cli import simulate as simulate_command
from unicorn_core.config import describe
from unicornd.cli.common import (
    EXIT_NO_DAEMON,
    EXIT_NO_STATE,
    EXIT_NOT_CONFIRMED,
    EXIT_NOT_OPERATOR,
    EXIT_STATE_UNREADABLE,
    EXIT_UNKNOWN_INCIDENT,
    EXIT_UNKNOWN_NODE,
    config_of,
    read_snapshot,
)
from unicornd.cli.goodput import goodput
from unicornd.cli.operator import Caller, confirm, drain, operator_refusal, resume, slurm_user_from_config
from unicornd.cli.preview import Outlook, outlook, outlook_json, plan_command, render_outlook, what_if_fail
from unicornd.cli.report import report
from unicornd.cli.status import (
    incident_json,
    incidents,
    incidents_json,
    render_incidents,
    render_tasks,
    status,
    task_json,
    tasks,
)
from unicornd.taskcli import task_group

__all__ = [
    "EXIT_NOT_CONFIRMED",
    "EXIT_NOT_OPERATOR",
    "EXIT_NO_DAEMON",
    "EXIT_NO_STATE",
    "EXIT_STATE_UNREADABLE",
    "EXIT_UNKNOWN_INCIDENT",
    "EXIT_UNKNOWN_NODE",
    "Caller",
    "Outlook",
    "cli",
    "incident_json",
    "incidents_json",
    "main",
    "operator_refusal",
    "outlook",
    "outlook_json",
    "read_snapshot",
    "render_incidents",
    "render_outlook",
    "render_tasks",
    "slurm_user_from_config",
    "task_json",
    "what_if_fail",
]


@click.group()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="unicorn.toml (default: $UNICORN_CONFIG, else built-in defaults).",
)
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None) -> None:
    """Operate unicorn: self-healing LLM training on Slurm."""
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path


@cli.command("config")
@click.option("--describe", "show_docs", is_flag=True, help="Every setting with its env var and meaning.")
@click.pass_context
def config_cmd(ctx: click.Context, show_docs: bool) -> None:
    """Print the effective configuration (after file and UNICORN_* overrides)."""
    if show_docs:
        for s in describe():
            click.echo(f"{s.key} = {s.default!r}   [{s.env_var}; {s.expected}]\n    {s.doc}")
        return
    cfg = config_of(ctx)
    click.echo(json.dumps(dataclasses.asdict(cfg), indent=2))


@cli.command(
    "node-check",
    help="Alias of unicorn-node-check (the compute-node command), with unicornctl's --config.\n\n    "
    + NODE_CHECK_HELP,
    short_help="Alias of unicorn-node-check: check this node (or --paired NODES).",
)
@node_check_options
@click.pass_context
def node_check(ctx: click.Context, /, **options: Any) -> None:
    run_node_check(config_path=(ctx.obj or {}).get("config_path"), **options)


incidents.add_command(confirm)
for command in (status, tasks, incidents, drain, resume, plan_command(), classify_command, simulate_command):
    cli.add_command(command)
for command in (goodput, report):
    cli.add_command(command)
cli.add_command(task_group)


def main() -> None:
    cli(prog_name="unicornctl")
