"""The built-in trainer on the checkpoint engine's tiers (``ckpt/``), memory first.

Save: every rank writes its part of a ``torch.distributed.checkpoint`` save into the
shared-memory tier through :class:`ckpt.dcp.MemoryStorageWriter` and goes on; the rank
blocks only for DCP's planning and the copy. Sealing, persistence to disk and
replication to peers are the node agent's (:mod:`launcher.ckptagent`), so a snapshot
survives its rank being killed right after ``save`` returns.

Restore, nearest first: the candidate iterations are every iteration any rank sees in
its tiers (gathered over the world), newest first. For one candidate, each rank opens
every shard of the saved world with :class:`ckpt.restore.Restorer` (own shm, this
node's peer backups, other nodes' agents over TCP, local disk, remote), each copy
verified by checksum and a corrupt or missing one skipped with its reason. Only when
every rank holds a verified copy of every shard does DCP load, resharding to this run's
layout (a DP4 save restores at DP2 or TP2·DP1); otherwise the next older candidate is
tried. All ranks call :meth:`MemoryCheckpoints.save` and :meth:`restore` together
(collectives), except ``save(..., local=True)``: DCP without collectives, each rank its
own part (replicas included), for :class:`TrainerJit`, the just-in-time snapshot taken
while peers may be dead. Every save of one iteration in one run carries the same save id,
so a restore may combine local and collective saves of that iteration.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

from ckpt.dcp import (
    COMPLETE_KEY,
    REPLICAS_KEY,
    SAVE_ID_KEY,
    MemoryStorageReader,
    MemoryStorageWriter,
    open_world,
    stand_ins,
    world_hint,
)
from ckpt.errors import InvalidArgument, InvalidTransition, RestoreFailed, ShardUnavailable
from ckpt.format import ShardState, read_meta
from ckpt.jit import JitCheckpointer
from ckpt.restore import PeerAddress, Restorer, RestoreReport
from ckpt.shard import OpenShard, seal_shard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Tier, TierDir
from launcher.trainer.config import SnapshotOptions, format_ranges, skipped_before

RESTORE_LOCK: Final = ".restore.lock"
SKIPPED_KEY: Final = "skipped_iterations"
"""Shard metadata ``extra`` key: the iterations the saving run had skipped by then
(``A-B,C-D``; absent: none)."""
_FETCH_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True)
class Restored:
    """A memory-tier restore: the iteration, where each saved shard came from, what was skipped."""

    iteration: int
    sources: Mapping[int, str]
    skipped: tuple[str, ...]

    def describe(self) -> str:
        by_source: dict[str, list[int]] = {}
        for rank, source in sorted(self.sources.items()):
            by_source.setdefault(source, []).append(rank)
        text = "; ".join(f"shards {ranks} from {source}" for source, ranks in by_source.items())
        return text + (f"; skipped: {' | '.join(self.skipped)}" if self.skipped else "")


def tier_dirs(opts: SnapshotOptions) -> tuple[TierDir, ...]:
    """This node's tier folders for ``opts``, nearest first: shm, peer backups, local, remote."""
    folders = [
        (opts.snap_dir, Tier.SHM),
        (opts.backup_dir, Tier.PEER),
        (opts.local_dir, Tier.LOCAL),
        (opts.remote_dir, Tier.REMOTE),
    ]
    return tuple(TierDir(Path(path), opts.job, tier) for path, tier in folders if path)


