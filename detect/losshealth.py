"""Loss health: NaN losses, loss spikes and gradient-norm explosions in one task's numbers.

Pure: reports in, findings out; no I/O, no clock. The coordinator's detector feeds every
:class:`unicorn_core.protocol.IterationTiming` that carries training numbers as a
:class:`LossSample` (the built-in trainer's hook sends the loss; the agent reads loss, grad
norm and Megatron-LM's skipped and NaN counters from Megatron's log line).

What fires (each a :class:`LossFinding` whose classification has its own status, see
:data:`detect.statuses.DEFAULT_SEVERITY` and :data:`detect.isolation.ISOLATION`):

- ``nan_loss``, at once: a NaN or infinite loss or grad norm, Megatron's ``number of nan
  iterations`` above 0, or ``max_skipped`` iterations in a row that Megatron skipped (its
  fp16 scaler found inf/NaN gradients every time; a few in a row are normal while the
  loss scale settles).
- ``loss_spike``: after ``warmup`` accepted reports, a loss above the running statistics
  by BOTH a z-score (``spike_z``) and a ratio (``spike_ratio``). Statistics are of
  log(loss) over the last ``window`` accepted reports: the level is their median, the
  noise scale the median absolute deviation of successive differences (so a falling trend
  does not widen it), at least :data:`SCALE_FLOOR`. The z-score alone fires on real,
  smooth curves (a tiny, very regular loss makes the scale tiny: 1.06x steps are 9.5 z in
  the built-in trainer's logs); the ratio alone would fire on a noisy curve. A loss below
  the level (the normal early fast decrease) never fires.
- ``grad_norm_explosion``: the same test on log(grad norm) with its own thresholds
  (``grad_z``, ``grad_ratio``): grad norms jump far more than losses in healthy runs.
- ``silent_data_corruption``: one node's reports keep being anomalous (``sdc_findings``
  distinct iterations within ``sdc_window`` iterations) while another node reported a
  normal value for the same iterations. This needs one series per node (each stream is
  judged on its own); it cannot fire where only one node reports the loss (Megatron-LM
  logs on its last rank only) or where every node reports the same all-reduced loss
  (the built-in trainer): there a corrupt replica spoils every node's loss alike and the
  finding is a plain ``loss_spike``.

A NaN that the training's own output names in words (Megatron-LM's rerun state machine)
is classified from the text (the ``training_nan`` rule, ``nan_loss``); :func:`named_iteration`
reads the iteration such a message names, so it rolls back like a NaN loss report.

An anomalous value never enters the statistics, and a series reports once per episode
(until one normal value). Reports of an iteration already judged on that node (every rank
of a node sends the same loss) are skipped. :meth:`LossHealth.restarted` (the processes
were restarted from saved state, iterations will repeat) forgets which iterations were
judged and ends the episodes, but keeps the statistics: a spike at the same data after the
restart is found again at once, with no second warm-up.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from detect.classify import Classification
from detect.statuses import ErrorStatus, Severity, default_severity
from unicorn_core.errors import InvalidArgument

SCALE_FLOOR: Final = 1e-3
"""Smallest noise scale of a series, in log units (0.1 %): a perfectly regular curve must
not make every wobble an infinite z-score (the ratio test guards as well)."""
_MAD_TO_SIGMA: Final = 1.4826 / math.sqrt(2.0)
"""MAD of successive differences to the standard deviation of one value (normal noise)."""
_SEEN_CAP: Final = 64
"""Iterations a node's stream remembers as judged: ranks of a node report an iteration
within a few iterations of each other (they train in lock-step), so a report older than
the 64 newest judged is not a duplicate to skip. At 4,096 it held up to 4,096 entries per
node (a gigabyte at 4,096 nodes after an hour of 1 s iterations)."""
RECENT_ITERATIONS: Final = 16
"""Iteration numbers (not reports: with a log interval of 10, two reports) behind the newest
for which :class:`LossHealth` keeps every node's verdict for the SDC test; older ones are
kept (up to ``sdc_window``) only where a node's report was anomalous, because an iteration
with no anomaly can never count towards a finding (see ``_record``)."""
_NAMED_ITERATION: Final = re.compile(r"\biteration #?(\d+)\b")


@dataclass(frozen=True)
class LossHealthConfig:
    """Thresholds (see the module doc; ``DetectConfig`` documents each one's choice)."""

    warmup: int = 20
    window: int = 100
    spike_z: float = 8.0
    spike_ratio: float = 1.6
    grad_z: float = 12.0
    grad_ratio: float = 4.0
    max_skipped: int = 50
    sdc_findings: int = 2
    sdc_window: int = 1000

    def __post_init__(self) -> None:
        if self.warmup < 5 or self.window < self.warmup:
            raise InvalidArgument(f"need 5 <= warmup <= window, got {self.warmup}, {self.window}")
        if min(self.spike_z, self.grad_z) <= 0 or min(self.spike_ratio, self.grad_ratio) <= 1:
            raise InvalidArgument("z thresholds must be > 0 and ratio thresholds > 1")
        if self.max_skipped < 1 or self.sdc_findings < 1 or self.sdc_window < 1:
            raise InvalidArgument("max_skipped, sdc_findings and sdc_window must be >= 1")


@dataclass(frozen=True)
class LossSample:
    """One report's training numbers (None: not reported). ``span``: iterations the report
    covers (Megatron's log interval), ``skipped``/``nan``: Megatron's counters over it."""

    node: str
    iteration: int
    loss: float | None = None
    grad_norm: float | None = None
    skipped: int | None = None
    nan: int | None = None
    span: int = 1
    rank: int | None = None


@dataclass(frozen=True)
class LossFinding:
    """A training-state finding: the node and rank whose report showed it, and what it is."""

    node: str
    rank: int | None
    iteration: int
    classification: Classification

    @property
    def status(self) -> ErrorStatus:
        return self.classification.status


@dataclass(frozen=True)
class Score:
    """How far a value lies above its series: z-score and ratio to the level."""

    z: float
    ratio: float
    level: float
    """The series' level (median), in the value's own units."""


class RobustSeries:
    """Robust running statistics of log(value) over the last ``window`` accepted values."""

    def __init__(self, window: int, warmup: int) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._warmup = warmup

    def __len__(self) -> int:
        return len(self._values)

    def score(self, value: float) -> Score | None:
        """The value's score; None while warming up or for a value that is not > 0 and finite."""
        if len(self._values) < self._warmup or not (value > 0 and math.isfinite(value)):
            return None
        values = list(self._values)
        level = statistics.median(values)
        diffs = [b - a for a, b in itertools.pairwise(values)]
        center = statistics.median(diffs)
        scale = max(SCALE_FLOOR, _MAD_TO_SIGMA * statistics.median(abs(d - center) for d in diffs))
        excess = math.log(value) - level
        return Score(excess / scale, math.exp(excess), math.exp(level))

    def add(self, value: float) -> None:
        if value > 0 and math.isfinite(value):
            self._values.append(math.log(value))


@dataclass
class _Stream:
    """One node's series and episode state."""

    loss: RobustSeries
    grad: RobustSeries
    seen: dict[int, None] = field(default_factory=dict)
    """Iterations judged since the last restart (insertion-ordered, capped)."""
    spiking: bool = False
    exploding: bool = False
    skipped_run: int = 0
    skipped_fired: bool = False


_Anomaly = tuple[ErrorStatus, str, str]


class LossHealth:
    """One task's loss health (see the module doc)."""

    def __init__(self, cfg: LossHealthConfig | None = None) -> None:
        self.cfg = cfg or LossHealthConfig()
        self._streams: dict[str, _Stream] = {}
        self._fired: set[tuple[ErrorStatus, int]] = set()
        self._history: dict[int, dict[str, bool]] = {}
        """Per iteration: each reporting node, and whether its report was anomalous (the
        newest :data:`RECENT_ITERATIONS`, and older ones with an anomaly)."""
        self._newest = -1
        """The newest iteration ever reported (the SDC window's end)."""
        self._front = -1
        """The newest iteration reported since the last restart."""
        self._sdc_fired: set[str] = set()

    def restarted(self) -> None:
        """The task's processes restart from saved state: iterations will be reported again."""
        self._front = -1
        for stream in self._streams.values():
            stream.seen.clear()
            stream.spiking = stream.exploding = stream.skipped_fired = False
            stream.skipped_run = 0
        self._fired.clear()
        self._sdc_fired.clear()

    def observe(self, sample: LossSample) -> list[LossFinding]:
        """Judge one report; the findings it raises (at most one per status)."""
        if not sample.node or sample.iteration < 0:
            return []
        if sample.loss is None and sample.grad_norm is None and sample.skipped is None and sample.nan is None:
            return []  # no training numbers in this report
        stream = self._streams.get(sample.node)
        if stream is None:
            stream = self._streams[sample.node] = _Stream(
                RobustSeries(self.cfg.window, self.cfg.warmup),
                RobustSeries(self.cfg.window, self.cfg.warmup),
            )
        if sample.iteration in stream.seen:
            return []  # another rank of the node reported the same iteration
        stream.seen[sample.iteration] = None
        if len(stream.seen) > _SEEN_CAP:
            del stream.seen[next(iter(stream.seen))]
        anomalies, judged = self._judge(stream, sample)
        if judged or anomalies:
            self._record(sample.node, sample.iteration, bool(anomalies))
        out: list[LossFinding] = []
        sdc = self._sdc(sample.iteration)
        for node, evidence in sdc:
            c = Classification(ErrorStatus.SILENT_DATA_CORRUPTION, Severity.SEV1, "loss_health_sdc", evidence)
            out.append(LossFinding(node, sample.rank if node == sample.node else None, sample.iteration, c))
        if any(node == sample.node for node, _ in sdc):
            return out  # the node's finding is the corruption; not also a plain spike
        for status, rule, evidence in anomalies:
            if (status, sample.iteration) in self._fired:
                continue  # another node reported the same iteration's finding first
            self._fired.add((status, sample.iteration))
            severity = default_severity(status)
            c = Classification(status, severity, rule, evidence)
            out.append(LossFinding(sample.node, sample.rank, sample.iteration, c))
        return out

    def _judge(self, stream: _Stream, s: LossSample) -> tuple[list[_Anomaly], bool]:
        """The node's anomalies in this report, and whether a loss or grad norm was judged."""
        cfg, k = self.cfg, s.iteration
        found: list[_Anomaly] = []
        nan_why = ""
        if s.loss is not None and not math.isfinite(s.loss):
            nan_why = f"loss {s.loss} at iteration {k}"
        elif s.grad_norm is not None and not math.isfinite(s.grad_norm):
            nan_why = f"grad norm {s.grad_norm} at iteration {k}"
        elif s.nan:
            nan_why = f"Megatron counted {s.nan} nan iteration(s) in the {s.span} ending at {k}"
        if nan_why:
            found.append((ErrorStatus.NAN_LOSS, "loss_health_nan", nan_why))
        if s.skipped is not None:
            advanced = s.span - s.skipped
            stream.skipped_run = stream.skipped_run + s.skipped if advanced <= 0 else 0
            if stream.skipped_run < cfg.max_skipped:
                stream.skipped_fired = False
            elif not stream.skipped_fired and not nan_why:
                stream.skipped_fired = True
                found.append(
                    (
                        ErrorStatus.NAN_LOSS,
                        "loss_health_skipped",
                        f"Megatron skipped {stream.skipped_run} iterations in a row up to {k} "
                        f"(inf/NaN gradients every time; limit {cfg.max_skipped})",
                    )
                )
        judged = False
        if s.loss is not None and s.loss > 0 and math.isfinite(s.loss):
            judged = True
            stream.spiking = self._series(
                stream.loss,
                s.loss,
                in_episode=stream.spiking,
                found=found,
                limits=(cfg.spike_z, cfg.spike_ratio),
                k=k,
                what="loss",
            )
        if s.grad_norm is not None and s.grad_norm > 0 and math.isfinite(s.grad_norm):
            judged = True
            stream.exploding = self._series(
                stream.grad,
                s.grad_norm,
                in_episode=stream.exploding,
                found=found,
                limits=(cfg.grad_z, cfg.grad_ratio),
                k=k,
                what="grad",
            )
        return found, judged

    @staticmethod
    def _series(
        series: RobustSeries,
        value: float,
        *,
        in_episode: bool,
        found: list[_Anomaly],
        limits: tuple[float, float],
        k: int,
        what: str,
    ) -> bool:
        """Judge one value of a series (a finding once per episode); whether it is anomalous.
        Anomalous values stay out of the statistics."""
        score = series.score(value)
        z_limit, ratio_limit = limits
        if score is None or score.z < z_limit or score.ratio < ratio_limit:
            series.add(value)
            return False
        if not in_episode:
            status, rule, name = (
                (ErrorStatus.LOSS_SPIKE, "loss_health_spike", "loss")
                if what == "loss"
                else (ErrorStatus.GRAD_NORM_EXPLOSION, "loss_health_grad_norm", "grad norm")
            )
            found.append(
                (
                    status,
                    rule,
                    f"{name} {value:.4g} at iteration {k} is {score.ratio:.2f}x the running median "
                    f"{score.level:.4g} (z {score.z:.1f}; limits {ratio_limit:g}x and z {z_limit:g})",
                )
            )
        return True

    def _record(self, node: str, iteration: int, anomalous: bool) -> None:
        """Keep ``node``'s verdict on ``iteration``, for the last ``sdc_window`` iterations
        of the newest ever reported (``_newest``; a report older than that is dropped, as it
        always was). Within them, an iteration more than :data:`RECENT_ITERATIONS` behind
        the newest reported since the last restart (``_front``: every node of a lock-step job
        has reported it by then) is forgotten when no report of it was anomalous: only an
        anomalous node's iterations count towards an SDC finding. A report that arrives
        later still for a forgotten iteration is judged without the others' (it can then
        miss a finding, never make one). Before, every node's verdict on the last
        ``sdc_window`` iterations was kept (1,000 x the job's nodes) and walked on every
        report; now the walk runs only when ``_front`` moves."""
        if iteration <= self._newest - self.cfg.sdc_window:
            return
        at = self._history.setdefault(iteration, {})
        at[node] = at.get(node, False) or anomalous
        if iteration <= self._front:  # (``_front <= _newest``: nothing moved)
            return
        self._front, self._newest = iteration, max(self._newest, iteration)
        # Nothing older than the window is ever kept (dropped above, or here when it moved).
        window, recent = self._newest - self.cfg.sdc_window, self._front - RECENT_ITERATIONS
        for old in [
            i
            for i, nodes in self._history.items()
            if i <= window or (i <= recent and not any(nodes.values()))
        ]:
            del self._history[old]

    def _sdc(self, iteration: int) -> list[tuple[str, str]]:
        """Nodes whose reports keep being anomalous where another node's were not."""
        out: list[tuple[str, str]] = []
        for node, bad in sorted(self._history.get(iteration, {}).items()):
            if not bad or node in self._sdc_fired:
                continue
            alone = sorted(
                i
                for i, nodes in self._history.items()
                if nodes.get(node) and any(not b for n, b in nodes.items() if n != node)
            )
            if len(alone) >= self.cfg.sdc_findings:
                self._sdc_fired.add(node)
                shown = ", ".join(str(i) for i in alone[-5:])
                out.append(
                    (
                        node,
                        f"node {node}'s loss or gradients were anomalous at {len(alone)} iterations "
                        f"({shown}) where other nodes' replicas were normal: possible silent data "
                        "corruption on this node",
                    )
                )
        return out


def named_iteration(text: str) -> int | None:
    """The iteration a training-state message names (>= 1), None when it names none.

    Megatron-LM's rerun state machine (megatron-core 0.16) names it as its log lines number
    it, in both of its forms: with the default ``--rerun-mode validate_results``, logged
    before it re-runs the step, ``Unexpected result nan on rank 0 at iteration #8 invocation
    #1 (message='found NaN in local forward loss calculation')``; with ``--rerun-mode
    disabled``, the rank's exception ``RuntimeError: Rank 0, node n1, device 0, iteration 8:
    Unexpected result nan (message=...)``. Its DDP check (``found NaN in local grad norm
    ...``) names none."""
    found = _NAMED_ITERATION.search(text)
    return int(found[1]) if found is not None and int(found[1]) >= 1 else None
