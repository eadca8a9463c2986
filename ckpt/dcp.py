"""``torch.distributed.checkpoint`` storage on the checkpoint tiers (memory first).

``MemoryStorageWriter`` turns each rank's part of a DCP save into one shard of the
snapshot format (one entry per write item: a DTensor/ShardedTensor chunk, a whole
tensor, or DCP's serialized non-tensor objects), written through a
:class:`~ckpt.snapshot.SnapshotWriter`, so a DCP save *is* a snapshot: the agent seals,
persists and replicates it like any other. No global metadata file is written: each
shard records its items (fully qualified name, chunk offsets and sizes, global size,
dtype), and ``MemoryStorageReader.read_metadata`` rebuilds DCP's ``Metadata`` from all
shards of the iteration. DCP's planners then reshard (DP4 -> DP2, DP -> TP, ...) by
chunk overlap, reading zero-copy from the first tier that holds each shard verified.

Checksums: the reader verifies each entry it reads (not the whole shard), so a layout
reading a quarter of a shard hashes a quarter of it. A caller that chose (and verified)
each shard's copy itself, e.g. with :class:`~ckpt.restore.Restorer`, passes them as
``shards``.

Saves without collectives (``dcp.save(..., no_dist=True)``, the just-in-time snapshot of
a rank whose peers may be dead) skip DCP's cross-rank deduplication, so data-parallel
replicas each write the same chunk; the reader keeps the first copy of each chunk.

Replicas stand in for a lost rank: a save may record, for every rank of its world, the
name of the state that rank holds (``REPLICAS_KEY``: data-parallel replicas without
sharding share one name), and whether the shard holds all of its rank's items
(``COMPLETE_KEY``: true only without collectives, since DCP's deduplication leaves a
replica's items to one rank). The reader then loads an iteration whose shard of rank R is
missing everywhere when a complete shard of another rank with R's name is present
(:func:`replica_for`): the survivors' just-in-time snapshot of the last completed
iteration restores a data-parallel job that lost a node, instead of an older version.

Consistency: every rank of one save passes the same ``save_id``; the reader refuses
(``corrupt``) an iteration whose shards carry different ids, i.e. shards of two runs
that reached the same iteration (another layout, or a run restarted from an older
version), which must never be mixed.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckpt.errors import InvalidArgument, ShardUnavailable
from ckpt.format import ShardMeta, dtype_name, read_meta, torch_dtype
from ckpt.shard import OpenShard, seal_shard
from ckpt.snapshot import SnapshotHandle, SnapshotWriter
from ckpt.tier import TierDir
from unicorn_core.logs import get_logger

EXTRA_KEY: Final = "dcp"
SAVE_ID_KEY: Final = "save_id"
REPLICAS_KEY: Final = "replicas"
"""Shard ``extra`` key: per rank of the saving world, the name of the state it holds; ranks
with one name hold identical state (absent: no rank is declared another's replica)."""
COMPLETE_KEY: Final = "complete"
"""Shard ``extra`` key: true when the shard holds every item of its rank's state (a save
without collectives); a collective save's shard may lack what DCP left to a replica."""


def replica_for(missing: int, present: Mapping[int, ShardMeta]) -> int | None:
    """A present rank whose shard holds everything saved rank ``missing`` held, or None.

    It must declare the saving world's replica names (``REPLICAS_KEY``), give ``missing``
    its own name, and be complete (``COMPLETE_KEY``). Pure: reads metadata only."""
    for rank, meta in sorted(present.items()):
        names = meta.extra.get(REPLICAS_KEY)
        if rank == missing or meta.extra.get(COMPLETE_KEY) is not True:
            continue
        if not isinstance(names, list) or len(names) != meta.world_size or not 0 <= missing < len(names):
            continue
        if rank < len(names) and names[rank] == names[missing]:
            return rank
    return None


class DcpItem(msgspec.Struct, frozen=True, kw_only=True):
    """One DCP write item as recorded in a shard's ``extra["dcp"]``."""

    fqn: str
    entry: str
    is_bytes: bool
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    global_size: tuple[int, ...] = ()
    dtype: str = ""
    requires_grad: bool = False


def _entry_name(fqn: str, offsets: Sequence[int]) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}"


def _encode_planner_data(data: Any) -> Any:
    """DCP's default planner data (fqn -> object path of str/int) as JSON; None if other."""
    if not isinstance(data, dict):
        return None
    out = {}
    for key, path in data.items():
        if not isinstance(key, str) or not isinstance(path, tuple | list):
            return None
        if not all(isinstance(p, str | int) and not isinstance(p, bool) for p in path):
            return None
        out[key] = list(path)
    return out


