"""A tier folder (shm, peer backups, local disk, remote) and its commit protocol.

A shard is *complete* in a tier once its done marker exists (written last, after the
bytes and metadata are verified and durable: :func:`ckpt.commit.commit_shard`). A
version is *published* once ``VERSION.json`` exists, which :meth:`TierDir.publish`
writes only when every rank ``0..world_size-1`` has a done marker for that iteration.
``latest_complete`` is the highest published iteration whose markers are all still
there. Where each node keeps its own shards (local disks), no folder ever holds every
rank: the coordinator gathers ``complete_iterations(rank)`` from the agents and
``latest_common`` picks the highest iteration that every rank holds.
"""

from __future__ import annotations

import enum
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ckpt.errors import InvalidArgument
from ckpt.format import (
    TMP_MARK,
    DoneMarker,
    ShardPaths,
    VersionManifest,
    VersionShard,
    check_index,
    check_job_id,
    encode,
    iteration_dir,
    now_unix_s,
    parse_iteration_dir,
    write_atomic,
)
from unicorn_core.logs import get_logger

VERSION_FILE = "VERSION.json"


class Tier(enum.StrEnum):
    """Where a copy lives, nearest first (the order restore tries them)."""

    SHM = "shm"
    PEER = "peer"
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True)
class Retention:
    """Keep at most ``keep_versions`` iterations and ``keep_bytes`` bytes in a tier.

    The oldest go first; the latest published version and the newest iteration (possibly
    still being written) are never evicted, so a tier always keeps something restorable.
    """

    keep_versions: int = 3
    keep_bytes: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.keep_versions, bool)
            or not isinstance(self.keep_versions, int)
            or self.keep_versions < 1
        ):
            raise InvalidArgument(f"keep_versions must be an integer >= 1, got {self.keep_versions!r}")
        if self.keep_bytes is not None and (not isinstance(self.keep_bytes, int) or self.keep_bytes < 0):
            raise InvalidArgument(f"keep_bytes must be None or an integer >= 0, got {self.keep_bytes!r}")


