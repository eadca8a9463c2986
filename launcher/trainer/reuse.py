"""Reuse of finished micro-batches when a data-parallel peer dies mid-iteration (``--reuse-microbatches``).

Unicron §6.2: when a DP replica fails in the middle of iteration ``k``, the micro-batches the
healthy replicas finished are kept; only the failed replica's micro-batches are computed
again. Here, at TP1 PP1 on gloo:

1. **Accumulate locally.** Each rank runs its replica's micro-batches with no collective
   in between and sums their raw gradients (and losses) into one float64 buffer
   (:class:`MicroBatchGrads`). The iteration's only collective is one all-reduce of a
   *copy* of that buffer together with the ranks' stop and save flags, on a process group
   of its own (see 4); the gradient is the
   sum over every micro-batch of the global batch divided by their number, then the
   optimizer steps. A float64 sum of float32 gradients does not depend on the order
   (to the last float32 bit, barring rare rounding ties), so an iteration completed by
   other ranks in another grouping gives the parameters an uninterrupted run gives.
2. **A peer dies.** Its process is gone, its sockets close, and gloo's all-reduce raises
   on every survivor within milliseconds (:class:`PeerLost`); their buffers are intact.
3. **Agree who is left** (:func:`agree_members`) on the job's store (torchrun's agent
   store, which outlives any rank): each survivor registers and waits for the others; the
   first to finish waiting fixes the member list (``compare_set``), which every survivor
   then reads; one registered too late is left out and exits. A rank's
   :class:`Heartbeat` tells dead from slow: the wait ends when every rank registered or
   every missing one's beat stood still for ``settle_s``. Without it a fixed ``settle_s``
   left out a live survivor still computing its last micro-batch on a loaded machine
   (seen in CI: survivors [0] of [0, 2]).
4. **A new process group among the survivors** (:func:`regroup`): the broken groups are
   destroyed and a new default group initialised on a prefix of the same store
   (``PrefixStore``) with the survivors renumbered in order. gloo needs nothing more:
   destroying a group whose peer died returns at once, and the new group connects a fresh
   full mesh. Only the survivors next to the dead rank in the all-reduce see its sockets
   close; the others wait on them and are released when *their* sockets close, i.e. when
   the group object is freed. A ``DeviceMesh`` over the whole world keeps a reference to
   the default group, whose sockets then stay open until the process exits (measured: the
   last survivor was released only when the others exited); hence the all-reduce runs on
   a group only :class:`MicroBatchGrads` holds.
5. **Compute only what is missing.** The lost replicas' micro-batches are split round
   robin over the survivors (:func:`missing_microbatches`, :func:`share`); data are
   addressed by global sample index (:mod:`launcher.trainer.data`), so any rank can
   compute any micro-batch. One all-reduce on the new group, the optimizer step: the
   state after ``k`` equals the uninterrupted run's.
6. **Save and restart.** The trainer saves ``k`` on the new group (memory tier and
   ``--save-dir``) and exits :data:`REUSED_EXIT_CODE`; a relaunch (unicornd restarts the
   task after the dead rank's exit) resumes at ``k + 1``.

The trainer wiring is in :mod:`launcher.trainer.loop`.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroup, Store, _get_default_store

REUSED_EXIT_CODE: Final = 4
"""Exit code of a survivor that completed and saved the iteration in flight after a
data-parallel peer died: restart the task from the newest version."""
STORE_PREFIX: Final = "unicorn-reuse"
_POLL_S: Final = 0.01
_BEATS: Final = f"{STORE_PREFIX}/beat"
BEATS_PER_SETTLE: Final = 5
"""Heartbeats a rank sends per ``settle_s``: the trainer's period is ``settle_s / 5``, well
under the silence that marks a rank dead."""


class PeerLost(Exception):
    """The iteration's all-reduce failed: a peer is gone. This rank's finished micro-batches
    are still in its :class:`MicroBatchGrads`.

    Carries the collective's error as text only, and is raised outside its ``except``
    block: the error's traceback holds the collective's frame, whose locals hold the broken
    group, which must be freed (see :meth:`MicroBatchGrads.release_group`)."""

    def __init__(self, iteration: int, cause: str, started_s: float) -> None:
        super().__init__(f"iteration {iteration}: the data-parallel all-reduce failed: {cause}")
        self.iteration = iteration
        self.cause = cause
        self.started_s = started_s
        """``time.monotonic()`` when the iteration began (its reported duration)."""
        self.failed_s = time.monotonic()


class LeftOut(RuntimeError):
    """This rank reached the survivors' agreement after the member list was fixed (it exits
    as after any uncaught error; the others completed the iteration without it)."""


@dataclass(frozen=True)
class Regrouped:
    """The survivors' new default process group: ``members`` are old ranks in order, this
    rank is ``rank`` of ``len(members)`` in it."""

    members: tuple[int, ...]
    rank: int
    waited_s: float

    @property
    def world_size(self) -> int:
        return len(self.members)


# --- which micro-batches (pure) ----------------------------------------------------------------


def microbatch_samples(iteration: int, index: int, *, global_batch: int, micro_batch: int) -> tuple[int, int]:
    """``(first_index, count)`` of global micro-batch ``index`` of ``iteration`` (1-based).

    Micro-batches are numbered over the global batch: replica ``r`` of ``dp`` trains
    ``r * n .. r * n + n - 1`` with ``n = global_batch / (dp * micro_batch)``, the samples
    :func:`launcher.trainer.data.replica_samples` gives it, in the same order.
    """
    if not 0 <= index < global_batch // micro_batch:
        raise ValueError(f"micro-batch {index} is outside the {global_batch // micro_batch} of an iteration")
    return (iteration - 1) * global_batch + index * micro_batch, micro_batch


def replica_microbatches(dp_rank: int, per_replica: int) -> range:
    """The global micro-batch indices replica ``dp_rank`` trains."""
    return range(dp_rank * per_replica, (dp_rank + 1) * per_replica)


def missing_microbatches(members: Sequence[int], dp: int, per_replica: int) -> tuple[int, ...]:
    """The micro-batches of the replicas not in ``members`` (DP ranks), in order."""
    alive = set(members)
    return tuple(i for r in range(dp) if r not in alive for i in replica_microbatches(r, per_replica))


def share(missing: Sequence[int], members: Sequence[int], me: int) -> tuple[int, ...]:
    """Member ``me``'s part of ``missing``: round robin over ``members`` in their order."""
    position = list(members).index(me)
    return tuple(missing[position :: len(members)])


