"""Performance model T(t, x): a task's best achieved FLOP/s on x GPUs over Megatron layouts.

Time of one iteration for a layout (tp, pp, dp, micro-batch b, v interleaved chunks,
recompute, distributed optimizer), with m = global_batch / (dp b) micro-batches:

* compute per micro-batch on the slowest stage: its layers' forward FLOPs x 3 (x 4 with
  full recomputation), plus the logit layer x 3 on the last stage, at
  peak x gemm_efficiency x d / (d + gemm_half_dim), d = the narrowest GEMM dimension
  (h/tp): thin tensor-parallel shards run less efficiently;
* tensor parallelism: 4 all-reduces (6 with recomputation) of s b h bf16 values per layer
  and micro-batch, ring cost 2 (tp-1)/tp x bytes over NVLink, not overlapped;
* pipeline: 1F1B costs (m + (pp-1)/v) stage times; every micro-batch sends s b h / tp
  bf16 values forward and back per chunk (Megatron's scatter-gather), over NVLink when
  the whole job is inside one node, else over the network;
* data parallelism: gradient all-reduce of the stage's fp32 gradients, 2 (dp-1)/dp x 4 B
  per parameter, or with the distributed optimizer reduce-scatter 4 B + all-gather 2 B,
  (dp-1)/dp x 6 B; over the network once tp x dp spans nodes, never overlapped with
  the backward pass (Megatron can overlap it; the model is conservative); plus the
  tied-embedding all-reduce between first and last stage;
* optimizer step: Adam streams ~32 B per local parameter through HBM.

Achieved FLOP/s counts *model* FLOPs (72 B s l h^2 (1 + s/6h + V/12lh)), so
recomputation's extra forward pass lowers it. :mod:`plan.calibration` refines these
predictions with measured iteration times (the analytic model is their prior).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from plan.hardware import GpuSpec
from plan.memory import MemoryAssumptions, MemoryEstimate, estimate_memory, stage_parameters
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

BF16_BYTES = 2.0
RANKED_PER_WORLD = 8
"""Fitting layouts a :class:`LayoutTable` keeps per world size, fastest first: the candidates
a calibrated plan chooses among (:func:`plan.calibration.calibrated_table`)."""


@dataclass(frozen=True)
class PerfAssumptions:
    """Efficiency factors of the time model (uncalibrated defaults)."""

    # Uncalibrated default: with it, the model reproduces Narayanan et al. (2021) Table 1
    # (A100, 1.7B..1T, 44-52% of peak counting recomputation) within about 10%.
    gemm_efficiency: float = 0.60
    gemm_half_dim: float = 64.0  # narrow GEMM dimension at which that efficiency halves
    nvlink_efficiency: float = 0.75  # NCCL bus bandwidth / one-way NVLink bandwidth
    network_efficiency: float = 0.80  # NCCL bus bandwidth / NIC line rate
    grad_bytes: float = 4.0  # fp32 main gradients (Megatron's default for bf16)
    optimizer_bytes_per_parameter: float = 32.0  # Adam step HBM traffic
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    distributed_optimizer: bool = True  # may a layout shard optimizer state over DP
    virtual_stages: tuple[int, ...] = (2, 4)
    memory: MemoryAssumptions = field(default_factory=MemoryAssumptions)


@dataclass(frozen=True)
class LayoutEstimate:
    """Predicted performance and memory of one layout on one GPU type."""

    layout: Layout
    iteration_s: float
    tflops: float  # aggregate achieved model TFLOP/s of the whole task
    tflops_per_gpu: float
    mfu: float  # tflops_per_gpu / peak, a fraction
    memory: MemoryEstimate
    fits: bool


@dataclass(frozen=True)
class Infeasible:
    """No layout runs the model on exactly ``gpus`` GPUs; ``reason`` says why."""

    gpus: int
    reason: str


def _allreduce_s(nbytes: float, group: int, bandwidth_b_s: float) -> float:
    if group <= 1:
        return 0.0
    return 2.0 * (group - 1) / group * nbytes / bandwidth_b_s


def estimate_layout(
    model: ModelSpec,
    layout: Layout,
    gpu: GpuSpec,
    gpus_per_node: int,
    assume: PerfAssumptions = PerfAssumptions(),
) -> LayoutEstimate:
    """Predict iteration time, achieved FLOP/s and memory of ``layout`` (validated first)."""
    layout.validate(model, gpus_per_node)
    tp, pp, dp, b = layout.tp, layout.pp, layout.dp, layout.micro_batch
    v, m = layout.virtual_stages, layout.num_microbatches
    s, h = model.sequence, model.hidden
    peak = gpu.peak_bf16_tflops * 1e12
    nvlink = gpu.nvlink_one_way_gb_s * 1e9 * assume.nvlink_efficiency
    network = gpu.network_gb_s * 1e9 * assume.network_efficiency

    narrow = min(h, model.ffn_hidden) / tp
    efficiency = assume.gemm_efficiency * narrow / (narrow + assume.gemm_half_dim)
    tokens = float(s * b)
    passes = 4.0 if layout.recompute else 3.0
    layer_flop = tokens * model.layer_forward_flop_per_token() * passes
    body_flop = model.layers / pp * layer_flop
    logit_flop = 3.0 * tokens * model.logit_forward_flop_per_token()
    stage_compute_s = (body_flop + logit_flop) / (tp * peak * efficiency)

    activation_bytes = tokens * h * BF16_BYTES
    tp_collectives = (6.0 if layout.recompute else 4.0) * model.layers / pp
    tp_s = tp_collectives * _allreduce_s(activation_bytes, tp, nvlink)
    world = layout.world_size
    p2p_bandwidth = nvlink if world <= gpus_per_node else network
    p2p_s = 2.0 * v * activation_bytes / tp / p2p_bandwidth if pp > 1 else 0.0
    stage_s = stage_compute_s + tp_s + p2p_s
    pipeline_s = (m + (pp - 1) / v) * stage_s

    first_params, last_params = stage_parameters(model, layout)
    local_params = max(first_params, last_params)
    dp_bandwidth = nvlink if tp * dp <= gpus_per_node else network
    if layout.distributed_optimizer:
        dp_s = (dp - 1) / dp * local_params * (assume.grad_bytes + BF16_BYTES) / dp_bandwidth
        optimizer_params = local_params / dp
    else:
        dp_s = _allreduce_s(local_params * assume.grad_bytes, dp, dp_bandwidth)
        optimizer_params = local_params
    embedding_s = 0.0
    if pp > 1:
        embedding_s = _allreduce_s(model.vocabulary * h / tp * assume.grad_bytes, 2, network)
    optimizer_s = optimizer_params * assume.optimizer_bytes_per_parameter / (gpu.hbm_tb_s * 1e12)

    iteration_s = pipeline_s + dp_s + embedding_s + optimizer_s
    tflops = model.model_flop_per_iteration() / iteration_s / 1e12
    memory = estimate_memory(model, layout, assume.memory)
    return LayoutEstimate(
        layout=layout,
        iteration_s=iteration_s,
        tflops=tflops,
        tflops_per_gpu=tflops / world,
        mfu=tflops / world / gpu.peak_bf16_tflops,
        memory=memory,
        fits=memory.fits(gpu.hbm_gib),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelSpec, gpus_per_node: int, assume: PerfAssumptions) -> Iterator[Layout]:
    """Every valid layout shape of ``model`` (any world size), recompute off."""
    tps = [
        tp for tp in _divisors(gpus_per_node) if model.heads % tp == 0 and model.num_query_groups % tp == 0
    ]
    for tp in tps:
        for pp in _divisors(model.layers):
            for dp in _divisors(model.global_batch):
                for b in assume.micro_batches:
                    if model.global_batch % (dp * b):
                        continue
                    m = model.global_batch // (dp * b)
                    vpps: list[int | None] = [None]
                    if pp > 1 and m % pp == 0:
                        vpps += [v for v in assume.virtual_stages if model.layers % (pp * v) == 0]
                    for vpp in vpps:
                        for distopt in (False, True) if dp > 1 and assume.distributed_optimizer else (False,):
                            yield Layout(tp, pp, dp, b, model.global_batch, vpp, False, distopt)


@dataclass(frozen=True)
class LayoutTable:
    """For every world size some layout has: the fastest layout that fits, and the least memory."""

    model: ModelSpec
    gpu: GpuSpec
    gpus_per_node: int
    best: dict[int, LayoutEstimate]  # world size -> fastest fitting layout
    least_memory_gib: dict[int, float]  # world size -> smallest per-GPU need of any layout
    world_sizes: tuple[int, ...]  # sorted keys of least_memory_gib
    ranked: dict[int, tuple[LayoutEstimate, ...]] = field(default_factory=dict)  # fastest fitting first

    def tflops_by_gpus(self, max_gpus: int) -> npt.NDArray[np.float64]:
        """T(t, x) for x = 0..max_gpus GPUs used exactly: aggregate TFLOP/s, 0 where infeasible."""
        curve = np.zeros(max_gpus + 1)
        for world, est in self.best.items():
            if world <= max_gpus:
                curve[world] = est.tflops
        return curve

    def lookup(self, gpus: int) -> LayoutEstimate | Infeasible:
        """Best layout on exactly ``gpus`` GPUs, or why there is none."""
        if gpus in self.best:
            return self.best[gpus]
        hbm = self.gpu.hbm_gib
        if gpus in self.least_memory_gib:
            need = self.least_memory_gib[gpus]
            return Infeasible(
                gpus,
                f"memory: every layout on {gpus} GPUs needs more than the {hbm:g} GiB of a {self.gpu.name} "
                f"(least: {need:.1f} GiB per GPU, even with recomputation and the distributed optimizer)",
            )
        fitting = sorted(self.best)
        at = bisect.bisect_left(fitting, gpus)
        nearby = [str(w) for w in fitting[max(0, at - 1) : at + 1]]
        hint = f"; nearest feasible sizes: {', '.join(nearby)} GPUs" if nearby else ""
        return Infeasible(
            gpus,
            f"shape: no layout uses exactly {gpus} GPUs (tp must divide {self.gpus_per_node} and "
            f"{self.model.heads} heads, pp must divide {self.model.layers} layers, "
            f"dp x micro-batch must divide global batch {self.model.global_batch}){hint}",
        )


@lru_cache(maxsize=256)
def layout_table(
    model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, assume: PerfAssumptions = PerfAssumptions()
) -> LayoutTable:
    """Evaluate every layout once (memoised): the planner's T(t, x) for all x.

    Recomputation only lowers throughput in this model, so a layout is evaluated with it
    only when it does not fit without it.
    """
    if gpus_per_node <= 0:
        raise InvalidArgument(f"gpus_per_node must be positive, got {gpus_per_node}")
    best: dict[int, LayoutEstimate] = {}
    least: dict[int, float] = {}
    fitting: dict[int, list[LayoutEstimate]] = {}
    for layout in candidate_layouts(model, gpus_per_node, assume):
        est = estimate_layout(model, layout, gpu, gpus_per_node, assume)
        if not est.fits:
            est = estimate_layout(model, _with_recompute(layout), gpu, gpus_per_node, assume)
        world = layout.world_size
        least[world] = min(least.get(world, float("inf")), est.memory.total_gib)
        if est.fits:
            fitting.setdefault(world, []).append(est)
            if world not in best or est.tflops > best[world].tflops:
                best[world] = est
    ranked = {
        world: tuple(sorted(ests, key=lambda e: -e.tflops)[:RANKED_PER_WORLD])
        for world, ests in fitting.items()
    }
    return LayoutTable(model, gpu, gpus_per_node, best, least, tuple(sorted(least)), ranked)


def _with_recompute(layout: Layout) -> Layout:
    return Layout(
        layout.tp,
        layout.pp,
        layout.dp,
        layout.micro_batch,
        layout.global_batch,
        layout.vpp,
        True,
        layout.distributed_optimizer,
    )


def best_layout(
    model: ModelSpec,
    gpus: int,
    gpu: GpuSpec,
    gpus_per_node: int,
    assume: PerfAssumptions = PerfAssumptions(),
) -> LayoutEstimate | Infeasible:
    """The fastest layout that fits on exactly ``gpus`` GPUs, or why there is none."""
    if gpus <= 0:
        raise InvalidArgument(f"gpus must be positive, got {gpus}")
    return layout_table(model, gpu, gpus_per_node, assume).lookup(gpus)
