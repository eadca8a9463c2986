"""Stragglers: a node persistently slower than its peers at the same work (issue 17, item 5).

The input is each rank's compute time per training iteration
(:attr:`~unicorn_core.protocol.IterationTiming.compute_s`: its own forward, backward and
optimizer time, its waits on peers in collectives excluded) and its pipeline stage. Wall
times cannot name a straggler: in lock-step training every rank waits for the slowest, so
all report the same time. Feed every report to :meth:`StragglerMonitor.observe`; it
returns the verdicts that report completed. Pure: no clock, no I/O.

The statistic, robust at every step (precision before recall: ordinary noise, a
checkpoint or evaluation step, warm-up and short bursts of CPU contention must never
convict a node):

1. **Windows** of ``window`` iterations by number (window ``iteration // window``), so every
   rank's window covers the same iterations. Only ``train`` steps with a compute time
   count (checkpoint and evaluation steps never do), and not a rank's first ``warmup``
   of them after its start or restart (compilation, allocator and cache warm-up).
2. **Per rank**: the lower decile of its compute times in the window, when it has at
   least half the window (reports can be lost: a full datagram queue drops them). A slower
   device is slower at *every* iteration, so even its quickest ones are slow; noise that
   only adds time (a checkpoint's side effects, page faults, a burst of contention) moves
   the lower decile only once it hits nine tenths of the reports. (The median breaks at
   half, the lower quartile at three quarters: the property test found a node with
   contention bursts of 8 iterations and spikes in 10 % of the others convicted with the
   median, and one with bursts of 9 in 20, such spikes and 29 % of reports lost convicted
   with the quartile, through whichever of its four ranks lost the most quick reports.)
3. **Per node and stage**: the largest of its ranks' deciles (one slow GPU slows the node).
   Ranks of different pipeline stages do different work and are never compared.
4. **Per node**: its value over the median of the *other* nodes' values of its stage, only
   in a stage that spans at least ``min_nodes`` nodes (3 or more: with two, either could be
   the odd one, and work that one rank does on top of the others could not be told from a
   slow node).
5. **Persistence**: a node is slow in a window when that ratio is at least ``factor``. After
   ``windows`` consecutive slow windows it is a straggler (reported again after every
   further ``windows``: the decision taker ignores repeats); a window in which the node
   was not compared breaks the streak. A straggler recovers after ``windows`` consecutive
   windows compared and not slow.

Why these defaults (``window`` 20, ``windows`` 3, ``factor`` 1.5): with per-iteration noise of
sigma (in log units) the lower decile of 10-20 samples varies by about 0.5 sigma; even at
sigma = 0.3 (30 % jitter, far above steady training's) a ratio of 1.5 (0.41 in log units)
is about three of those deviations away in one window, and three windows in a row make
a false conviction practically impossible (the property test in
``tests/detect/test_detect_stragglers.py`` draws such noise, with spikes, lost reports and
per-rank offsets, and asserts that nothing fires). A node 1.5x slower than its peers costs
its task up to a third of its throughput: worth a transition on any cluster whose nodes
fail less than daily (:mod:`unicornd.decide.stragglers` decides).

A window is judged when a report of the second iteration after it arrives (ranks in
lock-step report within an iteration of each other); a later report for it is dropped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from detect.classify import Classification
from detect.statuses import ErrorStatus, Severity
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import IterationPhase

STRAGGLER_RULE: Final = "straggler"
RECOVERED_RULE: Final = "straggler_recovered"


@dataclass(frozen=True)
class StragglerConfig:
    """The statistic's settings (module doc; unicornd reads them from ``[detect]``)."""

    window: int = 20
    windows: int = 3
    factor: float = 1.5
    min_nodes: int = 3
    warmup: int = 10

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.window, bool) or self.window < 4:
            problems.append(f"window must be >= 4 iterations, got {self.window!r}")
        if isinstance(self.windows, bool) or self.windows < 1:
            problems.append(f"windows must be >= 1, got {self.windows!r}")
        if not (math.isfinite(self.factor) and self.factor > 1):
            problems.append(f"factor must be > 1, got {self.factor!r}")
        if isinstance(self.min_nodes, bool) or self.min_nodes < 3:
            problems.append(
                f"min_nodes must be >= 3 (of two nodes either may be the slow one), got {self.min_nodes!r}"
            )
        if isinstance(self.warmup, bool) or self.warmup < 0:
            problems.append(f"warmup must be >= 0, got {self.warmup!r}")
        if problems:
            raise InvalidArgument("; ".join(problems))

    @property
    def min_samples(self) -> int:
        """Reports a rank needs in a window to be judged: half the window."""
        return -(-self.window // 2)


@dataclass(frozen=True)
class Straggler:
    """A node slower than its peers at the same work (or, ``recovered``, no longer).

    ``rank``: the node's slowest rank; ``stage``: its pipeline stage. ``compute_s``: the node's
    compute time per iteration (its slowest rank's lower decile), ``peers_compute_s``: the
    median of the other ``nodes`` - 1 nodes' of that stage, ``ratio``: the first over the
    second, all in the streak's *least* slow window (a conservative slowdown);
    ``iteration_s``: the task's median wall time per iteration in that window. ``windows``:
    windows in a row the node was slow (or, when recovered, not slow);
    ``first_iteration``/``last_iteration``: the iterations they cover.
    """

    node: str
    rank: int
    stage: int
    ratio: float
    compute_s: float
    peers_compute_s: float
    iteration_s: float
    windows: int
    first_iteration: int
    last_iteration: int
    nodes: int
    recovered: bool = False

    def describe(self) -> str:
        """One line with the numbers (the evidence of a finding)."""
        span = f"{self.windows} windows in a row (iterations {self.first_iteration}-{self.last_iteration})"
        if self.recovered:
            return f"{self.node} no longer slower than its peers: {self.ratio:.2f}x their median in {span}"
        return (
            f"{self.node} (rank {self.rank}, stage {self.stage}) computes {self.ratio:.2f}x as long as the "
            f"median of the other {self.nodes - 1} nodes ({self.compute_s:.4g} s against "
            f"{self.peers_compute_s:.4g} s per iteration; the task's iteration takes "
            f"{self.iteration_s:.4g} s) in {span}"
        )

    def classification(self) -> Classification:
        """As a ``straggler`` finding: sub-healthy (SEV3), never a fault the ladder acts on."""
        rule = RECOVERED_RULE if self.recovered else STRAGGLER_RULE
        return Classification(ErrorStatus.STRAGGLER, Severity.SEV3, rule, self.describe())


@dataclass(frozen=True)
class _Judged:
    """One node in one window."""

    rank: int
    stage: int
    ratio: float
    compute_s: float
    peers_s: float
    nodes: int
    wall_s: float

    def verdict(
        self,
        node: str,
        windows: int,
        first_window: int,
        last_window: int,
        size: int,
        *,
        recovered: bool = False,
    ) -> Straggler:
        """The verdict on ``node`` with this window's numbers, over windows
        ``first_window..last_window`` of ``size`` iterations."""
        return Straggler(
            node=node,
            rank=self.rank,
            stage=self.stage,
            ratio=self.ratio,
            compute_s=self.compute_s,
            peers_compute_s=self.peers_s,
            iteration_s=self.wall_s,
            windows=windows,
            first_iteration=first_window * size,
            last_iteration=(last_window + 1) * size - 1,
            nodes=self.nodes,
            recovered=recovered,
        )


@dataclass
class _Rank:
    node: str
    stage: int
    last_iteration: int
    train_count: int = 0


@dataclass
class _Window:
    compute: dict[int, list[float]] = field(default_factory=dict)
    wall: list[float] = field(default_factory=list)


@dataclass
class _Track:
    """One node's streaks."""

    last_window: int | None = None
    streak: int = 0
    first_window: int = 0
    least: _Judged | None = None
    ok: int = 0
    ok_first_window: int = 0
    convicted: bool = False


class StragglerMonitor:
    """Straggler verdicts for one task (all its ranks); see the module doc.

    Create a new one (or :meth:`reset`) when the task is relaunched: its layout, and so
    which ranks do the same work, may change.
    """

    def __init__(self, cfg: StragglerConfig | None = None) -> None:
        self.cfg = cfg or StragglerConfig()
        self.reset()

    def reset(self) -> None:
        """Forget every rank, window and streak (convictions too)."""
        self._ranks: dict[int, _Rank] = {}
        self._windows: dict[int, _Window] = {}
        self._judged_through = -1
        self._tracks: dict[str, _Track] = {}

    def assume_convicted(self, nodes: Iterable[str]) -> None:
        """Treat ``nodes`` as stragglers found before (e.g. reported before this monitor was
        made): each gets a ``recovered`` verdict once it was not slow for ``windows`` windows."""
        for node in nodes:
            self._tracks.setdefault(node, _Track()).convicted = True

    @property
    def convicted(self) -> frozenset[str]:
        """The nodes found slow and not recovered since."""
        return frozenset(n for n, t in self._tracks.items() if t.convicted)

    def observe(
        self,
        rank: int,
        node: str,
        iteration: int,
        compute_s: float | None,
        duration_s: float,
        *,
        phase: IterationPhase | str = IterationPhase.TRAIN,
        stage: int | None = None,
    ) -> list[Straggler]:
        """``rank`` on ``node`` finished ``iteration`` (a ``phase`` step) in ``duration_s`` wall
        seconds of which it computed ``compute_s`` (None: not measured); returns the verdicts
        of the windows this report completed. Bad input raises InvalidArgument and changes
        nothing."""
        if rank < 0 or iteration < 0 or (stage is not None and stage < 0) or not node:
            raise InvalidArgument(
                f"need rank, iteration and stage >= 0 and a node, got {rank}, {iteration}, {stage}, {node!r}"
            )
        for name, value in (("compute_s", compute_s), ("duration_s", duration_s)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{name} must be a finite number >= 0, got {value}")
        try:
            phase = IterationPhase(phase)
        except ValueError:
            raise InvalidArgument(f"unknown phase {phase!r}") from None
        if phase is not IterationPhase.TRAIN or compute_s is None:
            return []
        group = stage or 0
        state = self._ranks.get(rank)
        if state is not None and iteration < state.last_iteration:
            self._restarted()  # from a checkpoint: every rank restarts; windows repeat
            state = None
        if state is None or (state.node, state.stage) != (node, group):
            state = self._ranks[rank] = _Rank(node, group, iteration)
            self._forget_samples(rank)
        state.last_iteration = iteration
        state.train_count += 1
        out = self._judge_before(iteration)
        w = iteration // self.cfg.window
        if state.train_count > self.cfg.warmup and w > self._judged_through:
            window = self._windows.setdefault(w, _Window())
            window.compute.setdefault(rank, []).append(compute_s)
            window.wall.append(duration_s)
        return out

    # --- inside ------------------------------------------------------------------------

    def _restarted(self) -> None:
        self._ranks.clear()
        self._windows.clear()
        self._judged_through = -1
        for track in self._tracks.values():
            track.last_window = None  # window numbers repeat: no streak spans a restart

    def _forget_samples(self, rank: int) -> None:
        for window in self._windows.values():
            window.compute.pop(rank, None)

    def _judge_before(self, iteration: int) -> list[Straggler]:
        """Judge every pending window that ended at least two iterations before ``iteration``."""
        out: list[Straggler] = []
        for w in sorted(self._windows):
            if (w + 1) * self.cfg.window + 1 > iteration:
                break
            out.extend(self._judge(w, self._windows.pop(w)))
            self._judged_through = max(self._judged_through, w)
        return out

    def _judge(self, w: int, window: _Window) -> list[Straggler]:
        cfg = self.cfg
        stages: dict[int, dict[str, tuple[float, int]]] = {}
        for rank, samples in window.compute.items():
            state = self._ranks.get(rank)
            if state is None or len(samples) < cfg.min_samples:
                continue
            value = statistics.quantiles(samples, n=10, method="inclusive")[0]
            nodes = stages.setdefault(state.stage, {})
            if state.node not in nodes or value > nodes[state.node][0]:
                nodes[state.node] = (value, rank)
        wall = statistics.median(window.wall) if window.wall else 0.0
        judged: dict[str, _Judged] = {}
        for stage, nodes in sorted(stages.items()):
            if len(nodes) < cfg.min_nodes:
                continue
            for node, (value, rank) in nodes.items():
                peers = statistics.median(v for n, (v, _) in nodes.items() if n != node)
                if peers <= 0:
                    continue
                j = _Judged(rank, stage, value / peers, value, peers, len(nodes), wall)
                if node not in judged or j.ratio > judged[node].ratio:
                    judged[node] = j
        out = []
        for node, j in sorted(judged.items()):
            verdict = self._update(node, w, j)
            if verdict is not None:
                out.append(verdict)
        return out

    def _update(self, node: str, w: int, j: _Judged) -> Straggler | None:
        cfg = self.cfg
        track = self._tracks.setdefault(node, _Track())
        consecutive = track.last_window == w - 1
        track.last_window = w
        if j.ratio >= cfg.factor:
            track.ok = 0
            if consecutive and track.streak:
                track.streak += 1
                if track.least is None or j.ratio < track.least.ratio:
                    track.least = j
            else:
                track.streak, track.first_window, track.least = 1, w, j
            if track.streak < cfg.windows or (track.streak - cfg.windows) % cfg.windows:
                return None
            track.convicted = True
            assert track.least is not None
            return track.least.verdict(node, track.streak, track.first_window, w, cfg.window)
        track.streak, track.least = 0, None
        if consecutive and track.ok:
            track.ok += 1
        else:
            track.ok, track.ok_first_window = 1, w
        if not (track.convicted and track.ok >= cfg.windows):
            return None
        track.convicted = False
        return j.verdict(node, track.ok, track.ok_first_window, w, cfg.window, recovered=True)
