"""The training loop of ``unicorn-train`` (one process = one torchrun rank).

Per iteration ``k`` (1-based): every DP replica takes its slice of global samples
``[(k-1)*G, k*G)``, runs its micro-batches (:class:`~launcher.trainer.parallel.StepRunner`),
the optimizer steps, and one all-reduce over the world combines the replica losses and
the ranks' stop flags. That all-reduce is the only agreement point: a SIGTERM seen by
any rank before it makes *every* rank save after the same iteration and exit 0 (the
just-in-time save), so no rank waits in a collective the others skip. A SIGUSR1 (the
agent's ``checkpoint_now``) seen by any rank makes every rank save after the same
iteration and go on training.

With a memory tier (``--snapshot-dir``, :mod:`launcher.trainer.snapshots`) the ranks
also snapshot into shared memory every ``--snapshot-every`` iterations, at save-interval
iterations, on SIGUSR1 (memory only: the agent persists it), on SIGTERM (memory, then
``--save-dir``) and at the end; on start they restore the newest version from the
nearest tier holding it, and use ``--load`` only when it holds a newer one. A
just-in-time thread (:class:`~launcher.trainer.snapshots.TrainerJit`) also snapshots the
last completed iteration, without collectives, when SIGTERM or SIGUSR1 arrives while the
main thread is stuck in a collective with a dead peer, and a rank whose own step raised
snapshots it on its way out: a restart then loses at most the iteration in flight.

With ``--reuse-microbatches`` (TP1 PP1, gloo) a replica's micro-batches are summed
locally and the iteration's one collective is an all-reduce of those gradients with the
flags; when it fails because a peer died, the survivors complete the iteration from the
micro-batches they finished plus the lost replica's, save it and exit 4
(:mod:`launcher.trainer.reuse`).

Each training iteration's report carries the rank's compute time (``compute_s``, for the
straggler detection, :mod:`detect.stragglers`) and its pipeline stage. On CPU it is the
process's CPU time over the step (:func:`time.process_time`, every thread): a rank waiting
for a peer in a collective sleeps and accrues none, and a CPU it is kept off by other
processes does not count either. Wall time outside the collective calls would not do:
DDP overlaps its gradient all-reduce with the backward pass and waits for it inside
``backward()``, so a fast rank's backward lasts as long as the slowest rank's. On CUDA
the host's CPU time says nothing about the kernels; it would need CUDA events around the
compute on the compute stream, the NCCL kernels and the stream waits on them excluded,
which this trainer does not do: it reports None there. ``--slow-rank R --slow-factor F``
(test only) makes rank R a straggler: it burns ``F - 1`` times its compute time in extra
CPU work before the iteration's collective.

Exit codes (``main`` in :mod:`launcher.train`): 0 finished or stopped by SIGTERM after
saving; 1 uncaught error; 2 invalid arguments or layout; 3 injected ``exit`` fault; 4 a
data-parallel peer died mid-iteration and this rank completed and saved that iteration
(restart from it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from launcher.hook import get_hook
from launcher.trainer import checkpoint
from launcher.trainer.config import (
    CorruptMode,
    DataParallel,
    FaultMode,
    TrainConfig,
    format_ranges,
    skipped_before,
)
from launcher.trainer.data import batch, replica_samples
from launcher.trainer.logline import iteration_line
from launcher.trainer.model import build_stage, lm_loss, placement
from launcher.trainer.parallel import (
    StepRunner,
    apply_data_parallel,
    apply_tensor_parallel,
    build_mesh,
    replica_names,
)
from launcher.trainer.reuse import (
    BEATS_PER_SETTLE,
    REUSED_EXIT_CODE,
    Heartbeat,
    MicroBatchGrads,
    PeerLost,
    Reduced,
    Regrouped,
    job_store,
    microbatch_samples,
    missing_microbatches,
    regroup,
    replica_microbatches,
    share,
)
from launcher.trainer.snapshots import MemoryCheckpoints, TrainerJit
from unicorn_core.errors import InvalidArgument, UnicornError
from unicorn_core.protocol import IterationPhase

FAULT_EXIT_CODE: Final = 3
SPIKE_FACTOR: Final = 16.0
"""A corrupted batch (``--corrupt-mode spike``, test only) has its targets shifted and its
loss and gradients scaled by this: an outlier batch. Shifted targets alone do not stand out
while the tiny model still predicts nearly uniformly (every target then costs ln V)."""


class InjectedFault(RuntimeError):
    """Raised by ``--fail-mode raise`` (test fault injection only)."""


@dataclass
class StartupClock:
    """Wall-clock marks (``time.time()``) of one rank's start, for the relaunch benchmark.

    Wall time because the benchmark compares them with the time it issued the
    relaunch, in another process.
    """

    main_s: float
    imported_s: float = 0.0
    initialized_s: float = 0.0
    built_s: float = 0.0
    loaded_s: float = 0.0
    first_iteration_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def learning_rate(iteration: int, cfg: TrainConfig) -> float:
    """Megatron's linear warm-up then cosine decay to ``min_lr`` at ``cfg.iterations``; stateless."""
    if cfg.warmup_iterations and iteration <= cfg.warmup_iterations:
        return cfg.lr * iteration / cfg.warmup_iterations
    span = max(1, cfg.iterations - cfg.warmup_iterations)
    progress = min(1.0, (iteration - cfg.warmup_iterations) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


_SD_OPTIONS: Final = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState(Stateful):
    """Model and optimizer as DCP sees them: global parameter names, DTensor shards resharded on load.

    The optimizer state is flattened to one key per parameter (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``): the default nested form keeps one ``param_groups`` list
    per rank under a shared key, which pipeline stages (holding different parameters)
    would overwrite with each other's.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_SD_OPTIONS)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=_SD_OPTIONS,
        )


def _meta(cfg: TrainConfig) -> dict[str, int]:
    """What must match for a checkpoint to continue this run (the layout may differ)."""
    m = cfg.model
    return {
        "seed": cfg.seed,
        "layers": m.layers,
        "hidden": m.hidden,
        "heads": m.heads,
        "ffn_hidden": m.ffn_hidden,
        "sequence": m.sequence,
        "vocabulary": m.vocabulary,
        "global_batch": cfg.layout.global_batch,
    }


class _StopFlag:
    """``requested`` is set by SIGTERM (save and stop), ``save_requested`` by SIGUSR1 (the
    agent's checkpoint_now: save after this iteration and go on); both read once per
    iteration."""

    def __init__(self) -> None:
        self.requested = False
        self.save_requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGUSR1:
            self.save_requested = True
        else:
            self.requested = True


def _inject_fault(cfg: TrainConfig, iteration: int, rank: int, *, after_microbatches: int = 0) -> None:
    """Fire the configured fault if it is due: at the start of ``iteration``
    (``after_microbatches`` 0), or once this rank finished that many of its micro-batches."""
    fault = cfg.fault
    if (
        fault is None
        or fault.iteration != iteration
        or fault.rank != rank
        or fault.after_microbatches != after_microbatches
    ):
        return
    if fault.once_marker is not None:
        marker = Path(fault.once_marker)
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"fault at iteration {iteration} on rank {rank}\n")
    where = f" after {after_microbatches} micro-batches" if after_microbatches else ""
    print(f"[unicorn-train] rank {rank}: injecting fault {fault.mode} at iteration {iteration}{where}")
    sys.stdout.flush()
    if fault.mode is FaultMode.RAISE:
        raise InjectedFault(f"injected fault at iteration {iteration} on rank {rank}")
    if fault.mode is FaultMode.EXIT:
        os._exit(FAULT_EXIT_CODE)
    if fault.mode is FaultMode.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # HANG: no progress until killed
        time.sleep(3600)


def run(cfg: TrainConfig, clock: StartupClock) -> int:
    """Train on this rank under an initialised torchrun environment; returns the exit code.

    The hook and the SIGTERM handler are installed first, so an exception or a stop
    request during start-up (rendezvous, checkpoint load) is not lost.
    """
    get_hook().install()
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, stop)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=cfg.dist_timeout_s))
    try:
        return _train(cfg, clock, rank, device, stop)
    finally:
        dist.destroy_process_group()


def _train(cfg: TrainConfig, clock: StartupClock, rank: int, device: torch.device, stop: _StopFlag) -> int:
    trainer = _Trainer(cfg, clock, rank, device, stop)
    done = trainer.load()
    clock.loaded_s = time.time()
    if rank == 0:
        reuse = ""
        if cfg.reuse_microbatches:
            active = trainer.grads is not None
            reuse = " reuse_microbatches=" + ("on" if active else "off (needs TP1 PP1 on gloo)")
        print(
            f"[unicorn-train] layout {cfg.layout.describe()} dp={cfg.dp_impl} pp_schedule={cfg.pp_schedule} "
            f"device={device.type} world={dist.get_world_size()} resumed_from={done}{reuse}",
            flush=True,
        )
    trainer.start_jit(done)
    try:
        if trainer.store is not None:  # --reuse-microbatches: the survivors' agreement reads it
            trainer.heartbeat = Heartbeat(trainer.store, rank, cfg.reuse_settle_s / BEATS_PER_SETTLE)
        iteration, last_saved = _loop(cfg, trainer, rank, done)
    except PeerLost as lost:  # --reuse-microbatches: a peer died in the all-reduce
        return trainer.complete_after_peer_loss(lost)
    except Exception:
        if trainer.jit is not None:  # this rank's own step failed: keep the last completed one
            trainer.jit.take_now("exception")
        raise
    finally:
        if trainer.jit is not None:
            trainer.jit.stop()
        if trainer.heartbeat is not None:
            trainer.heartbeat.stop()
    if rank == 0:
        print(f"[unicorn-train] done at iteration {iteration} (last saved {last_saved})", flush=True)
    if trainer.memory is not None:
        trainer.memory.close()
    _leave_together(rank)
    return 0


def _leave_together(rank: int, timeout_s: float = 10.0) -> None:
    """Wait for every rank before the group is destroyed: a gloo rank that destroys it while
    a peer's last messages are still in flight can abort ("terminate called without an
    active exception", seen at the end of TP runs). Bounded: a peer that never comes costs
    at most ``timeout_s`` (gloo's monitored barrier), and only a warning."""
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
        else:
            dist.barrier()
    except RuntimeError as exc:
        print(f"[unicorn-train] rank {rank}: peers did not finish together: {exc}", file=sys.stderr)


def _loop(cfg: TrainConfig, trainer: _Trainer, rank: int, done: int) -> tuple[int, int]:
    """Iterations ``done + 1`` on; returns the last one run and the last one saved."""
    iteration, last_saved = done, done
    for iteration in range(done + 1, cfg.iterations + 1):
        _inject_fault(cfg, iteration, rank)
        if cfg.skips(iteration):
            stop_now = trainer.skip_iteration(iteration)
        else:
            stop_now = trainer.train_iteration(iteration, first=iteration == done + 1)
        exiting = stop_now or iteration == cfg.exit_at_iteration
        periodic = cfg.save_interval is not None and iteration % cfg.save_interval == 0
        asked = trainer.save_now
        due = periodic or exiting or iteration == cfg.iterations
        where = []
        if trainer.memory is not None and (due or asked or trainer.snapshot_due(iteration)):
            trainer.snapshot(iteration)
            where.append("memory")
        if cfg.save_dir is not None and (due or (asked and trainer.memory is None)):
            trainer.save(iteration, cfg.save_dir)
            where.append(cfg.save_dir)
        if where:
            last_saved = iteration
            if asked and rank == 0:
                print(
                    f"[unicorn-train] saved iteration {iteration} ({', '.join(where)}) on request (SIGUSR1)",
                    flush=True,
                )
        if exiting:
            if rank == 0:
                reason = "SIGTERM" if stop_now else "--exit-at-iteration"
                print(f"[unicorn-train] stopping after iteration {iteration} ({reason})", flush=True)
            break
    return iteration, last_saved


class _Trainer:
    """One rank's model, optimizer and step runner, built for ``cfg.layout``."""

    def __init__(
        self, cfg: TrainConfig, clock: StartupClock, rank: int, device: torch.device, stop: _StopFlag
    ) -> None:
        self.cfg, self.clock, self.rank, self.device, self.stop = cfg, clock, rank, device, stop
        self.save_now = False  # some rank got SIGUSR1 before the last iteration's agreement
        layout = cfg.layout
        mesh = build_mesh(layout, device.type)
        clock.initialized_s = time.time()
        self.hook = get_hook()
        pp_rank = mesh.get_local_rank("pp")
        self.stage = pp_rank
        stage = build_stage(cfg.model, placement(cfg.model, pp_rank, layout.pp), cfg.seed).to(device)
        apply_tensor_parallel(stage, mesh)
        # --reuse-microbatches: no DDP wrapper; the replica's micro-batch gradients are summed
        # locally and all-reduced once per iteration (MicroBatchGrads).
        reusing = cfg.reusing and dist.get_backend() == "gloo"
        module = stage if reusing else apply_data_parallel(stage, mesh, cfg.dp_impl, pipelined=layout.pp > 1)
        self.optimizer = torch.optim.AdamW(
            stage.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay
        )
        self.runner = StepRunner(module, mesh, layout, device, cfg.pp_schedule)
        self.grads = MicroBatchGrads(list(stage.parameters())) if reusing else None
        self.store = job_store() if reusing else None
        self.heartbeat: Heartbeat | None = None
        self.state: dict[str, Any] = {"train": TrainState(stage, self.optimizer), "meta": _meta(cfg)}
        self.memory = (
            MemoryCheckpoints(
                cfg.snapshots,
                rank,
                dist.get_world_size(),
                cfg.skip_iterations,
                replicas=replica_names(mesh, replicated=cfg.dp_impl is not DataParallel.FSDP),
            )
            if cfg.snapshots is not None
            else None
        )
        self.jit: TrainerJit | None = None
        self.is_logger = rank == dist.get_world_size() - 1  # Megatron logs from the last rank (last stage)
        self._window_t0: float | None = None  # monotonic start of the log window
        self._window_n = 0
        clock.built_s = time.time()

    def load(self) -> int:
        """Restore the newest version (or ``--ckpt-step``'s), nearest tier first: the memory
        tiers, then ``--load`` (used when it holds a newer version than they do).
        Returns the iterations already done."""
        cfg = self.cfg
        on_disk = None
        if cfg.load_dir is not None and cfg.load_iteration is None:
            box = [self._disk_version(cfg.load_dir) if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            on_disk = box[0]
        if self.memory is not None:
            restored = self.memory.restore(self.state, exactly=cfg.load_iteration, at_least=on_disk)
            if restored is not None:
                self._check_meta(f"the memory tier {self.memory.snap.job_dir}")
                if self.rank == 0:
                    print(
                        f"[unicorn-train] restored iteration {restored.iteration} from the memory tiers: "
                        f"{restored.describe()}",
                        flush=True,
                    )
                return restored.iteration
            if self.rank == 0:
                newer = f" newer than --load's {on_disk}" if on_disk is not None else ""
                print(f"[unicorn-train] no complete version{newer} in the memory tiers", flush=True)
        if cfg.load_dir is None:
            if cfg.load_iteration is not None:
                raise InvalidArgument(f"no tier holds a complete version of iteration {cfg.load_iteration}")
            return 0
        if cfg.load_iteration is None:
            loaded = None if on_disk is None else checkpoint.load_version(self.state, cfg.load_dir, on_disk)
        else:
            loaded = checkpoint.load_version(self.state, cfg.load_dir, cfg.load_iteration)
        if loaded is None:
            return 0
        self._check_meta(cfg.load_dir)
        if self.rank == 0:
            print(f"[unicorn-train] restored iteration {loaded} from --load {cfg.load_dir}", flush=True)
        return loaded

    def _disk_version(self, directory: str) -> int | None:
        """The version of ``--load`` to resume from: the published one, or with
        ``--skip-iterations`` the newest complete one, not newer, whose saving run skipped
        what this run skips by then (never one trained on data this run skips)."""
        latest = checkpoint.latest_iteration(directory)
        skip = self.cfg.skip_iterations
        if not skip or latest is None:
            return latest
        for version in checkpoint.complete_versions(directory):
            if version <= latest and checkpoint.skipped_of(directory, version) == format_ranges(
                skipped_before(skip, version)
            ):
                return version
        return None

    def start_jit(self, done: int) -> None:
        """With a memory tier: start the just-in-time thread; ``done`` is the restored iteration."""
        if self.memory is None:
            return
        self.jit = TrainerJit(self.memory, self.state)
        if done:
            self.jit.completed(done)
            if not self.memory.has_replicas:  # else see snapshot()
                self.jit.saved(done)  # a tier holds it already
        self.jit.watch_signals(signal.SIGTERM, signal.SIGUSR1)
        self.jit.start()

    def _updating(self) -> contextlib.AbstractContextManager[None]:
        """The JIT thread's lock around a state change or a snapshot (none without a tier)."""
        return self.jit.updating() if self.jit is not None else contextlib.nullcontext()

    def _check_meta(self, where: str) -> None:
        if self.state["meta"] != _meta(self.cfg):
            raise InvalidArgument(
                f"checkpoint in {where} was saved for {self.state['meta']}, this run is {_meta(self.cfg)}"
            )

    def snapshot_due(self, iteration: int) -> bool:
        every = self.cfg.snapshots.every if self.cfg.snapshots is not None else 0
        return every > 0 and iteration % every == 0

    def snapshot(self, iteration: int) -> None:
        """Save into the memory tier; the rank blocks for DCP's planning and the copy only."""
        assert self.memory is not None
        self.hook.slow_step(IterationPhase.CHECKPOINT)
        # One save at a time into this rank's writer; a save that fails (a peer died in
        # its collectives) leaves the state consistent for the JIT snapshot.
        with self.jit.saving() if self.jit is not None else contextlib.nullcontext():
            stall_s = self.memory.save(self.state, iteration)
        if self.jit is not None:
            if self.memory.has_replicas:
                # This save is deduplicated across the data-parallel replicas: a failure
                # before the next save still takes a complete just-in-time copy of this
                # iteration (which stands in for a lost replica's shard), also when a JIT
                # copy of it was written before this save replaced it.
                self.jit.replaced(iteration)
            else:
                self.jit.saved(iteration)
        self.hook.iteration(
            iteration, stall_s, phase=IterationPhase.CHECKPOINT, final=iteration == self.cfg.iterations
        )
        if dist.get_rank() == 0:
            print(
                f"[unicorn-train] snapshot of iteration {iteration} in memory ({stall_s:.3f} s)", flush=True
            )

    def train_iteration(self, iteration: int, *, first: bool) -> bool:
        """One optimizer step over the global batch; returns whether any rank asked to stop.

        Raises :class:`PeerLost` (``--reuse-microbatches``) when the iteration's all-reduce
        fails: :meth:`complete_after_peer_loss` then completes it with the survivors."""
        cfg, layout = self.cfg, self.cfg.layout
        t0, cpu0 = time.monotonic(), time.process_time()
        lr = learning_rate(iteration, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.grads is not None:
            loss, stop_now = self._accumulated_step(iteration, t0, cpu0)
        else:
            loss, stop_now = self._replica_step(iteration, cpu0)
        dt = time.monotonic() - t0
        compute_s = self._compute_since(cpu0)
        if first:
            self.clock.first_iteration_s = time.time()
            if self.rank == 0:
                print(f"[unicorn-train] startup {json.dumps(asdict(self.clock))}", flush=True)
        self.hook.iteration(
            iteration,
            dt,
            samples=layout.global_batch,
            phase=IterationPhase.TRAIN,
            loss=loss,
            final=iteration == cfg.iterations,
            microbatches=layout.global_batch // layout.micro_batch,
            compute_s=compute_s,
            stage=self.stage,
        )
        self._log(iteration, dt, lr, loss, force=stop_now)
        return stop_now

    def _compute_since(self, cpu0: float) -> float | None:
        """This rank's compute time since ``cpu0`` (:func:`time.process_time`): its CPU time
        on a CPU device, None on any other (see the module docstring)."""
        return time.process_time() - cpu0 if self.device.type == "cpu" else None

    def _straggle(self, cpu0: float) -> None:
        """``--slow-rank`` (test only): on that rank, burn ``factor - 1`` times the CPU time
        spent since ``cpu0`` before the iteration's collective (a slower device)."""
        slow = self.cfg.slowdown
        if slow is None or slow.rank != self.rank:
            return
        now = time.process_time()
        until = now + (slow.factor - 1.0) * (now - cpu0)
        while time.process_time() < until:
            pass

    def _replica_step(self, iteration: int, cpu0: float) -> tuple[float, bool]:
        """This replica's micro-batches (DDP/FSDP2 reduce the gradients), the optimizer step,
        then the agreement all-reduce of the replica losses and the flags; returns the
        global loss and whether any rank asked to stop."""
        cfg, layout = self.cfg, self.cfg.layout
        first_index, count = replica_samples(
            iteration, global_batch=layout.global_batch, dp=layout.dp, dp_rank=self.runner.coords.dp
        )
        inputs, targets = batch(
            first_index, count, seed=cfg.seed, sequence=cfg.model.sequence, vocabulary=cfg.model.vocabulary
        )
        targets = self._corrupt_targets(iteration, targets)
        local_loss = self._corrupt_step(
            iteration,
            self.runner.step(
                inputs.to(self.device),
                targets.to(self.device),
                on_microbatch=lambda done: _inject_fault(cfg, iteration, self.rank, after_microbatches=done),
            ),
        )
        # The state a JIT snapshot may take changes here only (the lr set above is
        # recomputed every iteration, so a snapshot holding the next one's is harmless).
        with self._updating():
            self.optimizer.step()
        if self.jit is not None:
            self.jit.completed(iteration)
        self._straggle(cpu0)
        replica_weight = 1.0 / (layout.tp * layout.dp)  # every last-stage rank holds its replica's loss
        agreed = torch.tensor(
            [
                0.0 if local_loss is None else local_loss * replica_weight,
                1.0 if self.stop.requested else 0.0,
                1.0 if self.stop.save_requested else 0.0,
            ],
            dtype=torch.float64,
            device=self.device,
        )
        self.stop.save_requested = False
        dist.all_reduce(agreed)
        self.save_now = bool(agreed[2].item() > 0)
        return float(agreed[0].item()), bool(agreed[1].item() > 0)

    # --- --reuse-microbatches ---------------------------------------------------------

    def _accumulated_step(self, iteration: int, started_s: float, cpu0: float) -> tuple[float, bool]:
        """``--reuse-microbatches``: this replica's micro-batches summed locally, one all-reduce
        of gradients, losses and flags, the optimizer step. Raises :class:`PeerLost` when the
        all-reduce fails (this rank's finished micro-batches stay in ``self.grads``)."""
        assert self.grads is not None
        cfg, layout = self.cfg, self.cfg.layout
        self.grads.reset()
        self._announce_corruption(iteration)
        mine = replica_microbatches(self.runner.coords.dp, layout.num_microbatches)
        for done, index in enumerate(mine, start=1):
            self._microbatch(iteration, index)
            _inject_fault(cfg, iteration, self.rank, after_microbatches=done)
        self._straggle(cpu0)
        flags = (1.0 if self.stop.requested else 0.0, 1.0 if self.stop.save_requested else 0.0)
        self.stop.save_requested = False
        failure = None
        try:
            reduced = self.grads.all_reduce(flags)
        except RuntimeError as exc:  # gloo: "Connection closed by peer" within milliseconds
            failure = str(exc)
        if failure is not None:  # raised here, with no reference to the collective's frame
            raise PeerLost(iteration, failure, started_s)
        loss = self._apply_reduced(iteration, reduced)
        self.save_now = reduced.flags[1] > 0
        return loss, reduced.flags[0] > 0

    def _microbatch(self, iteration: int, index: int) -> None:
        """Forward and backward of global micro-batch ``index``, added to ``self.grads``."""
        assert self.grads is not None
        cfg, layout = self.cfg, self.cfg.layout
        first, count = microbatch_samples(
            iteration, index, global_batch=layout.global_batch, micro_batch=layout.micro_batch
        )
        inputs, targets = batch(
            first, count, seed=cfg.seed, sequence=cfg.model.sequence, vocabulary=cfg.model.vocabulary
        )
        targets = self._corrupt_targets(iteration, targets, announce=False)
        loss = lm_loss(self.runner.module(inputs.to(self.device)), targets.to(self.device))
        torch.autograd.backward(loss)
        self.grads.add(index, float(loss.item()))

    def _apply_reduced(self, iteration: int, reduced: Reduced) -> float:
        """Gradients := the mean over every micro-batch of the global batch; the optimizer
        step; returns the iteration's loss."""
        assert self.grads is not None
        total = self.cfg.layout.global_batch // self.cfg.layout.micro_batch
        if reduced.microbatches != total:
            raise RuntimeError(
                f"iteration {iteration}: the all-reduce covered {reduced.microbatches} "
                f"of {total} micro-batches"
            )
        self.grads.write_mean(reduced, total)
        loss = self._corrupt_step(iteration, reduced.loss_sum / total)
        assert loss is not None
        with self._updating():
            self.optimizer.step()
        if self.jit is not None:
            self.jit.completed(iteration)
        return loss

    def complete_after_peer_loss(self, lost: PeerLost) -> int:
        """Complete the iteration in flight with the survivors, save it, return exit code 4.

        The just-in-time thread is stopped first: it must never snapshot this iteration
        through the old world's writer (shards of two saves of one iteration are refused).
        The survivors regroup (:func:`~launcher.trainer.reuse.regroup`), compute the lost
        replicas' micro-batches between them, all-reduce, step, and save the iteration
        on the new group (memory tier and ``--save-dir``)."""
        assert self.grads is not None and self.store is not None
        cfg, layout = self.cfg, self.cfg.layout
        iteration = lost.iteration
        if self.jit is not None:
            self.jit.stop()
            self.jit = None
        if self.memory is not None:
            self.memory.close()
        why = f"[unicorn-train] rank {self.rank}: {lost}; regrouping with the survivors"
        print(why, file=sys.stderr, flush=True)
        group = regroup(
            self.store,
            self.grads,
            tag=str(iteration),
            rank=self.rank,
            world_size=layout.world_size,
            settle_s=cfg.reuse_settle_s,
            timeout_s=cfg.dist_timeout_s,
        )
        self.is_logger = group.rank == group.world_size - 1
        missing = missing_microbatches(group.members, layout.dp, layout.num_microbatches)
        for index in share(missing, group.members, self.rank):
            self._microbatch(iteration, index)
        loss = self._apply_reduced(iteration, self.grads.all_reduce())
        dt = time.monotonic() - lost.started_s
        total = layout.global_batch // layout.micro_batch
        self.hook.iteration(
            iteration,
            dt,
            samples=layout.global_batch,
            phase=IterationPhase.TRAIN,
            loss=loss,
            final=iteration == cfg.iterations,
            microbatches=total,
            recomputed_microbatches=len(missing),
        )
        self._log(iteration, dt, learning_rate(iteration, cfg), loss, force=True)
        if group.rank == 0:
            lost_ranks = sorted(set(range(layout.world_size)) - set(group.members))
            print(
                f"[unicorn-train] iteration {iteration} completed without DP replicas {lost_ranks} "
                f"(lost mid-iteration): survivors {list(group.members)} agreed in {group.waited_s:.3f} s, "
                f"reused {total - len(missing)} finished micro-batches, "
                f"recomputed_microbatches={len(missing)} microbatches_per_iteration={total}, "
                f"{time.monotonic() - lost.failed_s:.3f} s after the failure",
                flush=True,
            )
        where = self._save_completed(iteration, group)
        if group.rank == 0:
            print(
                f"[unicorn-train] exiting {REUSED_EXIT_CODE} after saving iteration {iteration} "
                f"({', '.join(where) or 'nowhere'}) {time.monotonic() - lost.failed_s:.3f} s after the "
                "failure: restart from it",
                flush=True,
            )
        _leave_together(self.rank)
        return REUSED_EXIT_CODE

    def _save_completed(self, iteration: int, group: Regrouped) -> list[str]:
        """Save ``iteration`` on the survivors' group: a memory-tier writer per new rank (the
        version's world is the survivors'), then ``--save-dir``."""
        where = []
        if self.cfg.snapshots is not None:
            self.memory = MemoryCheckpoints(
                self.cfg.snapshots, group.rank, group.world_size, self.cfg.skip_iterations
            )
            self.snapshot(iteration)
            self.memory.close()
            where.append("memory")
        if self.cfg.save_dir is not None:
            self.save(iteration, self.cfg.save_dir)
            where.append(self.cfg.save_dir)
        return where

    def _corrupting(self, iteration: int) -> CorruptMode | None:
        corruption = self.cfg.corruption
        return corruption.mode if corruption is not None and iteration in corruption.iterations else None

    def _announce_corruption(self, iteration: int) -> None:
        mode = self._corrupting(iteration)
        if mode is not None and self.rank == 0:
            print(
                f"[unicorn-train] corrupting the batch of iteration {iteration} "
                f"({mode}, --corrupt-iterations: test only)",
                flush=True,
            )

    def _corrupt_targets(
        self, iteration: int, targets: torch.Tensor, *, announce: bool = True
    ) -> torch.Tensor:
        """``--corrupt-iterations`` (test only): the batch's targets, shifted in spike mode."""
        mode = self._corrupting(iteration)
        if mode is None:
            return targets
        if announce:
            self._announce_corruption(iteration)
        vocabulary = self.cfg.model.vocabulary
        return (targets + vocabulary // 2) % vocabulary if mode is CorruptMode.SPIKE else targets

    def _corrupt_step(self, iteration: int, local_loss: float | None) -> float | None:
        """``--corrupt-iterations`` (test only): the step's gradients and loss, scaled by
        :data:`SPIKE_FACTOR` (spike) or NaN (nan)."""
        mode = self._corrupting(iteration)
        if mode is None:
            return local_loss
        nan = mode is CorruptMode.NAN
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if nan:
                    param.grad.fill_(float("nan"))
                else:
                    param.grad.mul_(SPIKE_FACTOR)
        if local_loss is None:
            return None
        return float("nan") if nan else local_loss * SPIKE_FACTOR

    def skip_iteration(self, iteration: int) -> bool:
        """Iteration ``iteration`` of ``--skip-iterations``: its batch is consumed and
        discarded (no forward, no backward, no optimizer step; the next iteration reads the
        next samples, as in an uninterrupted run), the ranks still agree on stop and save
        requests, and the iteration is reported without a loss. Returns whether any rank
        asked to stop."""
        cfg, layout = self.cfg, self.cfg.layout
        t0 = time.monotonic()
        first_index, count = replica_samples(
            iteration, global_batch=layout.global_batch, dp=layout.dp, dp_rank=self.runner.coords.dp
        )
        batch(first_index, count, seed=cfg.seed, sequence=cfg.model.sequence, vocabulary=cfg.model.vocabulary)
        if self.jit is not None:
            self.jit.completed(iteration)  # the state is the previous iteration's, unchanged
        agreed = torch.tensor(
            [1.0 if self.stop.requested else 0.0, 1.0 if self.stop.save_requested else 0.0],
            dtype=torch.float64,
            device=self.device,
        )
        self.stop.save_requested = False
        dist.all_reduce(agreed)
        stop_now, self.save_now = bool(agreed[0].item() > 0), bool(agreed[1].item() > 0)
        dt = time.monotonic() - t0
        self.hook.iteration(
            iteration,
            dt,
            samples=layout.global_batch,
            phase=IterationPhase.TRAIN,
            final=iteration == cfg.iterations,
        )
        first_global = (iteration - 1) * layout.global_batch
        if self.is_logger:
            print(
                f"[unicorn-train] skipped iteration {iteration}: samples {first_global}.."
                f"{first_global + layout.global_batch - 1} consumed and discarded (--skip-iterations)",
                flush=True,
            )
        return stop_now

    def _log(self, iteration: int, dt: float, lr: float, loss: float, *, force: bool) -> None:
        """Megatron's log line every ``log_interval`` iterations. Its elapsed time per
        iteration is Megatron's: the wall time since the last line (its interval timer runs
        through everything: snapshots, saves, the hook) over the iterations since, the
        first window from its first iteration's start (``dt`` before now)."""
        cfg = self.cfg
        now = time.monotonic()
        if self._window_t0 is None:
            self._window_t0 = now - dt
        self._window_n += 1
        due = iteration % cfg.log_interval == 0 or force or iteration == cfg.iterations
        if not (self.is_logger and due):
            return
        line = iteration_line(
            iteration=iteration,
            train_iters=cfg.iterations,
            consumed_samples=iteration * cfg.layout.global_batch,
            elapsed_ms=1000.0 * (now - self._window_t0) / self._window_n,
            learning_rate=lr,
            global_batch=cfg.layout.global_batch,
            lm_loss=loss,
        )
        print(line, flush=True)
        self._window_t0, self._window_n = now, 0

    def save(self, iteration: int, directory: str) -> None:
        self.hook.slow_step(IterationPhase.CHECKPOINT)  # a save is slow, not a hang
        t_save = time.monotonic()
        skipped = format_ranges(skipped_before(self.cfg.skip_iterations, iteration))
        checkpoint.save(self.state, iteration, directory, skipped=skipped)
        self.hook.iteration(
            iteration,
            time.monotonic() - t_save,
            phase=IterationPhase.CHECKPOINT,
            final=iteration == self.cfg.iterations,
        )
        if dist.get_rank() == 0:
            print(f"[unicorn-train] saved iteration {iteration} to {directory}", flush=True)


def report_error(exc: UnicornError) -> None:
    """Print a typed error for the operator (main exits 2)."""
    print(f"unicorn-train: error: {exc}", file=sys.stderr, flush=True)