# --- the survivors' agreement and their new group ----------------------------------------------


def job_store() -> Store:
    """The store the default process group was initialised from (under torchrun: the agent's,
    which outlives every rank). Call while that group exists; keep the result."""
    return _get_default_store()


def agree_members(
    store: Store, *, tag: str, rank: int, world_size: int, settle_s: float, timeout_s: float
) -> tuple[float, tuple[int, ...]]:
    """Agree with the other survivors who is left; returns the seconds waited and the members.

    Every survivor registers under ``<prefix>/<tag>`` and waits until all ``world_size``
    ranks did, or every rank still missing is silent: its :class:`Heartbeat` counter has not
    moved for ``settle_s`` since this rank began looking (a rank without a heartbeat is
    silent from the start, so ``settle_s`` is then a fixed wait). A missing rank that still
    beats is alive, only slow, and is waited for, at most ``timeout_s`` in all. The first to
    stop waiting writes the ranks registered by then as the member list (``compare_set``:
    only the first write wins), and every survivor reads that one list (a survivor arriving
    after it was written stops waiting at once). A missing rank agreeing under another tag
    (another iteration: its all-reduce of this one completed) is not coming. Raises
    :class:`LeftOut` for a rank not in it. Store operations time out after ``timeout_s``
    (the store is the job's: torchrun's agent).
    """
    keys = PrefixStore(f"{STORE_PREFIX}/{tag}", store)
    keys.set_timeout(timedelta(seconds=timeout_s))
    beats = PrefixStore(_BEATS, store)
    start = time.monotonic()
    beats.set(f"at/{rank}", tag)
    keys.set(f"alive/{rank}", "1")
    arrived = keys.add("arrived", 1)
    missing = set(range(world_size)) - {rank}
    moved: dict[int, tuple[int, float]] = {}  # rank -> (its beat count, when this rank saw it change)
    poll_s = max(_POLL_S, settle_s / 10)
    while arrived < world_size and not keys.check(["members"]) and time.monotonic() - start < timeout_s:
        missing = {r for r in missing if not keys.check([f"alive/{r}"])}
        now = time.monotonic()
        silent = [_silent(beats, r, tag, now=now, moved=moved, settle_s=settle_s) for r in missing]
        if all(silent):  # every missing rank's count updated first (no short circuit)
            break
        time.sleep(poll_s)
        arrived = keys.add("arrived", 0)
    alive = [r for r in range(world_size) if keys.check([f"alive/{r}"])]
    agreed = keys.compare_set("members", "", ",".join(map(str, alive))).decode()
    members = tuple(int(r) for r in agreed.split(","))
    if rank not in members:
        raise LeftOut(f"rank {rank} arrived after the survivors {list(members)} agreed")
    return time.monotonic() - start, members


