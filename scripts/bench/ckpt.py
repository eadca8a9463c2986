#!/usr/bin/env python3
"""Checkpoint engine benchmark (issues 7 and 22): prints one JSON object.

For each size S (MiB of float32 state in 16 MiB tensors, like a model plus optimizer).
Every comparison runs its sides in rounds, one after the other in a rotating order, and
reports each side's median and the median of the per-round ratios, so all sides see the
same background load (this machine is shared). A ``x_over_y`` figure is time(x) /
time(y): below 1, x is faster. Every allocation of 1 MiB or more is a fresh ``mmap``
(``fresh_allocations``): a restarted rank restores into a process whose memory was never
touched, so every side pays the same first-touch page faults for what it allocates.

Stall (issue 7):

- ``stall_s``: median time ``SnapshotWriter.snapshot`` blocks (steady state: slots
  reserved and reused, as in training); ``stall_memcpy_s``: the same tensors copied with
  the same primitive (``Tensor.copy_``) into a prefaulted buffer, nothing else.
- ``seal_s``: the agent's checksum pass (off the training thread, not in the stall).

Restore (issue 22), sides of one rotation, each ending with owned tensors whose every
byte was read:

- ``restore_s``: the real path of a rank, ``Restorer(shm).restore``: open the sealed
  shard under its lock, check metadata and done marker, verify *every* checksum, then
  ``state_dict(copy=True)`` (owned copies of every tensor).
- ``memcpy_s``: the physical limit of the same work: a fresh private mapping of the same
  ``.bin`` in shm (the flags and huge-page advice ``OpenShard`` uses), one ``torch.empty``
  per tensor and a plain memcpy (numpy ``copyto``) of its bytes, in 8 MiB pieces on as
  many threads as the restore verifies on (``ckpt.shard.VERIFY_THREADS``); nothing else
  (no lock, metadata, checksums, tree). ``memcpy_1thread_s``: the same on one thread.
- ``torch_load_mmap_s``: ``torch.load(mmap=True, weights_only=True)`` of the same state
  saved by ``torch.save`` to ``--disk-dir``, the file in the page cache, then a
  ``clone`` of every tensor (mapped views would read nothing): the same owned copies.
- ``torch_load_s``: ``torch.load(weights_only=True)`` of that file from the page cache
  (it reads the file into tensors it owns).
- ``torch_load_cold_s`` and ``torch_load_mmap_cold_s``: the same two after the file's
  pages were dropped: ``cold`` says how. ``drop_caches`` (root): fdatasync, then
  ``echo 1 > /proc/sys/vm/drop_caches``; otherwise ``fadvise`` (posix_fadvise
  DONTNEED on the file). On a VM the host may still cache the disk.
- ``restore_over_memcpy`` (goal <= 2), ``restore_over_torch_load_mmap`` (warm, the
  strongest torch side), ``restore_over_torch_load_cold``.

The trainer's path (DCP load into existing tensors, ``ckpt.dcp.MemoryStorageReader``),
a rotation of its own over a DCP save of the same state into the same shm folder:

- ``dcp_restore_s``: ``Restorer.open`` (every checksum verified), then
  ``state_dict_loader.load`` through ``MemoryStorageReader`` into a live state (tensors
  allocated and written before, as a model's are); ``dcp_memcpy_s``: a fresh mapping of
  the same ``.bin`` and the plain memcpy above into the same live tensors.
- ``dcp_restore_over_memcpy``.

Persistence:

- ``persist_mib_s``: ``Persister`` writing the sealed snapshot to ``--disk-dir``: its
  own timing of the tier write (``sendfile`` in 16 MiB chunks, fdatasync, metadata,
  renames, directory fsyncs); ``persist_with_verify_mib_s``: the whole ``persist`` call,
  the checksum pass over the shm copy included.
- ``disk_mib_s``: the disk's bandwidth measured the same way, in this process: the same
  bytes (copied once, before timing, into this process's memory) written with
  ``os.write`` in 16 MiB chunks to a new file in the same folder, then fdatasync;
  ``persist_over_disk`` = their ratio (median of the rounds' ratios).
- Each side removes what it wrote after its timing and commits the removal (an fsync of
  the folder), so no side's fdatasync pays for another's deleted file (``/`` is mounted
  with ``discard`` here: freed blocks are trimmed at the next journal commit).
- ``persist_readback_verify_s``: what step 4 of the commit protocol (``ckpt.commit``)
  costs inside ``persist_mib_s``: every checksum of the new copy verified, read back
  through the page cache (timed separately, right after each persist).

Temporary files live in one per-run folder under ``--shm-dir`` and one under
``--disk-dir``; both are removed at the end, whatever happens.

Run: ``nice -n 19 .venv/bin/python scripts/bench/ckpt.py [--size-mib 256 --size-mib 1024]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# This file is named like the package it measures: keep its own folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
import torch  # noqa: E402
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver  # noqa: E402

from ckpt.dcp import MemoryStorageReader, MemoryStorageWriter  # noqa: E402
from ckpt.format import ShardPaths, read_meta, torch_dtype  # noqa: E402
from ckpt.persist import DEFAULT_CHUNK_BYTES, Persister  # noqa: E402
from ckpt.restore import Restorer  # noqa: E402
from ckpt.shard import VERIFY_THREADS, OpenShard, advise_huge_pages, seal_shard  # noqa: E402
from ckpt.snapshot import SnapshotWriter  # noqa: E402
from ckpt.tier import Retention, Tier, TierDir  # noqa: E402
from unicorn_core.logs import configure_logging  # noqa: E402

TENSOR_MIB = 16
GOALS = {"stall_over_memcpy_max": 1.5, "restore_over_memcpy_max": 2.0, "persist_over_disk_min": 0.7}
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
MEMCPY_PIECE_BYTES = 8 << 20


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    count = max(1, size_mib // TENSOR_MIB)
    numel = min(size_mib, TENSOR_MIB) * (1 << 20) // 4
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(numel, generator=gen) for i in range(count)}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fresh_allocations() -> bool:
    """Make every allocation of 1 MiB or more a fresh ``mmap`` (glibc ``M_MMAP_THRESHOLD``).

    glibc otherwise raises its threshold after the first large free and serves later
    allocations from memory an earlier side already faulted in, so a side's time would
    depend on what ran before it. A restarted rank restores into a fresh process, whose
    memory was never touched: every side here pays the same first-touch page faults.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 20))


