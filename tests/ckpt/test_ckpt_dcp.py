"""Resharding from memory through torch.distributed.checkpoint: save at DP4, load at DP2 and TP2·DP1."""

from __future__ import annotations

from pathlib import Path

import torch.multiprocessing as mp

from ckpt.dcp import replica_for
from ckpt.format import ShardMeta, ShardState
from ckpt.tier import Tier, TierDir
from tests.ckpt import _dcp_workers


def test_save_dp4_restore_dp2_and_tp2_from_memory(shm_root: Path, tmp_path: Path) -> None:
    # Four gloo ranks save DTensors sharded over DP4 into the shm tier; two of them then load
    # the same iteration at DP2 and at TP2·DP1 and compare every element (see _dcp_workers).
    mp.spawn(
        _dcp_workers.save_dp4_then_load_world2,
        args=(str(shm_root), str(tmp_path / "store")),
        nprocs=4,
        join=True,
    )
    shm = TierDir(shm_root, _dcp_workers.JOB, Tier.SHM)
    assert shm.done_ranks(_dcp_workers.ITERATION) == {0, 1, 2, 3}


def _meta(rank: int, world: int, **extra: object) -> ShardMeta:
    return ShardMeta(
        job_id="j", iteration=2, rank=rank, world_size=world, state=ShardState.SEALED, data_bytes=0,
        entries=(), tree=None, extra=dict(extra), created_unix_s=0.0,
    )  # fmt: skip


def test_a_complete_shard_of_the_same_state_stands_in_for_a_lost_rank() -> None:
    names = ["pp0.tp0", "pp1.tp0", "pp0.tp0", "pp1.tp0"]  # PP2 x DP2: ranks 0 and 2 are replicas
    complete = {r: _meta(r, 4, replicas=names, complete=True) for r in (0, 1, 3)}
    assert replica_for(2, complete) == 0
    assert replica_for(2, {1: complete[1], 3: complete[3]}) is None  # no rank of stage 0 left
    deduplicated = {r: _meta(r, 4, replicas=names, complete=False) for r in (0, 1, 3)}
    assert replica_for(2, deduplicated) is None  # a collective save may have left rank 2's items to it
    undeclared = {r: _meta(r, 4, complete=True) for r in (0, 1, 3)}
    assert replica_for(2, undeclared) is None
    fsdp = {r: _meta(r, 2, replicas=["pp0.dp0.tp0", "pp0.dp1.tp0"], complete=True) for r in (0,)}
    assert replica_for(1, fsdp) is None
    wrong_length = {0: _meta(0, 2, replicas=["pp0.tp0"], complete=True)}
    assert replica_for(1, wrong_length) is None
