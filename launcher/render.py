"""Render a :class:`~unicorn_core.layout.Layout` to command lines: torchrun, Megatron-LM, ``unicorn-train``.

Pure functions from values to ``list[str]`` argv (never a shell string), so the
coordinator can show a relaunch before doing it and golden files pin the exact text.
This module imports no torch: the coordinator imports it.

One relaunch = one :func:`torchrun_argv` per node (same rendezvous, its own node rank)
followed by the training program and its arguments (:func:`megatron_args` for
``pretrain_gpt.py``, :func:`trainer_args` for the built-in ``unicorn-train``).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec


class RdzvBackend(StrEnum):
    """How torchrun's agents find each other.

    ``c10d``: dynamic rendezvous on a TCPStore at the endpoint (torchrun's recommended
    mode; node ranks are assigned in arrival order). ``static``: ``--master-addr`` and
    ``--master-port`` with fixed node ranks (no rendezvous round, slightly faster start).
    """

    C10D = "c10d"
    STATIC = "static"


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one launch meet: ``host:port`` plus a run id shared by all nodes."""

    host: str
    port: int
    run_id: str = "unicorn"
    backend: RdzvBackend = RdzvBackend.C10D

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise InvalidArgument(
                f"rendezvous host must be a non-empty name without spaces, got {self.host!r}"
            )
        if isinstance(self.port, bool) or not 0 < self.port < 65536:
            raise InvalidArgument(f"rendezvous port must be in 1..65535, got {self.port!r}")
        if not self.run_id or any(c.isspace() for c in self.run_id):
            raise InvalidArgument(f"rendezvous run_id must be non-empty without spaces, got {self.run_id!r}")


@dataclass(frozen=True)
class TorchrunOptions:
    """torchrun knobs that are not part of the layout.

    ``max_restarts`` stays 0: restarts are unicorn's decision (possibly at another
    layout), never torchrun's. ``redirects``/``tee`` take torchrun's values (``0``-``3``
    or per-rank maps such as ``0:3,1:0``); ``log_dir`` keeps per-rank logs and error
    files (torchrun writes each rank's uncaught exception there as JSON).
    """

    max_restarts: int = 0
    log_dir: str | None = None
    redirects: str | None = None
    tee: str | None = None
    monitor_interval_s: float | None = None
    program: Sequence[str] = ("torchrun",)

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise InvalidArgument(f"max_restarts must be >= 0, got {self.max_restarts!r}")
        if self.monitor_interval_s is not None and self.monitor_interval_s <= 0:
            raise InvalidArgument(f"monitor_interval_s must be positive, got {self.monitor_interval_s!r}")
        if not self.program:
            raise InvalidArgument("torchrun program must not be empty")


def processes_per_node(layout: Layout, nnodes: int, gpus_per_node: int) -> int:
    """Ranks started on each node: ``world / nnodes``, which must fit the node and keep TP in it.

    Raises :class:`InvalidArgument` when the world does not spread evenly over the nodes,
    needs more GPUs than a node has, or would split a tensor-parallel group across nodes
    (Megatron's rank order puts TP fastest, so a node must hold whole TP groups).
    """
    if isinstance(nnodes, bool) or nnodes <= 0:
        raise InvalidArgument(f"nnodes must be positive, got {nnodes!r}")
    if gpus_per_node <= 0:
        raise InvalidArgument(f"gpus_per_node must be positive, got {gpus_per_node!r}")
    world = layout.world_size
    if world % nnodes:
        raise InvalidArgument(
            f"layout {layout.describe()} has world size {world}, "
            f"which does not split evenly over {nnodes} nodes"
        )
    nproc = world // nnodes
    if nproc > gpus_per_node:
        raise InvalidArgument(
            f"layout {layout.describe()} needs {nproc} GPUs per node on {nnodes} nodes; "
            f"a node has {gpus_per_node} (world size {world} != GPUs available {nnodes * gpus_per_node})"
        )
    if nproc % layout.tp:
        raise InvalidArgument(
            f"tp={layout.tp} does not divide the {nproc} ranks per node (a TP group must stay within a node)"
        )
    return nproc


def torchrun_argv(
    layout: Layout,
    *,
    nnodes: int,
    node_rank: int,
    gpus_per_node: int,
    rendezvous: Rendezvous,
    options: TorchrunOptions | None = None,
) -> list[str]:
    """torchrun's argv for node ``node_rank`` of ``nnodes`` (the training program is appended by the caller).

    Every node gets the same argv except ``--node-rank``. With the c10d backend torchrun
    assigns node ranks itself and ignores ``--node-rank``; it is still rendered so logs
    name the node's planned position.
    """
    opts = options or TorchrunOptions()
    if isinstance(node_rank, bool) or not 0 <= node_rank < nnodes:
        raise InvalidArgument(f"node_rank must be in 0..{nnodes - 1}, got {node_rank!r}")
    nproc = processes_per_node(layout, nnodes, gpus_per_node)
    argv = [
        *opts.program,
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={opts.max_restarts}",
    ]
    if rendezvous.backend is RdzvBackend.C10D:
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous.host}:{rendezvous.port}",
            f"--rdzv-id={rendezvous.run_id}",
        ]
    else:
        argv += [f"--master-addr={rendezvous.host}", f"--master-port={rendezvous.port}"]
    if opts.monitor_interval_s is not None:
        argv.append(f"--monitor-interval={opts.monitor_interval_s:g}")
    if opts.log_dir is not None:
        argv.append(f"--log-dir={opts.log_dir}")
    if opts.redirects is not None:
        argv.append(f"--redirects={opts.redirects}")
    if opts.tee is not None:
        argv.append(f"--tee={opts.tee}")
    return argv


