"""Megatron-LM's distributed checkpoints on unicorn's tiers, memory first.

Megatron-LM (``--ckpt-format torch_dist``) saves through megatron-core's
``dist_checkpointing``: ``save(sharded_state_dict, <save>/iter_NNNNNNN, strategy)``,
where the strategy comes from megatron-core's registry
(``get_default_save_sharded_strategy('torch_dist')``), and loads with the strategy named
by the checkpoint's ``metadata.json``. :func:`install` puts two strategies there, so an
unmodified Megatron-LM checkpoints into the memory tier:

- :class:`MemorySaveStrategy` (registered as the ``torch_dist`` save strategy) runs a
  ``torch.distributed.checkpoint`` save with megatron-core's own planner into
  :class:`ckpt.dcp.MemoryStorageWriter`: each rank's shard goes to shared memory and the
  rank goes on; the node agent seals, persists and replicates it like the built-in
  trainer's. The copy *is* the whole stall, so ``async_save`` does it at once and hands
  Megatron an empty request (its ``--async-save`` path then has nothing left to run).
- ``metadata.json`` then names backend ``unicorn_mem``, so every load of such a
  checkpoint goes to :class:`MemoryLoadStrategy`. It opens every shard of the iteration
  nearest first (own shm, this node's peer backups, other nodes' agents, local disk,
  remote; each copy verified, a bad one skipped with its reason, exactly as
  :class:`launcher.trainer.snapshots.MemoryCheckpoints`) and lets megatron-core's load
  planner reshard them to this run's TP/PP/DP. Ordinary file checkpoints keep
  megatron-core's own loader.

What stays on disk in ``iter_NNNNNNN``: megatron-core's ``metadata.json`` and
``common.pt`` (args, iteration, scheduler: kilobytes) and Megatron-LM's tracker file, so
``--save`` should be shared storage, as usual; tensors and ``ShardedObject`` bytes are
only in the tiers. The iteration is the folder's number (``release`` folders are not
supported).

Run a Megatron-LM script as ``python -m launcher.mcore_ckpt pretrain_gpt.py ARGS`` (or
``torchrun ... -m launcher.mcore_ckpt pretrain_gpt.py ARGS``): :func:`install_from_env`
reads the tiers the node agent exports (``UNICORN_CKPT_*``), then the script runs as
``__main__``. Without a memory tier in the environment the script runs untouched.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values  # type: ignore[import-untyped]
from megatron.core.dist_checkpointing.mapping import (  # type: ignore[import-untyped]
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.strategies import (  # type: ignore[import-untyped]
    torch as mcore_torch,
)
from megatron.core.dist_checkpointing.strategies.async_utils import (  # type: ignore[import-untyped]
    AsyncRequest,
)
from megatron.core.dist_checkpointing.strategies.base import (  # type: ignore[import-untyped]
    AsyncSaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ckpt.dcp import MemoryStorageReader, MemoryStorageWriter
from ckpt.errors import InvalidArgument, RestoreFailed
from launcher import ckptagent
from launcher.megatron import SKIPPED_FILE, TRACKER_FILE, rollback_load, skipped_by, skipped_ranges
from launcher.trainer.config import SnapshotOptions, format_ranges, parse_peers, skipped_before
from launcher.trainer.snapshots import MemoryCheckpoints, all_ranks, tier_dirs
from unicorn_core.logs import get_logger

BACKEND: Final = "unicorn_mem"
"""What ``metadata.json`` says for a checkpoint in the tiers: routes its loads to us only."""
VERSION: Final = 1
_ITER_DIR: Final = re.compile(r"^iter_(\d+)$")

log = get_logger(__name__)


def iteration_of(checkpoint_dir: str | Path) -> int:
    """The iteration of a Megatron-LM checkpoint folder ``.../iter_0000100``."""
    match = _ITER_DIR.match(Path(checkpoint_dir).name)
    if match is None:
        raise InvalidArgument(
            f"{checkpoint_dir}: the memory tier needs Megatron-LM's iter_NNNNNNN folders "
            "('release' checkpoints are not supported)"
        )
    return int(match.group(1))


class _Tiers:
    """One :class:`MemoryCheckpoints` per process, built at the first save or load: both
    are collective in megatron-core, and building it is too (the run id broadcast)."""

    def __init__(self, opts: SnapshotOptions) -> None:
        self.opts = opts
        self._memory: MemoryCheckpoints | None = None

    def memory(self) -> MemoryCheckpoints:
        if self._memory is None:
            import torch.distributed as dist

            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            self._memory = MemoryCheckpoints(self.opts, rank, world)
        return self._memory

    def reader(self, iteration: int) -> MemoryStorageReader:
        """A reader over this node's tiers only, for metadata: no peers and no collective,
        because megatron-core may ask for metadata on one rank alone."""
        return MemoryStorageReader(tier_dirs(self.opts), iteration)


class MemorySaveStrategy(AsyncSaveShardedStrategy):  # type: ignore[misc]
    """megatron-core save strategy into the memory tier (see the module doc)."""

    def __init__(self, tiers: _Tiers) -> None:
        super().__init__(BACKEND, VERSION)  # what save() writes to metadata.json
        self.tiers = tiers
        # Megatron-LM sets these on every torch_dist strategy (--ckpt-assume-constant-structure).
        self.use_cached_ckpt_structure = False
        self.cached_global_metadata = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects (RNG states, ...) go into the shard as bytes, not ``.pt`` files."""
        return True

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        iteration = iteration_of(checkpoint_dir)
        flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True
        )
        state = mcore_torch.mcore_to_pyt_state_dict(flat, is_loading=False)
        memory = self.tiers.memory()
        writer = MemoryStorageWriter(
            memory.writer(), iteration, seal=False, save_id=f"{memory.run_id}-{iteration}"
        )
        planner = mcore_torch.MCoreSavePlanner(flatten_state_dict=False)
        state_dict_saver.save(state, storage_writer=writer, planner=planner)
        _record_skipped(Path(checkpoint_dir), iteration)
        return AsyncRequest(None, (), [])


