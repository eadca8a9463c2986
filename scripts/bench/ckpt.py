#!/usr/bin/env python3
"""Checkpoint engine benchmark (issue 7): prints one JSON object.

For each size S (MiB of float32 state in 16 MiB tensors, like a model plus optimizer):

Comparisons are *paired*: the two sides alternate ``--repeat`` times and the ratio is
the median of the per-pair ratios, so both see the same background load (this machine
is shared).

- ``stall_s``: median time ``SnapshotWriter.snapshot`` blocks (steady state: slots
  reserved and reused, as in training); ``memcpy_s``: the same tensors copied with the
  same primitive (``Tensor.copy_``) into a prefaulted buffer, nothing else;
  ``stall_over_memcpy`` = their ratio. ``seal_s``: the agent's checksum pass (off the
  training thread, not part of the stall).
- ``torch_save_s``: ``torch.save`` of the same state to local disk plus fsync.
- ``restore_shm_s``: open the sealed snapshot, verify every checksum, rebuild the state
  as zero-copy tensors; ``restore_shm_copy_s``: the same with owned copies.
- ``torch_load_s``: ``torch.load`` of that file *cold*: after fdatasync the file's pages
  are dropped from the page cache (posix_fadvise DONTNEED), so it reads the disk.
  ``torch_load_warm_s``: the same file again, from the page cache.
  ``restore_over_torch_load`` = torch_load_s / restore_shm_s (the speed-up).
- ``persist_mib_s``: ``Persister`` writing the sealed snapshot to local disk (chunked,
  fdatasync'd, committed); ``persist_with_verify_mib_s`` includes the checksum pass over
  the shm copy that precedes the write; ``disk_mib_s``: ``dd if=/dev/zero bs=16M conv=fdatasync`` of
  the same size to the same folder; ``persist_over_disk`` = their ratio.

Run: ``nice -n 10 .venv/bin/python scripts/bench/ckpt.py [--size-mib 256 --size-mib 2048]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# This file is named like the package it measures: keep its own folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from ckpt.persist import Persister  # noqa: E402
from ckpt.shard import OpenShard, seal_shard  # noqa: E402
from ckpt.snapshot import SnapshotWriter  # noqa: E402
from ckpt.tier import Retention, Tier, TierDir  # noqa: E402
from unicorn_core.logs import configure_logging  # noqa: E402

TENSOR_MIB = 16
GOALS = {"stall_over_memcpy_max": 1.5, "restore_over_torch_load_min": 10.0, "persist_over_disk_min": 0.7}


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    count = max(1, size_mib // TENSOR_MIB)
    numel = min(size_mib, TENSOR_MIB) * (1 << 20) // 4
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(numel, generator=gen) for i in range(count)}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def paired(
    first: Callable[[], float], second: Callable[[], float], repeat: int
) -> tuple[float, float, float]:
    """Alternate two measurements ``repeat`` times (so both see the same background load):
    (median of first, median of second, median of the per-pair ratios second/first)."""
    a, b = [], []
    for _ in range(repeat):
        a.append(first())
        b.append(second())
    return (
        statistics.median(a),
        statistics.median(b),
        statistics.median(y / x for x, y in zip(a, b, strict=True)),
    )


def bench_size(size_mib: int, shm_base: Path, disk_base: Path, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    state = make_state(size_mib)
    total = sum(t.numel() * t.element_size() for t in state.values())
    shm_root = Path(tempfile.mkdtemp(prefix="unicorn-bench-", dir=shm_base))
    disk_dir = Path(tempfile.mkdtemp(prefix="unicorn-bench-", dir=disk_base))
    try:
        # Stall vs memcpy: the same tensors, the same copy primitive, prefaulted destinations.
        dst = torch.zeros(total, dtype=torch.uint8)

        def memcpy() -> float:
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

        memcpy(), snapshot(), snapshot()  # warm-up: every slot used once
        out["memcpy_s"], out["stall_s"], out["stall_over_memcpy"] = paired(memcpy, snapshot, repeat)
        dst = torch.empty(0, dtype=torch.uint8)  # free it before the rest
        shm = TierDir(shm_root, "bench", Tier.SHM)
        out["seal_s"] = timed(lambda: seal_shard(shm.shard(iteration, 0)))

        # Restore from memory (verify every checksum) vs torch.load from a cold page cache.
        def restore(copy: bool) -> float:
            start = time.perf_counter()
            with OpenShard(shm.shard(iteration, 0)) as shard:
                restored = shard.state_dict(copy=copy, verify=True)
                assert len(restored) == len(state)
                del restored
            return time.perf_counter() - start

        path = disk_dir / "state.pt"

        def save() -> None:
            torch.save(state, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        out["torch_save_s"] = timed(save)

        def load_cold() -> float:
            drop_cache(path)
            return timed(lambda: torch.load(path, weights_only=True))

        out["torch_load_s"], out["restore_shm_s"], ratio = paired(load_cold, lambda: restore(False), repeat)
        out["restore_over_torch_load"] = 1 / ratio
        out["torch_load_warm_s"] = timed(lambda: torch.load(path, weights_only=True))
        out["restore_shm_copy_s"] = restore(True)
        path.unlink()

        # Persistence (sendfile, fdatasync, commit) vs dd of the same size, same folder.
        local = TierDir(disk_dir / "local", "bench", Tier.LOCAL)
        persister = Persister(shm, [(local, Retention(1))])
        with_verify = []

        def persist() -> float:
            shutil.rmtree(local.job_dir, ignore_errors=True)
            start = time.perf_counter()
            result = persister.persist(iteration, 0)[0]
            with_verify.append(total / (1 << 20) / (time.perf_counter() - start))
            return result.mib_s

        def dd() -> float:
            argv = [
                "dd",
                "if=/dev/zero",
                f"of={disk_dir / 'dd.bin'}",
                "bs=16M",
                f"count={max(1, total >> 24)}",
                "conv=fdatasync",
            ]
            seconds = timed(lambda: subprocess.run(argv, check=True, capture_output=True, timeout=600))
            (disk_dir / "dd.bin").unlink()
            return total / (1 << 20) / seconds

        out["disk_mib_s"], out["persist_mib_s"], out["persist_over_disk"] = paired(
            dd, persist, max(2, repeat // 2)
        )
        out["persist_with_verify_mib_s"] = statistics.median(with_verify)
        writer.close()
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mib", type=int, action="append", help="state size (repeatable); default 256 and 2048"
    )
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeat", type=int, default=5, help="paired repetitions per comparison")
    args = parser.parse_args()
    configure_logging("warning", "json")  # stdout carries only the result
    sizes = args.size_mib or [256, 2048]
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    results = {str(size): bench_size(size, args.shm_dir, args.disk_dir, args.repeat) for size in sizes}
    met = {
        size: {
            "stall": r["stall_over_memcpy"] <= GOALS["stall_over_memcpy_max"],
            "restore": r["restore_over_torch_load"] >= GOALS["restore_over_torch_load_min"],
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
                "torch_threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(),
                "device": "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()
