"""Lay a :class:`~launcher.trainer.model.GPTStage` out over a ``(pp, dp, tp)`` device mesh.

Rank order is Megatron's: TP fastest, then DP, then PP, i.e. a row-major mesh of shape
``(pp, dp, tp)``. TP uses DTensor's ``parallelize_module`` on every block, DP wraps the
stage in DDP or FSDP2 ``fully_shard`` (over the ``dp`` sub-mesh, so FSDP2 composes with
TP), PP builds a ``torch.distributed.pipelining`` stage and schedule over the ``pp``
sub-mesh. :class:`StepRunner` hides which of these is active: one call runs every
micro-batch of one iteration (forward, backward, gradient accumulation and DP gradient
reduction) and returns this replica's mean micro-batch loss where it is known.

Gradient scaling keeps one iteration equal to one optimizer step over the whole global
batch at any layout: each micro-batch loss is divided by the replica's micro-batch count
(pipelining does this with ``scale_grads``), and DDP/FSDP2 average over DP replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from launcher.trainer.config import DataParallel, PipelineSchedule
from launcher.trainer.model import Block, GPTStage, lm_loss
from unicorn_core.layout import Layout

TP_PLAN: Final[dict[str, ParallelStyle]] = {
    # The attention input enters DTensor land once (replicated), so the backward sums the
    # q/k/v input gradients locally and all-reduces them once instead of three times.
    "attn": PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    ),
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(),
}
"""Megatron's split of a transformer layer: column-parallel in, row-parallel out."""


@dataclass(frozen=True)
class MeshCoords:
    """This rank's position in the ``(pp, dp, tp)`` mesh."""

    pp: int
    dp: int
    tp: int


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The ``(pp, dp, tp)`` mesh over the default process group (must already be initialised)."""
    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))


def coords(mesh: DeviceMesh) -> MeshCoords:
    return MeshCoords(mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), mesh.get_local_rank("tp"))


def replica_names(mesh: DeviceMesh, *, replicated: bool) -> tuple[str, ...]:
    """Per global rank, the name of the training state it holds: ``pp<i>.tp<j>`` when the
    data-parallel ranks hold identical state (``replicated``: DDP or no wrapper, not FSDP),
    else one name per rank. Recorded in snapshots so that a survivor's complete copy stands
    in for a lost replica's (``ckpt.dcp.replica_for``)."""
    grid = mesh.mesh  # (pp, dp, tp) -> global rank
    names = [""] * grid.numel()
    pp, dp, tp = grid.shape
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                names[int(grid[p, d, t])] = f"pp{p}.tp{t}" if replicated else f"pp{p}.dp{d}.tp{t}"
    return tuple(names)


def apply_tensor_parallel(stage: GPTStage, mesh: DeviceMesh) -> None:
    """Split every block's attention and MLP over the ``tp`` sub-mesh (in place; no-op at TP1)."""
    tp_mesh = mesh["tp"]
    if tp_mesh.size() == 1:
        return
    for block in stage.layers.values():
        parallelize_module(block, tp_mesh, dict(TP_PLAN))


def apply_data_parallel(
    stage: GPTStage, mesh: DeviceMesh, impl: DataParallel, *, pipelined: bool
) -> nn.Module:
    """Wrap ``stage`` for data parallelism over the ``dp`` sub-mesh; returns the module to call.

    With one replica nothing is wrapped. FSDP2 shards each block and then the stage
    root; under pipelining it keeps parameters unsharded between forward and backward
    (``reshard_after_forward=False``) so micro-batches do not all-gather again.
    """
    dp_mesh = mesh["dp"]
    if dp_mesh.size() == 1:
        return stage
    if impl is DataParallel.DDP:
        return DistributedDataParallel(stage, process_group=dp_mesh.get_group())
    if impl is DataParallel.FSDP:
        for block in stage.layers.values():
            assert isinstance(block, Block)
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=not pipelined)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=not pipelined)
        return stage
    raise ValueError(f"unresolved data-parallel implementation {impl}")


class StepRunner:
    """Runs one iteration's micro-batches on this rank (see module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        layout: Layout,
        device: torch.device,
        schedule: PipelineSchedule,
    ) -> None:
        self.module = module
        self.layout = layout
        self.coords = coords(mesh)
        self.pipelined = layout.pp > 1
        self._schedule: PipelineScheduleSingle | None = None
        if self.pipelined:
            stage = PipelineStage(module, self.coords.pp, layout.pp, device, group=mesh["pp"].get_group())
            cls = ScheduleGPipe if schedule is PipelineSchedule.GPIPE else Schedule1F1B
            self._schedule = cls(stage, n_microbatches=layout.num_microbatches, loss_fn=lm_loss)

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        on_microbatch: Callable[[int], None] | None = None,
    ) -> float | None:
        """Forward and backward over this replica's samples (``[global/dp, seq]``).

        Returns the mean micro-batch loss on the last pipeline stage, ``None`` elsewhere.
        Gradients are left reduced across DP and scaled for one optimizer step.
        ``on_microbatch(done)`` is called after each micro-batch without pipelining (test
        fault injection).
        """
        if self._schedule is not None:
            return self._pipelined_step(inputs, targets)
        nmb, mb = self.layout.num_microbatches, self.layout.micro_batch
        total = 0.0
        for i in range(nmb):
            last = i == nmb - 1
            sync = contextlib.nullcontext()
            if isinstance(self.module, DistributedDataParallel) and not last:
                sync = self.module.no_sync()  # type: ignore[assignment]
            if isinstance(self.module, FSDPModule):  # accumulate unsharded, reduce-scatter once
                self.module.set_requires_gradient_sync(last)
                self.module.set_reshard_after_backward(last)
            with sync:
                loss = lm_loss(self.module(inputs[i * mb : (i + 1) * mb]), targets[i * mb : (i + 1) * mb])
                torch.autograd.backward(loss / nmb)
            total += loss.item()
            if on_microbatch is not None:
                on_microbatch(i + 1)
        return total / nmb

    def _pipelined_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        assert self._schedule is not None
        losses: list[torch.Tensor] = []
        if self.is_first_stage:
            self._schedule.step(inputs)
        elif self.is_last_stage:
            self._schedule.step(target=targets, losses=losses)
        else:
            self._schedule.step()
        if not self.is_last_stage:
            return None
        return sum(float(t.item()) for t in losses) / len(losses)
