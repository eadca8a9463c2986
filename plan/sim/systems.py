"""Throughput of one task under each simulated system, from the planner's performance model.

Every system runs on the same performance model (:func:`plan.perf.estimate_layout`, the
one the ideal and unicorn use); what differs is the set of layouts the system can run,
as its paper describes it, and the work its mechanisms add:

* **Megatron, fixed shape** (:func:`fixed_shape`): the TP and PP sizes, micro-batch and
  schedule it was launched with; only DP shrinks (and must still divide the global
  batch), so a restart on fewer nodes may leave some of them idle.
* **Varuna** (:func:`varuna_curve`; EuroSys'22, Sections 3-4): pipeline and data
  parallelism only (no intra-layer, i.e. tensor, parallelism: the paper's premise is
  commodity networking), its own 1F1B-style schedule (no interleaving), no optimizer-state
  sharding; any number of GPUs the (P, D) calculator likes, up to what the nodes hold.
* **Oobleck** (:func:`oobleck_curve`; SOSP'23, Sections 4.1-4.2): pipelines built from
  pipeline templates, each template spanning whole nodes (its stages split a node's GPUs,
  so TP within a node is allowed); at least f+1 pipelines; templates for n0 .. N - f n0
  nodes; heterogeneous pipelines share the global batch in proportion to their speed
  (batch distribution). A pipeline's speed in a k-pipeline ensemble is its speed in a
  homogeneous data-parallel group of k (gradient synchronisation over k replicas).
* **Bamboo** (:func:`bamboo_curve`; NSDI'23, Sections 3-4): pipeline and data parallelism
  on DeepSpeed (no TP, no interleaving), with redundant computation: every GPU also
  holds its successor stage's model state (twice the state memory) and runs that
  stage's forward pass eagerly (FRC) in the pipeline bubble; what does not fit in the
  bubble lengthens the iteration. A stage's successor lives on another node, so a task
  needs two nodes at least. In failover a GPU runs two stages, doubling the bottleneck
  stage time.

Where a paper's system lacks no feature we model (optimizer sharding for Oobleck and
Bamboo, recomputation when memory requires it), the layout space is left as generous as
Megatron's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

from plan.hardware import GpuSpec
from plan.memory import MemoryAssumptions
from plan.perf import LayoutEstimate, PerfAssumptions, estimate_layout
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

_ASSUME = PerfAssumptions()


@dataclass(frozen=True)
class RunConfig:
    """How one task runs on ``nodes`` nodes under some system (TFLOP/s before stalls)."""

    nodes: int  # nodes the task holds
    gpus: int  # GPUs it computes on (<= nodes x GPUs per node)
    tflops: float  # achieved model TFLOP/s
    iteration_s: float
    layout: Layout | None = None  # one homogeneous layout (None for Oobleck's ensembles)
    pipelines: tuple[int, ...] = ()  # Oobleck: nodes of each pipeline instance
    failover_tflops: float = 0.0  # Bamboo: TFLOP/s while a GPU runs its lost successor's stage too


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fitting(model: ModelSpec, layout: Layout, gpu: GpuSpec, gpus_per_node: int) -> LayoutEstimate | None:
    """The estimate of ``layout``, with full recomputation if that is what makes it fit."""
    est = estimate_layout(model, layout, gpu, gpus_per_node, _ASSUME)
    if est.fits:
        return est
    est = estimate_layout(model, replace(layout, recompute=True), gpu, gpus_per_node, _ASSUME)
    return est if est.fits else None


def _tps(model: ModelSpec, gpus_per_node: int) -> list[int]:
    return [
        tp for tp in _divisors(gpus_per_node) if model.heads % tp == 0 and model.num_query_groups % tp == 0
    ]


# --- Megatron with a fixed TP/PP ---------------------------------------------------------------


@lru_cache(maxsize=4096)
def fixed_shape(
    model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, base: Layout, nodes: int
) -> RunConfig | None:
    """``base``'s TP, PP, micro-batch and schedule on at most ``nodes`` nodes, at the largest DP that runs."""
    per_replica = base.tp * base.pp
    samples = model.global_batch // base.micro_batch
    for dp in sorted(_divisors(samples), reverse=True):
        world = per_replica * dp
        if world > nodes * gpus_per_node:
            continue
        m = model.global_batch // (dp * base.micro_batch)
        vpp = base.vpp if base.vpp is not None and m % base.pp == 0 else None
        layout = Layout(
            base.tp,
            base.pp,
            dp,
            base.micro_batch,
            model.global_batch,
            vpp,
            base.recompute,
            base.distributed_optimizer and dp > 1,
        )
        est = _fitting(model, layout, gpu, gpus_per_node)
        if est is None:
            return None  # fewer replicas only need more memory per GPU
        used = math.ceil(world / gpus_per_node)
        return RunConfig(used, world, est.tflops, est.iteration_s, est.layout)
    return None


