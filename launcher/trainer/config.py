"""What one ``unicorn-train`` run is asked to do, validated before torch is imported.

Validation runs first so an impossible layout costs milliseconds and exits 2 with a
clear message instead of failing inside a collective on some rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec


class DataParallel(StrEnum):
    """Data-parallel implementation: DDP (replicated weights) or FSDP2 (``fully_shard``).

    DDP cannot wrap DTensor parameters, so tensor parallelism needs FSDP2; ``auto``
    picks DDP without TP and FSDP2 with it.
    """

    AUTO = "auto"
    DDP = "ddp"
    FSDP = "fsdp"


class PipelineSchedule(StrEnum):
    """``torch.distributed.pipelining`` schedule for pipeline parallelism."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class FaultMode(StrEnum):
    """Test-only fault injection: what the chosen rank does at the chosen iteration."""

    RAISE = "raise"  # uncaught exception (reaches the agent through the hook)
    EXIT = "exit"  # os._exit(FAULT_EXIT_CODE) without cleanup, like a crash
    KILL = "kill"  # SIGKILL to itself (kill -9), e.g. right after a memory snapshot
    HANG = "hang"  # stop making progress (sleeps until killed)


@dataclass(frozen=True)
class FaultInjection:
    """Make ``rank`` fail with ``mode`` when it starts iteration ``iteration`` (1-based), or,
    with ``after_microbatches`` > 0, once it has finished that many of its micro-batches of
    the iteration (mid-iteration: its finished work dies with it; pipeline parallelism 1).

    With ``once_marker`` the fault fires only if that file does not exist, and creates it
    first: a run relaunched from an earlier checkpoint passes the iteration again without
    failing again (a transient fault, as recovery tests need).
    """

    iteration: int
    rank: int
    mode: FaultMode = FaultMode.RAISE
    once_marker: str | None = None
    after_microbatches: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.after_microbatches, bool) or self.after_microbatches < 0:
            raise InvalidArgument(f"--fail-after-microbatches must be >= 0, got {self.after_microbatches!r}")


@dataclass(frozen=True)
class SlowRank:
    """Test-only straggler: ``rank`` burns ``factor - 1`` times its own compute time of
    every training iteration in extra CPU work before the iteration's collective, as a rank
    on a slower device would (its peers wait for it; its reported compute time grows by
    ``factor``). For the straggler detection's tests (:mod:`detect.stragglers`)."""

    rank: int
    factor: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or self.rank < 0:
            raise InvalidArgument(f"--slow-rank must be >= 0, got {self.rank!r}")
        if not 1.0 <= self.factor <= 100.0:
            raise InvalidArgument(f"--slow-factor must be in [1, 100], got {self.factor!r}")


class CorruptMode(StrEnum):
    """Test-only data corruption: what a corrupted batch does to the step."""

    SPIKE = "spike"  # targets shifted, loss and gradients x16 (an outlier batch): the loss jumps
    NAN = "nan"  # the step's loss and gradients become NaN


@dataclass(frozen=True)
class BatchCorruption:
    """Corrupt the batch of each of ``iterations`` on every rank (a bad stretch of data,
    for the loss-spike roll back's tests). A skipped iteration's batch is never trained on,
    so it cannot spike."""

    iterations: tuple[int, ...]
    mode: CorruptMode = CorruptMode.SPIKE

    def __post_init__(self) -> None:
        if not self.iterations or any(isinstance(i, bool) or i < 1 for i in self.iterations):
            raise InvalidArgument(f"--corrupt-iterations needs iterations >= 1, got {list(self.iterations)}")