def torchrun_argvs(
    layout: Layout,
    *,
    nodes: Sequence[str],
    gpus_per_node: int,
    rendezvous: Rendezvous,
    options: TorchrunOptions | None = None,
) -> dict[str, list[str]]:
    """One torchrun argv per planned node, node ranks in the order of ``nodes``."""
    if len(set(nodes)) != len(nodes):
        raise InvalidArgument(f"nodes must be distinct, got {list(nodes)}")
    return {
        node: torchrun_argv(
            layout,
            nnodes=len(nodes),
            node_rank=rank,
            gpus_per_node=gpus_per_node,
            rendezvous=rendezvous,
            options=options,
        )
        for rank, node in enumerate(nodes)
    }


def _check_save_interval(save_dir: str | None, save_interval: int | None) -> None:
    """Both frameworks' rule: a positive interval, and only with somewhere to save."""
    if save_interval is not None and (isinstance(save_interval, bool) or save_interval <= 0):
        raise InvalidArgument(f"save_interval must be positive, got {save_interval!r}")
    if save_interval is not None and save_dir is None:
        raise InvalidArgument("save_interval needs save_dir")


@dataclass(frozen=True)
class MegatronCheckpointing:
    """Megatron-LM checkpoint flags that make a relaunch at another layout resume.

    ``torch_dist`` (``--ckpt-format``) is the distributed format that reshards on load to
    a new TP/PP/DP. ``legacy_use_dist_ckpt`` adds ``--use-dist-ckpt`` for Megatron-LM
    releases that predate ``--ckpt-format``. ``exit_signal_handler`` makes Megatron save
    and exit on SIGTERM (the just-in-time save). ``optim_fully_reshardable`` adds
    ``--dist-ckpt-optim-fully-reshardable`` to a layout with the distributed optimizer:
    its default checkpoint form (``dp_reshardable``) reshards over DP only, and Megatron
    refuses to load it at another TP or PP (releases without the flag: pass False).
    """

    save_dir: str | None = None
    load_dir: str | None = None
    save_interval: int | None = None
    ckpt_format: str = "torch_dist"
    legacy_use_dist_ckpt: bool = False
    exit_signal_handler: bool = True
    optim_fully_reshardable: bool = True

    def __post_init__(self) -> None:
        _check_save_interval(self.save_dir, self.save_interval)