def can_drop_caches() -> bool:
    try:
        DROP_CACHES.write_text("1")
    except OSError:
        return False
    return True


def drop_cache(path: Path, method: str) -> None:
    """Evict ``path``'s pages from the page cache (``method``: drop_caches or fadvise)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        if method == "drop_caches":
            DROP_CACHES.write_text("1")
        else:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rounds(sides: Mapping[str, Callable[[], float]], repeat: int) -> dict[str, list[float]]:
    """Run every side once per round, ``repeat`` rounds, the starting side rotating."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(sides[name]())
    return times


def ratio(times: Mapping[str, list[float]], top: str, bottom: str) -> float:
    """Median over rounds of time(top) / time(bottom)."""
    return statistics.median(a / b for a, b in zip(times[top], times[bottom], strict=True))


@contextlib.contextmanager
def mapped(paths: ShardPaths, nbytes: int) -> Iterator[torch.Tensor]:
    """A fresh private read mapping of a shard's ``.bin``, as ``OpenShard`` makes it."""
    fd = os.open(paths.bin, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
        advise_huge_pages(mm)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        try:
            yield base
        finally:
            del base
            mm.close()
    finally:
        os.close(fd)


class Memcpy:
    """Plain memcpy (numpy ``copyto``, which releases the GIL) of byte ranges, in pieces of
    ``MEMCPY_PIECE_BYTES`` on ``threads`` threads of its own."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def __call__(self, pairs: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]) -> None:
        pieces = [
            (dst[i : i + MEMCPY_PIECE_BYTES], src[i : i + MEMCPY_PIECE_BYTES])
            for dst, src in pairs
            for i in range(0, src.shape[0], MEMCPY_PIECE_BYTES)
        ]
        if self.pool is None:
            for dst, src in pieces:
                np.copyto(dst, src)
        else:
            list(self.pool.map(lambda pair: np.copyto(pair[0], pair[1]), pieces))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def tensor_layout(paths: ShardPaths) -> list[tuple[str, int, int, torch.dtype, tuple[int, ...]]]:
    """(name, offset, nbytes, dtype, shape) of every tensor entry, from the shard's metadata."""
    return [
        (e.name, e.offset, e.nbytes, torch_dtype(e.dtype), e.shape)
        for e in read_meta(paths.meta).entries
        if e.kind == "tensor"
    ]


def bench_restore(
    state: dict[str, torch.Tensor],
    shm: TierDir,
    iteration: int,
    disk_dir: Path,
    cold: str,
    repeat: int,
    parallel: Memcpy,
    single: Memcpy,
) -> dict[str, float]:
    out: dict[str, float] = {}
    paths = shm.shard(iteration, 0)
    layout = tensor_layout(paths)
    data_bytes = read_meta(paths.meta).data_bytes
    restorer = Restorer(shm)

    def restore() -> float:
        start = time.perf_counter()
        restored, _ = restorer.restore(iteration, 0)
        elapsed = time.perf_counter() - start
        assert len(restored) == len(state)
        return elapsed

    def memcpy_with(copy: Memcpy) -> Callable[[], float]:
        def side() -> float:
            start = time.perf_counter()
            with mapped(paths, data_bytes) as base:
                source = base.numpy()
                copies = {name: torch.empty(shape, dtype=dtype) for name, _, _, dtype, shape in layout}
                copy(
                    [
                        (copies[name].reshape(-1).view(torch.uint8).numpy(), source[offset : offset + nbytes])
                        for name, offset, nbytes, _, _ in layout
                    ]
                )
                del source
            elapsed = time.perf_counter() - start
            assert len(copies) == len(state)
            return elapsed

        return side

    path = disk_dir / "state.pt"

    def save() -> None:
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out["torch_save_s"] = timed(save)

    def load(*, mmap_: bool, drop: bool) -> Callable[[], float]:
        def side() -> float:
            if drop:
                drop_cache(path, cold)
            else:
                with path.open("rb", buffering=0) as f:  # in the page cache, whatever ran before
                    while f.read(MEMCPY_PIECE_BYTES):
                        pass
            start = time.perf_counter()
            loaded = torch.load(path, weights_only=True, mmap=mmap_)
            if mmap_:
                loaded = {k: v.clone() for k, v in loaded.items()}
            elapsed = time.perf_counter() - start
            assert len(loaded) == len(state)
            return elapsed

        return side

    times = rounds(
        {
            "memcpy": memcpy_with(parallel),
            "memcpy_1thread": memcpy_with(single),
            "restore": restore,
            "torch_load_mmap": load(mmap_=True, drop=False),
            "torch_load": load(mmap_=False, drop=False),
            "torch_load_mmap_cold": load(mmap_=True, drop=True),
            "torch_load_cold": load(mmap_=False, drop=True),
        },
        repeat,
    )
    path.unlink()
    for name, values in times.items():
        out[f"{name}_s"] = statistics.median(values)
    out["restore_over_memcpy"] = ratio(times, "restore", "memcpy")
    out["restore_over_torch_load_mmap"] = ratio(times, "restore", "torch_load_mmap")
    out["restore_over_torch_load"] = ratio(times, "restore", "torch_load")
    out["restore_over_torch_load_cold"] = ratio(times, "restore", "torch_load_cold")
    out["restore_over_torch_load_mmap_cold"] = ratio(times, "restore", "torch_load_mmap_cold")
    return out


def bench_dcp_restore(
    state: dict[str, torch.Tensor], shm_root: Path, repeat: int, parallel: Memcpy
) -> dict[str, float]:
    """The trainer's path: DCP load into existing tensors, against copy_ into the same tensors."""
    iteration = 1
    writer = SnapshotWriter(shm_root, "bench-dcp", 0, 1, slots=1)
    try:
        state_dict_saver.save(
            state, storage_writer=MemoryStorageWriter(writer, iteration, seal=True), no_dist=True
        )
    finally:
        writer.close()
    shm = TierDir(shm_root, "bench-dcp", Tier.SHM)
    paths = shm.shard(iteration, 0)
    data_bytes = read_meta(paths.meta).data_bytes
    layout = tensor_layout(paths)
    live = {k: torch.empty_like(v).fill_(0.5) for k, v in state.items()}  # written once: faulted in
    by_entry = {name: live[name.rsplit("@", 1)[0]] for name, *_ in layout}  # entry "fqn@offsets"
    assert len(by_entry) == len(live)
    restorer = Restorer(shm)

    def dcp_restore() -> float:
        start = time.perf_counter()
        shard, _ = restorer.open(iteration, 0)
        reader = MemoryStorageReader([shm], iteration, shards={0: shard})
        try:
            state_dict_loader.load(live, storage_reader=reader, no_dist=True)
        finally:
            reader.close()
        return time.perf_counter() - start

    def dcp_memcpy() -> float:
        start = time.perf_counter()
        with mapped(paths, data_bytes) as base:
            source = base.numpy()
            parallel(
                [
                    (by_entry[name].reshape(-1).view(torch.uint8).numpy(), source[offset : offset + nbytes])
                    for name, offset, nbytes, _, _ in layout
                ]
            )
            del source
        return time.perf_counter() - start

    dcp_restore()
    assert all(torch.equal(live[k], v) for k, v in state.items()), "DCP restore returned other bytes"
    times = rounds({"dcp_memcpy": dcp_memcpy, "dcp_restore": dcp_restore}, repeat)
    out = {f"{name}_s": statistics.median(values) for name, values in times.items()}
    out["dcp_restore_over_memcpy"] = ratio(times, "dcp_restore", "dcp_memcpy")
    return out


def settle(path: Path, folder: Path) -> None:
    """Remove ``path`` and commit the removal (fsync of ``folder``: an ext4 journal commit,
    which also issues a ``discard`` mount's trims), so no side pays for another's file."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_persist(shm: TierDir, iteration: int, disk_dir: Path, total: int, repeat: int) -> dict[str, float]:
    local = TierDir(disk_dir / "local", "bench", Tier.LOCAL)
    persister = Persister(shm, [(local, Retention(1))])
    mib = total / (1 << 20)
    with_verify: list[float] = []
    readback: list[float] = []

    def persist() -> float:
        start = time.perf_counter()
        result = persister.persist(iteration, 0)[0]
        with_verify.append(mib / (time.perf_counter() - start))
        # What the commit's step 4 costs: every checksum of the new copy, read back from the page cache.
        readback.append(timed(lambda: _verify(local, iteration)))
        settle(local.job_dir, disk_dir / "local")
        return result.elapsed_s

    with OpenShard(shm.shard(iteration, 0)) as shard:  # the same bytes, in memory already faulted in
        payload = memoryview(bytearray(shard.data()[:total]))

    def disk() -> float:
        target = disk_dir / "disk.bin"
        start = time.perf_counter()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = 0
            while written < total:
                written += os.write(fd, payload[written : min(total, written + DEFAULT_CHUNK_BYTES)])
            os.fdatasync(fd)
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - start
        settle(target, disk_dir)
        return elapsed

    times = rounds({"disk": disk, "persist": persist}, repeat)
    return {
        "disk_mib_s": mib / statistics.median(times["disk"]),
        "persist_mib_s": mib / statistics.median(times["persist"]),
        "persist_with_verify_mib_s": statistics.median(with_verify),
        "persist_over_disk": 1 / ratio(times, "persist", "disk"),
        "persist_readback_verify_s": statistics.median(readback),
    }


def _verify(tier: TierDir, iteration: int) -> None:
    with OpenShard(tier.shard(iteration, 0)) as shard:
        shard.verify()


def bench_size(size_mib: int, shm_run: Path, disk_run: Path, repeat: int, cold: str) -> dict[str, Any]:
    out: dict[str, float] = {}
    state = make_state(size_mib)
    total = sum(t.numel() * t.element_size() for t in state.values())
    shm_root = shm_run / f"{size_mib}"
    disk_dir = disk_run / f"{size_mib}"
    shm_root.mkdir()
    disk_dir.mkdir()
    try:
        # Stall vs memcpy: the same tensors, the same copy primitive, prefaulted destinations.
        dst = torch.zeros(total, dtype=torch.uint8)

        def stall_memcpy() -> float:
            start = time.perf_counter()
            offset = 0
            for t in state.values():
                n = t.numel() * 4
                dst[offset : offset + n].view(torch.float32).copy_(t)
                offset += n
            return time.perf_counter() - start

        writer = SnapshotWriter(shm_root, "bench", 0, 1, slots=2)
        writer.reserve(total + 4096)
        iteration = 0

        def snapshot() -> float:
            nonlocal iteration
            iteration += 1
            return writer.snapshot(state, iteration).stall_s

        stall_memcpy(), snapshot(), snapshot()  # warm-up: every slot used once
        times = rounds({"stall_memcpy": stall_memcpy, "stall": snapshot}, repeat)
        out["stall_memcpy_s"] = statistics.median(times["stall_memcpy"])
        out["stall_s"] = statistics.median(times["stall"])
        out["stall_over_memcpy"] = ratio(times, "stall", "stall_memcpy")
        dst = torch.empty(0, dtype=torch.uint8)  # free it before the rest
        shm = TierDir(shm_root, "bench", Tier.SHM)
        out["seal_s"] = timed(lambda: seal_shard(shm.shard(iteration, 0)))

        parallel, single = Memcpy(VERIFY_THREADS), Memcpy(1)
        try:
            out |= bench_restore(state, shm, iteration, disk_dir, cold, repeat, parallel, single)
            out |= bench_dcp_restore(state, shm_root, repeat, parallel)
        finally:
            parallel.close()
        out |= bench_persist(shm, iteration, disk_dir, total, max(2, repeat // 2))
        writer.close()
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, action="append", help="state size (repeatable); default 256")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeat", type=int, default=5, help="rounds per comparison")
    parser.add_argument(
        "--cold",
        choices=["auto", "drop_caches", "fadvise"],
        default="auto",
        help="how the torch.load file is evicted (auto: drop_caches where writable)",
    )
    args = parser.parse_args()
    configure_logging("warning", "json")  # stdout carries only the result
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP without a group
    sizes = args.size_mib or [256]
    cold = args.cold if args.cold != "auto" else ("drop_caches" if can_drop_caches() else "fadvise")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    fresh = fresh_allocations()
    shm_run = Path(tempfile.mkdtemp(prefix="unicorn-bench-ckpt-", dir=args.shm_dir))
    disk_run = Path(tempfile.mkdtemp(prefix="unicorn-bench-ckpt-", dir=args.disk_dir))
    try:
        results = {str(size): bench_size(size, shm_run, disk_run, args.repeat, cold) for size in sizes}
    finally:
        shutil.rmtree(shm_run, ignore_errors=True)
        shutil.rmtree(disk_run, ignore_errors=True)
    met = {
        size: {
            "stall": r["stall_over_memcpy"] <= GOALS["stall_over_memcpy_max"],
            "restore": r["restore_over_memcpy"] <= GOALS["restore_over_memcpy_max"],
            "persist": r["persist_over_disk"] >= GOALS["persist_over_disk_min"],
        }
        for size, r in results.items()
    }
    print(
        json.dumps(
            {
                "sizes_mib": results,
                "goals": GOALS,
                "goals_met": met,
                "cold": cold,
                "fresh_allocations": fresh,
                "shm_dir": str(args.shm_dir),
                "torch_threads": torch.get_num_threads(),
                "copy_threads": VERIFY_THREADS,
                "cpu_count": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "device": "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()