class TierDir:
    """One job's folder in one tier: ``<root>/<job_id>/it-*/``. ``durable`` = fsync writes."""

    def __init__(self, root: Path, job_id: str, tier: Tier, *, durable: bool | None = None) -> None:
        self.root = Path(root)
        self.job_id = check_job_id(job_id)
        self.tier = tier
        self.durable = tier in (Tier.LOCAL, Tier.REMOTE) if durable is None else durable
        self._log = get_logger("ckpt.tier", job_id=job_id, tier=str(tier))

    def __repr__(self) -> str:
        return f"TierDir({self.tier}, {self.root})"

    @property
    def job_dir(self) -> Path:
        return self.root / self.job_id

    def shard(self, iteration: int, rank: int) -> ShardPaths:
        return ShardPaths.of(self.root, self.job_id, iteration, rank)

    def iterations(self) -> list[int]:
        """Every iteration with a folder here, complete or not, ascending."""
        try:
            found = [parse_iteration_dir(child.name) for child in self.job_dir.iterdir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(i for i in found if i is not None)

    def metas(self, iteration: int) -> list[Path]:
        """The metadata files (``shard-*.json``) of every shard of ``iteration`` here, sorted;
        [] when its folder is gone (:func:`listing`)."""
        return listing(iteration_dir(self.root, self.job_id, iteration), "shard-*.json")

    def done_ranks(self, iteration: int) -> set[int]:
        directory = iteration_dir(self.root, self.job_id, iteration)
        ranks = set()
        for path in listing(directory, "shard-*.done"):
            try:
                ranks.add(int(path.stem.removeprefix("shard-")))
            except ValueError:
                continue
        return ranks

    def complete_iterations(self, rank: int) -> list[int]:
        """Iterations for which ``rank``'s shard is complete here (has its done marker)."""
        check_index(rank, "rank")
        return [i for i in self.iterations() if self.shard(i, rank).done.exists()]

    def manifest(self, iteration: int) -> VersionManifest | None:
        path = iteration_dir(self.root, self.job_id, iteration) / VERSION_FILE
        try:
            return msgspec.json.decode(path.read_bytes(), type=VersionManifest)
        except (FileNotFoundError, msgspec.MsgspecError):
            return None

    def publish(self, iteration: int, world_size: int) -> VersionManifest | None:
        """Write ``VERSION.json`` if every rank's shard is done; ``None`` (nothing written) if not.

        Idempotent and safe to race: concurrent publishers write identical content by rename.
        """
        check_index(iteration, "iteration")
        if world_size < 1:
            raise InvalidArgument(f"world_size must be >= 1, got {world_size}")
        shards = []
        for rank in range(world_size):
            try:
                done = msgspec.json.decode(self.shard(iteration, rank).done.read_bytes(), type=DoneMarker)
            except (FileNotFoundError, msgspec.MsgspecError):
                return None
            shards.append(VersionShard(rank=rank, digest=done.digest, data_bytes=done.data_bytes))
        manifest = VersionManifest(
            job_id=self.job_id,
            iteration=iteration,
            world_size=world_size,
            shards=tuple(shards),
            published_unix_s=now_unix_s(),
        )
        write_atomic(
            iteration_dir(self.root, self.job_id, iteration) / VERSION_FILE,
            encode(manifest),
            durable=self.durable,
        )
        self._log.info("version published", iteration=iteration, world_size=world_size)
        return manifest

    def latest_complete(self) -> int | None:
        """Highest published iteration whose shards all still have their done markers."""
        for iteration in reversed(self.iterations()):
            manifest = self.manifest(iteration)
            if manifest is not None and self.done_ranks(iteration) >= set(range(manifest.world_size)):
                return iteration
        return None

    def version_bytes(self, iteration: int) -> int:
        directory = iteration_dir(self.root, self.job_id, iteration)
        return sum(p.stat().st_size for p in directory.iterdir() if p.is_file()) if directory.is_dir() else 0

    def evict(self, iteration: int) -> None:
        """Unpublish first (so no half-deleted version looks complete), then delete."""
        directory = iteration_dir(self.root, self.job_id, iteration)
        if not directory.is_dir():
            return
        (directory / VERSION_FILE).unlink(missing_ok=True)
        for done in directory.glob("*.done"):
            done.unlink()
        trash = directory.with_name(f".evict-{directory.name}{TMP_MARK}{os.getpid()}")
        directory.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        self._log.info("version evicted", iteration=iteration)

    def apply_retention(self, retention: Retention) -> list[int]:
        """Evict the oldest iterations beyond ``retention``; return the evicted ones."""
        iterations = self.iterations()
        protected = {
            i for i in (self.latest_complete(), iterations[-1] if iterations else None) if i is not None
        }
        sizes = {i: self.version_bytes(i) for i in iterations}
        total = sum(sizes.values())
        count = len(iterations)
        evicted = []
        for iteration in iterations:
            over_count = count > retention.keep_versions
            over_bytes = retention.keep_bytes is not None and total > retention.keep_bytes
            if not (over_count or over_bytes):
                break
            if iteration in protected:
                continue
            self.evict(iteration)
            evicted.append(iteration)
            count -= 1
            total -= sizes[iteration]
        return evicted

    def clean_tmp(self) -> int:
        """Delete temp files and eviction leftovers of processes that no longer exist."""
        if not self.job_dir.is_dir():
            return 0
        removed = 0
        for path in list(self.job_dir.rglob(f"*{TMP_MARK}*")):
            pid = path.name.rsplit(TMP_MARK, 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and Path(f"/proc/{pid}").exists():
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
        return removed


def listing(directory: Path, pattern: str) -> list[Path]:
    """``directory.glob(pattern)``, sorted; empty when the folder vanishes meanwhile. A
    writer reclaims an old iteration's folder at any moment, between a scan listing it and
    globbing it (a ckpt agent died of exactly that: FileNotFoundError from scandir)."""
    try:
        return sorted(directory.glob(pattern))
    except FileNotFoundError:
        return []


def latest_common(held: Mapping[int, Iterable[int]], world_size: int) -> int | None:
    """Highest iteration that every rank ``0..world_size-1`` holds (``held``: rank -> iterations)."""
    if world_size < 1:
        raise InvalidArgument(f"world_size must be >= 1, got {world_size}")
    common: set[int] | None = None
    for rank in range(world_size):
        mine = set(held.get(rank, ()))
        common = mine if common is None else common & mine
    return max(common) if common else None