def _silent(
    beats: Store, rank: int, tag: str, *, now: float, moved: dict[int, tuple[int, float]], settle_s: float
) -> bool:
    """Whether missing ``rank`` is not coming to agreement ``tag``: it is in another one, or
    its beat count has not moved for ``settle_s`` since this rank first looked (``moved``
    keeps the count and when it last changed)."""
    if beats.check([f"at/{rank}"]) and beats.get(f"at/{rank}").decode() != tag:
        return True
    count = beats.add(str(rank), 0)
    if moved.get(rank, (None, 0.0))[0] != count:
        moved[rank] = (count, now)
    return now - moved[rank][1] >= settle_s


class Heartbeat:
    """This rank's liveness for :func:`agree_members`: a daemon thread adds 1 to
    ``<prefix>/beat/<rank>`` on the job's store every ``period_s`` until :meth:`stop` or
    the process ends.

    Why a thread: a survivor still computing its micro-batches (or blocked in the all-reduce
    until a peer frees its group) reaches the agreement late; its main thread cannot say it
    is alive, but a thread beats while torch computes without the GIL, and a dead rank's
    counter stands still. ``period_s`` must be well under the agreement's ``settle_s`` (the
    trainer uses ``settle_s /`` :data:`BEATS_PER_SETTLE`). The store client serialises the
    thread's and the main thread's operations; one small ``add`` per period per rank is the
    load on torchrun's store."""

    def __init__(self, store: Store, rank: int, period_s: float) -> None:
        if period_s <= 0:
            raise ValueError(f"the heartbeat period must be positive, got {period_s}")
        self._keys = PrefixStore(_BEATS, store)
        self._name = str(rank)
        self._period_s = period_s
        self._stopped = threading.Event()
        self._keys.add(self._name, 1)
        self._thread = threading.Thread(target=self._run, name=f"reuse-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            try:
                self._keys.add(self._name, 1)
            except RuntimeError:  # DistStoreError: a store hiccup or the job ending; beat on
                continue

    def stop(self) -> None:
        """Stop beating (idempotent); waits for the thread, at most the longer of 1 s and
        four periods (a beat blocked in the store is left to the daemon thread)."""
        self._stopped.set()
        self._thread.join(max(1.0, 4 * self._period_s))


def regroup(
    store: Store,
    grads: MicroBatchGrads,
    *,
    tag: str,
    rank: int,
    world_size: int,
    settle_s: float,
    timeout_s: float,
) -> Regrouped:
    """Replace the broken process groups by one default group of the survivors (gloo); the
    new group is also ``grads``'s from then on.

    The all-reduce's group is freed first, before the agreement: a survivor whose own
    collective did not touch the dead rank's sockets is still blocked in it, waiting on a
    survivor, and is released only when that survivor's sockets close.

    Needs from torch.distributed: a store that outlives the dead rank (torchrun's agent
    store; with a rank-hosted ``env://`` store, that rank must survive), ``destroy_process_group``
    on a group whose peer died (gloo returns at once; NCCL would need its communicators
    aborted first), and ``init_process_group(store=PrefixStore(...))`` with a new prefix so
    the new rendezvous never meets the old group's keys.
    """
    backend = dist.get_backend()
    grads.release_group()
    dist.destroy_process_group()
    waited_s, members = agree_members(
        store, tag=tag, rank=rank, world_size=world_size, settle_s=settle_s, timeout_s=timeout_s
    )
    dist.init_process_group(
        backend,
        store=PrefixStore(f"{STORE_PREFIX}/{tag}/group", store),
        rank=members.index(rank),
        world_size=len(members),
        timeout=timedelta(seconds=timeout_s),
    )
    return Regrouped(members, members.index(rank), waited_s)


# --- gradients of finished micro-batches -------------------------------------------------------


@dataclass(frozen=True)
class Reduced:
    """One all-reduce of :class:`MicroBatchGrads` over the group: the summed gradients and
    losses, how many micro-batches they cover, and the summed flags."""

    grads: torch.Tensor
    loss_sum: float
    microbatches: int
    flags: tuple[float, ...]


class MicroBatchGrads:
    """The raw gradients and losses of the micro-batches this rank finished in the iteration
    in flight, summed in one float64 buffer (see the module docstring).

    Constructed on every rank together: it creates the all-reduce's own process group over
    the world (``new_group``), which nothing else references."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.group: ProcessGroup | None = dist.new_group(backend=dist.get_backend())
        self.params = [p for p in params if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.grads = torch.zeros(self.numel, dtype=torch.float64)
        self.loss_sum = 0.0
        self.done: list[int] = []

    def reset(self) -> None:
        self.grads.zero_()
        self.loss_sum = 0.0
        self.done = []

    def add(self, index: int, loss: float) -> None:
        """Take the gradients the backward of micro-batch ``index`` left in ``.grad`` (and
        clear them), and its loss."""
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                self.grads[offset : offset + n].add_(p.grad.detach().reshape(-1))
                p.grad = None
            offset += n
        self.loss_sum += loss
        self.done.append(index)

    def all_reduce(self, flags: Sequence[float] = ()) -> Reduced:
        """Sum a copy of the buffer, the loss, the micro-batch count and ``flags`` over the
        all-reduce's group (after :meth:`release_group`, the default group). Raises what the
        collective raises; this buffer is left as it was."""
        scalars = torch.tensor([self.loss_sum, float(len(self.done)), *flags], dtype=torch.float64)
        buf = torch.cat([self.grads, scalars])
        dist.all_reduce(buf, group=self.group)
        tail = buf[self.numel :].tolist()
        return Reduced(buf[: self.numel], float(tail[0]), round(tail[1]), tuple(float(f) for f in tail[2:]))

    def release_group(self) -> None:
        """Destroy the all-reduce's group and free it now, which closes its sockets (a peer
        still blocked in it on this rank is released); later all-reduces use the default
        group."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
            gc.collect()

    def write_mean(self, reduced: Reduced, microbatches: int) -> None:
        """Set every parameter's ``.grad`` to the mean over ``microbatches`` micro-batches."""
        mean = reduced.grads / microbatches
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = mean[offset : offset + n].view(p.shape).to(p.dtype)
            offset += n