class MemoryCheckpoints:
    """One rank's view of the tiers in ``opts``. Construct on every rank together (collective)."""

    def __init__(
        self,
        opts: SnapshotOptions,
        rank: int,
        world_size: int,
        skip: tuple[tuple[int, int], ...] = (),
        replicas: Sequence[str] = (),
    ) -> None:
        """``skip``: the iterations this run skips (``--skip-iterations``): each save records
        the part it has passed, and a restore takes only versions whose record agrees (see
        :meth:`restore`). ``replicas``: per rank of this world, the name of the state it
        holds (data-parallel replicas share one; empty: none declared), recorded in every
        save so that a survivor's complete shard stands in for a lost replica's."""
        self.opts = opts
        self.rank = rank
        self.world_size = world_size
        self.skip = skip
        if replicas and len(replicas) != world_size:
            raise InvalidArgument(f"{len(replicas)} replica names for a world of {world_size}")
        self.replicas = tuple(replicas)
        self._tiers = tier_dirs(opts)
        self.snap = self._tiers[0]
        self.backups = tuple(t for t in self._tiers if t.tier is Tier.PEER)
        self.local = next((t for t in self._tiers if t.tier is Tier.LOCAL), None)
        self.remote = next((t for t in self._tiers if t.tier is Tier.REMOTE), None)
        self.peers = tuple(PeerAddress(p.node, p.host, p.port) for p in opts.peers)
        # Created at the first save, i.e. after any restore: a restore may fetch a peer's
        # copy of shard R into shm, and a writer that had already adopted shard R's file
        # as a slot would go on writing into the replaced (unlinked) file.
        self._writer: SnapshotWriter | None = None
        box = [uuid.uuid4().hex[:12] if rank == 0 else ""]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        self.run_id = box[0]

    @property
    def has_replicas(self) -> bool:
        """Whether some ranks hold identical state: a collective save then leaves part of a
        rank's state to a replica (DCP's deduplication), so its shard is not complete."""
        return len(set(self.replicas)) < len(self.replicas)

    # --- save -------------------------------------------------------------------------

    def writer(self) -> SnapshotWriter:
        """This rank's shm writer, created at its first use (a save or the JIT thread's start),
        which must come after any restore (see ``__init__``)."""
        if self._writer is None:
            self._writer = SnapshotWriter(
                self.snap.root, self.snap.job_id, self.rank, self.world_size, slots=self.opts.slots
            )
        return self._writer

    def save(self, state: dict[str, Any], iteration: int, *, local: bool = False) -> float:
        """Snapshot ``state`` as ``iteration`` into shared memory; returns the seconds blocked.

        ``local``: no collective (DCP ``no_dist``), so a dead peer cannot block it, and
        the shard holds every item of this rank (no deduplication against replicas).
        """
        start = time.perf_counter()
        skipped = format_ranges(skipped_before(self.skip, iteration))
        extra: dict[str, Any] = {SKIPPED_KEY: skipped} if skipped else {}
        if self.replicas:
            extra[REPLICAS_KEY] = list(self.replicas)
            extra[COMPLETE_KEY] = local
        writer = MemoryStorageWriter(
            self.writer(),
            iteration,
            seal=False,
            save_id=f"{self.run_id}-{iteration}",
            extra=extra or None,
        )
        state_dict_saver.save(state, storage_writer=writer, no_dist=local)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # --- restore ----------------------------------------------------------------------

    def restore(
        self, state: dict[str, Any], *, exactly: int | None = None, at_least: int | None = None
    ) -> Restored | None:
        """Load the newest version every rank can read verified (``exactly`` that one, or
        one ``>= at_least``) into ``state`` in place; None when no candidate qualifies.

        A version is this run's past only if it skipped what this run skips up to it: one
        saved at or after a skipped iteration by a run that trained on it (the run a roll
        back replaces) is passed over with its reason, so the ranks restore the newest
        version older than the bad data, at this launch and at every later one."""
        skipped: list[str] = []
        for iteration in self.candidates():
            if (exactly is not None and iteration != exactly) or (
                at_least is not None and iteration < at_least
            ):
                continue
            try:
                shards, sources = self.open_version(iteration)
            except RestoreFailed as exc:
                skipped.append(f"iteration {iteration}: {exc}")
                continue
            # The lowest saved rank found: rank 0's shard may be a replica's (ckpt.dcp).
            recorded = str(shards[min(shards)].meta.extra.get(SKIPPED_KEY, "")) if shards else ""
            expected = format_ranges(skipped_before(self.skip, iteration))
            if recorded != expected:
                _close(shards)
                skipped.append(
                    f"iteration {iteration}: saved by a run that skipped [{recorded}], this run "
                    f"skips [{expected}] by then (it trained on data this run skips)"
                )
                continue
            reader = MemoryStorageReader([self.snap], iteration, shards=shards)
            try:
                state_dict_loader.load(state, storage_reader=reader)
            finally:
                reader.close()
            return Restored(iteration, sources, tuple(skipped))
        return None

    def open_version(self, iteration: int) -> tuple[dict[int, OpenShard], dict[int, str]]:
        """A verified copy of every saved shard of ``iteration``, nearest first, on every rank,
        and where each came from (over all ranks). Collective. ``RestoreFailed`` on every
        rank when any rank lacks one; the caller closes the shards (``MemoryStorageReader``)."""
        shards, sources, reason = self._open_all(iteration)
        if not all_ranks(shards is not None):
            _close(shards)
            raise RestoreFailed(reason or "another rank lacks a verified shard", None)
        assert shards is not None
        return shards, _merge_sources(sources)

    def restorable(self, iteration: int) -> bool:
        """Whether every saved shard of ``iteration`` opens verified on every rank (the shards
        are closed again). Collective, like :meth:`open_version`."""
        try:
            shards, _ = self.open_version(iteration)
        except RestoreFailed:
            return False
        _close(shards)
        return True

    def tiers(self) -> Iterator[TierDir]:
        """This node's tier folders, nearest first (:func:`tier_dirs`)."""
        yield from self._tiers

    def candidates(self) -> list[int]:
        """Every iteration some rank sees in its tiers, newest first (the same list on every rank)."""
        mine = sorted({i for tier in self.tiers() for i in tier.iterations()})
        if not dist.is_initialized():
            return mine[::-1]
        gathered: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return sorted({i for part in gathered for i in part or ()}, reverse=True)

    def _open_all(self, iteration: int) -> tuple[dict[int, OpenShard] | None, dict[int, str], str]:
        """A verified copy of every shard of ``iteration`` and where each came from, or the reason not."""
        restorer = Restorer(
            self.snap,
            backups=self.backups,
            peers=self.peers,
            local=self.local,
            remote=self.remote,
            fetch_timeout_s=_FETCH_TIMEOUT_S,
        )
        sources: dict[int, str] = {}

        def open_rank(rank: int) -> OpenShard:
            try:
                shard, report = restorer.open(iteration, rank)
            except RestoreFailed as exc:
                raise ShardUnavailable("missing", str(exc)) from exc
            sources[rank] = _source(report)
            return shard

        # How far to look for the saved world's first shard: what any rank's node holds (a
        # spare node holds none). A collective, so before the node lock below.
        hint = _reduced(world_hint(self._tiers, iteration), dist.ReduceOp.MAX)
        # One rank of this node at a time: the first fetches a peer's copy into shm, the
        # next finds it there (two concurrent fetches of one shard would replace each other).
        with self._node_lock():
            self._seal_copied(iteration)
            try:
                shards, missing = open_world(open_rank, lambda: hint)
            except ShardUnavailable as exc:
                return None, {}, exc.detail
        replicas = stand_ins(missing, shards)  # a replica's complete shard (ckpt.dcp)
        if None in replicas.values():
            _close(shards)
            return None, {}, "; ".join(missing[r] for r, stand_in in replicas.items() if stand_in is None)
        for rank, stand_in in replicas.items():
            sources[rank] = f"replica rank {stand_in}"
        save_ids = {s.meta.extra.get(SAVE_ID_KEY, "") for s in shards.values()}
        worlds = {s.meta.world_size for s in shards.values()}
        if len(save_ids) > 1 or len(worlds) > 1:
            _close(shards)
            return (
                None,
                {},
                f"shards of different saves mixed (ids {sorted(save_ids)}, worlds {sorted(worlds)})",
            )
        return shards, sources, ""

    @contextlib.contextmanager
    def _node_lock(self) -> Iterator[None]:
        self.snap.job_dir.mkdir(parents=True, exist_ok=True)
        with (self.snap.job_dir / RESTORE_LOCK).open("a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _seal_copied(self, iteration: int) -> None:
        """Seal this node's shm copies of ``iteration`` the agent has not sealed yet (no agent,
        or a rank restarting before its agent got to them). Sealing is idempotent."""
        for meta_path in self.snap.metas(iteration):
            stem = meta_path.stem.removeprefix("shard-")
            try:
                if stem.isdigit() and read_meta(meta_path).state is ShardState.COPIED:
                    seal_shard(self.snap.shard(iteration, int(stem)))
            except (OSError, msgspec.MsgspecError, ShardUnavailable, InvalidTransition):
                continue  # reused or half-written: the restore attempt reports it


class TrainerJit(JitCheckpointer):
    """The trainer's just-in-time snapshot: DCP without collectives into the memory tier."""

    def __init__(self, memory: MemoryCheckpoints, state: dict[str, Any]) -> None:
        super().__init__(memory.writer(), lambda: state)
        self.memory = memory
        self.state = state

    def _write(self, iteration: int, request_id: str) -> float:
        return self.memory.save(self.state, iteration, local=True)


def _source(report: RestoreReport) -> str:
    return str(report.tier) if report.tier is not Tier.PEER else f"peer {report.source}"


def _merge_sources(mine: dict[int, str]) -> dict[int, str]:
    """Where each shard came from, over all ranks: the farther tier wins, because a rank
    that fetched a peer's (or read a disk) copy left it in shm, where the others found it."""
    if not dist.is_initialized():
        return mine
    gathered: list[dict[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: dict[int, str] = {}
    for sources in gathered:
        for rank, source in (sources or {}).items():
            if merged.get(rank, str(Tier.SHM)) == str(Tier.SHM):
                merged[rank] = source
    return merged


def _close(shards: Mapping[int, OpenShard] | None) -> None:
    for shard in (shards or {}).values():
        shard.close()


def all_ranks(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a MIN all-reduce)."""
    return bool(_reduced(1 if ok else 0, dist.ReduceOp.MIN))


def _reduced(value: int, op: Any) -> int:
    """``value`` all-reduced over the ranks with ``op`` (``value`` itself without a group)."""
    if not dist.is_initialized():
        return value
    flag = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=op)
    return int(flag.item())
