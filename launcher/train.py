"""``unicorn-train``: the built-in trainer, run once per rank under torchrun.

    torchrun --standalone --nproc-per-node=4 -m launcher.train --tp=2 --pp=2 \\
        --iterations=100 --save-dir=/ckpt --save-interval=10 --load=/ckpt

Memory tier (``ckpt/``): under a node agent the ``--snapshot-*`` options come from the
agent's ``UNICORN_CKPT_*`` variables; each rank then saves DCP into shared memory every
``--snapshot-every`` iterations and on SIGUSR1/SIGTERM (the agent persists and
replicates), and on start restores the newest version nearest first (shm, this node's
peer backups, other nodes' agents, local disk, remote, then ``--load``).

``--reuse-microbatches`` (TP1 PP1 on gloo): when a data-parallel peer dies in the middle
of an iteration, the survivors keep the gradients of the micro-batches they finished,
form a new process group, compute only the lost replica's micro-batches, save that
completed iteration and exit 4; the relaunch resumes after it (:mod:`launcher.trainer.reuse`).

Arguments are validated before torch is imported; an impossible layout (TP not
dividing the heads or the node's ranks, PP not dividing the layers, DP x micro-batch
not dividing the global batch, TP x PP x DP differing from torchrun's world) exits 2
with one clear line. Exit codes: 0 done or stopped by SIGTERM after a just-in-time
save; 1 uncaught error (also written to torchrun's error file and sent to the agent);
2 invalid arguments; 3 injected ``exit`` fault; 4 a data-parallel peer died mid-iteration
and this rank completed and saved that iteration (``--reuse-microbatches``: restart from
it). ``--fail-*`` options are for tests.
"""

from __future__ import annotations

import os
import sys
import time

import click

from launcher import ckptagent
from launcher.trainer.config import (
    BatchCorruption,
    CorruptMode,
    DataParallel,
    FaultInjection,
    FaultMode,
    PipelineSchedule,
    SlowRank,
    SnapshotOptions,
    TrainConfig,
    parse_peers,
    parse_ranges,
    resolve_layout,
)
from unicorn_core.errors import UnicornError
from unicorn_core.model import ModelSpec

