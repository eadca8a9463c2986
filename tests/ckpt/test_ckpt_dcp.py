"""Resharding from memory through torch.distributed.checkpoint: save at DP4, load at DP2 and TP2·DP1."""

from __future__ import annotations

from pathlib import Path

import torch.multiprocessing as mp

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
