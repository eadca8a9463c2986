"""Calibration: the planner's guesses refined by what the cluster measured (issue 21, item 2).

Three inputs of Unicron's objective are guesses until tasks run:

* T(t, x), from the analytic iteration time of a layout (:mod:`plan.perf`);
* D_transition(t), a fixed restart cost plus reloading the model states
  (:class:`plan.objective.TransitionModel`);
* the node MTBF behind D_running (:class:`plan.objective.FailureModel`).

Each becomes a **shrinkage estimate**: the guess is a prior worth ``prior_samples``
observations, and the measurements count as many as were seen::

    estimate = (prior_samples x prior + samples x measured_mean) / (prior_samples + samples)

Why this and not an exponential moving average of a correction factor (what
``refine_efficiency`` used to offer):

* with no measurement the estimate *is* the prior, so an uncalibrated planner plans
  exactly as before;
* the evidence decides how far it moves: one odd iteration cannot swing a plan, a few
  hundred consistent ones do, while an EMA gives its first sample a fixed weight
  whatever came before;
* the memory is bounded: a :class:`Running` mean keeps its mean and its sample weight,
  never the samples, and the weight is capped at a ``window``. Past the cap each new
  observation weighs ``1/window`` (an exponentially weighted mean), so a cluster that
  changes (a slower network, a new driver) is followed, and the prior keeps
  ``prior_samples / (prior_samples + window)`` of the weight for good.

Iteration times are calibrated per (model, layout, GPU type). A layout never measured
borrows from the same model's measured layouts on that GPU type (their pooled
measured/predicted speed, itself shrunk towards the analytic model): a cluster whose
network is slower than its datasheet slows every layout, not just the one that ran.

The MTBF is the conjugate estimate of a Poisson failure rate: the configured MTBF counts
as ``prior_failures`` failures in ``prior_failures x MTBF`` node-hours, the history adds
its failures and its node-hours.

Everything here is pure: values in, values out. unicornd keeps the measurements in its
snapshot (:mod:`unicornd.calibrate`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from plan.hardware import GpuSpec
from plan.perf import LayoutEstimate, LayoutTable, PerfAssumptions, estimate_layout
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

HOUR_S: Final = 3600.0


@dataclass(frozen=True)
class Running:
    """A bounded running mean: ``mean`` of what was observed, ``samples`` the weight behind
    it (at most the window it was added with), ``count`` the observations ever added."""

    mean: float
    samples: float
    count: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean >= 0):
            raise InvalidArgument(f"running mean must be finite and >= 0, got {self.mean!r}")
        if not (math.isfinite(self.samples) and self.samples > 0):
            raise InvalidArgument(f"running samples must be finite and > 0, got {self.samples!r}")
        if self.count < 1:
            raise InvalidArgument(f"running count must be >= 1, got {self.count!r}")


def observe(est: Running | None, value: float, weight: float, window: float) -> Running:
    """``est`` with ``value`` added at ``weight`` (e.g. the iterations a report covers).

    Up to ``window`` the mean is exact; beyond, each new observation weighs
    ``weight / window`` (an exponentially weighted mean over about ``window`` samples).
    """
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgument(f"observed value must be finite and >= 0, got {value!r}")
    if not (weight > 0 and window > 0):
        raise InvalidArgument(f"weight and window must be > 0, got {weight!r}, {window!r}")
    if est is None:
        return Running(value, min(weight, window))
    total = min(est.samples + weight, window)
    step = min(1.0, weight / total)
    return Running(est.mean + step * (value - est.mean), total, est.count + 1)


def shrink(prior: float, prior_samples: float, est: Running | None) -> float:
    """The prior and the measured mean, weighed by ``prior_samples`` and the samples seen."""
    if est is None:
        return prior
    return (prior_samples * prior + est.samples * est.mean) / (prior_samples + est.samples)


def model_key(model: ModelSpec) -> str:
    """A model's shape as a short stable key (every field of :class:`ModelSpec`)."""
    return (
        f"L{model.layers}.H{model.hidden}.A{model.heads}.S{model.sequence}.V{model.vocabulary}"
        f".B{model.global_batch}.F{model.ffn_hidden}.G{model.num_query_groups}"
    )


# --- iteration time: T(t, x) ------------------------------------------------------------


@dataclass(frozen=True)
class LayoutTiming:
    """Measured iteration times of one model at one layout on one GPU type."""

    layout: Layout
    iteration_s: Running


