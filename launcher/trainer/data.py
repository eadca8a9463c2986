"""Deterministic synthetic data addressed by global sample index.

Sample ``i`` depends only on ``(seed, i)``, never on the layout or on which rank reads
it, so a run resumed at iteration ``k`` at any layout sees exactly the samples an
uninterrupted run would. Each sample is an arithmetic sequence modulo the vocabulary
(random start and stride), which a small transformer can learn, so the loss visibly falls.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of SplitMix64: a fixed, platform-independent integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_tokens(index: int, *, seed: int, sequence: int, vocabulary: int) -> list[int]:
    """``sequence + 1`` token ids of global sample ``index`` (inputs and shifted targets)."""
    if index < 0:
        raise ValueError(f"sample index must be >= 0, got {index}")
    h = splitmix64(((seed & 0xFFFFFFFF) << 32) ^ index)
    start = h % vocabulary
    stride = 1 + (h >> 32) % max(1, vocabulary - 1)
    return [(start + stride * t) % vocabulary for t in range(sequence + 1)]


def batch(
    first_index: int, count: int, *, seed: int, sequence: int, vocabulary: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (``[count, sequence]`` int64) for samples ``first_index..+count``."""
    rows = [
        sample_tokens(first_index + j, seed=seed, sequence=sequence, vocabulary=vocabulary)
        for j in range(count)
    ]
    tokens = torch.tensor(rows, dtype=torch.long)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def replica_samples(iteration: int, *, global_batch: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """``(first_index, count)`` of the samples data-parallel replica ``dp_rank`` trains on in ``iteration``.

    ``iteration`` is 1-based; replicas take contiguous equal slices of the global batch.
    """
    per_replica = global_batch // dp
    return (iteration - 1) * global_batch + dp_rank * per_replica, per_replica
