"""Snapshot tier: a training rank copies its state into shared memory and goes on.

``SnapshotWriter.snapshot`` is the only call a training loop blocks on: it copies every
tensor into a preallocated, already-faulted ``mmap`` of a file under the shm root
(``/dev/shm/...``), writes the metadata (state ``copied``) and returns. Checksums, the
done marker, persistence and replication belong to the node agent (``seal_shard``,
``Persister``, ``ckpt.peer``), so a snapshot survives its rank being killed the moment
``snapshot`` returns.

Slots: a writer keeps up to ``slots`` files per rank and reuses the oldest one that no
reader holds (a reader's shared ``flock`` pins a slot; see :mod:`ckpt.shard`). Reuse
renames the file into the new iteration's folder after deleting the old iteration's
metadata and marker, so a reader never sees new bytes under an old name. Writing into a
reused, mapped file costs no page faults; that is why the stall stays near a memcpy. A
restarted rank adopts the slots its predecessor left (``slots`` on disk are found by name).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

from ckpt.errors import InvalidArgument, SnapshotBusy
from ckpt.format import (
    ALIGN_BYTES,
    FlatState,
    ShardMeta,
    ShardPaths,
    ShardState,
    check_index,
    check_job_id,
    encode,
    flatten_state,
    iteration_dir,
    layout_entries,
    now_unix_s,
    parse_iteration_dir,
    write_atomic,
)
from ckpt.shard import advise_huge_pages, seal_shard

SPARE_DIR: Final = "spare"
_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE: Final = 23
"""Linux >= 5.14; older kernels refuse it (``EINVAL``) and get ``MAP_POPULATE`` instead."""


def map_populated(fd: int, capacity: int) -> mmap.mmap:
    """A shared read-write mapping of ``fd`` with every page faulted in (no fault in the copy).

    Asks for transparent huge pages first (:func:`ckpt.shard.advise_huge_pages`): on a
    tmpfs mounted ``huge=advise`` that is what makes the file's pages 2 MiB; on
    ``huge=within_size``/``always`` they are anyway, and on ``never`` it changes nothing.
    """
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=rw)
    advise_huge_pages(mm)
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        mm.close()
        mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | _POPULATE, prot=rw)
    return mm


@dataclass(frozen=True)
class SnapshotHandle:
    """What ``snapshot`` returns: where the shard lies and how long the copy blocked."""

    paths: ShardPaths
    meta: ShardMeta
    stall_s: float

    @property
    def iteration(self) -> int:
        return self.meta.iteration

    def seal(self) -> ShardMeta:
        """Compute checksums now (normally the agent's job; see ``seal_shard``)."""
        return seal_shard(self.paths)


class _Slot:
    """One reusable shard file of this rank, mapped read-write while the writer lives."""

    def __init__(self, path: Path, iteration: int | None) -> None:
        self.path = path
        self.iteration = iteration
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.capacity = os.fstat(self.fd).st_size
        self.mm: mmap.mmap | None = None
        self.base: torch.Tensor | None = None

    def ensure(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over the mapping, grown to at least ``nbytes`` (pages populated)."""
        if self.base is not None and self.capacity >= nbytes:
            return self.base
        self.unmap()
        capacity = max(self.capacity, nbytes, ALIGN_BYTES)
        if capacity > self.capacity:
            os.ftruncate(self.fd, capacity)
            self.capacity = capacity
        self.mm = map_populated(self.fd, capacity)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self.base

    def unmap(self) -> None:
        self.base = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None

    def close(self) -> None:
        self.unmap()
        os.close(self.fd)


class SnapshotWriter:
    """Writes one rank's snapshots under ``<root>/<job_id>/`` (see module doc).

    Not thread-safe: one writer per rank, used by one thread at a time (the training
    loop, or the just-in-time thread under :class:`ckpt.jit.JitCheckpointer`'s lock).
    """

    def __init__(
        self,
        root: Path,
        job_id: str,
        rank: int,
        world_size: int,
        *,
        slots: int = 2,
        lock_timeout_s: float = 10.0,
    ) -> None:
        check_index(rank, "rank")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= rank:
            raise InvalidArgument(f"world_size must be an integer > rank {rank}, got {world_size!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InvalidArgument(f"slots must be an integer >= 1, got {slots!r}")
        self.root = Path(root)
        self.job_id = check_job_id(job_id)
        self.rank = rank
        self.world_size = world_size
        self.max_slots = slots
        self.lock_timeout_s = lock_timeout_s
        self._slots: list[_Slot] = []
        self._adopt()

    def _adopt(self) -> None:
        """Take over the files a previous incarnation of this rank left (its snapshots stay readable)."""
        job_dir = self.root / self.job_id
        if not job_dir.is_dir():
            return
        for child in sorted(job_dir.iterdir()):
            iteration = parse_iteration_dir(child.name)
            if iteration is not None:
                path = ShardPaths(child, self.rank).bin
                if path.exists():
                    self._slots.append(_Slot(path, iteration))
        spare = job_dir / SPARE_DIR
        if spare.is_dir():
            self._slots.extend(_Slot(p, None) for p in sorted(spare.glob(f"shard-{self.rank:05d}-*.bin")))

    def _new_spare(self) -> _Slot:
        spare = self.root / self.job_id / SPARE_DIR
        spare.mkdir(parents=True, exist_ok=True)
        taken = {slot.path.name for slot in self._slots}
        index = next(i for i in range(len(self._slots) + 1) if f"shard-{self.rank:05d}-{i}.bin" not in taken)
        slot = _Slot(spare / f"shard-{self.rank:05d}-{index}.bin", None)
        self._slots.append(slot)
        return slot

    def reserve(self, nbytes: int) -> None:
        """Preallocate and fault in every slot at ``nbytes`` (``slots`` x ``nbytes`` of shm),
        so no snapshot pays for page faults inside the training loop's stall."""
        check_index(nbytes, "nbytes")
        while len(self._slots) < self.max_slots:
            self._new_spare()
        for slot in self._slots:
            slot.ensure(nbytes)

    def _pick(self, iteration: int) -> _Slot:
        """Lock (exclusively) the slot to write ``iteration`` into; see the module doc."""
        same = [s for s in self._slots if s.iteration == iteration]
        spares = [s for s in self._slots if s.iteration is None]
        used = sorted(
            (s for s in self._slots if s.iteration is not None and s.iteration != iteration),
            key=lambda s: s.iteration or 0,
        )
        if not same and not spares and len(self._slots) < self.max_slots:
            spares = [self._new_spare()]
        # A version rewritten (a just-in-time copy of an iteration saved already) goes into
        # its own slot, waiting for readers: another slot would rename its file over the
        # same path, leaving the first slot's file unlinked under a reader that still
        # seals it, and the next reuse of that slot would write into the unlinked file.
        candidates = same or spares + used
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            for slot in candidates:
                try:
                    fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                return slot
            if time.monotonic() >= deadline:
                raise SnapshotBusy(
                    f"rank {self.rank}: all {len(candidates)} snapshot slots stayed locked by readers "
                    f"for {self.lock_timeout_s:g} s"
                )
            time.sleep(0.005)

    def snapshot(
        self, state: Mapping[str, Any], iteration: int, *, extra: Mapping[str, Any] | None = None
    ) -> SnapshotHandle:
        """Copy ``state`` into shared memory as ``iteration``; return once the copy is done.

        ``state``: tensors (any device), bytes, numpy arrays, JSON scalars, and dicts,
        lists and tuples of them; anything else raises ``InvalidArgument`` before a byte
        is written. ``extra`` (JSON values) is stored in the metadata as is.
        """
        check_index(iteration, "iteration")
        start = time.perf_counter()
        flat = flatten_state(state)
        entries, data_bytes = layout_entries(flat)
        slot = self._pick(iteration)
        try:
            paths = self._claim(slot, iteration)
            base = slot.ensure(data_bytes)
            _copy_leaves(flat, entries, base, slot.mm)
            meta = ShardMeta(
                job_id=self.job_id,
                iteration=iteration,
                rank=self.rank,
                world_size=self.world_size,
                state=ShardState.COPIED,
                data_bytes=data_bytes,
                entries=entries,
                tree=flat.tree,
                extra=dict(extra or {}),
                created_unix_s=now_unix_s(),
            )
            write_atomic(paths.meta, encode(meta), durable=False)
        finally:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)
        return SnapshotHandle(paths, meta, time.perf_counter() - start)

    def _claim(self, slot: _Slot, iteration: int) -> ShardPaths:
        """Evict what ``slot`` held (marker and metadata first) and move it under ``iteration``."""
        paths = ShardPaths(iteration_dir(self.root, self.job_id, iteration), self.rank)
        old = ShardPaths(slot.path.parent, self.rank) if slot.iteration is not None else None
        if old is not None:
            old.done.unlink(missing_ok=True)
            old.meta.unlink(missing_ok=True)
        if slot.path != paths.bin:
            for _ in range(3):  # another rank may remove the folder between mkdir and rename
                paths.directory.mkdir(parents=True, exist_ok=True)
                try:
                    slot.path.rename(paths.bin)
                    break
                except FileNotFoundError:
                    continue
            else:
                slot.path.rename(paths.bin)
            if old is not None:
                with contextlib.suppress(OSError):  # other ranks' shards are still there
                    old.directory.rmdir()
            slot.path = paths.bin
        slot.iteration = iteration
        return paths

    def close(self) -> None:
        """Unmap and close every slot (the files stay: they are the snapshots)."""
        for slot in self._slots:
            slot.close()
        self._slots.clear()


def _copy_leaves(flat: FlatState, entries: tuple[Any, ...], base: torch.Tensor, mm: mmap.mmap | None) -> None:
    for entry, value in zip(entries, flat.leaves, strict=True):
        if entry.nbytes == 0:
            continue
        dst = base[entry.offset : entry.offset + entry.nbytes]
        if isinstance(value, torch.Tensor):
            dst.view(value.dtype).view(value.shape).copy_(value)
        elif isinstance(value, np.ndarray):
            np.copyto(dst.numpy().view(value.dtype).reshape(value.shape), value)
        else:
            assert mm is not None
            mm[entry.offset : entry.offset + entry.nbytes] = value
