"""A tiny GPT whose pieces can be placed on pipeline stages and split by tensor parallelism.

Parameter names are global and layout-independent (``embed.tok.weight``,
``layers.5.attn.q.weight``, ``head.weight``): a pipeline stage holds a subset of the
layers under their global index, so checkpoints saved at one pipeline split load at
another by name. Every parameter is initialised from a generator seeded by
``(seed, name)``, so any stage built at any layout starts from the same weights an
unsplit model would have.

Attention projections are separate ``q``/``k``/``v``/``o`` linears and the MLP is
``fc1``/``fc2`` so Megatron's tensor-parallel split maps onto DTensor's
``ColwiseParallel`` (q, k, v, fc1) and ``RowwiseParallel`` (o, fc2); attention reads the
number of local heads from the local width, so the same code runs split or not.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - conventional alias
from torch import nn

from launcher.trainer.data import splitmix64
from unicorn_core.model import ModelSpec

INIT_STD = 0.02


class Attention(nn.Module):
    """Causal multi-head self-attention; heads = local width / head_dim (TP-aware)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        local_heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(b, s, local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.o(y.transpose(1, 2).reshape(b, s, local_heads * self.head_dim))
        return out


class Mlp(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class Block(nn.Module):
    """Pre-norm transformer layer (Megatron/GPT-2 order)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.attn = Attention(spec.hidden, spec.heads)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.mlp = Mlp(spec.hidden, spec.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocabulary, spec.hidden)
        self.pos = nn.Embedding(spec.sequence, spec.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        out: torch.Tensor = self.tok(tokens) + self.pos(positions)
        return out


@dataclass(frozen=True)
class StagePlacement:
    """Which part of the model pipeline stage ``index`` of ``count`` holds."""

    index: int
    count: int
    first_layer: int
    last_layer: int  # exclusive

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


def placement(spec: ModelSpec, stage: int, stages: int) -> StagePlacement:
    """Stage ``stage`` of ``stages`` holds an equal contiguous slice of the layers (``stages`` | layers)."""
    per_stage = spec.layers // stages
    return StagePlacement(stage, stages, stage * per_stage, (stage + 1) * per_stage)


class GPTStage(nn.Module):
    """The part of the GPT on one pipeline stage (the whole model when there is one stage).

    The first stage maps token ids to hidden states, middle stages map hidden states to
    hidden states, the last stage ends with the final norm and the (untied) LM head and
    returns logits.
    """

    def __init__(self, spec: ModelSpec, where: StagePlacement) -> None:
        super().__init__()
        self.where = where
        self.embed = Embedding(spec) if where.is_first else None
        self.layers = nn.ModuleDict({str(i): Block(spec) for i in range(where.first_layer, where.last_layer)})
        self.norm = nn.LayerNorm(spec.hidden) if where.is_last else None
        self.head = nn.Linear(spec.hidden, spec.vocabulary, bias=False) if where.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def init_weights(module: nn.Module, seed: int) -> None:
    """Initialise every parameter from ``(seed, its name)`` alone (layout-independent).

    Weights of linears and embeddings ~ N(0, 0.02), biases 0, layer-norm weights 1.
    """
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif ".ln" in name or name.startswith("norm."):
                param.fill_(1.0)
            else:
                gen = torch.Generator().manual_seed(splitmix64(seed ^ zlib.crc32(name.encode())) >> 1)
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)


def scale_output_projections(module: nn.Module, total_layers: int) -> None:
    """Scale residual output projections (``attn.o``, ``mlp.fc2``) by 1/sqrt(2*layers) (GPT-2)."""
    factor = 1.0 / math.sqrt(2.0 * total_layers)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith(("attn.o.weight", "mlp.fc2.weight")):
                param.mul_(factor)


def build_stage(spec: ModelSpec, where: StagePlacement, seed: int) -> GPTStage:
    """A deterministically initialised stage module on the CPU."""
    stage = GPTStage(spec, where)
    init_weights(stage, seed)
    scale_output_projections(stage, spec.layers)
    return stage


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of one micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