EXIT_INVALID: int = 2


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UnicornError(f"environment variable {name}={raw!r} is not an integer") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--dp", type=int, default=None, help="Data-parallel size [default: world/(tp*pp)].")
@click.option("--micro-batch", type=int, default=2, show_default=True, help="Sequences per micro-batch.")
@click.option("--global-batch", type=int, default=16, show_default=True, help="Sequences per iteration.")
@click.option("--layers", type=int, default=4, show_default=True)
@click.option("--hidden", type=int, default=64, show_default=True)
@click.option("--heads", type=int, default=4, show_default=True)
@click.option("--ffn-hidden", type=int, default=0, help="MLP width [default: 4*hidden].")
@click.option("--seq", "sequence", type=int, default=32, show_default=True, help="Sequence length.")
@click.option("--vocab", "vocabulary", type=int, default=128, show_default=True)
@click.option(
    "--iterations", type=int, default=100, show_default=True, help="Total iterations (fixes LR schedule)."
)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--min-lr", type=float, default=1e-4, show_default=True)
@click.option("--warmup", "warmup_iterations", type=int, default=2, show_default=True)
@click.option("--weight-decay", type=float, default=0.01, show_default=True)
@click.option("--seed", type=int, default=1234, show_default=True, help="Weights and data.")
@click.option("--save-dir", type=str, default=None, help="Checkpoint directory to save to.")
@click.option("--save-interval", type=int, default=None, help="Save every N iterations.")
@click.option(
    "--load", "load_dir", type=str, default=None, help="Resume from this directory's latest version."
)
@click.option(
    "--ckpt-step", "load_iteration", type=int, default=None, help="Load this version, not the latest."
)
@click.option("--exit-at-iteration", type=int, default=None, help="Save (if --save-dir) and exit 0 after it.")
@click.option("--log-interval", type=int, default=1, show_default=True)
@click.option(
    "--data-parallel",
    type=click.Choice([d.value for d in DataParallel]),
    default=DataParallel.AUTO.value,
    show_default=True,
    help="DDP or FSDP2 (auto: DDP without TP, FSDP2 with TP).",
)
@click.option(
    "--pp-schedule",
    type=click.Choice([s.value for s in PipelineSchedule]),
    default=PipelineSchedule.ONE_F_ONE_B.value,
    show_default=True,
)
@click.option("--dist-timeout-s", type=float, default=120.0, show_default=True, help="Collective timeout.")
@click.option(
    "--snapshot-dir",
    envvar=ckptagent.ENV_SNAP_DIR,
    default=None,
    help="Memory tier root (a tmpfs); unset = no memory tier.",
)
@click.option(
    "--snapshot-job",
    envvar=ckptagent.ENV_JOB,
    default="local",
    show_default=True,
    help="Job folder in every tier.",
)
@click.option(
    "--snapshot-every",
    envvar=ckptagent.ENV_EVERY,
    type=int,
    default=0,
    show_default=True,
    help="Snapshot every N iterations (0: only at --save-interval, signals and the end).",
)
@click.option(
    "--snapshot-backup-dir", envvar=ckptagent.ENV_BACKUP_DIR, default=None, help="Peer backups here."
)
@click.option("--snapshot-local-dir", envvar=ckptagent.ENV_LOCAL_DIR, default=None, help="Local-disk tier.")
@click.option("--snapshot-remote-dir", envvar=ckptagent.ENV_REMOTE_DIR, default=None, help="Remote tier.")
@click.option(
    "--snapshot-peers", envvar=ckptagent.ENV_PEERS, default="", help="Other agents: NODE=HOST:PORT,..."
)
@click.option(
    "--snapshot-slots",
    envvar=ckptagent.ENV_SLOTS,
    type=int,
    default=2,
    show_default=True,
    help="Versions each rank keeps in the memory tier (the agent derives it from detect.loss_stop_window).",
)
@click.option(
    "--reuse-microbatches/--no-reuse-microbatches",
    default=False,
    show_default=True,
    help="When a data-parallel peer dies mid-iteration, complete that iteration from the survivors' "
    "finished micro-batches plus the lost replica's, save it and exit 4 (TP1 PP1 on gloo; "
    "needs --save-dir or a memory tier).",
)
@click.option(
    "--reuse-settle-s",
    type=float,
    default=0.5,
    show_default=True,
    help="How long a missing rank's heartbeat (every fifth of this) must stand still before the survivors "
    "agree without it; a rank that still beats is waited for, up to --dist-timeout-s.",
)
@click.option(
    "--skip-iterations",
    default="",
    help="Consume and discard the data of these iterations (A-B,C,...; 1-based): a roll back past a "
    "loss spike. Versions saved by a run that trained on it are never restored.",
)
@click.option(
    "--corrupt-iterations",
    default="",
    help="TEST ONLY: corrupt the batch of these iterations (A,B-C) on every rank.",
)
@click.option(
    "--corrupt-mode",
    type=click.Choice([m.value for m in CorruptMode]),
    default=CorruptMode.SPIKE.value,
    show_default=True,
    help="TEST ONLY: spike (targets shifted: the loss jumps) or nan (NaN loss and gradients).",
)
@click.option(
    "--slow-rank",
    type=int,
    default=None,
    help="TEST ONLY (fault injection): this rank burns extra CPU in every training iteration, "
    "a straggler (see --slow-factor).",
)
@click.option(
    "--slow-factor",
    type=float,
    default=2.0,
    show_default=True,
    help="TEST ONLY: --slow-rank's compute time per iteration is this many times its own.",
)
@click.option(
    "--fail-at-iteration", type=int, default=None, help="TEST ONLY: inject a fault at this iteration."
)
@click.option("--fail-rank", type=int, default=0, show_default=True, help="TEST ONLY: rank that fails.")
@click.option(
    "--fail-after-microbatches",
    type=int,
    default=0,
    show_default=True,
    help="TEST ONLY: fail once the rank finished this many of its micro-batches of the iteration "
    "(0: as it starts it).",
)
@click.option(
    "--fail-once-marker",
    type=str,
    default=None,
    help="TEST ONLY: fail only if this file is absent (and create it): a transient fault.",
)
@click.option(
    "--fail-mode",
    type=click.Choice([m.value for m in FaultMode]),
    default=FaultMode.RAISE.value,
    show_default=True,
    help="TEST ONLY: raise an exception, exit 3, SIGKILL itself, or hang.",
)
def cli(**opts: object) -> None:
    """Train a tiny GPT with TP/PP/DP on PyTorch's own parallel building blocks."""
    start_s = time.time()
    try:
        cfg = _config(opts)
    except UnicornError as exc:
        click.echo(f"unicorn-train: error: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    sys.exit(_run(cfg, start_s))


def _config(opts: dict[str, object]) -> TrainConfig:
    def i(name: str) -> int:
        value = opts[name]
        assert isinstance(value, int)
        return value

    def oi(name: str) -> int | None:
        value = opts[name]
        assert value is None or isinstance(value, int)
        return value

    def f(name: str) -> float:
        value = opts[name]
        assert isinstance(value, float | int)
        return float(value)

    def os_(name: str) -> str | None:
        value = opts[name]
        assert value is None or isinstance(value, str)
        return value

    model = ModelSpec(
        layers=i("layers"),
        hidden=i("hidden"),
        heads=i("heads"),
        sequence=i("sequence"),
        vocabulary=i("vocabulary"),
        global_batch=i("global_batch"),
        ffn_hidden=i("ffn_hidden"),
    )
    layout = resolve_layout(
        tp=i("tp"),
        pp=i("pp"),
        dp=oi("dp"),
        micro_batch=i("micro_batch"),
        global_batch=i("global_batch"),
        world_size=_env_int("WORLD_SIZE", 1),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        model=model,
    )
    fail_at = oi("fail_at_iteration")
    fault = None
    if fail_at is not None:
        marker = opts.get("fail_once_marker")
        fault = FaultInjection(
            iteration=fail_at,
            rank=i("fail_rank"),
            mode=FaultMode(str(opts["fail_mode"])),
            once_marker=str(marker) if marker else None,
            after_microbatches=i("fail_after_microbatches"),
        )
    return TrainConfig(
        model=model,
        layout=layout,
        iterations=i("iterations"),
        lr=f("lr"),
        min_lr=f("min_lr"),
        warmup_iterations=i("warmup_iterations"),
        weight_decay=f("weight_decay"),
        seed=i("seed"),
        save_dir=os_("save_dir"),
        save_interval=oi("save_interval"),
        load_dir=os_("load_dir"),
        load_iteration=oi("load_iteration"),
        exit_at_iteration=oi("exit_at_iteration"),
        log_interval=i("log_interval"),
        data_parallel=DataParallel(str(opts["data_parallel"])),
        pp_schedule=PipelineSchedule(str(opts["pp_schedule"])),
        fault=fault,
        dist_timeout_s=f("dist_timeout_s"),
        snapshots=_snapshots(opts),
        skip_iterations=parse_ranges(str(opts["skip_iterations"] or "")),
        corruption=_corruption(opts),
        reuse_microbatches=bool(opts["reuse_microbatches"]),
        reuse_settle_s=f("reuse_settle_s"),
        slowdown=_slowdown(opts),
    )


def _slowdown(opts: dict[str, object]) -> SlowRank | None:
    rank = opts["slow_rank"]
    if rank is None:
        return None
    factor = opts["slow_factor"]
    assert isinstance(rank, int) and isinstance(factor, float | int)
    return SlowRank(rank, float(factor))


def _corruption(opts: dict[str, object]) -> BatchCorruption | None:
    ranges = parse_ranges(str(opts["corrupt_iterations"] or ""), "--corrupt-iterations")
    if not ranges:
        return None
    iterations = tuple(i for a, b in ranges for i in range(a, b + 1))
    return BatchCorruption(iterations, CorruptMode(str(opts["corrupt_mode"])))


def _snapshots(opts: dict[str, object]) -> SnapshotOptions | None:
    def text(name: str) -> str | None:
        value = opts[name]
        return str(value) if value else None

    snap_dir = text("snapshot_dir")
    if snap_dir is None:
        return None
    every, slots = opts["snapshot_every"], opts["snapshot_slots"]
    assert isinstance(every, int) and isinstance(slots, int)
    return SnapshotOptions(
        snap_dir=snap_dir,
        job=str(opts["snapshot_job"]),
        every=every,
        backup_dir=text("snapshot_backup_dir"),
        local_dir=text("snapshot_local_dir"),
        remote_dir=text("snapshot_remote_dir"),
        peers=parse_peers(str(opts["snapshot_peers"] or "")),
        slots=slots,
    )


def _run(cfg: TrainConfig, start_s: float) -> int:
    """Import torch (timed for the relaunch benchmark) and train.

    Uncaught errors go to torchrun's error file (``@record``) and, through the hook, to the agent.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    from launcher.trainer.loop import StartupClock, report_error, run

    clock = StartupClock(main_s=start_s, imported_s=time.time())

    @record
    def entry() -> int:
        try:
            return run(cfg, clock)
        except UnicornError as exc:  # e.g. a checkpoint of another model: nothing was trained
            report_error(exc)
            return EXIT_INVALID

    code = entry()
    return 1 if code is None else code


def main() -> None:
    """Console-script entry point (``unicorn-train``)."""
    cli(prog_name="unicorn-train")


if __name__ == "__main__":
    main()
