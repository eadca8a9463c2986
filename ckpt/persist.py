"""Persistence tiers: the node agent flushes sealed snapshots to local disk and remote.

Per shard and target tier: the shm copy is verified, then committed to the tier by the
one shard commit protocol, :func:`ckpt.commit.commit_shard` (a crash at any point leaves
no done marker, so the shard does not count and no version is published without it),
its bytes copied by ``sendfile`` in ``chunk_bytes`` pieces (kernel to kernel: no buffer
is allocated, memory use does not grow with the shard). Then ``TierDir.publish`` writes
``VERSION.json`` if every rank of the iteration is done, and the tier's retention
evicts the oldest versions.

The calls are blocking; the agent runs them off its event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from ckpt.commit import commit_shard
from ckpt.errors import InvalidArgument, ShardUnavailable
from ckpt.format import ShardMeta, ShardState
from ckpt.shard import OpenShard, seal_shard
from ckpt.tier import Retention, Tier, TierDir
from unicorn_core.logs import get_logger

DEFAULT_CHUNK_BYTES: Final = 16 << 20


@dataclass(frozen=True)
class PersistResult:
    """One shard written to one tier."""

    tier: Tier
    iteration: int
    rank: int
    data_bytes: int
    elapsed_s: float
    published: bool

    @property
    def mib_s(self) -> float:
        return self.data_bytes / (1 << 20) / self.elapsed_s if self.elapsed_s > 0 else float("inf")


def write_shard(
    source: OpenShard,
    target: TierDir,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_chunk: Callable[[int], None] | None = None,
) -> ShardMeta:
    """Commit an open, sealed shard into ``target`` (:func:`ckpt.commit.commit_shard`).

    ``on_chunk(bytes_written_so_far)`` is called after each chunk (progress, tests).
    """
    if chunk_bytes < 1:
        raise InvalidArgument(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    meta = source.meta

    def copy(fd: int) -> None:
        written = 0
        while written < meta.data_bytes:
            # sendfile: page cache to page cache in the kernel, no user mapping to fault in.
            sent = os.sendfile(fd, source.fileno(), written, min(chunk_bytes, meta.data_bytes - written))
            if sent == 0:
                raise ShardUnavailable("incomplete", f"{source.paths.bin} ended at {written} B")
            written += sent
            if on_chunk is not None:
                on_chunk(written)

    commit_shard(target, meta, copy)
    return meta


class Persister:
    """Flushes one job's sealed shm snapshots to its persistence tiers (the agent owns one).

    ``targets``: (tier folder, retention) pairs, typically local disk then remote.
    """

    def __init__(
        self,
        shm: TierDir,
        targets: Sequence[tuple[TierDir, Retention]],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if chunk_bytes < 1:
            raise InvalidArgument(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        for target, _ in targets:
            if target.job_id != shm.job_id:
                raise InvalidArgument(f"target {target} is for job {target.job_id}, not {shm.job_id}")
        self.shm = shm
        self.targets = tuple(targets)
        self.chunk_bytes = chunk_bytes
        self._log = get_logger("ckpt.persist", job_id=shm.job_id)
        for target, _ in self.targets:
            target.clean_tmp()

    def persist(
        self, iteration: int, rank: int, *, on_chunk: Callable[[int], None] | None = None
    ) -> list[PersistResult]:
        """Seal (if needed), verify, then write ``rank``'s shard of ``iteration`` to every target.

        The shard stays share-locked in shm throughout, so the rank cannot reuse its slot
        mid-copy. A corrupt shm copy raises ``ShardUnavailable('corrupt')`` and writes
        nothing; a target copy that fails its own verification is deleted, and raises.
        """
        paths = self.shm.shard(iteration, rank)
        with OpenShard(paths, require_sealed=False) as probe:
            sealed = probe.meta.state == ShardState.SEALED
        if not sealed:
            seal_shard(paths)
        results = []
        with OpenShard(paths) as shard:
            shard.verify()
            for target, retention in self.targets:
                start = time.perf_counter()
                meta = write_shard(shard, target, chunk_bytes=self.chunk_bytes, on_chunk=on_chunk)
                elapsed = time.perf_counter() - start
                published = target.publish(iteration, meta.world_size) is not None
                evicted = target.apply_retention(retention)
                result = PersistResult(target.tier, iteration, rank, meta.data_bytes, elapsed, published)
                self._log.info(
                    "shard persisted",
                    tier=str(target.tier),
                    iteration=iteration,
                    rank=rank,
                    mib_s=round(result.mib_s, 1),
                    published=published,
                    evicted=evicted,
                )
                results.append(result)
        return results
