"""How unicornd turns (task, layout, nodes) into command lines: torchrun per node, agents.

Pure functions of their inputs (the coordinator shows a relaunch before doing it).
The training program is the task's ``command``; the layout is appended in the task's
framework's own flags: for Megatron-LM, :func:`launcher.megatron.pretrain_command`
(runner, script, the user's arguments, layout, model shape, checkpoint flags); for
``unicorn-train``, ``--tp/--pp/--dp/--micro-batch/--global-batch``.
"""

from __future__ import annotations

import shlex
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeAlias

from launcher.megatron import pretrain_command
from launcher.render import RdzvBackend, Rendezvous, TorchrunOptions, torchrun_argvs
from unicorn_core.config import AgentConfig
from unicorn_core.layout import Layout
from unicornd.state import TaskRecord

Render: TypeAlias = Callable[[TaskRecord, Layout, tuple[str, ...]], Mapping[str, Sequence[str]]]
"""``render(task, layout, nodes)`` -> one training argv per node of ``nodes`` (node-rank order)."""


def bin_dir(cfg: AgentConfig) -> Path:
    """Where unicorn-agent, torchrun and python live on compute nodes."""
    return Path(cfg.bin_dir) if cfg.bin_dir else Path(sys.executable).parent


def trainer_layout_args(layout: Layout) -> list[str]:
    """The layout in the built-in trainer's flags.

    The built-in trainer runs the layout's TP/PP/DP and micro-batch; interleaving (vpp),
    recompute and the distributed optimizer are Megatron features it lacks, so it runs the
    same layout without them (the planner's estimate assumed them; on the dev cluster's
    CPU ranks the difference is immaterial).
    """
    return [
        f"--tp={layout.tp}",
        f"--pp={layout.pp}",
        f"--dp={layout.dp}",
        f"--micro-batch={layout.micro_batch}",
        f"--global-batch={layout.global_batch}",
    ]


def trainer_skip_args(skip: Sequence[tuple[int, int]]) -> list[str]:
    """The built-in trainer's ``--skip-iterations=A-B,C-D`` for the task's skipped ranges
    (:meth:`TaskRecord.skip_ranges`; nothing when none)."""
    return [f"--skip-iterations={','.join(f'{a}-{b}' for a, b in skip)}"] if skip else []


def rendezvous_port(cfg: AgentConfig, task_id: str, generation: int) -> int:
    """A port that differs between launches of a task and (almost surely) between tasks."""
    return cfg.rendezvous_port_base + (generation * 37 + zlib.crc32(task_id.encode())) % 1000


def render_task(
    task: TaskRecord,
    layout: Layout,
    nodes: Sequence[str],
    *,
    cfg: AgentConfig,
    gpus_per_node: int,
    generation: int,
) -> dict[str, list[str]]:
    """One training argv per node: torchrun (static rendezvous, fixed node ranks) + program + layout.

    A Megatron-LM task's argv is :func:`launcher.megatron.pretrain_command`'s, which checks
    the command again (:func:`launcher.megatron.check_user_args`): a bad one cannot render.
    Iterations the task skips after a roll back (:meth:`TaskRecord.skip_ranges`) are
    appended in the framework's flag: ``--skip-iterations`` or ``--iterations-to-skip``.
    """
    rdzv = Rendezvous(
        host=cfg.rendezvous_host or nodes[0],
        port=rendezvous_port(cfg, task.task_id, generation),
        run_id=f"{task.task_id}-{generation}",
        backend=RdzvBackend.STATIC,
    )
    options = TorchrunOptions(program=(str(bin_dir(cfg) / "torchrun"),), monitor_interval_s=0.1)
    heads = torchrun_argvs(layout, nodes=nodes, gpus_per_node=gpus_per_node, rendezvous=rdzv, options=options)
    skip = task.skip_ranges()
    if task.framework == "megatron":
        return {
            node: pretrain_command(heads[node], task.command, layout=layout, model=task.model, skip=skip)
            for node in nodes
        }
    # torchrun runs a *.py program with python itself; anything else (python -m ..., a
    # console script such as unicorn-train) is an executable: --no-python.
    exe = [] if task.command[0].endswith(".py") else ["--no-python"]
    tail = [*task.command, *trainer_layout_args(layout), *trainer_skip_args(skip)]
    return {node: [*heads[node], *exe, *tail] for node in nodes}


def renderer(cfg: AgentConfig, gpus_per_node: int, generation: int) -> Render:
    """The ``render`` callable :func:`unicornd.replan.plan_transition` takes, for one plan
    generation (its rendezvous port and run id derive from it)."""

    def render(task: TaskRecord, layout: Layout, nodes: tuple[str, ...]) -> Mapping[str, Sequence[str]]:
        return render_task(task, layout, nodes, cfg=cfg, gpus_per_node=gpus_per_node, generation=generation)

    return render


def agent_argv(
    cfg: AgentConfig,
    job_id: int,
    node: str | None,
    command: Sequence[str],
    *,
    config_path: str | None = None,
    launch_id: str = "",
) -> list[str]:
    """``unicorn-agent`` for (job, node) supervising ``command`` (run by srun on that node);
    ``launch_id``: the action starting it (the agent tags its ranks' iterations with it).

    ``node`` None and no ``command``: one agent of a step over the whole job, whose node
    :func:`logged_on_each_node` adds and which reads its training command from Redis
    (``--await-launch``, :meth:`unicorn_core.keys.RedisKeys.agent_launch`)."""
    argv = [str(bin_dir(cfg) / "unicorn-agent"), "--job-id", str(job_id)]
    if node is not None:
        argv += ["--node", node]
    if launch_id:
        argv += ["--launch-id", launch_id]
    if config_path:
        argv += ["--config", config_path]
    if node is None and not command:
        return [*argv, "--await-launch"]
    return [*argv, "--", *command]


def logged(argv: Sequence[str], run_dir: Path) -> list[str]:
    """``argv`` run by ``/bin/sh`` on the node with its output appended to
    ``run_dir/agent.out``, the folder made first (on the node: slurmstepd opens an srun
    ``--output`` file before the agent runs, and never makes its folder). The agent's run
    folder holds its other logs and goes with them, so nothing is left in /tmp."""
    out = run_dir / "agent.out"
    script = f"mkdir -p {shlex.quote(str(run_dir))} && exec {shlex.join(argv)} >>{shlex.quote(str(out))} 2>&1"
    return ["/bin/sh", "-c", script]


def logged_on_each_node(argv: Sequence[str], runs_root: Path) -> list[str]:
    """:func:`logged` for the agent ``argv`` (without ``--node``) of one step over many
    nodes: slurmstepd sets ``$SLURMD_NODENAME`` for each task, and the shell passes it as
    the agent's ``--node`` (its command line names its node, as ``unicorn-probe`` looks
    agents up) and makes ``runs_root/$SLURMD_NODENAME`` its run folder (what
    :func:`unicorn_core.paths.agent_run_dir` gives for that node)."""
    root = shlex.quote(str(runs_root))
    agent = f'{shlex.quote(argv[0])} --node "$SLURMD_NODENAME" {shlex.join(argv[1:])}'
    script = f'd={root}/"$SLURMD_NODENAME" && mkdir -p "$d" && exec {agent} >>"$d/agent.out" 2>&1'
    return ["/bin/sh", "-c", script]
