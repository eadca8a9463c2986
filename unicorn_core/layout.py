"""How one training task is laid out over GPUs (Megatron-LM's parallel dimensions)."""

from __future__ import annotations

from dataclasses import dataclass

from unicorn_core.errors import InvalidArgument
from unicorn_core.model import ModelSpec


@dataclass(frozen=True)
class Layout:
    """A Megatron-LM layout: tensor (``tp``), pipeline (``pp``) and data (``dp``) parallel sizes.

    ``vpp`` is the number of virtual pipeline stages per GPU (interleaved 1F1B); ``None``
    means the plain 1F1B schedule. ``recompute`` is full activation recomputation;
    ``distributed_optimizer`` shards optimizer states across the data-parallel group.
    Rank order is Megatron's default: TP fastest, then DP, then PP.
    """

    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    vpp: int | None = None
    recompute: bool = False
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"layout {name} must be a positive integer, got {value!r}")
        if self.vpp is not None and (isinstance(self.vpp, bool) or self.vpp < 2):
            raise InvalidArgument(f"layout vpp must be None or an integer >= 2, got {self.vpp!r}")
        if self.vpp is not None and self.pp < 2:
            raise InvalidArgument(
                f"layout vpp={self.vpp} needs pipeline parallelism (pp >= 2), got pp={self.pp}"
            )
        if self.global_batch % (self.dp * self.micro_batch):
            raise InvalidArgument(
                f"layout dp*micro_batch = {self.dp}*{self.micro_batch} = {self.dp * self.micro_batch} "
                f"does not divide global_batch {self.global_batch}"
            )

    @property
    def world_size(self) -> int:
        """GPUs used: tp x pp x dp."""
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per iteration on each data-parallel replica."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        return 1 if self.vpp is None else self.vpp

    def validate(self, model: ModelSpec, gpus_per_node: int) -> None:
        """Raise :class:`InvalidArgument` unless Megatron can run ``model`` with this layout.

        TP must stay within a node and divide the attention heads and query groups; PP (times
        VPP) must divide the layers; the global batch must match the model's.
        """
        if gpus_per_node <= 0:
            raise InvalidArgument(f"gpus_per_node must be positive, got {gpus_per_node}")
        if self.tp > gpus_per_node or gpus_per_node % self.tp:
            raise InvalidArgument(
                f"tp={self.tp} must divide gpus_per_node={gpus_per_node} "
                "(tensor parallelism stays within a node)"
            )
        if model.heads % self.tp:
            raise InvalidArgument(f"tp={self.tp} does not divide the model's {model.heads} attention heads")
        if model.num_query_groups % self.tp:
            raise InvalidArgument(
                f"tp={self.tp} does not divide the model's {model.num_query_groups} query groups"
            )
        chunks = self.pp * self.virtual_stages
        if model.layers % chunks:
            what = f"pp={self.pp}" if self.vpp is None else f"pp*vpp={self.pp}*{self.vpp}={chunks}"
            raise InvalidArgument(f"{what} does not divide the model's {model.layers} layers")
        if self.global_batch != model.global_batch:
            raise InvalidArgument(
                f"layout global_batch {self.global_batch} differs from the model's {model.global_batch}"
            )
        if self.vpp is not None and self.num_microbatches % self.pp:
            raise InvalidArgument(
                f"interleaved schedule needs the micro-batch count ({self.num_microbatches}) "
                f"divisible by pp={self.pp}"
            )

    def describe(self) -> str:
        """Short human form, e.g. ``TP4.PP2.DP8 mb2 +recompute +distopt``."""
        text = f"TP{self.tp}.PP{self.pp}.DP{self.dp} mb{self.micro_batch}"
        if self.vpp is not None:
            text += f" vpp{self.vpp}"
        if self.recompute:
            text += " +recompute"
        if self.distributed_optimizer:
            text += " +distopt"
        return text