# --- Varuna ----------------------------------------------------------------------------------


def _best_by_world(
    model: ModelSpec,
    gpu: GpuSpec,
    gpus_per_node: int,
    layouts: Iterator[Layout],
    score: Callable[[Layout], RunConfig | None],
) -> dict[int, RunConfig]:
    best: dict[int, RunConfig] = {}
    for layout in layouts:
        cfg = score(layout)
        if cfg is None:
            continue
        world = layout.world_size
        if world not in best or cfg.tflops > best[world].tflops:
            best[world] = cfg
    return best


def _pipeline_layouts(model: ModelSpec, max_gpus: int, distributed_optimizer: bool) -> Iterator[Layout]:
    """TP1 layouts without interleaving: pipeline and data parallelism only."""
    for pp in _divisors(model.layers):
        for dp in _divisors(model.global_batch):
            if pp * dp > max_gpus:
                continue
            for b in _ASSUME.micro_batches:
                if model.global_batch % (dp * b):
                    continue
                for distopt in (False, True) if distributed_optimizer and dp > 1 else (False,):
                    yield Layout(1, pp, dp, b, model.global_batch, None, False, distopt)


def _prefix_best(
    best: dict[int, RunConfig], max_nodes: int, gpus_per_node: int
) -> tuple[RunConfig | None, ...]:
    """For n = 0..max_nodes: the fastest configuration using at most n nodes' GPUs (holding n nodes)."""
    out: list[RunConfig | None] = [None]
    top: RunConfig | None = None
    for n in range(1, max_nodes + 1):
        for world in range((n - 1) * gpus_per_node + 1, n * gpus_per_node + 1):
            cfg = best.get(world)
            if cfg is not None and (top is None or cfg.tflops > top.tflops):
                top = cfg
        out.append(replace(top, nodes=n) if top is not None else None)
    return tuple(out)


@lru_cache(maxsize=64)
def varuna_curve(
    model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, max_nodes: int
) -> tuple[RunConfig | None, ...]:
    """Varuna's best (P, D) configuration on n = 0..max_nodes nodes (job morphing's choice)."""

    def score(layout: Layout) -> RunConfig | None:
        est = _fitting(model, layout, gpu, gpus_per_node)
        if est is None:
            return None
        return RunConfig(0, layout.world_size, est.tflops, est.iteration_s, est.layout)

    layouts = _pipeline_layouts(model, max_nodes * gpus_per_node, distributed_optimizer=False)
    return _prefix_best(_best_by_world(model, gpu, gpus_per_node, layouts, score), max_nodes, gpus_per_node)


# --- Bamboo ----------------------------------------------------------------------------------


def _stage_s(model: ModelSpec, layout: Layout, gpu: GpuSpec, gpus_per_node: int) -> float:
    """Time of one pipeline stage per micro-batch: the slope of the iteration time in the batch.

    The iteration takes (m + (pp - 1)) x stage + a batch-independent rest, so doubling the
    global batch adds m stage times.
    """
    double = replace(model, global_batch=2 * model.global_batch)
    one = estimate_layout(model, layout, gpu, gpus_per_node, _ASSUME)
    two = estimate_layout(
        double, replace(layout, global_batch=double.global_batch), gpu, gpus_per_node, _ASSUME
    )
    return (two.iteration_s - one.iteration_s) / layout.num_microbatches


def _bamboo_fits(est: LayoutEstimate, gpu: GpuSpec, memory: MemoryAssumptions) -> bool:
    """Twice the model states (its own stage and its successor's), plus its activations."""
    mem = est.memory
    total = (2.0 * mem.states_gib + mem.activations_gib) * memory.fragmentation + memory.reserved_gib
    return total <= gpu.hbm_gib


@lru_cache(maxsize=64)
def bamboo_curve(
    model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, max_nodes: int
) -> tuple[RunConfig | None, ...]:
    """Bamboo's best redundant-computation configuration on n = 0..max_nodes nodes."""
    memory = _ASSUME.memory

    def score(layout: Layout) -> RunConfig | None:
        if layout.pp < 2 or layout.world_size <= gpus_per_node:
            return None  # no successor on another node to fail over to
        est = None
        for candidate in (layout, replace(layout, recompute=True)):
            e = estimate_layout(model, candidate, gpu, gpus_per_node, _ASSUME)
            if _bamboo_fits(e, gpu, memory):
                est = e
                break
        if est is None:
            return None
        stage = _stage_s(model, est.layout, gpu, gpus_per_node)
        m = est.layout.num_microbatches
        forward_share = 1.0 / (4.0 if est.layout.recompute else 3.0)
        frc_excess = max(0.0, m * stage * forward_share - (est.layout.pp - 1) * stage)
        iteration = est.iteration_s + frc_excess
        failover = iteration + (m + est.layout.pp - 1) * stage
        flop = model.model_flop_per_iteration() / 1e12
        return RunConfig(0, layout.world_size, flop / iteration, iteration, est.layout, (), flop / failover)

    layouts = _pipeline_layouts(model, max_nodes * gpus_per_node, distributed_optimizer=True)
    return _prefix_best(_best_by_world(model, gpu, gpus_per_node, layouts, score), max_nodes, gpus_per_node)