_RANGE_RE: Final = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_ranges(text: str, what: str = "--skip-iterations") -> tuple[tuple[int, int], ...]:
    """``A-B,C,D-E`` (1-based, inclusive) -> sorted ``(first, last)`` pairs, overlapping or
    adjacent ones merged; an empty text is no range. Raises InvalidArgument on anything else."""
    pairs: list[tuple[int, int]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _RANGE_RE.match(item)
        if match is None:
            raise InvalidArgument(f"{what} item {item!r}: expected A-B or A (iterations >= 1)")
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if first < 1 or last < first:
            raise InvalidArgument(f"{what} item {item!r}: need 1 <= A <= B")
        pairs.append((first, last))
    merged: list[tuple[int, int]] = []
    for first, last in sorted(pairs):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def format_ranges(ranges: tuple[tuple[int, int], ...]) -> str:
    """Inverse of :func:`parse_ranges` (``A-B`` items joined by commas)."""
    return ",".join(f"{a}-{b}" for a, b in ranges)


def skipped_before(ranges: tuple[tuple[int, int], ...], iteration: int) -> tuple[tuple[int, int], ...]:
    """The part of ``ranges`` at or before ``iteration``: what a run that reached
    ``iteration`` has skipped. A saved version is this run's past only if it skipped exactly
    that (see :mod:`launcher.trainer.snapshots`)."""
    return tuple((a, min(b, iteration)) for a, b in ranges if a <= iteration)


_JOB_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PEER_RE: Final = re.compile(r"^([^=,\s]+)=([^=,\s]+):(\d{1,5})$")


@dataclass(frozen=True)
class PeerSpec:
    """Another node's agent, which may hold shards of this job (``node=host:port``)."""

    node: str
    host: str
    port: int


def parse_peers(text: str) -> tuple[PeerSpec, ...]:
    """``n2=host:port,n3=host:port`` (as the agent exports it) -> peers, in that order."""
    peers = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _PEER_RE.match(item)
        if match is None or not 0 < int(match[3]) < 65536:
            raise InvalidArgument(f"--snapshot-peers item {item!r}: expected NODE=HOST:PORT")
        peers.append(PeerSpec(match[1], match[2], int(match[3])))
    return tuple(peers)


@dataclass(frozen=True)
class SnapshotOptions:
    """The checkpoint engine's tiers for this run (``ckpt/``), nearest first.

    ``snap_dir``: the host-memory tier (ranks write DCP saves there as snapshots, the
    agent seals, persists and replicates them); ``backup_dir``: this node's copies of
    other nodes' snapshots; ``peers``: other nodes' agents; ``local_dir``/``remote_dir``:
    where the agent persists. Shards live under ``<dir>/<job>/``. ``every``: iterations
    between snapshots (0 = only at save-interval iterations, SIGUSR1/SIGTERM and the end).
    ``slots``: versions each rank keeps in the memory tier (the agent derives it from the
    loss detector's window, ``ckpt.memory_versions``, so a roll back past a loss spike
    finds a version older than the spike).
    """

    snap_dir: str
    job: str
    every: int = 0
    backup_dir: str | None = None
    local_dir: str | None = None
    remote_dir: str | None = None
    peers: tuple[PeerSpec, ...] = ()
    slots: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or self.slots < 1:
            raise InvalidArgument(f"--snapshot-slots must be an integer >= 1, got {self.slots!r}")
        if not _JOB_RE.match(self.job):
            raise InvalidArgument(
                f"--snapshot-job {self.job!r}: expected 1-128 of [A-Za-z0-9._-], not starting with . or -"
            )
        if isinstance(self.every, bool) or self.every < 0:
            raise InvalidArgument(f"--snapshot-every must be an integer >= 0, got {self.every!r}")


@dataclass(frozen=True)
class TrainConfig:
    """A validated run: model shape, layout, optimizer, checkpointing, logging.

    Iterations are 1-based as in Megatron: iteration ``k`` consumes global samples
    ``[(k-1)*G, k*G)``; a checkpoint "at k" holds the state after ``k`` iterations.
    ``iterations`` is the total (Megatron's ``--train-iters``) and fixes the learning-rate
    schedule, so a relaunch must pass the same value. ``skip_iterations``: iterations whose
    data is consumed and discarded, never trained on (a roll back past a loss spike; the
    iteration numbers, the data positions and the LR schedule of the others are unchanged).
    ``corruption``: test-only bad batches (:class:`BatchCorruption`).

    ``reuse_microbatches``: when a data-parallel peer dies in the middle of an iteration,
    the surviving ranks keep the gradients of the micro-batches they finished, regroup,
    compute only the lost replica's micro-batches, complete and save that iteration, and
    exit :data:`launcher.trainer.reuse.REUSED_EXIT_CODE` for a restart from it
    (:mod:`launcher.trainer.reuse`). Active at TP1 PP1 on gloo (:attr:`reusing`); at other
    layouts, which unicorn may choose at any relaunch, the run trains as without it.
    ``reuse_settle_s``: how long a missing rank's heartbeat must stand still before the
    survivors agree without it (:func:`~launcher.trainer.reuse.agree_members`).
    ``slowdown``: a test-only straggler rank (:class:`SlowRank`).
    """

    model: ModelSpec
    layout: Layout
    iterations: int
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iterations: int = 2
    weight_decay: float = 0.01
    seed: int = 1234
    save_dir: str | None = None
    save_interval: int | None = None
    load_dir: str | None = None
    load_iteration: int | None = None
    exit_at_iteration: int | None = None
    log_interval: int = 1
    data_parallel: DataParallel = DataParallel.AUTO
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    fault: FaultInjection | None = None
    dist_timeout_s: float = 120.0
    snapshots: SnapshotOptions | None = None
    skip_iterations: tuple[tuple[int, int], ...] = ()
    corruption: BatchCorruption | None = None
    reuse_microbatches: bool = False
    reuse_settle_s: float = 0.5
    slowdown: SlowRank | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_options()
        if self.skip_iterations != parse_ranges(format_ranges(self.skip_iterations)):
            raise InvalidArgument(
                f"skip_iterations must be sorted, disjoint (first, last) pairs, got {self.skip_iterations}"
            )

    def skips(self, iteration: int) -> bool:
        """Whether iteration ``iteration``'s data is skipped (``--skip-iterations``)."""
        return any(a <= iteration <= b for a, b in self.skip_iterations)

    def _check_numbers(self) -> None:
        positive_ints = {"iterations": self.iterations, "log_interval": self.log_interval}
        if self.save_interval is not None:
            positive_ints["save_interval"] = self.save_interval
        if self.exit_at_iteration is not None:
            positive_ints["exit_at_iteration"] = self.exit_at_iteration
        for name, value in positive_ints.items():
            if isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
        if self.warmup_iterations < 0:
            raise InvalidArgument(f"warmup_iterations must be >= 0, got {self.warmup_iterations}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise InvalidArgument(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr} min_lr={self.min_lr}")
        if self.weight_decay < 0:
            raise InvalidArgument(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.dist_timeout_s <= 0:
            raise InvalidArgument(f"dist_timeout_s must be positive, got {self.dist_timeout_s}")
        if not 0 < self.reuse_settle_s <= self.dist_timeout_s:
            raise InvalidArgument(
                f"--reuse-settle-s must be in (0, --dist-timeout-s={self.dist_timeout_s:g}], "
                f"got {self.reuse_settle_s}"
            )

    def _check_options(self) -> None:
        if self.save_interval is not None and self.save_dir is None:
            raise InvalidArgument("--save-interval needs --save-dir")
        if self.load_iteration is not None and (
            (self.load_dir is None and self.snapshots is None) or self.load_iteration < 0
        ):
            raise InvalidArgument("--ckpt-step needs --load or --snapshot-dir, and an iteration >= 0")
        if self.exit_at_iteration is not None and self.exit_at_iteration > self.iterations:
            raise InvalidArgument(
                f"--exit-at-iteration {self.exit_at_iteration} is beyond --iterations {self.iterations}"
            )
        if self.layout.vpp is not None or self.layout.recompute or self.layout.distributed_optimizer:
            raise InvalidArgument("unicorn-train supports neither vpp, recompute nor a distributed optimizer")
        if self.model.num_query_groups != self.model.heads:
            raise InvalidArgument("unicorn-train has no grouped-query attention")
        if self.data_parallel is DataParallel.DDP and self.layout.tp > 1:
            raise InvalidArgument(
                "DDP cannot wrap tensor-parallel (DTensor) weights; use --data-parallel fsdp"
            )
        gpipe_ddp = self.pp_schedule is PipelineSchedule.GPIPE and self.layout.pp > 1 and self.layout.dp > 1
        if gpipe_ddp and self.dp_impl is DataParallel.DDP:
            raise InvalidArgument(
                "GPipe runs every forward before any backward, which DDP's reducer rejects; "
                "use --pp-schedule 1f1b or --data-parallel fsdp"
            )
        if self.fault is not None and self.fault.rank >= self.layout.world_size:
            raise InvalidArgument(
                f"--fail-rank {self.fault.rank} is outside the world of {self.layout.world_size} ranks"
            )
        if self.slowdown is not None and self.slowdown.rank >= self.layout.world_size:
            raise InvalidArgument(
                f"--slow-rank {self.slowdown.rank} is outside the world of {self.layout.world_size} ranks"
            )
        if self.fault is not None and self.fault.after_microbatches and self.layout.pp > 1:
            raise InvalidArgument("--fail-after-microbatches needs pipeline parallelism 1")
        if self.reuse_microbatches and self.save_dir is None and self.snapshots is None:
            raise InvalidArgument(
                "--reuse-microbatches needs --save-dir or a memory tier (--snapshot-dir): "
                "the iteration the survivors complete must be saved for the restart"
            )

    @property
    def reusing(self) -> bool:
        """Whether ``--reuse-microbatches`` is active at this layout: data parallelism only
        (TP1 PP1, not FSDP). The backend (gloo) is checked when the process group exists."""
        return (
            self.reuse_microbatches
            and self.layout.tp == 1
            and self.layout.pp == 1
            and self.data_parallel is not DataParallel.FSDP
        )

    @property
    def dp_impl(self) -> DataParallel:
        """The concrete data-parallel implementation (``auto`` resolved)."""
        if self.data_parallel is not DataParallel.AUTO:
            return self.data_parallel
        return DataParallel.FSDP if self.layout.tp > 1 else DataParallel.DDP


def resolve_layout(
    *,
    tp: int,
    pp: int,
    dp: int | None,
    micro_batch: int,
    global_batch: int,
    world_size: int,
    local_world_size: int,
    model: ModelSpec,
) -> Layout:
    """The layout for this launch, checked against torchrun's world.

    ``dp`` defaults to ``world / (tp*pp)``. Raises :class:`InvalidArgument` when
    ``tp*pp*dp`` differs from the world size, TP does not fit in a node (the node's
    ranks, ``LOCAL_WORLD_SIZE``) or the model, PP does not divide the layers, or
    ``dp*micro_batch`` does not divide the global batch.
    """
    if world_size <= 0 or local_world_size <= 0:
        raise InvalidArgument(f"bad world: WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={local_world_size}")
    for name, value in (("tp", tp), ("pp", pp)):
        if value <= 0:
            raise InvalidArgument(f"{name} must be a positive integer, got {value}")
    if dp is None:
        if world_size % (tp * pp):
            raise InvalidArgument(
                f"tp*pp = {tp}*{pp} = {tp * pp} does not divide the world size {world_size}"
            )
        dp = world_size // (tp * pp)
    layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=global_batch)
    if layout.world_size != world_size:
        raise InvalidArgument(
            f"layout {layout.describe()} needs tp*pp*dp = {layout.world_size} ranks, "
            f"but torchrun started {world_size}"
        )
    layout.validate(model, gpus_per_node=local_world_size)
    return layout
