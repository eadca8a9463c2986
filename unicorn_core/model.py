"""The shape of a GPT-style transformer: what the planner, trainer and sbatch wrapper share.

Only architecture and batch size live here; how the model is laid out over GPUs is a
:class:`unicorn_core.layout.Layout`, and what it costs to run is the planner's business.
"""

from __future__ import annotations

from dataclasses import dataclass

from unicorn_core.errors import InvalidArgument


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (GPT-3 family shape) and its global batch.

    ``global_batch`` is in sequences of ``sequence`` tokens. ``ffn_hidden`` defaults to
    4 x ``hidden`` (GPT-3); ``num_query_groups`` defaults to ``heads`` (multi-head
    attention; fewer groups means grouped-query attention).
    """

    layers: int
    hidden: int
    heads: int
    sequence: int
    vocabulary: int
    global_batch: int
    ffn_hidden: int = 0
    num_query_groups: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "sequence", "vocabulary", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"model {name} must be a positive integer, got {value!r}")
        for name in ("ffn_hidden", "num_query_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"model {name} must be a positive integer, got {value!r}")
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.num_query_groups == 0:
            object.__setattr__(self, "num_query_groups", self.heads)
        if self.hidden % self.heads:
            raise InvalidArgument(f"model hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.num_query_groups:
            raise InvalidArgument(
                f"model heads {self.heads} is not divisible by num_query_groups {self.num_query_groups}"
            )

    @property
    def kv_hidden(self) -> int:
        """Width of the K and V projections (``hidden`` unless grouped-query attention)."""
        return self.hidden * self.num_query_groups // self.heads

    @property
    def layer_parameters(self) -> int:
        """Weights of one transformer layer: QKV, output projection, MLP, two layer norms, biases."""
        h, f = self.hidden, self.ffn_hidden
        attention = h * (h + 2 * self.kv_hidden) + (h + 2 * self.kv_hidden) + h * h + h
        mlp = 2 * h * f + f + h
        norms = 4 * h
        return attention + mlp + norms

    @property
    def embedding_parameters(self) -> int:
        """Token and learned position embeddings (the output layer shares the token embedding)."""
        return self.vocabulary * self.hidden + self.sequence * self.hidden

    @property
    def parameters(self) -> int:
        """All weights, counting the tied embedding once."""
        return self.layers * self.layer_parameters + self.embedding_parameters + 2 * self.hidden

    def layer_forward_flop_per_token(self) -> float:
        """Forward FLOPs of one layer per token: matrix multiplies plus attention scores.

        With the GPT-3 defaults this is 24 h^2 + 4 s h, the per-token form of Narayanan
        et al. (2021), eq. 3.
        """
        h, f = self.hidden, self.ffn_hidden
        matmul = 2 * (h * (h + 2 * self.kv_hidden) + h * h + 2 * h * f)
        attention = 4 * self.sequence * h
        return float(matmul + attention)

    def logit_forward_flop_per_token(self) -> float:
        """Forward FLOPs of the output (logit) layer per token: 2 h V."""
        return 2.0 * self.hidden * self.vocabulary

    def model_flop_per_iteration(self) -> float:
        """Useful FLOPs of one training iteration (forward + backward, no recomputation).

        For GPT-3 shapes this equals 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (Narayanan et
        al. 2021). Recomputation executes more FLOPs but does no more useful work, so
        achieved FLOP/s is always counted against this figure.
        """
        tokens = float(self.global_batch * self.sequence)
        per_token = self.layers * self.layer_forward_flop_per_token() + self.logit_forward_flop_per_token()
        return 3.0 * tokens * per_token