def open_world(
    open_rank: Callable[[int], OpenShard], hint: Callable[[], int]
) -> tuple[dict[int, OpenShard], dict[int, str]]:
    """Every shard of one saved world that ``open_rank`` finds (it raises
    ``ShardUnavailable``), and why each other is missing. The world size comes from the
    first shard found (rank 0 may be the lost one); ``hint()``, asked once and only when
    rank 0 is missing, bounds the search for it. ``ShardUnavailable("missing")`` when none
    is found, or as soon as a shard is missing and the save declares no replicas (nothing
    could stand in for it). On any error the shards opened are closed."""
    opened: dict[int, OpenShard] = {}
    missing: dict[int, str] = {}
    world_size: int | None = None
    bound: int | None = None
    declared = False  # the save names its replicas (every shard of one save does alike)
    rank = 0
    try:
        while world_size is None or rank < world_size:
            try:
                shard = opened[rank] = open_rank(rank)
            except ShardUnavailable as exc:
                missing[rank] = exc.detail
            else:
                world_size = world_size or shard.meta.world_size
                declared = declared or REPLICAS_KEY in shard.meta.extra
            rank += 1
            if world_size is None and bound is None:
                bound = hint()
            if (missing and opened and not declared) or (world_size is None and rank >= (bound or 1)):
                reasons = "; ".join(f"rank {r}: {why}" for r, why in missing.items())
                raise ShardUnavailable("missing", f"no complete set of shards: {reasons}")
    except BaseException:
        for opened_shard in opened.values():
            opened_shard.close()
        raise
    return opened, missing


def world_hint(sources: Sequence[TierDir], iteration: int, opened: Iterable[OpenShard] = ()) -> int:
    """The largest saved world any shard metadata of ``iteration`` in ``sources`` names (at least 1)."""
    sizes = [shard.meta.world_size for shard in opened]
    for tier in sources:
        for path in tier.metas(iteration):
            with contextlib.suppress(OSError, msgspec.MsgspecError, ShardUnavailable):
                sizes.append(read_meta(path).world_size)
    return max(sizes, default=1)


def stand_ins(missing: Iterable[int], opened: Mapping[int, OpenShard]) -> dict[int, int | None]:
    """For each missing saved rank, the open rank whose complete shard stands in for it
    (:func:`replica_for`), or None when none does."""
    metas = {rank: shard.meta for rank, shard in opened.items()}
    return {rank: replica_for(rank, metas) for rank in missing}


class MemoryStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` into the snapshot tier: ``dcp.save(sd, storage_writer=...)``.

    Every rank passes its own ``SnapshotWriter`` (same root and job, its rank).
    ``seal=True`` computes checksums before ``save`` returns (a restore can read it at
    once); ``False`` leaves that to the agent and keeps the stall to the copy.
    ``save_id``: the same on every rank of one save (see the module doc). ``extra``: the
    caller's own JSON values, stored in every shard's metadata beside DCP's (e.g. the
    iterations the run skipped), readable before any tensor is loaded.
    """

    def __init__(
        self,
        writer: SnapshotWriter,
        iteration: int,
        *,
        seal: bool = True,
        save_id: str = "",
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.writer = writer
        self.iteration = iteration
        self.seal = seal
        self.save_id = save_id
        self.extra = dict(extra or {})
        self.handle: SnapshotHandle | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.handle = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        state: dict[str, Any] = {}
        items: list[DcpItem] = []
        results: list[WriteResult] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                name = _entry_name(item.index.fqn, ())
                state[name] = data.getvalue()
                items.append(DcpItem(fqn=item.index.fqn, entry=name, is_bytes=True))
                nbytes = len(state[name])
            else:
                assert isinstance(data, torch.Tensor) and item.tensor_data is not None
                chunk = item.tensor_data.chunk
                name = _entry_name(item.index.fqn, chunk.offsets)
                state[name] = data.detach()
                props = item.tensor_data.properties
                items.append(
                    DcpItem(
                        fqn=item.index.fqn,
                        entry=name,
                        is_bytes=False,
                        offsets=tuple(chunk.offsets),
                        sizes=tuple(chunk.sizes),
                        global_size=tuple(item.tensor_data.size),
                        dtype=dtype_name(props.dtype),
                        requires_grad=props.requires_grad,
                    )
                )
                nbytes = data.numel() * data.element_size()
            results.append(
                WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=(self.writer.rank, name))
            )
        extra = {
            **self.extra,
            EXTRA_KEY: msgspec.to_builtins(items),
            "planner_data": _encode_planner_data(plan.planner_data),
            SAVE_ID_KEY: self.save_id,
        }
        self.handle = self.writer.snapshot(state, self.iteration, extra=extra)
        if self.seal:
            seal_shard(self.handle.paths)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing global to write: the reader rebuilds the metadata from the shards."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class MemoryStorageReader(StorageReader):
    """DCP ``StorageReader`` over the tiers: ``dcp.load(sd, storage_reader=...)``.

    ``sources``: tier folders searched per shard in order (e.g. shm, local, remote); each
    shard is read from the first that holds it sealed. ``shards``: copies already opened
    (saved rank -> open shard), used before any source; the reader closes them too. The
    world size of the *saved* layout comes from the shards; the loading layout may differ.
    A rank whose shard no source holds is read from a complete replica (:func:`replica_for`)
    when one is open; otherwise the load fails (``ShardUnavailable("missing")``).
    """

    def __init__(
        self,
        sources: Sequence[TierDir],
        iteration: int,
        *,
        shards: Mapping[int, OpenShard] | None = None,
    ) -> None:
        super().__init__()
        if not sources:
            raise InvalidArgument("MemoryStorageReader needs at least one source tier")
        self.sources = tuple(sources)
        self.iteration = iteration
        self._shards: dict[int, OpenShard] = dict(shards or {})
        for rank, shard in self._shards.items():
            if shard.meta.iteration != iteration or shard.meta.rank != rank:
                raise InvalidArgument(
                    f"shard {shard.paths.bin} is rank {shard.meta.rank} of iteration "
                    f"{shard.meta.iteration}, not rank {rank} of {iteration}"
                )
        self._log = get_logger("ckpt.dcp", job_id=sources[0].job_id, iteration=iteration)

    def reset(self, checkpoint_id: Any = None) -> None:
        """DCP calls this at the start of every load: keep the shards handed over."""

    def _open(self, rank: int) -> OpenShard:
        if rank in self._shards:
            return self._shards[rank]
        reasons = []
        for tier in self.sources:
            try:
                shard = OpenShard(tier.shard(self.iteration, rank))
            except ShardUnavailable as exc:
                reasons.append(f"{tier.tier}: {exc}")
                self._log.warning(
                    "dcp source skipped", tier=str(tier.tier), rank=rank, reason=exc.reason, detail=exc.detail
                )
                continue
            self._shards[rank] = shard
            return shard
        raise ShardUnavailable("missing", f"rank {rank} of iteration {self.iteration}: {'; '.join(reasons)}")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        opened, missing = open_world(
            self._open, lambda: world_hint(self.sources, self.iteration, self._shards.values())
        )
        lowest = min(opened)
        first = opened[lowest].meta
        world_size, save_id = first.world_size, first.extra.get(SAVE_ID_KEY, "")
        state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, tuple[int, str]] = {}
        planner_data: dict[str, tuple[str | int, ...]] = {}
        for rank, stand_in in stand_ins(missing, opened).items():
            if stand_in is None:
                raise ShardUnavailable("missing", f"rank {rank}: {missing[rank]}")
            self._log.info("dcp shard read from a replica", rank=rank, replica=stand_in)
        for rank in sorted(opened):
            meta = opened[rank].meta
            if meta.world_size != world_size:
                raise ShardUnavailable(
                    "corrupt",
                    f"rank {rank} says world size {meta.world_size}, rank {lowest} {world_size}",
                )
            if meta.extra.get(SAVE_ID_KEY, "") != save_id:
                raise ShardUnavailable(
                    "corrupt",
                    f"rank {rank} belongs to save {meta.extra.get(SAVE_ID_KEY)!r}, "
                    f"rank {lowest} to {save_id!r}",
                )
            for raw in meta.extra.get(EXTRA_KEY, []):
                item = msgspec.convert(raw, DcpItem)
                if item.is_bytes:
                    state_md[item.fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(item.fqn)] = (rank, item.entry)
                    continue
                index = MetadataIndex(item.fqn, torch.Size(item.offsets))
                if index in storage:  # a replica's copy (a save without DCP's dedup: ``no_dist``)
                    continue
                md = state_md.get(item.fqn)
                if not isinstance(md, TensorStorageMetadata):
                    props = TensorProperties(dtype=torch_dtype(item.dtype), requires_grad=item.requires_grad)
                    md = state_md[item.fqn] = TensorStorageMetadata(props, torch.Size(item.global_size), [])
                md.chunks.append(ChunkStorageMetadata(torch.Size(item.offsets), torch.Size(item.sizes)))
                storage[index] = (rank, item.entry)
            for key, path in (meta.extra.get("planner_data") or {}).items():
                planner_data[key] = tuple(path)
        return Metadata(state_dict_metadata=state_md, planner_data=planner_data or None, storage_data=storage)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data: dict[MetadataIndex, tuple[int, str]] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        wanted: dict[int, set[str]] = {}
        for item in plan.items:
            rank, name = self.storage_data[item.storage_index]
            wanted.setdefault(rank, set()).add(name)
        for rank, names in wanted.items():  # every entry this rank reads, hashed in parallel
            shard = self._open(rank)
            shard.verify_entries(shard.index(name) for name in names)
        for item in plan.items:
            rank, name = self.storage_data[item.storage_index]
            shard = self._open(rank)
            value = shard.value(name, copy=False, verify=True)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(value))
                continue
            source = value
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise ShardUnavailable(
                    "corrupt", f"{name}: read {tuple(source.size())}, expected {tuple(target.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def close(self) -> None:
        """Release the shards (their locks); call after ``dcp.load`` returns."""
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()
