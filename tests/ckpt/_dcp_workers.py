"""Worker processes for the resharding test (spawned; imported without pytest).

A two-layer MLP with Megatron-style TP placements: ``w1`` column-parallel (Shard(0)),
``w2`` row-parallel (Shard(1)); Adam-like moments alongside. Saved at DP4 (every tensor
fully sharded on dim 0 over 4 ranks, as FSDP/ZeRO-3 does), restored at DP2 and at
TP2·DP1. Every rank checks the tensors it loaded against the values it expects.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from ckpt.dcp import MemoryStorageReader, MemoryStorageWriter
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Tier, TierDir

JOB = "reshard"
ITERATION = 40
SHAPES = {"w1": (8, 6), "b1": (8,), "w2": (6, 8)}


def expected() -> dict[str, torch.Tensor]:
    """Deterministic full tensors (distinct values everywhere, so a misplaced chunk shows)."""
    out: dict[str, torch.Tensor] = {}
    base = 0
    for name, shape in SHAPES.items():
        numel = torch.Size(shape).numel()
        for kind in ("param", "exp_avg"):
            out[f"{kind}.{name}"] = (torch.arange(numel, dtype=torch.float32) + base).reshape(shape) / 7
            base += numel
    return out


def _init(rank: int, world: int, store: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _state(placements: dict[str, list[Shard]], mesh: object) -> dict[str, object]:
    full = expected()
    model = {n: distribute_tensor(full[f"param.{n}"], mesh, placements[n]) for n in SHAPES}  # type: ignore[arg-type]
    optim = {n: distribute_tensor(full[f"exp_avg.{n}"], mesh, placements[n]) for n in SHAPES}  # type: ignore[arg-type]
    return {"model": model, "optim": {"exp_avg": optim, "step": 40}, "data": {"position": 1234}}


def save_dp4_then_load_world2(rank: int, root: str, store: str) -> None:
    """All 4 ranks save at DP4; then ranks 0 and 1 load at DP2 and TP2·DP1 in a 2-rank group.

    One spawn for both halves: starting processes that import torch dominates the cost.
    """
    _init(rank, 4, store)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    state = _state({n: [Shard(0)] for n in SHAPES}, mesh)
    writer = SnapshotWriter(Path(root), JOB, rank, 4)
    dcp.save(state, storage_writer=MemoryStorageWriter(writer, ITERATION))
    writer.close()
    pair = dist.new_group([0, 1])
    dist.barrier()
    if rank < 2:
        _load_world2(rank, root, pair)
    dist.barrier()
    dist.destroy_process_group()


def _load_world2(rank: int, root: str, group: dist.ProcessGroup) -> None:
    """Load at DP2 and at TP2·DP1 from the shm tier; compare every element."""
    full = expected()
    layouts = {
        "dp2": {n: [Shard(0)] for n in SHAPES},
        "tp2": {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)]},
    }
    for label, placements in layouts.items():
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(label,))
        target = _state(placements, mesh)
        for group_name in ("model", "optim"):  # zero the targets: values must come from the checkpoint
            tensors = target[group_name] if group_name == "model" else target[group_name]["exp_avg"]  # type: ignore[index]
            for tensor in tensors.values():  # type: ignore[union-attr]
                tensor.to_local().zero_()
        target["optim"]["step"] = -1  # type: ignore[index]
        target["data"]["position"] = -1  # type: ignore[index]
        reader = MemoryStorageReader([TierDir(Path(root), JOB, Tier.SHM)], ITERATION)
        dcp.load(target, storage_reader=reader, process_group=group)
        reader.close()
        for name in SHAPES:
            for kind, tensors in (("param", target["model"]), ("exp_avg", target["optim"]["exp_avg"])):  # type: ignore[index]
                tensor = tensors[name]
                assert isinstance(tensor, DTensor)
                local = tensor.to_local()
                want = full[f"{kind}.{name}"]
                dim = placements[name][0].dim
                step = want.shape[dim] // 2
                expect_local = want.narrow(dim, rank * step, step)
                assert torch.equal(local, expect_local), (
                    f"{label} {kind}.{name} rank {rank}: {local} != {expect_local}"
                )
        assert target["optim"]["step"] == 40, target["optim"]  # type: ignore[index]
        assert target["data"]["position"] == 1234, target["data"]  # type: ignore[index]