def _record_skipped(checkpoint_dir: Path, iteration: int) -> None:
    """Rank 0 writes what this run skipped by ``iteration`` into the version folder
    (:data:`launcher.megatron.SKIPPED_FILE`), so a later roll back knows which versions
    were trained on skipped data (:func:`launcher.megatron.rollback_load`)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    skipped = format_ranges(skipped_before(skipped_ranges(sys.argv), iteration))
    marker = checkpoint_dir / SKIPPED_FILE
    if skipped:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{skipped}\n")
    else:
        marker.unlink(missing_ok=True)


class MemoryLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):  # type: ignore[misc]
    """megatron-core load strategy for ``unicorn_mem`` checkpoints (see the module doc)."""

    def __init__(self, tiers: _Tiers) -> None:
        super().__init__()
        self.tiers = tiers

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """megatron-core's ``TorchDistLoadShardedStrategy.load`` with our reader in place
        of its file reader (the only part it does not let a subclass change)."""
        iteration = iteration_of(checkpoint_dir)
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        template = sharded_state_dict
        flat, flat_mapping, rename_mapping = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        state = mcore_torch.mcore_to_pyt_state_dict(flat, is_loading=True)
        planner = mcore_torch.MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
        )
        memory = self.tiers.memory()
        try:
            shards, sources = memory.open_version(iteration)
        except RestoreFailed as exc:
            raise RestoreFailed(f"{exc}; {fall_back(memory, Path(checkpoint_dir), iteration)}", None) from exc
        reader = MemoryStorageReader([memory.snap], iteration, shards=shards)
        try:
            state_dict_loader.load(state, storage_reader=reader, planner=planner)
        finally:
            reader.close()
        log.info("megatron checkpoint restored from the tiers", iteration=iteration, sources=sources)
        loaded = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in state.items()}
        loaded = mcore_torch._replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        mcore_torch._restore_dict_types(loaded, template)
        return loaded

    def _metadata(self, checkpoint_dir: str | Path) -> Metadata:
        reader = self.tiers.reader(iteration_of(checkpoint_dir))
        try:
            return reader.read_metadata()
        finally:
            reader.close()

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Metadata | None = None) -> Any:
        return super().load_tensors_metadata(checkpoint_dir, metadata or self._metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> Any:
        metadata = self._metadata(checkpoint_dir)
        out: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        raise InvalidArgument("a checkpoint in the memory tier cannot be edited in place")

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise InvalidArgument(f"a {loaded_backend!r} checkpoint; this strategy reads {BACKEND!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise InvalidArgument(f"{BACKEND} version {loaded_version}; this strategy reads {VERSION}")


def fall_back(memory: MemoryCheckpoints, checkpoint_dir: Path, iteration: int) -> str:
    """After ``iteration`` could not be restored (``open_version`` fails on every rank
    together): point Megatron-LM's tracker at the newest older version that every rank can
    restore, so the next launch loads it; returns what was done, for the error. Collective.

    A shard saved into the memory tier exists only there (the folder holds metadata), and its
    copies to other nodes follow the save by the agent's seal, persist and push: a node killed
    in that window takes the only copy of its shard with it, after rank 0 has already written
    the tracker. Megatron-LM loads the tracker's version and nothing else, so every later
    launch would fail the same way (a CI run of the node-kill system test: the relaunch and
    its restart in place died at load, and the task waited out the restart timeout). The
    version moved back to is one of this run's past (:func:`launcher.megatron.rollback_load`'s
    rule for skipped data). Only the tracker changes, and only when it names ``iteration``
    and the command gives no ``--ckpt-step``."""
    save_dir = checkpoint_dir.parent
    tracker = save_dir / TRACKER_FILE
    try:
        named: int | None = int(tracker.read_text().strip())
    except (OSError, ValueError):
        named = None
    # The same answer on every rank, so every rank makes the same collective calls below.
    if not all_ranks(named == iteration) or any(a.partition("=")[0] == "--ckpt-step" for a in sys.argv):
        return f"Megatron-LM was asked for iteration {iteration} ({tracker} names {named}): tracker left"
    skip = skipped_ranges(sys.argv)
    for older in (i for i in memory.candidates() if i < iteration):
        ours = skipped_by(save_dir, older) == format_ranges(skipped_before(skip, older))
        on_disk = (save_dir / f"iter_{older:07d}" / "metadata.json").is_file()
        if not all_ranks(ours and on_disk) or not memory.restorable(older):
            continue
        if not dist.is_initialized() or dist.get_rank() == 0:
            staged = tracker.with_name(f".{TRACKER_FILE}.unicorn")
            staged.write_text(f"{older}\n")
            staged.replace(tracker)
        if dist.is_initialized():
            dist.barrier()  # moved before any rank fails (torchrun then ends them all)
        log.warning("megatron checkpoint unrestorable; tracker moved back", iteration=iteration, to=older)
        return f"{tracker} now names {older}, the newest version all ranks restore: the next launch loads it"
    return f"no older version every rank can restore; {tracker} still names {iteration}"


_ORIGINAL_REGISTER: Final[Callable[[], None]] = mcore_torch.register_default_torch_strategies


def install(opts: SnapshotOptions) -> tuple[MemorySaveStrategy, MemoryLoadStrategy]:
    """Make megatron-core's registry hand out the memory-tier strategies for ``opts``.

    ``get_default_strategy`` re-runs ``register_default_torch_strategies()`` on every call,
    which re-registers ``('torch_dist', 1)``: a plain registration of ours would be
    overwritten, so that function is wrapped (it is looked up by name at each call). Call
    before Megatron-LM reads any checkpoint (its ``load_args_from_checkpoint`` runs early).
    """
    tiers = _Tiers(opts)
    save, load = MemorySaveStrategy(tiers), MemoryLoadStrategy(tiers)

    def register() -> None:
        _ORIGINAL_REGISTER()
        register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, save)

    mcore_torch.register_default_torch_strategies = register
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, load)
    return save, load


def uninstall() -> None:
    """Megatron-core's own strategies again (tests)."""
    mcore_torch.register_default_torch_strategies = _ORIGINAL_REGISTER
    _ORIGINAL_REGISTER()