def megatron_args(
    layout: Layout,
    model: ModelSpec | None = None,
    checkpointing: MegatronCheckpointing | None = None,
) -> list[str]:
    """``pretrain_gpt.py`` arguments for ``layout`` (and the model shape, when given).

    Megatron derives the data-parallel size from the world size, so DP is implied by
    torchrun's world rather than passed. ``--num-layers-per-virtual-pipeline-stage``
    needs the model's layer count; without ``model`` a layout with ``vpp`` is rejected.
    """
    argv = [
        "--tensor-model-parallel-size",
        str(layout.tp),
        "--pipeline-model-parallel-size",
        str(layout.pp),
    ]
    if layout.vpp is not None:
        if model is None:
            raise InvalidArgument(
                "a layout with vpp needs the model to render --num-layers-per-virtual-pipeline-stage"
            )
        chunks = layout.pp * layout.vpp
        if model.layers % chunks:
            raise InvalidArgument(f"pp*vpp={chunks} does not divide the model's {model.layers} layers")
        argv += ["--num-layers-per-virtual-pipeline-stage", str(model.layers // chunks)]
    argv += [
        "--micro-batch-size",
        str(layout.micro_batch),
        "--global-batch-size",
        str(layout.global_batch),
    ]
    if layout.distributed_optimizer:
        argv.append("--use-distributed-optimizer")
    if layout.recompute:
        argv += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    if model is not None:
        argv += [
            "--num-layers",
            str(model.layers),
            "--hidden-size",
            str(model.hidden),
            "--ffn-hidden-size",
            str(model.ffn_hidden),
            "--num-attention-heads",
            str(model.heads),
            "--seq-length",
            str(model.sequence),
            "--max-position-embeddings",
            str(model.sequence),
        ]
        if model.num_query_groups != model.heads:
            argv += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if checkpointing is not None:
        argv += _megatron_checkpoint_args(checkpointing)
        if checkpointing.optim_fully_reshardable and layout.distributed_optimizer:
            argv.append("--dist-ckpt-optim-fully-reshardable")
    return argv


def _megatron_checkpoint_args(ck: MegatronCheckpointing) -> list[str]:
    argv: list[str] = []
    if ck.save_dir is not None:
        argv += ["--save", ck.save_dir]
    if ck.save_interval is not None:
        argv += ["--save-interval", str(ck.save_interval)]
    if ck.load_dir is not None:
        argv += ["--load", ck.load_dir]
    if ck.legacy_use_dist_ckpt:
        argv.append("--use-dist-ckpt")
    argv += ["--ckpt-format", ck.ckpt_format]
    if ck.exit_signal_handler:
        argv.append("--exit-signal-handler")
    return argv


@dataclass(frozen=True)
class TrainerCheckpointing:
    """Checkpoint options of the built-in trainer (``unicorn-train``)."""

    save_dir: str | None = None
    save_interval: int | None = None
    load_dir: str | None = None

    def __post_init__(self) -> None:
        _check_save_interval(self.save_dir, self.save_interval)


def trainer_args(
    layout: Layout,
    model: ModelSpec,
    *,
    iterations: int,
    checkpointing: TrainerCheckpointing | None = None,
    seed: int = 1234,
) -> list[str]:
    """``unicorn-train`` arguments for ``layout`` and ``model``.

    Unlike Megatron, DP is passed explicitly so the trainer checks it against torchrun's
    world size and fails fast (exit 2) on a mismatch.
    """
    if layout.vpp is not None:
        raise InvalidArgument(
            "unicorn-train has no interleaved (vpp) schedule; render the layout without vpp"
        )
    if layout.recompute or layout.distributed_optimizer:
        raise InvalidArgument("unicorn-train does not implement recompute or a distributed optimizer")
    if model.num_query_groups != model.heads:
        raise InvalidArgument(
            "unicorn-train has no grouped-query attention (num_query_groups must equal heads)"
        )
    if layout.global_batch != model.global_batch:
        raise InvalidArgument(
            f"layout global_batch {layout.global_batch} differs from the model's {model.global_batch}"
        )
    if isinstance(iterations, bool) or iterations <= 0:
        raise InvalidArgument(f"iterations must be positive, got {iterations!r}")
    argv = [
        f"--tp={layout.tp}",
        f"--pp={layout.pp}",
        f"--dp={layout.dp}",
        f"--micro-batch={layout.micro_batch}",
        f"--global-batch={layout.global_batch}",
        f"--layers={model.layers}",
        f"--hidden={model.hidden}",
        f"--heads={model.heads}",
        f"--ffn-hidden={model.ffn_hidden}",
        f"--seq={model.sequence}",
        f"--vocab={model.vocabulary}",
        f"--iterations={iterations}",
        f"--seed={seed}",
    ]
    if checkpointing is not None:
        if checkpointing.save_dir is not None:
            argv.append(f"--save-dir={checkpointing.save_dir}")
        if checkpointing.save_interval is not None:
            argv.append(f"--save-interval={checkpointing.save_interval}")
        if checkpointing.load_dir is not None:
            argv.append(f"--load={checkpointing.load_dir}")
    return argv


RESTART_RUNG = "restart_processes"
"""The ladder rung whose steps restart every node's ranks (``<incident>/restart_processes/
<attempt>/<restart_ranks|restart_agent|rollback>/<node>``; a roll back past a loss spike is
that rung's relaunch)."""
_RESTART_STEPS = ("restart_ranks", "restart_agent", "rollback")
PORT_SPAN = 1000
"""Rendezvous ports are ``[agent] rendezvous_port_base`` + [0, PORT_SPAN)
(:func:`unicornd.launch.rendezvous_port`)."""


def restart_rendezvous(argv: Sequence[str], launch_id: str, port_base: int) -> list[str]:
    """``argv`` with its ``--master-port`` moved for a restart of every node's ranks.

    A restart runs the same command on every node; with the same port, a node that starts
    its new ranks before the rank-0 node's old torchrun has exited joins the old store, and
    its ranks wait there until the collective timeout (seen in the soak bench: the ranks of
    a fast node restarted 3.8 s before the master node's old store closed). Every node's step
    of one restart (``restart_ranks`` or, where the agent was gone, ``restart_agent``; a
    roll back's ``rollback`` relaunch) has the same id up to its last two parts, so each
    derives the same new port from it, and a port no old store holds. Other launch ids,
    and ports outside the rendezvous range, are left as they are.
    """
    parts = launch_id.split("/")
    if len(parts) < 5 or parts[-4] != RESTART_RUNG or parts[-2] not in _RESTART_STEPS:
        return list(argv)
    offset = 1 + zlib.crc32("/".join(parts[:-2]).encode()) % (PORT_SPAN - 1)
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        port = int(value) if flag == "--master-port" and eq and value.isdigit() else -1
        if port_base <= port < port_base + PORT_SPAN:
            out.append(f"--master-port={port_base + (port - port_base + offset) % PORT_SPAN}")
        else:
            out.append(arg)
    return out
