"""Per-GPU memory of a Megatron layout: model states plus activations, on the fullest stage.

Model states per parameter (mixed precision with Adam, Rajbhandari et al. 2020 and
Megatron's defaults): bf16 weight 2 B + fp32 main gradient 4 B + fp32 master weight,
momentum and variance 12 B = 18 B; the distributed optimizer shards the 12 B across
the data-parallel group (6 + 12/dp B).

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation"), with sequence parallelism whenever tp > 1 and flash attention (no
s x s score matrix stored): s b (18 h + 4 f) / tp bytes, i.e. 34 s b h / tp for f = 4h.
With full recomputation only each layer's input (2 s b h / tp) is kept, plus one
layer's full activations while it is recomputed.

Pipeline imbalance: under 1F1B the first stage holds min(pp, m) micro-batches in flight
(times 1 + (pp-1)/(pp v) with v interleaved chunks) and the embedding; the last stage
holds one micro-batch plus the fp32 logits and the output layer. The peak is the larger
of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryAssumptions:
    """Software-side allowances, independent of the GPU type."""

    reserved_gib: float = 3.0  # CUDA context, NCCL buffers, cuBLAS workspace
    fragmentation: float = 1.10  # allocator slack on top of live tensors
    logit_bytes_per_element: float = 8.0  # fp32 logits and their gradient in cross-entropy


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak per-GPU memory of a layout, split by kind, for its fullest pipeline stage."""

    states_gib: float
    activations_gib: float
    total_gib: float  # (states + activations) x fragmentation + reserved

    def fits(self, hbm_gib: float) -> bool:
        return self.total_gib <= hbm_gib


def state_bytes_per_parameter(layout: Layout) -> float:
    """Bytes of weights, gradients and optimizer states per parameter on one GPU."""
    if layout.distributed_optimizer:
        return 6.0 + 12.0 / layout.dp
    return 18.0


def stage_parameters(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """Parameters held by one GPU of the first and of the last pipeline stage."""
    layers = model.layers / layout.pp
    body = layers * model.layer_parameters / layout.tp
    embedding = model.embedding_parameters / layout.tp
    output = model.vocabulary * model.hidden / layout.tp  # last stage's copy of the tied embedding
    if layout.pp == 1:
        return body + embedding, body + embedding
    return body + embedding, body + output


def estimate_memory(
    model: ModelSpec, layout: Layout, assume: MemoryAssumptions = MemoryAssumptions()
) -> MemoryEstimate:
    """Peak per-GPU memory of running ``model`` with ``layout`` (see the module docstring)."""
    s, b, h, tp = model.sequence, layout.micro_batch, model.hidden, layout.tp
    per_state = state_bytes_per_parameter(layout)
    first_params, last_params = stage_parameters(model, layout)

    full_layer = s * b * (18 * h + 4 * model.ffn_hidden) / tp
    kept_layer = 2.0 * s * b * h / tp if layout.recompute else full_layer
    working = full_layer if layout.recompute else 0.0
    layers_per_stage = model.layers / layout.pp
    in_flight = min(layout.pp, layout.num_microbatches)
    v = layout.virtual_stages
    interleave = 1.0 + (layout.pp - 1) / (layout.pp * v) if v > 1 else 1.0
    first_act = layers_per_stage * kept_layer * in_flight * interleave + working
    logits = assume.logit_bytes_per_element * s * b * model.vocabulary / tp
    last_act = layers_per_stage * kept_layer + working + logits
    if layout.pp == 1:
        first_act = last_act

    first = first_params * per_state + first_act
    last = last_params * per_state + last_act
    if first >= last:
        states, acts = first_params * per_state, first_act
    else:
        states, acts = last_params * per_state, last_act
    total = (states + acts) * assume.fragmentation / GIB + assume.reserved_gib
    return MemoryEstimate(states_gib=states / GIB, activations_gib=acts / GIB, total_gib=total)
