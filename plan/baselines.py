"""Static allocations the planner is compared with (Unicron, Table 3 baselines).

Each splits the workers in proportion to a share (equal, by weight, by model size) with
the largest-remainder method and lets each task run its best layout on at most its share
(a share that no layout can use exactly would otherwise earn nothing, which no operator
would accept). Trimming leaves workers idle (a 7B task given 3 nodes runs on 2), and no
operator would leave them idle either: :func:`hand_out_leftovers` gives them to the
tasks where they add the most F, every task keeping at least what its share runs on.

That leftover rule is the most favourable one for the baseline: it is the exact optimum
over every way of adding the idle workers to the trimmed shares, so any other rule
(round-robin in the baseline's own order, one worker at a time to the largest marginal
gain) earns at most as much. The comparison with the planner is then about the shares
themselves (what the planner may take away from a task), not about idle workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from plan.solver import solve
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


def hand_out_leftovers(
    wafs: Sequence[npt.NDArray[np.float64]], allocation: Sequence[int], workers: int
) -> tuple[int, ...]:
    """``allocation`` plus the workers it leaves idle, given where they add the most F.

    Every task keeps at least its count in ``allocation``; of the ``workers - sum``
    idle workers, task i may get any number e_i (sum of e_i at most the idle count) and
    then runs its best layout on at most ``allocation[i] + e_i``. The e_i are the exact
    optimum (:func:`plan.solver.solve` over the few idle workers), so no other way of
    handing them out earns more. Workers no task can use stay idle.
    """
    if len(wafs) != len(allocation):
        raise InvalidArgument(f"{len(allocation)} counts for {len(wafs)} tasks")
    idle = workers - sum(allocation)
    if idle < 0 or any(k < 0 or k >= w.shape[0] for w, k in zip(wafs, allocation, strict=True)):
        raise InvalidArgument(f"allocation {list(allocation)} does not fit {workers} workers and the curves")
    if idle == 0 or not wafs:
        return tuple(allocation)
    gains = []
    for waf, k in zip(wafs, allocation, strict=True):
        best = np.maximum.accumulate(waf)  # best[x]: F of the best layout on at most x workers
        reach = np.minimum(np.arange(k, k + idle + 1), waf.shape[0] - 1)
        gains.append(best[reach])
    extra = solve(gains, idle).workers
    return tuple(best_within(w, k + e) for w, k, e in zip(wafs, allocation, extra, strict=True))


def baseline_allocation(
    tasks: Sequence[TaskSpec], wafs: Sequence[npt.NDArray[np.float64]], workers: int, kind: Baseline
) -> tuple[int, ...]:
    """Workers each task runs on under baseline ``kind``: its share trimmed to its best
    usable size, then the workers trimming left idle handed out (:func:`hand_out_leftovers`)."""
    trimmed = tuple(
        best_within(w, s) for w, s in zip(wafs, baseline_shares(tasks, workers, kind), strict=True)
    )
    return hand_out_leftovers(wafs, trimmed, workers)
