"""What failures cost each simulated system, every figure with its source.

Two kinds of source:

* **measured**: our own figures, from ``BENCHMARKS.md`` (the section and row are named
  at each field). unicorn pays them, and so does every baseline whose paper gives no
  figure of its own for that step: nobody gets a free snapshot, detection or restart.
* **cited**: a paper's own figure (section named), or a default of our configuration
  (``etc/unicorn.toml``, named).

Model-state bytes: a checkpoint holds the bf16 weights (2 B) and the fp32 master weights,
momentum and variance (12 B) of every parameter, 14 B in all (gradients are not saved),
split evenly over the task's GPUs (a fully parallel, deduplicated save, as Megatron's
distributed checkpoint writes it). Every rank copies, restores or loads its own share in
parallel, at the rate one process reached in our measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plan.sim.trace import EventKind
from unicorn_core.errors import InvalidArgument
from unicorn_core.model import ModelSpec

MINUTE_S = 60.0
GIB = float(1 << 30)
CHECKPOINT_BYTES_PER_PARAMETER = 14.0  # bf16 weight 2 B + fp32 master, momentum, variance 12 B


def checkpoint_gib_per_gpu(model: ModelSpec, gpus: int) -> float:
    """GiB of model state one of ``gpus`` GPUs saves, restores or loads (its even share)."""
    if gpus <= 0:
        return 0.0
    return CHECKPOINT_BYTES_PER_PARAMETER * model.parameters / gpus / GIB


@dataclass(frozen=True)
class Measured:
    """Our measured figures (``BENCHMARKS.md``), p95 where a distribution was measured."""

    # "Detection: scripts/bench/detection.py (2026-11-21)", table rows, p95:
    detect_node_loss_s: float = 1.33  # row "node loss (dev-cluster kill-node)"
    detect_process_exit_s: float = 0.018  # row "process exit (SIGKILL one rank)"
    detect_exception_s: float = 0.006  # row "exception raised in a rank"
    # "The closed-loop redesign against the commit before it (2026-11-23)", rows "this tree",
    # p95 of "resumed" minus p95 of "detect": from the fault's detection to the first new
    # iteration, including everything the dev cluster does on the way. Measured with a tiny
    # model on 2 CPU cores: the restore of a real model's state is added by its size below;
    # a large cluster's slower start (NCCL set-up of many ranks) is not measured
    # (scripts/bench/simulate.py reports unicorn with these x10 as a sensitivity).
    relaunch_s: float = 11.150 - 0.494  # node loss: drain, replan, requeue, relaunch, restore
    restart_in_place_s: float = 7.293 - 0.111  # rank exception: restart the processes in place
    # "Checkpoint engine (2026-11-21, session 6)", 2048 MiB on /dev/shm (the default tier):
    snapshot_s_per_gib: float = 0.147 / 2.0  # row "training stall": blocks the rank this long
    # the slower of the two restore rows: the restored tensors must be the training's own
    restore_s_per_gib: float = 0.958 / 2.0  # row "restore with owned copies (clone of every tensor)"
    save_s_per_gib: float = 5.68 / 2.0  # row "torch.save + fsync (reference)": a persistent save
    load_s_per_gib: float = 1.579 / 2.0  # row "torch.load / restore from memory", torch.load side

    def __post_init__(self) -> None:
        if min(vars(self).values()) < 0:
            raise InvalidArgument("measured costs must be >= 0")


MEASURED = Measured()


def measured_detection_s(measured: Measured, kind: EventKind) -> float:
    """Our detection time of a failure of ``kind``: a lost node, a process exit (SEV2), an
    exception such as a reset connection (SEV3)."""
    return {
        EventKind.SEV1: measured.detect_node_loss_s,
        EventKind.SEV2: measured.detect_process_exit_s,
        EventKind.SEV3: measured.detect_exception_s,
        EventKind.NODE_RETURN: 0.0,
    }[kind]


@dataclass(frozen=True)
class UnicornCosts:
    """unicorn's own mechanisms and their costs (also those of ``per-task``).

    * Detection, restarts and relaunches: :class:`Measured`.
    * SEV3 is retried in place (Unicron Fig. 7; our ladder's ``retry_in_place``). How long a
      transient fault stalls training before the retry resumes it is not measured, so the
      simulator charges the ladder's worst case: no iteration for ``retry_timeout_s``, then
      a restart in place (``etc/unicorn.toml`` ``[recovery] retry_timeout_s``).
    * Memory snapshots every ``snapshot_every`` iterations (``[ckpt] snapshot_every``),
      each stalling training for one copy of the rank's share (measured); ``None``: the
      Young/Daly interval sqrt(2 x stall x MTBF) with the planner's node MTBF.
    * A process or network fault leaves the node: the just-in-time snapshot
      (ARCHITECTURE.md "Just-in-time state") loses at most the iteration in flight. A lost
      node loses its shard of every snapshot not yet copied to its ring peer
      (``[ckpt] peer_factor = 1``), which is rate-limited to ``peer_rate_mib_s`` (256).
    """

    measured: Measured = MEASURED
    retry_timeout_s: float = 60.0  # etc/unicorn.toml [recovery] retry_timeout_s
    snapshot_every: int | None = 10  # etc/unicorn.toml [ckpt] snapshot_every
    peer_rate_mib_s: float = 256.0  # etc/unicorn.toml [ckpt] peer_rate_mib_s

    def __post_init__(self) -> None:
        if self.retry_timeout_s < 0 or not self.peer_rate_mib_s > 0:
            raise InvalidArgument("retry_timeout_s must be >= 0 and peer_rate_mib_s > 0")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise InvalidArgument(f"snapshot_every must be >= 1 or None, got {self.snapshot_every}")

    def detection_s(self, kind: EventKind) -> float:
        return measured_detection_s(self.measured, kind)

    def snapshot_stall_s(self, model: ModelSpec, gpus: int) -> float:
        """Seconds one memory snapshot blocks training."""
        return checkpoint_gib_per_gpu(model, gpus) * self.measured.snapshot_s_per_gib

    def restore_s(self, model: ModelSpec, gpus: int) -> float:
        """Seconds to restore the model state from host memory or peers (any layout)."""
        return checkpoint_gib_per_gpu(model, gpus) * self.measured.restore_s_per_gib

    def replication_lag_s(self, model: ModelSpec, gpus: int, nodes: int) -> float:
        """Seconds until a node's snapshot shard has reached its ring peer."""
        if nodes <= 1:
            return 0.0
        node_gib = checkpoint_gib_per_gpu(model, gpus) * gpus / nodes
        return node_gib * 1024.0 / self.peer_rate_mib_s

    def snapshot_interval_s(self, model: ModelSpec, gpus: int, iteration_s: float, mtbf_s: float) -> float:
        """Seconds between memory snapshots (``snapshot_every`` iterations, or Young/Daly)."""
        if self.snapshot_every is not None:
            return self.snapshot_every * iteration_s
        stall = self.snapshot_stall_s(model, gpus)
        return max(iteration_s, math.sqrt(2.0 * stall * mtbf_s))


@dataclass(frozen=True)
class MegatronCosts:
    """Plain Megatron-LM's terminate-and-restart costs.

    Unicron Section 2 breaks a manual recovery on 256 H800 GPUs into a 30 min hang until
    the all-reduce timeout, 9 min of resubmission, 14 min of environment set-up (which
    includes loading the checkpoint) and 15 min of recomputation: half of a 30 min
    persistent checkpoint interval. Megatron-LM's ``--save`` is synchronous, so every
    checkpoint stalls training for the rank's share at our measured ``torch.save`` +
    fsync rate (:class:`Measured`; Unicron gives no figure for it).
    """

    detection_s: float = 30 * MINUTE_S  # Unicron Sec. 2: hang until the all-reduce timeout
    resubmit_s: float = 9 * MINUTE_S  # Unicron Sec. 2: resubmission
    setup_s: float = 14 * MINUTE_S  # Unicron Sec. 2: environment set-up (incl. checkpoint load)
    checkpoint_interval_s: float = 30 * MINUTE_S  # Unicron Sec. 2: 15 min recomputed on average
    measured: Measured = MEASURED

    def __post_init__(self) -> None:
        values = (self.detection_s, self.resubmit_s, self.setup_s)
        if min(values) < 0 or not self.checkpoint_interval_s > 0:
            raise InvalidArgument("megatron costs must be >= 0 and the checkpoint interval > 0")

    @property
    def restart_s(self) -> float:
        return self.resubmit_s + self.setup_s

    def save_s(self, model: ModelSpec, gpus: int) -> float:
        """Seconds one synchronous persistent checkpoint stalls training."""
        return checkpoint_gib_per_gpu(model, gpus) * self.measured.save_s_per_gib

    def stall_fraction(self, model: ModelSpec, gpus: int) -> float:
        """Share of training time spent in persistent saves."""
        save = self.save_s(model, gpus)
        return save / (self.checkpoint_interval_s + save)


@dataclass(frozen=True)
class ElasticCosts:
    """Oobleck, Varuna and Bamboo: what their papers fix, and our measured figures for the rest.

    None of the three papers gives a detection time or a restart time on our kind of
    cluster, so all three detect and restart at our measured speed (:class:`Measured`).

    * Oobleck (Jang et al., SOSP'23, arXiv 2309.08125): ``oobleck_f`` is the fault-tolerance
      threshold f of Section 4: at least f+1 pipelines, from templates of n0 to N - f n0
      nodes (N: the task's allocation). The paper leaves f to the user; f = 1 (its
      artifact's example) is the smallest that tolerates a failure.
    * Varuna (Athlur et al., EuroSys'22, arXiv 2111.04007): persistent checkpoints every
      ``varuna_checkpoint_interval_s``. The paper's interval for our setting is not given;
      we use Megatron's 30 min (Unicron Sec. 2), and its background upload does not stall
      the step beyond the local write, charged at our measured ``torch.save`` rate.
    * Bamboo (Thorpe et al., NSDI'23, arXiv 2204.12013): a failover (a predecessor takes over
      its lost successor's stage from its redundant copy) pauses the pipeline for as long
      as our measured in-place restart (assumption: no figure in the paper).
    """

    measured: Measured = MEASURED
    oobleck_f: int = 1
    varuna_checkpoint_interval_s: float = 30 * MINUTE_S

    def __post_init__(self) -> None:
        if self.oobleck_f < 0 or not self.varuna_checkpoint_interval_s > 0:
            raise InvalidArgument("oobleck_f must be >= 0 and the Varuna checkpoint interval > 0")

    def detection_s(self, kind: EventKind) -> float:
        return measured_detection_s(self.measured, kind)

    def state_copy_s(self, model: ModelSpec, gpus: int) -> float:
        """Seconds to copy the model state from surviving replicas (Oobleck Sec. 5, Bamboo)."""
        return checkpoint_gib_per_gpu(model, gpus) * self.measured.restore_s_per_gib

    def checkpoint_load_s(self, model: ModelSpec, gpus: int) -> float:
        """Seconds to load a persistent checkpoint (Varuna)."""
        return checkpoint_gib_per_gpu(model, gpus) * self.measured.load_s_per_gib

    def checkpoint_save_s(self, model: ModelSpec, gpus: int) -> float:
        """Seconds of one persistent checkpoint's local write (Varuna)."""
        return checkpoint_gib_per_gpu(model, gpus) * self.measured.save_s_per_gib

    def varuna_stall_fraction(self, model: ModelSpec, gpus: int) -> float:
        save = self.checkpoint_save_s(model, gpus)
        return save / (self.varuna_checkpoint_interval_s + save)