def options_from_env(env: Mapping[str, str]) -> SnapshotOptions | None:
    """The tiers the node agent exports to training processes; None without a memory tier."""
    snap, job = env.get(ckptagent.ENV_SNAP_DIR, ""), env.get(ckptagent.ENV_JOB, "")
    if not snap or not job:
        return None
    return SnapshotOptions(
        snap_dir=snap,
        job=job,
        backup_dir=env.get(ckptagent.ENV_BACKUP_DIR) or None,
        local_dir=env.get(ckptagent.ENV_LOCAL_DIR) or None,
        remote_dir=env.get(ckptagent.ENV_REMOTE_DIR) or None,
        peers=parse_peers(env.get(ckptagent.ENV_PEERS, "")),
        slots=int(env.get(ckptagent.ENV_SLOTS, "") or 2),
    )


def install_from_env(env: Mapping[str, str] | None = None) -> bool:
    """:func:`install` for the agent's exported tiers; False (nothing changed) without them."""
    opts = options_from_env(os.environ if env is None else env)
    if opts is None:
        return False
    install(opts)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m launcher.mcore_ckpt SCRIPT [ARGS]``: install, then run SCRIPT as __main__.

    Two things every rank of a Megatron-LM task needs from the runner, whatever the
    script: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` where the job did not set it (Megatron
    asserts it for TP > 1, and unicorn may relaunch a TP=1 job at TP=2), and torchrun's
    ``@record``, so an uncaught exception of the script reaches torchrun's error file
    (type, message, traceback) and the agent reports it as the rank's exception.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m launcher.mcore_ckpt SCRIPT [ARGS...]")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    installed = install_from_env()
    log.info("megatron checkpoints", memory_tier=installed, script=args[0])
    rolled = rollback_load(args)
    if rolled != args:
        log.info(
            "megatron roll back", skipped=format_ranges(skipped_ranges(args)), args=rolled[len(args) - 2 :]
        )
    args = rolled
    sys.argv = args
    from torch.distributed.elastic.multiprocessing.errors import record

    record(lambda: runpy.run_path(args[0], run_name="__main__"))()


if __name__ == "__main__":
    main()
