"""``unicornctl task``: one training task, from inside its Slurm job.

What the sbatch wrapper (``etc/unicorn-job.sbatch``) runs::

    sbatch [slurm options] etc/unicorn-job.sbatch [unicorn options] -- COMMAND...
      -> unicornctl task register --job-id J --nodes HOSTLIST [unicorn options] -- COMMAND...
      -> exec unicornctl task wait TASK --job-id J

The logic lives in :mod:`unicornd.wrapper`; this module is only the click surface.
Exit codes: 0 done (``wait``: the training finished); 1 refused, unreachable, or the
task failed; 2 bad options (nothing registered); 3 the task was stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path

import click
from click.core import ParameterSource

from unicorn_core import acl
from unicorn_core.config import Config, load_config
from unicorn_core.errors import ConfigError, UnicornError
from unicorn_core.jobenv import capture
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import configure_logging
from unicorn_core.slurm.hostlist import compress, expand
from unicorn_core.taskspec import MAX_WEIGHT, MIN_WEIGHT
from unicornd import wrapper
from unicornd.control import ControlClient
from unicornd.state import FRAMEWORKS, TaskRecord


class _BadOptionError(click.ClickException):
    """Bad wrapper options: exit 2 (as click's usage errors); nothing was registered."""

    exit_code = wrapper.EXIT_USAGE


def _config(ctx: click.Context) -> Config:
    """The effective config (``unicornctl --config``, else ``$UNICORN_CONFIG``), console logs."""
    root = ctx.find_root().obj or {}
    try:
        cfg = load_config(root.get("config_path"))
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    configure_logging(
        cfg.log.level, "console" if cfg.log.format == "auto" else cfg.log.format, stream=sys.stderr
    )
    return cfg


def _source(ctx: click.Context, param: click.Parameter, env: str, spank: str) -> str:
    """How the user gave the value: the option itself, or the variable (SPANK option / env)."""
    name = param.name or ""
    if ctx.get_parameter_source(name) is ParameterSource.ENVIRONMENT:
        return f"${env} (from sbatch {spank} or the environment)"
    return f"--{name.replace('_', '-')}"


def _weight(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        weight = float(value)
    except ValueError:
        weight = float("nan")
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NaN fails too
        where = _source(ctx, param, "UNICORN_WEIGHT", "--unicorn-weight")
        raise _BadOptionError(
            f"{where} = {value!r}: the weight must be a number between {MIN_WEIGHT} and {MAX_WEIGHT}"
        )
    return weight


def _min_gpus(ctx: click.Context, param: click.Parameter, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        where = _source(ctx, param, "UNICORN_MIN_GPUS", "--unicorn-min-gpus")
        raise _BadOptionError(f"{where} = {value!r}: min GPUs must be an integer >= 1")
    return int(value)


@click.group("task")
def task_group() -> None:
    """One training task, from inside its Slurm job (what etc/unicorn-job.sbatch runs).

    \b
    sbatch [slurm options] etc/unicorn-job.sbatch [unicorn options] -- COMMAND...
    runs in the job:  unicornctl task register ... -- COMMAND
                      unicornctl task wait TASK
    """


@task_group.command("register", context_settings={"allow_interspersed_args": False})
@click.option("--job-id", type=click.IntRange(min=1), default=None, help="The Slurm job holding the nodes.")
@click.option(
    "--nodes", "hostlist", default=None, metavar="HOSTLIST", help="Its nodes ($SLURM_JOB_NODELIST)."
)
@click.option(
    "--name", default=None,
    help="Task name, [A-Za-z0-9_.-]+ (default: the job's name); the task id is NAME.JOBID.",
)  # fmt: skip
@click.option(
    "--weight", envvar="UNICORN_WEIGHT", default="1.0", show_default=True, callback=_weight,
    help=f"Share of the cluster, {MIN_WEIGHT} to {MAX_WEIGHT} (default: $UNICORN_WEIGHT, set by "
    "sbatch --unicorn-weight).",
)  # fmt: skip
@click.option(
    "--min-gpus", envvar="UNICORN_MIN_GPUS", default="1", show_default=True, callback=_min_gpus,
    help="Fewest GPUs worth running on (default: $UNICORN_MIN_GPUS, set by sbatch --unicorn-min-gpus).",
)  # fmt: skip
@click.option("--max-gpus", type=click.IntRange(min=1), default=None, help="Most GPUs to plan for.")
@click.option(
    "--gpu-types", default=None, metavar="TYPE[,TYPE...]",
    help="GPU types (Slurm GRES types, e.g. h100) the task may run on; default: the model "
    "file's gpu_types, else any. It never runs on two types at once.",
)  # fmt: skip
@click.option(
    "--model", "model_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
    help="Model description, TOML or *.json: layers, hidden, heads, sequence, vocabulary, "
    "global_batch [, ffn_hidden, num_query_groups], at the top level or in a [model] table.",
)  # fmt: skip
@click.option("--framework", type=click.Choice(FRAMEWORKS), default=FRAMEWORKS[0], show_default=True)
@click.option(
    "--timeout-s", type=click.FloatRange(min=1), default=30.0, show_default=True,
    help="How long to wait for unicornd's verdict.",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Check everything and print the task; register nothing.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def task_register(  # noqa: PLR0917 - click passes options positionally
    ctx: click.Context,
    job_id: int | None,
    hostlist: str | None,
    name: str | None,
    weight: float,
    min_gpus: int,
    max_gpus: int | None,
    gpu_types: str | None,
    model_path: Path,
    framework: str,
    timeout_s: float,
    dry_run: bool,
    command: tuple[str, ...],
) -> None:
    """Register this job's training task with unicornd and print its id on stdout.

    Everything is checked before anything is sent (exit 2, nothing registered): weight,
    GPUs, the model file, the command. The command's program is resolved to an absolute
    path; the training runs in this directory with this environment's exported variables
    (but Slurm's, unicorn's and the batch step's GPUs). Exit 1
    when unicornd refuses or does not answer. A job rerun after a requeue finds its task
    registered and attaches to it (exit 0, nothing sent).
    """
    if not dry_run and (job_id is None or not hostlist):
        raise _BadOptionError(
            "--job-id and --nodes are required (inside a job: $SLURM_JOB_ID and $SLURM_JOB_NODELIST)"
        )
    if max_gpus is not None and max_gpus < min_gpus:
        raise _BadOptionError(f"--max-gpus {max_gpus} is below the minimum of {min_gpus} GPU(s)")
    try:
        nodes = tuple(expand(hostlist)) if hostlist else ()
        model, accepted = wrapper.load_model_and_gpu_types(model_path)
        if gpu_types is not None:
            accepted = tuple(dict.fromkeys(t.strip() for t in gpu_types.split(",") if t.strip()))
        argv = wrapper.resolve_command(command, cwd=Path.cwd(), path=os.environ.get("PATH", os.defpath))
        task_name = name if name is not None else wrapper.default_name(os.environ.get("SLURM_JOB_NAME", ""))
        task_id = wrapper.task_id_for(task_name, job_id)
        task = TaskRecord(
            task_id=task_id, name=task_id, model=model, command=argv, weight=weight, min_gpus=min_gpus,
            max_gpus=max_gpus, job_id=job_id, nodes=nodes, framework=framework, gpu_types=accepted,
        )  # fmt: skip
        task.check_command()
    except UnicornError as e:
        raise _BadOptionError(str(e)) from None
    if dry_run:
        click.echo(json.dumps(task.to_dict(), indent=2))
        return
    cfg = _config(ctx)
    try:
        environment = capture(os.environ, str(Path.cwd()))
        attached = asyncio.run(
            wrapper.register_or_attach(cfg, task, timeout_s=timeout_s, environment=environment)
        )
    except UnicornError as e:
        raise click.ClickException(f"task {task_id} not registered: {e}") from None
    what = "already registered (the job was requeued); attaching to it" if attached else "registered"
    click.echo(
        f"unicorn: task {task_id} {what}: job {job_id} on {compress(nodes)}, weight {weight:g}, "
        f"min GPUs {min_gpus}, framework {framework}, command: {shlex.join(argv)}",
        err=True,
    )
    click.echo(task_id)


@task_group.command("wait")
@click.argument("task_id")
@click.option(
    "--job-id", type=click.IntRange(min=1), default=None, help="The task's job (default: unicornd's record)."
)
@click.option("--poll-s", type=click.FloatRange(min=0.05), default=1.0, show_default=True)
@click.option(
    "--progress-interval-s", type=click.FloatRange(min=0), default=30.0, show_default=True,
    help="At most one iteration line per this many seconds.",
)  # fmt: skip
@click.option(
    "--stop-timeout-s", type=click.FloatRange(min=0), default=100.0, show_default=True,
    help="After a stop request, how long to wait for the agents to be gone.",
)  # fmt: skip
@click.option(
    "--restarts", "run_restarts", envvar="SLURM_RESTART_COUNT", type=click.IntRange(min=0), default=0,
    help="This run's restart count ($SLURM_RESTART_COUNT): a SIGTERM that comes with a higher "
    "count in Slurm is a requeue, not a stop.",
)  # fmt: skip
@click.pass_context
def task_wait(  # noqa: PLR0917 - click passes options positionally
    ctx: click.Context,
    task_id: str,
    job_id: int | None,
    poll_s: float,
    progress_interval_s: float,
    stop_timeout_s: float,
    run_restarts: int,
) -> None:
    """Follow TASK_ID, print progress lines, exit with its result.

    Exit codes: 0 finished; 1 failed or unknown to unicornd; 3 stopped (scancel, the
    time-limit signal, or unicorn's breaker). SIGTERM, SIGINT and SIGUSR1 ask unicornd to
    stop the task (ranks save and exit), except a SIGTERM while the job is being requeued.
    """
    cfg = _config(ctx)
    opts = wrapper.WaitOptions(
        poll_s=poll_s,
        progress_interval_s=progress_interval_s,
        stop_timeout_s=stop_timeout_s,
        run_restarts=run_restarts,
    )

    def say(line: str) -> None:
        click.echo(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] unicorn: {task_id}: {line}")
        sys.stdout.flush()

    sys.exit(asyncio.run(wrapper.wait_task(cfg, task_id, job_id, opts, say)))


@task_group.command("stop")
@click.argument("task_id")
@click.option("--why", default="stopped with unicornctl task stop", show_default=True)
@click.option("--timeout-s", type=click.FloatRange(min=1), default=30.0, show_default=True)
@click.pass_context
def task_stop(ctx: click.Context, task_id: str, why: str, timeout_s: float) -> None:
    """Stop TASK_ID: its agents stop (ranks save and exit) and it becomes ``stopped``.

    Exit 1 when unicornd refuses (an unknown task) or does not answer.
    """
    cfg = _config(ctx)

    async def go() -> None:
        client = acl.connect_caller(cfg.redis, client_name="unicornctl")
        try:
            control = ControlClient(client, RedisKeys(cfg.redis.key_prefix), timeout_s=timeout_s)
            await control.stop(task_id, why)
        finally:
            await client.aclose()

    try:
        asyncio.run(go())
    except UnicornError as e:
        raise click.ClickException(f"task {task_id} not stopped: {e}") from None
    click.echo(f"task {task_id}: stop requested")