@dataclass(frozen=True)
class Efficiency:
    """Calibrated speed of one model on one GPU type, as analytic / calibrated iteration time.

    ``by_layout``: for each measured layout; ``pooled``: for any other layout.
    ``estimates``: the analytic estimates of the measured layouts (so a plan can pick a
    measured layout that is not among a table's ranked candidates).
    """

    pooled: float = 1.0
    by_layout: Mapping[Layout, float] = field(default_factory=dict)
    estimates: Mapping[Layout, LayoutEstimate] = field(default_factory=dict)

    def of(self, layout: Layout) -> float:
        return self.by_layout.get(layout, self.pooled)

    @property
    def trivial(self) -> bool:
        return self.pooled == 1.0 and not self.by_layout


def efficiency(
    model: ModelSpec,
    gpu: GpuSpec,
    gpus_per_node: int,
    timings: Sequence[LayoutTiming],
    *,
    prior_samples: float,
    assume: PerfAssumptions | None = None,
) -> Efficiency:
    """Two-level shrinkage of measured against analytic speed (see the module docstring).

    A measured layout L with ratio r_L = analytic / measured mean and weight n_L gets
    ``(n0 e + n_L r_L) / (n0 + n_L)``, where e pools the *other* measured layouts of the
    model, ``(n0 + sum n_K r_K) / (n0 + sum n_K)`` (1.0, the analytic model, when there are
    none); a layout never measured gets the pool of all of them. Layouts the model cannot
    run (no longer valid) are ignored.
    """
    if prior_samples < 0:
        raise InvalidArgument(f"prior_samples must be >= 0, got {prior_samples!r}")
    ratios: dict[Layout, tuple[float, float]] = {}
    estimates: dict[Layout, LayoutEstimate] = {}
    for t in timings:
        if t.iteration_s.mean <= 0:
            continue
        try:
            est = estimate_layout(model, t.layout, gpu, gpus_per_node, assume or PerfAssumptions())
        except InvalidArgument:
            continue
        estimates[t.layout] = est
        ratios[t.layout] = (est.iteration_s / t.iteration_s.mean, t.iteration_s.samples)
    if not ratios:
        return Efficiency()
    weight = sum(n for _, n in ratios.values())
    mass = sum(r * n for r, n in ratios.values())

    def pooled(without: float = 0.0, without_mass: float = 0.0) -> float:
        n = prior_samples + weight - without
        return (prior_samples + mass - without_mass) / n if n > 0 else 1.0

    by_layout = {}
    for layout, (r, n) in ratios.items():
        e = pooled(n, r * n)
        by_layout[layout] = (prior_samples * e + n * r) / (prior_samples + n)
    return Efficiency(pooled(), by_layout, estimates)


def calibrated(est: LayoutEstimate, factor: float) -> LayoutEstimate:
    """``est`` at ``factor`` times the analytic speed."""
    return replace(
        est,
        iteration_s=est.iteration_s / factor,
        tflops=est.tflops * factor,
        tflops_per_gpu=est.tflops_per_gpu * factor,
        mfu=est.mfu * factor,
    )


def calibrated_table(table: LayoutTable, eff: Efficiency) -> LayoutTable:
    """``table`` with every world size's best layout chosen again at calibrated speed, among
    its ranked candidates and the measured layouts of that size."""
    if eff.trivial:
        return table
    extra: dict[int, list[LayoutEstimate]] = {}
    for layout, est in eff.estimates.items():
        if est.fits:
            extra.setdefault(layout.world_size, []).append(est)
    best: dict[int, LayoutEstimate] = {}
    for world, analytic in table.best.items():
        candidates = (*table.ranked.get(world, (analytic,)), *extra.get(world, ()))
        best[world] = max(
            (calibrated(c, eff.of(c.layout)) for c in candidates), key=lambda c: (c.tflops, -c.iteration_s)
        )
    return replace(table, best=best)


# --- D_transition and the MTBF ----------------------------------------------------------


def transition_s(prior_s: float, prior_samples: float, measured: Running | None) -> float:
    """D_transition of one task: its prior (restart plus reload) shrunk towards what its
    transitions took."""
    return shrink(prior_s, prior_samples, measured)


def node_mtbf_h(prior_h: float, prior_failures: float, failures: int, node_h: float) -> float:
    """Node MTBF from the history: ``(prior_failures x prior_h + node_h) / (prior_failures + failures)``.

    With no history the prior; with no prior (``prior_failures`` 0) node-hours per failure
    (infinite without a failure, so the prior's weight must be > 0 to plan)."""
    if prior_h <= 0 or prior_failures < 0 or failures < 0 or node_h < 0:
        raise InvalidArgument(
            f"need prior_h > 0 and prior_failures, failures, node_h >= 0; got "
            f"{prior_h!r}, {prior_failures!r}, {failures!r}, {node_h!r}"
        )
    if prior_failures + failures == 0:
        return math.inf
    return (prior_failures * prior_h + node_h) / (prior_failures + failures)
