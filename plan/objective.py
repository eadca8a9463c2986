"""Unicron's objective (Eq. 2-4): weighted achieved FLOP/s and the reconfiguration gain.

F(t, x) = w(t) T(t, x) if the task's requirement is met on x workers, else 0.
G(t, x') = F(t, x') D_running(n') - F(t, x) 1(x != x' or t faulted) D_transition(t).

F is in weighted TFLOP/s, durations in seconds, so G is weighted TFLOP of work: what
the new configuration earns until the next failure minus what the old one would have
earned during the transition it forces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from unicorn_core.errors import InvalidArgument
from unicorn_core.taskspec import TaskSpec

HOUR_S = 3600.0
# Unicron: 1-7 failures a week per 128 GPUs (16 nodes of 8); the midpoint, 4 a week,
# gives a per-node MTBF of 16 x 168 h / 4 = 672 h.
DEFAULT_NODE_MTBF_H = 672.0


@dataclass(frozen=True)
class FailureModel:
    """Independent node failures: a pool of n nodes fails every MTBF / n on average."""

    node_mtbf_h: float = DEFAULT_NODE_MTBF_H

    def __post_init__(self) -> None:
        if self.node_mtbf_h <= 0:
            raise InvalidArgument(f"node_mtbf_h must be positive, got {self.node_mtbf_h!r}")

    def running_s(self, nodes: int) -> float:
        """D_running(n): expected time until the next failure anywhere in ``nodes`` nodes."""
        return self.node_mtbf_h * HOUR_S / max(nodes, 1)


@dataclass(frozen=True)
class TransitionModel:
    """D_transition(t): how long a task stops when it is reconfigured.

    Measured transition times (per task name) win; otherwise a fixed restart cost plus
    reloading the model states (18 B per parameter) at ``reload_gb_s``.
    """

    restart_s: float = 60.0
    reload_gb_s: float = 10.0
    measured_s: Mapping[str, float] | None = None

    def transition_s(self, task: TaskSpec) -> float:
        if self.measured_s is not None and task.name in self.measured_s:
            return self.measured_s[task.name]
        return self.restart_s + 18.0 * task.model.parameters / (self.reload_gb_s * 1e9)


def requirement_met(task: TaskSpec, gpus: int, tflops: float) -> bool:
    """T_necessary: the task runs (some layout fits) on at least ``min_gpus`` GPUs, at most ``max_gpus``."""
    if tflops <= 0 or gpus < task.min_gpus:
        return False
    return task.max_gpus is None or gpus <= task.max_gpus


def waf_curve(task: TaskSpec, tflops: npt.NDArray[np.float64], worker_gpus: int) -> npt.NDArray[np.float64]:
    """F(t, x) for x = 0..len-1 workers of ``worker_gpus`` GPUs each, from T(t, x)."""
    gpus = np.arange(tflops.shape[0]) * worker_gpus
    met = (tflops > 0) & (gpus >= task.min_gpus)
    if task.max_gpus is not None:
        met &= gpus <= task.max_gpus
    return np.where(met, task.weight * tflops, 0.0)


def gains(
    waf: npt.NDArray[np.float64],
    *,
    current: int,
    current_waf: float,
    faulted: bool,
    running_s: float,
    transition_s: float,
) -> npt.NDArray[np.float64]:
    """G(t, x') for every x' = 0..len-1 (Eq. 3).

    ``current`` is the task's worker count now and ``current_waf`` its F there, F(t, x);
    every x' other than ``current`` (and every x' at all if the task ``faulted``) pays
    F(t, x) x D_transition.
    """
    g = waf * running_s - current_waf * transition_s
    if not faulted and 0 <= current < waf.shape[0]:
        g[current] += current_waf * transition_s
    return g