# --- Oobleck ---------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def oobleck_pipeline(
    model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, nodes: int, replicas: int
) -> tuple[float, float] | None:
    """(samples/s, iteration s) of the best template on ``nodes`` nodes among ``replicas`` pipelines.

    The pipeline's stages split its ``nodes x gpus_per_node`` GPUs (TP within a node times
    PP); it trains on its share of the global batch and synchronises gradients over
    ``replicas`` pipelines. The batch is rounded up to a multiple of the replicas' micro-
    batches (Oobleck hands out micro-batches unevenly; the model needs equal shares).
    """
    gpus = nodes * gpus_per_node
    best: tuple[float, float] | None = None
    for tp in _tps(model, gpus_per_node):
        if gpus % tp or model.layers % (gpus // tp):
            continue
        pp = gpus // tp
        for b in _ASSUME.micro_batches:
            batch = replicas * b * math.ceil(model.global_batch / (replicas * b))
            shaped = replace(model, global_batch=batch)
            for distopt in (False, True) if replicas > 1 else (False,):
                layout = Layout(tp, pp, replicas, b, batch, None, False, distopt)
                est = _fitting(shaped, layout, gpu, gpus_per_node)
                if est is None:
                    continue
                rate = batch / replicas / est.iteration_s
                if best is None or rate > best[0]:
                    best = (rate, est.iteration_s)
    return best


def _partitions(n: int, smallest: int, largest: int) -> Iterator[tuple[int, ...]]:
    """Partitions of ``n`` into parts in [smallest, largest], largest part first."""
    if n == 0:
        yield ()
        return
    for part in range(min(n, largest), smallest - 1, -1):
        for rest in _partitions(n - part, smallest, part):
            yield (part, *rest)


def oobleck_n0(model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, f: int, max_nodes: int) -> int | None:
    """n0: the fewest nodes one pipeline template fits on (Oobleck Sec. 4.1)."""
    for n in range(1, max_nodes + 1):
        if oobleck_pipeline(model, gpu, gpus_per_node, n, f + 1) is not None:
            return n
    return None


@lru_cache(maxsize=4096)
def oobleck_instance(
    model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, nodes: int, *, f: int, allocation: int
) -> RunConfig | None:
    """The fastest instantiation of Oobleck's templates on ``nodes`` nodes (Sec. 4.2).

    Templates exist for n0 .. ``allocation`` - f n0 nodes; an instantiation uses every node
    in at least f+1 pipelines. ``None`` when no combination covers the nodes.
    """
    if f < 0 or allocation < 1:
        raise InvalidArgument(f"oobleck needs f >= 0 and an allocation >= 1, got {f}, {allocation}")
    n0 = oobleck_n0(model, gpu, gpus_per_node, f, allocation)
    if n0 is None or nodes < (f + 1) * n0:
        return None
    largest = allocation - f * n0
    flop_per_sample = model.model_flop_per_iteration() / model.global_batch / 1e12
    best: RunConfig | None = None
    for parts in _partitions(nodes, n0, largest):
        if len(parts) < f + 1:
            continue
        rates = [oobleck_pipeline(model, gpu, gpus_per_node, p, len(parts)) for p in parts]
        if any(r is None for r in rates):
            continue
        samples_s = sum(r[0] for r in rates if r is not None)
        tflops = samples_s * flop_per_sample
        if best is None or tflops > best.tflops:
            iteration = model.global_batch / samples_s
            best = RunConfig(nodes, nodes * gpus_per_node, tflops, iteration, None, parts)
    return best


def oobleck_curve(
    model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, max_nodes: int, f: int
) -> tuple[RunConfig | None, ...]:
    """Oobleck's best instantiation on n = 0..max_nodes nodes, templates sized for ``max_nodes``."""
    return (
        None,
        *(
            oobleck_instance(model, gpu, gpus_per_node, n, f=f, allocation=max_nodes)
            for n in range(1, max_nodes + 1)
        ),
    )
