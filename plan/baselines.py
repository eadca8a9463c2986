"""Static allocations the planner is compared with (Unicron, Table 3 baselines).

Each splits the workers in proportion to a share (equal, by weight, by model size) with
the largest-remainder method, then lets each task run its best layout on at most its
share (a share that no layout can use exactly would otherwise earn nothing, which no
operator would accept).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from unicorn_core.errors import InvalidArgument
from unicorn_core.taskspec import TaskSpec


class Baseline(StrEnum):
    """How a baseline divides the cluster."""

    EQUALLY = "equally"
    WEIGHTED = "weighted"  # in proportion to task weight
    SIZED = "sized"  # in proportion to parameter count


def apportion(shares: Sequence[float], workers: int) -> tuple[int, ...]:
    """Split ``workers`` in proportion to ``shares`` (largest remainder, ties to the first)."""
    if workers < 0 or any(s < 0 for s in shares) or (shares and sum(shares) <= 0):
        raise InvalidArgument(f"cannot apportion {workers} workers by shares {list(shares)}")
    if not shares:
        return ()
    total = float(sum(shares))
    exact = [workers * s / total for s in shares]
    floors = [int(e) for e in exact]
    left = workers - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return tuple(floors)


def baseline_shares(tasks: Sequence[TaskSpec], workers: int, kind: Baseline) -> tuple[int, ...]:
    """Workers each task is given by baseline ``kind``."""
    if kind is Baseline.EQUALLY:
        shares = [1.0] * len(tasks)
    elif kind is Baseline.WEIGHTED:
        shares = [t.weight for t in tasks]
    else:
        shares = [float(t.model.parameters) for t in tasks]
    return apportion(shares, workers)


def best_within(waf: npt.NDArray[np.float64], share: int) -> int:
    """Workers a task actually uses out of ``share``: the count with the highest F (fewest on ties)."""
    return int(np.argmax(waf[: share + 1]))


def baseline_allocation(
    tasks: Sequence[TaskSpec], wafs: Sequence[npt.NDArray[np.float64]], workers: int, kind: Baseline
) -> tuple[int, ...]:
    """Workers each task runs on under baseline ``kind`` (its share, trimmed to its best usable size)."""
    return tuple(best_within(w, s) for w, s in zip(wafs, baseline_shares(tasks, workers, kind), strict=True))
