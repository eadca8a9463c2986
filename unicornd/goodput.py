"""The goodput ledger: achieved WAF, measured, and the gap to the ideal by cause (issue 21).

Pure: :func:`advance` is a function of the previous :class:`Ledger`, the committed
:class:`~unicornd.state.Snapshot` and the clock; no I/O. :class:`unicornd.core.Core`
advances it after every commit and saves it under ``keys.goodput()``
(:mod:`unicornd.ledgerstore`); ``unicornctl goodput`` and the metrics read it.

Work is in weighted TFLOP (weighted TFLOP/s x s, Unicron's F integrated), time in GPU-seconds.

* **Achieved**: each iteration past a task's high-water mark earns ``weight x`` its
  model's FLOPs per iteration, when a rank finished it (``TaskRecord.last_iteration_s``).
  Recomputed iterations earn nothing.
* **Ideal** W*: the planner's best allocation of the same (planned) tasks on all known
  nodes with no failures, each task's analytic rate x its **calibration** (the measured
  over the analytic iteration time; the first measured stretch of a task's layout sets it,
  later stretches on that layout move it: quickly up, slowly down, so a slowdown stays
  visible). The analytic model's error is its layout's own, so a new layout starts a new
  calibration: carried over a shrink, the old one lagged the new layout's measured rate and
  W* read below the achieved rate for a few stretches (CI, stop 44). A task enters the WAF
  accounts once calibrated (its GPU-seconds are counted from the start).
* Rates **in force** are those of the snapshot at the previous update (layout, nodes,
  health): the interval up to now is booked at them, then they are re-read.

The gap, ``ideal - achieved``, by :class:`Cause` (the simulator's Eq. 1 split, live):

* per task, per stretch of its own clock, at its in-force rate P (calibrated rate of its
  layout): ``detection`` (its last iteration before an incident to the incident's
  detection), ``decision_drain`` (detection to the first rung, or the drain done:
  :data:`ACTED`), ``transition`` (then to the first iteration of the new ranks; also a
  plan's launch or move of a task to its first new high), ``recomputation`` (from that
  iteration until the task passes its old mark, less the calibrated time of the new
  iterations in that stretch), ``sub_healthy`` (a running stretch's P x time less its
  achieved work: slower than calibrated; negative when faster);
* per task at the cluster clock: ``sub_healthy`` (its ideal share less its share in the
  planner's best allocation of the nodes not out, i.e. healthy or still used) and
  ``idle`` (that share less P: healthy GPUs no task uses, or a task waiting);
* GPU-seconds: out nodes' GPUs -> ``sub_healthy``, healthy unused GPUs -> ``idle``, a
  task's GPUs per stretch split like its work (productive / causes, never negative).
  A node that other users' jobs hold and no task uses (``NodeRecord.jobs``, issue 24) is
  not unicorn's while they do: in neither the ideal nor the GPU-seconds.

The time since a task's last iteration is not attributed yet (it becomes running or
detection when the next iteration or incident says which): ``unattributed`` = gap - sum of
the causes, at most about one iteration per task plus calibration drift.

For ``unicornctl report`` the ledger also keeps, bounded: a WAF time series
(:class:`WafSample`, one per :data:`SERIES_EVERY_S` at most, :data:`SERIES_MAX` samples,
older ones thinned: :func:`thin_series`) and per task its layout history
(:class:`LayoutChange`, one per change of state, layout or nodes, the newest
:data:`LAYOUTS_KEEP`: :func:`record_layout`). Ledgers stored before them decode with both empty.

A decode that fails raises :class:`~unicorn_core.errors.ProtocolError` and changes nothing.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Final

import msgspec

from plan.hardware import GpuSpec
from plan.perf import PerfAssumptions, estimate_layout
from plan.planner import Cluster, Granularity, plan_cluster, task_curves
from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
from unicorn_core.taskspec import TaskSpec
from unicornd.alerts import incident_milestones
from unicornd.replan import PLANNED_STATES
from unicornd.state import (
    LIVE_TASK_STATES,
    Incident,
    LadderStage,
    NodeHealth,
    NodeRecord,
    Snapshot,
    TaskRecord,
    TaskState,
)

LEDGER_VERSION: Final = 1
HISTORY_EVERY_S: Final = 3600.0
"""A checkpoint of the totals every hour (``unicornctl goodput --since`` subtracts one)."""
HISTORY_KEEP_S: Final = 8 * 86400.0
"""Checkpoints are kept 8 days (``--since 7d`` and a margin)."""
RANGES_KEEP: Final = 200
"""Running ranges kept per task (:attr:`TaskBook.running_ranges`): merged when adjacent, so
a new range starts only after a stall or an incident."""
SERIES_EVERY_S: Final = 10.0
"""The WAF series takes a sample at the first advance at least this long after the last one."""
SERIES_MAX: Final = 2000
"""Samples kept (about 64 KiB of JSON, 0.3 MB in memory): past it the older half is thinned
(every other sample dropped), so at least the newest 1000 samples (~2.8 h) stay at full
resolution and resolution halves with age; none older than :data:`HISTORY_KEEP_S`."""
LAYOUTS_KEEP: Final = 100
"""Layout changes kept per task (the oldest go first; nodes are stored as changes, so an
entry costs a few node names, not the task's whole node list)."""
CALIBRATE_UP: Final = 0.3
"""Weight of a stretch faster than the calibration (the healthy rate is found quickly)."""
CALIBRATE_DOWN: Final = 0.03
"""Weight of a slower stretch: a slowdown is sub-healthy for ~1/0.03 stretches before the
calibration takes it as the task's rate."""


class Cause(enum.StrEnum):
    """Why WAF was lost (see the module docstring)."""

    DETECTION = "detection"
    DECISION_DRAIN = "decision_drain"
    TRANSITION = "transition"
    RECOMPUTATION = "recomputation"
    SUB_HEALTHY = "sub_healthy"
    IDLE = "idle"


class Phase(enum.StrEnum):
    """What a task's GPUs do since its clock (``booked_s``)."""

    NONE = "none"  # no GPUs (pending, ended)
    RUNNING = "running"  # iterations advance; time after the last one is not attributed yet
    DECIDING = "deciding"  # an incident was detected, no rung acted yet
    TRANSITION = "transition"  # a rung acted or a plan (re)launched; waiting for iterations
    RECOMPUTE = "recompute"  # iterating again, not past the old mark yet


ACTED: Final = frozenset(
    {
        LadderStage.RETRY_IN_PLACE,
        LadderStage.RESTART_PROCESSES,
        LadderStage.REPLAN,
        LadderStage.TRANSITION,
        LadderStage.RESUMED,
        LadderStage.CLOSED,
    }
)
"""Stages that end ``decision_drain``: a rung acted in place, or the drain is done (replan)."""
_ENDED: Final = frozenset({LadderStage.RESUMED, LadderStage.CLOSED})
_PHASE_CAUSE: Final = {
    Phase.DECIDING: Cause.DECISION_DRAIN,
    Phase.TRANSITION: Cause.TRANSITION,
}


def _check(ok: bool, problem: str) -> None:
    if not ok:
        raise ValueError(problem)


def _finite(value: float, what: str) -> None:
    _check(math.isfinite(value), f"{what} must be finite, got {value!r}")


class Totals(msgspec.Struct, forbid_unknown_fields=True):
    """Accumulated amounts: work in weighted TFLOP, time in GPU-seconds."""

    ideal_wtflop: float = 0.0
    achieved_wtflop: float = 0.0
    lost_wtflop: dict[Cause, float] = msgspec.field(default_factory=dict)
    gpu_s: float = 0.0
    productive_gpu_s: float = 0.0
    lost_gpu_s: dict[Cause, float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.gpu_s >= 0 and self.productive_gpu_s >= 0, "GPU-seconds must be >= 0")
        # One sum first (a NaN or an infinity anywhere makes it non-finite): the ledger builds
        # thousands of these per commit at scale; the per-value checks only name the culprit.
        if math.isfinite(
            self.ideal_wtflop
            + self.achieved_wtflop
            + sum(self.lost_wtflop.values())
            + sum(self.lost_gpu_s.values())
        ):
            return
        for what, v in (("ideal", self.ideal_wtflop), ("achieved", self.achieved_wtflop)):
            _finite(v, what)
        for c, v in (*self.lost_wtflop.items(), *self.lost_gpu_s.items()):
            _finite(v, f"lost[{c}]")

    @property
    def unattributed_wtflop(self) -> float:
        """The gap no cause explains yet (see the module docstring)."""
        return self.ideal_wtflop - self.achieved_wtflop - sum(self.lost_wtflop.values())

    @property
    def unattributed_gpu_s(self) -> float:
        return self.gpu_s - self.productive_gpu_s - sum(self.lost_gpu_s.values())

    def minus(self, other: Totals) -> Totals:
        """The amounts accumulated since ``other`` (an earlier checkpoint)."""
        return Totals(
            self.ideal_wtflop - other.ideal_wtflop,
            self.achieved_wtflop - other.achieved_wtflop,
            {c: self.lost_wtflop.get(c, 0.0) - other.lost_wtflop.get(c, 0.0) for c in Cause},
            max(0.0, self.gpu_s - other.gpu_s),
            max(0.0, self.productive_gpu_s - other.productive_gpu_s),
            {c: self.lost_gpu_s.get(c, 0.0) - other.lost_gpu_s.get(c, 0.0) for c in Cause},
        )


class LayoutChange(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """From ``t_s`` the task was in ``state`` at ``layout`` (None: none) on ``nodes`` nodes
    (``gpus`` GPUs); ``added``/``removed``: its nodes that changed since the entry before
    (in the oldest entry kept, ``added`` is the whole node list)."""

    t_s: float
    state: TaskState
    layout: Layout | None = None
    nodes: int = 0
    gpus: int = 0
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _finite(self.t_s, "layout change: t_s")
        _check(self.nodes >= 0 and self.gpus >= 0, "layout change: nodes and gpus must be >= 0")


class WafSample(msgspec.Struct, forbid_unknown_fields=True, array_like=True, gc=False):
    """The WAF at ``t_s`` (weighted TFLOP/s, stored as a JSON array): ``ideal`` W* and
    ``achieved``, in force from ``t_s`` until the next sample (a step function)."""

    t_s: float
    ideal: float
    achieved: float

    def __post_init__(self) -> None:
        for what, v in (("t_s", self.t_s), ("ideal", self.ideal), ("achieved", self.achieved)):
            _finite(v, f"WAF sample: {what}")


class TaskBook(msgspec.Struct, forbid_unknown_fields=True):
    """One task's clock, phase and in-force rates, and its totals.

    ``booked_s``: its time is attributed up to here; ``mark``: the high-water iteration
    seen; ``incidents``: per incident id, how many of its milestones (detected, acted,
    ended) were booked; ``efficiency``: measured / analytic speed (None: not calibrated),
    measured at the analytic iteration time ``calibrated_analytic_s`` (its layout's).
    In force since the last update: ``gpus``, ``iteration_wtflop`` (weight x model TFLOP per
    iteration), ``analytic_iteration_s`` of its layout (None: no layout), ``ideal_wtflops``
    and ``healthy_wtflops`` (its analytic share in the best plan on all nodes, on the nodes
    not out). ``achieved_wtflops``: the rate of its latest running stretch (0 otherwise).
    ``running_s``/``running_iterations``: the time and the new iterations of every running
    stretch that earned work, less the stretch that passed the mark after a restart (its
    time is booked at the calibration, not measured): their ratio is the iteration time
    the ledger measured. ``running_ranges``: the iterations they hold, as inclusive
    ranges, oldest first (adjacent ones merged; at most :data:`RANGES_KEEP`), so a reader can
    compare the training logs' time over exactly those iterations.
    ``nodes``: the task's nodes at the last update; ``layouts``: its layout history, oldest
    first (:class:`LayoutChange`, at most :data:`LAYOUTS_KEEP`).
    """

    task_id: str
    booked_s: float
    phase: Phase = Phase.NONE
    mark: int | None = None
    launched_s: float | None = None
    incidents: dict[str, int] = msgspec.field(default_factory=dict)
    efficiency: float | None = None
    calibrated_analytic_s: float | None = None
    gpus: int = 0
    iteration_wtflop: float = 0.0
    analytic_iteration_s: float | None = None
    ideal_wtflops: float = 0.0
    healthy_wtflops: float = 0.0
    achieved_wtflops: float = 0.0
    running_s: float = 0.0
    running_iterations: int = 0
    running_ranges: list[tuple[int, int]] = msgspec.field(default_factory=list)
    totals: Totals = msgspec.field(default_factory=Totals)
    nodes: tuple[str, ...] = ()
    layouts: list[LayoutChange] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _finite(self.booked_s, f"task {self.task_id}: booked_s")
        _check(self.gpus >= 0, f"task {self.task_id}: gpus must be >= 0")
        _check(
            self.efficiency is None or (math.isfinite(self.efficiency) and self.efficiency > 0),
            f"task {self.task_id}: efficiency must be > 0",
        )
        if not math.isfinite(
            self.iteration_wtflop + self.ideal_wtflops + self.healthy_wtflops + self.achieved_wtflops
        ):  # one sum first, as in Totals
            for v in (self.iteration_wtflop, self.ideal_wtflops, self.healthy_wtflops, self.achieved_wtflops):
                _finite(v, f"task {self.task_id}: rate")
        _check(
            self.analytic_iteration_s is None or self.analytic_iteration_s > 0,
            f"task {self.task_id}: analytic_iteration_s must be > 0",
        )

    def rate(self, efficiency: float | None = None) -> float:
        """P: calibrated weighted TFLOP/s of the layout in force (0 while uncalibrated);
        with ``efficiency``, at that calibration instead of the book's."""
        e = self.efficiency if efficiency is None else efficiency
        if e is None or self.analytic_iteration_s is None or self.gpus == 0:
            return 0.0
        return self.iteration_wtflop * e / self.analytic_iteration_s

    def calibrated_iteration_s(self, efficiency: float | None = None) -> float | None:
        e = self.efficiency if efficiency is None else efficiency
        if e is None or self.analytic_iteration_s is None:
            return None
        return self.analytic_iteration_s / e


class Checkpoint(msgspec.Struct, forbid_unknown_fields=True):
    """The totals at ``t_s`` (cluster and per task)."""

    t_s: float
    totals: Totals
    tasks: dict[str, Totals] = msgspec.field(default_factory=dict)


class Ledger(msgspec.Struct, forbid_unknown_fields=True):
    """The whole ledger as stored. ``t_s``: the cluster clock (booked up to here);
    ``gpus_total``/``gpus_out``/``gpus_idle``: in force since then; ``history``: hourly
    checkpoints; ``series``: the WAF over time, oldest first (:class:`WafSample`)."""

    t_s: float
    started_s: float
    v: int = LEDGER_VERSION
    gpus_total: int = 0
    gpus_out: int = 0
    gpus_idle: int = 0
    totals: Totals = msgspec.field(default_factory=Totals)
    tasks: dict[str, TaskBook] = msgspec.field(default_factory=dict)
    history: list[Checkpoint] = msgspec.field(default_factory=list)
    series: list[WafSample] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.v == LEDGER_VERSION, f"ledger version {self.v}, expected {LEDGER_VERSION}")
        _finite(self.t_s, "t_s")
        _finite(self.started_s, "started_s")
        _check(self.started_s <= self.t_s, "started_s must not be after t_s")
        _check(min(self.gpus_total, self.gpus_out, self.gpus_idle) >= 0, "GPU counts must be >= 0")
        for key, book in self.tasks.items():
            _check(key == book.task_id, f"tasks: key {key!r} holds task {book.task_id!r}")

    def achieved_wtflops(self) -> float:
        """Achieved WAF now: the sum of running tasks' measured rates."""
        return _achieved_rate(self.tasks.values())

    def ideal_wtflops(self) -> float:
        """W* now (calibrated tasks' shares in the best plan on all nodes)."""
        return _ideal_rate(self.tasks.values())

    def since(self, start_s: float) -> tuple[float, Totals, dict[str, Totals]]:
        """(window start, cluster totals, per-task totals) since the newest checkpoint at or
        before ``start_s`` (the ledger's start when there is none)."""
        base = Checkpoint(self.started_s, Totals())
        for cp in self.history:
            if cp.t_s <= start_s:
                base = cp
        tasks = {tid: b.totals.minus(base.tasks.get(tid, Totals())) for tid, b in self.tasks.items()}
        return base.t_s, self.totals.minus(base.totals), tasks


def _achieved_rate(books: Iterable[TaskBook]) -> float:
    return sum(b.achieved_wtflops for b in books if b.phase is Phase.RUNNING)


def _ideal_rate(books: Iterable[TaskBook]) -> float:
    return sum(b.ideal_wtflops * (b.efficiency or 0.0) for b in books)


def add_range(ranges: list[tuple[int, int]], first: int, last: int) -> list[tuple[int, int]]:
    """``ranges`` with the inclusive range ``first..last`` appended (merged into the last
    one when adjacent), the oldest dropped past :data:`RANGES_KEEP`."""
    if ranges and ranges[-1][1] + 1 == first:
        return [*ranges[:-1], (ranges[-1][0], last)]
    return [*ranges, (first, last)][-RANGES_KEEP:]


def thin_series(series: list[WafSample], now_s: float, cap: int = SERIES_MAX) -> list[WafSample]:
    """``series`` (in time order) without samples older than :data:`HISTORY_KEEP_S` and,
    while over ``cap``, every other sample of its older half dropped (the oldest kept): at
    most ``cap`` samples, the newest ``cap // 2`` at full resolution. A new list (``series``
    is not changed)."""
    _check(cap >= 2, f"cap must be >= 2, got {cap}")
    out = series[bisect.bisect_left(series, now_s - HISTORY_KEEP_S, key=lambda p: p.t_s) :]
    while len(out) > cap:
        half = len(out) // 2
        out = out[:half:2] + out[half:]
    return out


def record_layout(
    layouts: list[LayoutChange], before: tuple[str, ...], task: TaskRecord, gpus: int, now_s: float
) -> list[LayoutChange]:
    """``layouts`` with a :class:`LayoutChange` at ``now_s`` appended when ``task``'s state,
    layout or node set differs from the newest entry (``before``: the nodes then); at most
    :data:`LAYOUTS_KEEP` entries (the oldest is folded into the next, whose ``added`` becomes
    the whole node list). ``layouts`` itself is returned when nothing changed."""
    last = layouts[-1] if layouts else None
    nodes, now_set = task.nodes, set(task.nodes)
    old = set(before) if last is not None else set()
    if last is not None and last.state is task.state and last.layout == task.layout and old == now_set:
        return layouts
    change = LayoutChange(
        t_s=now_s,
        state=task.state,
        layout=task.layout,
        nodes=len(nodes),
        gpus=gpus,
        added=tuple(n for n in nodes if n not in old),
        removed=tuple(n for n in before if n not in now_set) if last is not None else (),
    )
    out = [*layouts, change]
    while len(out) > LAYOUTS_KEEP:
        first, second = out[0], out[1]
        gone = set(second.removed)
        whole = [n for n in first.added if n not in gone] + list(second.added)
        out = [msgspec.structs.replace(second, added=tuple(whole), removed=()), *out[2:]]
    return out


def new_ledger(now_s: float) -> Ledger:
    return Ledger(t_s=now_s, started_s=now_s)


def encode(ledger: Ledger) -> bytes:
    return msgspec.json.encode(ledger)


def decode(raw: str | bytes) -> Ledger:
    """The ledger in ``raw``; ProtocolError (``malformed``/``invalid``) when it is not one."""
    try:
        return msgspec.json.decode(raw, type=Ledger)
    except msgspec.DecodeError as e:
        kind = "invalid" if isinstance(e, msgspec.ValidationError) else "malformed"
        raise ProtocolError(kind, f"goodput ledger: {e}") from e


# --- the planner's view, memoised ------------------------------------------------------


@lru_cache(maxsize=64)
def _best_shares(
    specs: tuple[TaskSpec, ...], nodes: int, gpus_per_node: int, gpu: GpuSpec, assume: PerfAssumptions
) -> tuple[float, ...]:
    """Each task's analytic weighted TFLOP/s in the planner's best failure-free allocation."""
    if not specs or nodes <= 0:
        return (0.0,) * len(specs)
    cluster = Cluster(nodes, gpus_per_node, gpu, Granularity.NODE)
    curves = task_curves(list(specs), cluster, cluster.workers + 1, assume)
    plan = plan_cluster(curves, cluster)
    return tuple(a.waf_tflops for a in plan.assignments)


@lru_cache(maxsize=256)
def _analytic_iteration_s(
    model: ModelSpec, layout: Layout, gpu: GpuSpec, gpus_per_node: int, assume: PerfAssumptions
) -> float | None:
    try:
        return estimate_layout(model, layout, gpu, gpus_per_node, assume).iteration_s
    except InvalidArgument:
        return None


# --- advancing -------------------------------------------------------------------------


_CAUSES: Final = tuple(Cause)
"""Every cause, once (iterating the enum itself is slow, and the ledger does it per task
per commit)."""


@dataclass
class _Acc:
    """Mutable totals while advancing (built back into :class:`Totals`)."""

    ideal: float = 0.0
    achieved: float = 0.0
    gpu_s: float = 0.0
    productive: float = 0.0
    lost: dict[Cause, float] = field(default_factory=lambda: dict.fromkeys(_CAUSES, 0.0))
    lost_gpu: dict[Cause, float] = field(default_factory=lambda: dict.fromkeys(_CAUSES, 0.0))

    @classmethod
    def of(cls, t: Totals) -> _Acc:
        lost, lost_gpu = t.lost_wtflop, t.lost_gpu_s
        return cls(
            t.ideal_wtflop,
            t.achieved_wtflop,
            t.gpu_s,
            t.productive_gpu_s,
            {c: lost.get(c, 0.0) for c in _CAUSES},
            {c: lost_gpu.get(c, 0.0) for c in _CAUSES},
        )

    def totals(self) -> Totals:
        return Totals(
            self.ideal, self.achieved, dict(self.lost), self.gpu_s, self.productive, dict(self.lost_gpu)
        )


class _Book:
    """One task's book while advancing; every amount goes to the task and the cluster."""

    def __init__(self, book: TaskBook, cluster: _Acc) -> None:
        self.b = book
        self.acc = _Acc.of(book.totals)
        self.cluster = cluster
        self.booked = book.booked_s
        self.phase = book.phase
        self.mark = book.mark
        self.efficiency = book.efficiency
        self.calibrated_analytic = book.calibrated_analytic_s
        self.achieved_rate = book.achieved_wtflops
        self.running_s = book.running_s
        self.running_iterations = book.running_iterations
        self.running_ranges = list(book.running_ranges)

    def _add(
        self, wtflop: dict[Cause, float], achieved: float, gpu: dict[Cause, float], productive: float
    ) -> None:
        for acc in (self.acc, self.cluster):
            acc.achieved += achieved
            acc.productive += productive
            for c, v in wtflop.items():
                acc.lost[c] += v
            for c, v in gpu.items():
                acc.lost_gpu[c] += v

    def stall(self, until: float, cause: Cause) -> None:
        """Book [booked, until) to ``cause``: no new iterations."""
        dt = until - self.booked
        if dt <= 0:
            return
        self._add({cause: self.b.rate(self.efficiency) * dt}, 0.0, {cause: self.b.gpus * dt}, 0.0)
        self.booked = until

    def progress(self, until: float, new: int, cause: Cause | None) -> None:
        """Book [booked, until) in which ``new`` iterations past the mark finished: to
        ``cause`` (a stall that still made progress), or running (``None``; in the
        ``RECOMPUTE`` phase, recomputation first). A running stretch then calibrates the task
        (booked at the calibration before it; the first one is booked in GPU-seconds only)."""
        dt = until - self.booked
        if dt <= 0:
            return
        e = self.efficiency
        rate, gpus = self.b.rate(e), self.b.gpus
        earned = self.b.iteration_wtflop * new if e is not None else 0.0
        if cause is not None:
            self._add({cause: rate * dt - earned}, earned, {cause: gpus * dt}, 0.0)
        else:
            tau = self.b.calibrated_iteration_s(e)
            recompute = 0.0
            if self.phase is Phase.RECOMPUTE:
                recompute = max(0.0, dt - new * tau) if tau is not None else (dt if new == 0 else 0.0)
            run = dt - recompute
            share = min(1.0, earned / (rate * run)) if rate > 0 and run > 0 else 1.0
            self._add(
                {Cause.RECOMPUTATION: rate * recompute, Cause.SUB_HEALTHY: rate * run - earned},
                earned,
                {Cause.RECOMPUTATION: gpus * recompute, Cause.SUB_HEALTHY: gpus * run * (1.0 - share)},
                gpus * run * share,
            )
            if new > 0 and run > 0:
                self.achieved_rate = self.b.iteration_wtflop * new / run
                # Measured stretches that earned work: not the one that passes the mark
                # (its running time is the calibrated time of its new iterations).
                if e is not None and self.phase is Phase.RUNNING:
                    self.running_s += run
                    self.running_iterations += new
            if self.phase is Phase.RUNNING and new > 0:
                self._calibrate(dt / new)
        self.booked = until

    # --- what happened, in time order ---------------------------------------------------

    def detected(self, t: float) -> None:
        """An incident's detection: the time since the last iteration was the fault's."""
        if self.phase in (Phase.RUNNING, Phase.RECOMPUTE):
            self.stall(t, Cause.DETECTION)
        elif self.phase is Phase.TRANSITION:
            self.stall(t, Cause.TRANSITION)
        self.booked = max(self.booked, t)
        self.phase = Phase.DECIDING

    def acted(self, t: float) -> None:
        """A rung acted in place, or the drain is done."""
        if self.phase is Phase.DECIDING:
            self.stall(t, Cause.DECISION_DRAIN)
            self.phase = Phase.TRANSITION

    def launched(self, t: float) -> None:
        """A plan (re)launched the task (inside an incident's transition: nothing new)."""
        if self.phase in (Phase.RUNNING, Phase.RECOMPUTE):
            self.stall(t, Cause.TRANSITION)
            self.phase = Phase.TRANSITION
        elif self.phase is Phase.NONE:
            self.booked = max(self.booked, t)
            self.phase = Phase.TRANSITION

    def high(self, t: float, iteration: int, *, incident_open: bool) -> None:
        """The task passed its mark: ``iteration`` finished at ``t``."""
        new = iteration - self.mark if self.mark is not None else 0
        if self.phase in (Phase.DECIDING, Phase.TRANSITION):
            self.progress(t, new, _PHASE_CAUSE[self.phase])
            if not incident_open and self.phase is Phase.TRANSITION:
                self.phase = Phase.RUNNING
        elif self.phase in (Phase.RUNNING, Phase.RECOMPUTE):
            counted = self.running_iterations
            self.progress(t, new, None)
            if self.running_iterations > counted and self.mark is not None:
                self.running_ranges = add_range(self.running_ranges, self.mark + 1, iteration)
            self.phase = Phase.RUNNING
        else:
            self.booked = max(self.booked, t)
        self.mark = iteration

    def ended(self, t: float) -> None:
        """The incident resumed (or closed): the new ranks' first iteration."""
        if self.phase in (Phase.DECIDING, Phase.TRANSITION):
            self.stall(t, _PHASE_CAUSE[self.phase])
            self.phase = Phase.RECOMPUTE

    def finish(self, task: TaskRecord, now_s: float) -> None:
        """Book the open phases up to now; a task that lost its GPUs leaves the books."""
        live = task.state in LIVE_TASK_STATES and task.layout is not None and bool(task.nodes)
        if self.phase in (Phase.DECIDING, Phase.TRANSITION):
            self.stall(now_s, _PHASE_CAUSE[self.phase])
        if not live:
            if self.phase in (Phase.RUNNING, Phase.RECOMPUTE):
                self.progress(now_s, 0, None)
            self.phase = Phase.NONE
            self.booked = max(self.booked, now_s)
        elif self.phase is Phase.NONE:
            self.phase = Phase.RUNNING if task.state is TaskState.RUNNING else Phase.TRANSITION
            self.booked = max(self.booked, now_s)
        if self.phase is not Phase.RUNNING:
            self.achieved_rate = 0.0
        if self.mark is None:
            self.mark = task.last_iteration

    def _calibrate(self, measured_s: float) -> None:
        analytic = self.b.analytic_iteration_s
        if analytic is None or measured_s <= 0:
            return
        observed = analytic / measured_s
        if self.efficiency is None or analytic != self.calibrated_analytic:
            self.efficiency = observed  # the first stretch of this layout
        else:
            weight = CALIBRATE_UP if observed > self.efficiency else CALIBRATE_DOWN
            self.efficiency += weight * (observed - self.efficiency)
        self.calibrated_analytic = analytic


def _events(
    task: TaskRecord, book: _Book, incidents: list[Incident], now_s: float
) -> list[tuple[float, int, str, str]]:
    """(time, order, kind, incident id) of what happened since the book last saw the task."""
    out: list[tuple[float, int, str, str]] = []
    for inc in incidents:
        done = book.b.incidents.get(inc.incident_id, 0)
        m = incident_milestones(inc)
        acted = next((e.t_s for e in inc.timeline if e.stage in ACTED), None)
        ended = next((e.t_s for e in inc.timeline if e.stage in _ENDED), None)
        for level, (t, order, kind) in enumerate(
            ((m.detected_s, 0, "detected"), (acted, 1, "acted"), (ended, 4, "ended")), start=1
        ):
            if t is not None and level > done:
                out.append((min(t, now_s), order, kind, inc.incident_id))
    if task.launched_s is not None and task.launched_s != book.b.launched_s:
        out.append((min(task.launched_s, now_s), 2, "launched", ""))
    if task.last_iteration is not None and (book.mark is None or task.last_iteration > book.mark):
        at = task.last_iteration_s if task.last_iteration_s is not None else now_s
        out.append((min(at, now_s), 3, "high", ""))
    return sorted(out)


def _advance_task(task: TaskRecord, book: _Book, snap: Snapshot, now_s: float) -> dict[str, int]:
    """Book the task's stretches up to now from the snapshot's timestamps; the incident
    milestones booked, per incident id."""
    mine = sorted(
        (i for i in snap.incidents.values() if i.task_id == task.task_id),
        key=lambda i: (i.opened_s, i.incident_id),
    )
    seen = {i.incident_id: book.b.incidents.get(i.incident_id, 0) for i in mine}
    levels = {"detected": 1, "acted": 2, "ended": 3}
    for t, _, kind, inc_id in _events(task, book, mine, now_s):
        if kind == "high":
            assert task.last_iteration is not None
            book.high(t, task.last_iteration, incident_open=snap.open_incident(task.task_id) is not None)
        else:
            getattr(book, kind)(t)
        if inc_id:
            seen[inc_id] = levels[kind]
    book.finish(task, now_s)
    return seen


_TaskPlaces = tuple[tuple[TaskState, tuple[str, ...], int | None], ...]
_COUNTS: list[tuple[Mapping[str, NodeRecord], _TaskPlaces, tuple[int, int]]] = []
"""The last :func:`_node_counts` (one entry): its snapshot's node mapping, each task's
state, nodes and job, and the counts. :meth:`Snapshot.apply` keeps a mapping nothing
changed in, so most commits (progress, incidents) find their counts here instead of
walking every node."""


def _node_counts(snap: Snapshot) -> tuple[int, int]:
    """(ours, not out): the nodes that are unicorn's (other users' jobs hold the rest:
    ``[slurm]`` scope, neither in the ideal nor idle: their GPUs are someone else's work,
    not unicorn's loss), and of those the ones not out (healthy, not held and not held
    down by Slurm, or running a task)."""
    places = tuple((t.state, t.nodes, t.job_id) for t in snap.tasks.values())
    if _COUNTS and _COUNTS[0][0] is snap.nodes and _COUNTS[0][1] == places:
        return _COUNTS[0][2]
    used = {n for t in snap.tasks.values() if t.state in LIVE_TASK_STATES for n in t.nodes}
    task_jobs = {t.job_id for t in snap.tasks.values() if t.job_id is not None}
    foreign = {
        n.name for n in snap.nodes.values() if n.name not in used and any(j not in task_jobs for j in n.jobs)
    }
    not_out = sum(
        1
        for n in snap.nodes.values()
        if n.name not in foreign
        and ((n.health is NodeHealth.HEALTHY and not n.held and not n.slurm_down) or n.name in used)
    )
    counts = (len(snap.nodes) - len(foreign), not_out)
    _COUNTS[:] = [(snap.nodes, places, counts)]
    return counts


def advance(ledger: Ledger, snap: Snapshot, now_s: float, gpu: GpuSpec, assume: PerfAssumptions) -> Ledger:
    """The ledger booked up to ``now_s`` with the rates in force, then with ``snap``'s rates
    in force (see the module docstring). A clock that went back books nothing."""
    now_s = max(now_s, ledger.t_s)
    dt = now_s - ledger.t_s
    cluster = _Acc.of(ledger.totals)
    # The cluster clock: ideal shares and structural losses, GPUs out or idle.
    cluster.gpu_s += ledger.gpus_total * dt
    cluster.lost_gpu[Cause.SUB_HEALTHY] += ledger.gpus_out * dt
    cluster.lost_gpu[Cause.IDLE] += ledger.gpus_idle * dt
    books: dict[str, _Book] = {}
    for tid, old in ledger.tasks.items():
        book = books[tid] = _Book(old, cluster)
        e = old.efficiency or 0.0
        ideal, healthy = e * old.ideal_wtflops * dt, e * old.healthy_wtflops * dt
        in_force = old.rate() * dt
        for acc in (book.acc, cluster):
            acc.ideal += ideal
            acc.lost[Cause.SUB_HEALTHY] += ideal - healthy
            acc.lost[Cause.IDLE] += healthy - in_force
    # Each task's own clock, from the snapshot's timestamps.
    out: dict[str, TaskBook] = {}
    planned = sorted((t for t in snap.tasks.values() if t.state in PLANNED_STATES), key=lambda t: t.task_id)
    gpn = snap.gpus_per_node
    ours, not_out = _node_counts(snap)
    specs = tuple(t.spec() for t in planned)
    all_shares = dict(
        zip((t.task_id for t in planned), _best_shares(specs, ours, gpn, gpu, assume), strict=True)
    )
    healthy_shares = dict(
        zip((t.task_id for t in planned), _best_shares(specs, not_out, gpn, gpu, assume), strict=True)
    )
    for task in sorted(snap.tasks.values(), key=lambda t: t.task_id):
        book = books.get(task.task_id) or _Book(TaskBook(task.task_id, booked_s=now_s), cluster)
        seen = _advance_task(task, book, snap, now_s)
        live = task.state in LIVE_TASK_STATES and task.layout is not None
        analytic = (
            _analytic_iteration_s(task.model, task.layout, gpu, gpn, assume) if live and task.layout else None
        )
        gpus = len(task.nodes) * gpn if live else 0
        out[task.task_id] = TaskBook(
            task_id=task.task_id,
            booked_s=book.booked,
            phase=book.phase,
            mark=book.mark,
            launched_s=task.launched_s,
            incidents=seen,
            efficiency=book.efficiency,
            calibrated_analytic_s=book.calibrated_analytic,
            gpus=gpus,
            iteration_wtflop=task.weight * task.model.model_flop_per_iteration() / 1e12,
            analytic_iteration_s=analytic,
            ideal_wtflops=all_shares.get(task.task_id, 0.0),
            healthy_wtflops=healthy_shares.get(task.task_id, 0.0),
            achieved_wtflops=book.achieved_rate,
            running_s=book.running_s,
            running_iterations=book.running_iterations,
            running_ranges=book.running_ranges,
            totals=book.acc.totals(),
            nodes=task.nodes,
            layouts=record_layout(book.b.layouts, book.b.nodes, task, gpus, now_s),
        )
    gpus_total = ours * gpn
    gpus_used = sum(b.gpus for b in out.values())
    gpus_out = gpn * (ours - not_out)
    totals = cluster.totals()
    history = [cp for cp in ledger.history if now_s - cp.t_s <= HISTORY_KEEP_S]
    if not history or now_s - history[-1].t_s >= HISTORY_EVERY_S:
        history.append(Checkpoint(now_s, totals, {tid: b.totals for tid, b in out.items()}))
    series = ledger.series
    if not series or now_s - series[-1].t_s >= SERIES_EVERY_S:
        ideal, achieved = _ideal_rate(out.values()), _achieved_rate(out.values())
        sample = WafSample(round(now_s, 1), _sig(ideal), _sig(achieved))
        series = thin_series([*series, sample], now_s)
    return Ledger(
        t_s=now_s,
        started_s=ledger.started_s,
        gpus_total=gpus_total,
        gpus_out=gpus_out,
        gpus_idle=max(0, gpus_total - gpus_out - gpus_used),
        totals=totals,
        tasks=out,
        history=history,
        series=series,
    )


def _sig(v: float) -> float:
    """``v`` to 7 significant digits (the series is stored as JSON: shorter numbers)."""
    return float(f"{v:.7g}")


def summary(totals: Totals) -> dict[str, object]:
    """The JSON view of some totals (``unicornctl goodput --json``)."""
    return {
        "ideal": totals.ideal_wtflop,
        "achieved": totals.achieved_wtflop,
        "lost": {c.value: totals.lost_wtflop.get(c, 0.0) for c in Cause},
        "unattributed": totals.unattributed_wtflop,
        "gpu_s": {
            "total": totals.gpu_s,
            "productive": totals.productive_gpu_s,
            "lost": {c.value: totals.lost_gpu_s.get(c, 0.0) for c in Cause},
            "unattributed": totals.unattributed_gpu_s,
        },
    }


def cause_shares(totals: Totals) -> Mapping[Cause, float]:
    """Each cause's share of the gap (0 when there is no gap)."""
    gap = totals.ideal_wtflop - totals.achieved_wtflop
    return {c: (totals.lost_wtflop.get(c, 0.0) / gap if gap else 0.0) for c in Cause}
