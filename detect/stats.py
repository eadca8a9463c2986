"""Online iteration-time statistics of one task: hangs, slowdowns and stragglers.

Feed every :class:`~unicorn_core.protocol.IterationTiming` to
:meth:`IterationMonitor.observe` and call :meth:`IterationMonitor.check` periodically;
both take the caller's monotonic clock ``now_s``, so decisions are functions of the
inputs and the clock and tests replay traces without sleeping.

- **Learning.** A rank's first ``warmup_iterations`` train steps (after start, or after
  its iteration number goes back, i.e. a restart) are ignored: they include compilation
  and allocator warm-up. Checkpoint and eval steps never feed the train statistics. The
  task's robust mean is the median of the last ``window`` train durations of all ranks,
  its spread 1.4826 x their MAD (both robust to the occasional slow step).
- **Hang.** A rank hangs when the time since its last report exceeds
  ``deadline_s() = k x mean``. ``k`` is ``hang_factor``; with ``max_hang_factor`` above
  it, ``k`` is learned: ``learn_margin`` x the largest duration/mean ratio seen in the
  window, kept between the two. Until ratios of ``noise_iterations`` train iterations
  are in, ``k`` is ``max_hang_factor``: the noise of a handful of steps says little
  about the next one. CI once called a rolled-back task hung 2 s after its restore, on
  a loaded machine, judged at 2 x a mean learned from its first 5 steps, and restarted
  it again. Iterations, not samples: the ranks of one lock-step iteration share its
  noise, and a large job reports thousands at once. A stop is therefore detected within
  ``k`` mean iterations of the last report, i.e. within ``k`` of the stop itself.
- **CPU starvation is no hang.** A rank that is runnable but kept off the CPU by other
  processes is slow, not stuck. Agents report how long their ranks waited for a CPU
  (:meth:`IterationMonitor.observe_cpu_wait`: per source, e.g. a node, a growing
  counter of the wait of its most-starved rank, from ``/proc/<pid>/schedstat``). With
  sources, a rank's silence is counted up to the newest time every source has reported
  for, less the largest wait any source accumulated meanwhile (lock-step: the whole job
  waits for its most-starved rank). A stopped rank or one asleep in a collective
  accumulates no wait and is caught as before; one spinning on a busy CPU is caught
  later, in proportion to the CPU it gets. At most ``max_excused`` of a silence is
  excused, so a rank starved without end is still caught (after ``1/(1-max_excused)``
  deadlines). Measured (``scripts/bench/detection.py --trace``, a CPU hog beside the
  ranks on 2 cores): in two fault-free runs, silences of up to 2.9x and 3.1x the median
  iteration were at most 1.6x and 2.3x once the wait was taken off.
- **Slow steps.** A checkpoint or eval step may legitimately take far longer. Such a
  step is allowed ``k`` x that phase's own learned mean when it is announced
  (:meth:`IterationMonitor.expect_slow_step`, e.g. when a checkpoint is commanded or the
  trainer says it is saving) or predicted (the phase recurs at a fixed iteration
  period, learned from its last two occurrences). One rank's notice for iteration
  ``i`` covers every rank still before ``i``: in lock-step training the others wait
  for it in a collective, and they may never announce it (a rank whose checkpoint
  signal came late, a notice lost). Before its duration or the train mean is known,
  an announced slow step is allowed ``slow_step_timeout_s`` (None: no limit), or ``k`` x
  its learned time when that is longer.
- **Suspects.** In lock-step data-parallel training every rank waits in the same
  collective, so all stall together and the verdict names them all; a rank that lags
  (others reported later iterations) is named alone.
- **Stragglers.** Scores in [0, 1], 1 = not straggling: a rank's recent median
  against the best rank's, or against its own history. They are as good as the
  durations fed in: wall-clock iteration times are equal across ranks in lock-step
  training; compute-only times tell ranks apart. unicornd does not use these scores: it
  judges nodes on their ranks' compute times with :mod:`detect.stragglers`.
"""

from __future__ import annotations

import bisect
import enum
import math
import statistics
from array import array
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Final

from detect.classify import Classification
from detect.statuses import ErrorStatus, Severity
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import IterationPhase

CPU_WAIT_SAMPLES: Final = 512
"""CPU-wait samples kept per source: 51 s of the agent's 0.1 s samples, 8 minutes of
1 s heartbeats; a silence that began before the oldest is excused only from there."""

SLOW_STEP_TIMEOUT_S: Final = 600.0
"""What agents and unicornd allow an announced slow step (a checkpoint save, an
evaluation) before its phase's duration is learned: a save of a large model to a remote
filesystem takes minutes; a save that never ends is still caught."""

MAD_TO_SIGMA: Final = 1.4826
"""Scales the median absolute deviation to the standard deviation of a normal sample."""


class StragglerReference(enum.StrEnum):
    """What a straggler score compares a rank's recent iteration time with."""

    BEST_RANK = "best_rank"
    OWN_HISTORY = "own_history"


@dataclass(frozen=True)
class IterationStats:
    """The task's learned statistics (``mean_s`` None until ``min_samples`` are in)."""

    samples: int
    mean_s: float | None
    spread_s: float | None
    hang_factor: float
    deadline_s: float | None


@dataclass(frozen=True)
class HangVerdict:
    """Ranks that stopped reporting for longer than allowed.

    ``ranks`` are the suspects: the stalled ranks with the lowest last iteration.
    ``waited_s`` is the longest silence among them and ``deadline_s`` what that rank
    was allowed; ``starved_s`` the part of that silence put down to CPU starvation;
    ``last_iteration`` is -1 for a rank registered but never heard from.
    """

    ranks: tuple[int, ...]
    stalled_ranks: tuple[int, ...]
    last_iteration: int
    waited_s: float
    deadline_s: float
    mean_iteration_s: float | None
    starved_s: float = 0.0

    def classification(self) -> Classification:
        """As a ``task_hang`` finding (secondary: a hang is usually a symptom of a fault elsewhere)."""
        who = ", ".join(str(r) for r in self.ranks)
        mean = (
            f" ({self.deadline_s / self.mean_iteration_s:.2g} x mean {self.mean_iteration_s:.3g} s)"
            if (self.mean_iteration_s)
            else ""
        )
        starved = f" ({self.starved_s:.3g} s of it waiting for a CPU)" if self.starved_s >= 0.001 else ""
        return Classification(
            ErrorStatus.TASK_HANG,
            Severity.SEV2,
            "iteration_stall",
            f"rank(s) {who} reported no iteration for {self.waited_s:.3g} s{starved}, allowed "
            f"{self.deadline_s:.3g} s{mean}; last iteration {self.last_iteration}",
            secondary=True,
        )


class Samples:
    """The last ``capacity`` floats, oldest first, in one ``array('d')``: 8 bytes a sample
    where a deque holds a 24-byte float object and a pointer. There is one per rank: at
    4,096 nodes x 8 ranks and a 256-sample window, 71 MiB instead of 282 (tracemalloc;
    ``scripts/bench/scale.py``'s long run found the growth)."""

    __slots__ = ("_buf", "_start", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._buf = array("d")
        self._start = 0

    def append(self, value: float) -> None:
        if len(self._buf) < self.capacity:
            self._buf.append(value)
        else:  # full: overwrite the oldest
            self._buf[self._start] = value
            self._start = (self._start + 1) % self.capacity

    def __len__(self) -> int:
        return len(self._buf)

    def __iter__(self) -> Iterator[float]:
        yield from self._buf[self._start :]
        yield from self._buf[: self._start]

    def last(self, n: int) -> list[float]:
        """The newest ``n`` (all when fewer), oldest first."""
        return list(self)[-n:] if n > 0 else []


class CounterSeries:
    """The last ``capacity`` (time, value) samples of a counter, oldest first, in two
    ``array('d')``: 16 bytes a sample where a deque of tuples holds a tuple, two float
    objects and a pointer (~110 bytes), all walked by every full garbage collection. There
    is one per agent: at 4,096 nodes and 512 samples, 32 MiB instead of 218 (tracemalloc,
    ``scripts/bench/scale.py --tracemalloc-every-s``)."""

    __slots__ = ("_times", "_values", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._times = array("d")
        self._values = array("d")

    def append(self, t: float, value: float) -> None:
        """Add a sample no older than the last (the caller checks the clock)."""
        self._times.append(t)
        self._values.append(value)
        if len(self._times) > self.capacity:  # a memmove of the arrays: ~1 us at 512
            del self._times[0]
            del self._values[0]

    def __len__(self) -> int:
        return len(self._times)

    def last(self) -> tuple[float, float]:
        """The newest (time, value); IndexError when empty."""
        return self._times[-1], self._values[-1]

    def at(self, t: float) -> float:
        """The counter at ``t``, linearly interpolated between samples; the first value
        before the first sample, the last after the last. IndexError when empty."""
        times, values = self._times, self._values
        i = bisect.bisect_right(times, t)
        if i == 0:
            return values[0]
        if i == len(times):
            return values[-1]
        t0, t1 = times[i - 1], times[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (t - t0) / (t1 - t0)


@dataclass
class _Rank:
    last_iteration: int
    last_seen_s: float
    durations: Samples
    train_count: int = 0
    announced: tuple[int, IterationPhase] | None = None
    """(iteration, phase): that iteration is a slow step; cleared once it is reported."""


def _check_clock(now_s: float, last_s: float) -> None:
    if not math.isfinite(now_s):
        raise InvalidArgument(f"now_s must be finite, got {now_s}")
    if now_s < last_s:
        raise InvalidArgument(f"now_s went back from {last_s} to {now_s}: pass a monotonic clock")


class IterationMonitor:
    """Iteration statistics and hang detection for one task (all its ranks); see module doc.

    Create a new monitor (or :meth:`reset`) when the task is relaunched with a new
    layout: its iteration time changes.
    """

    def __init__(
        self,
        hang_factor: float = 3.0,
        warmup_iterations: int = 2,
        min_samples: int = 5,
        *,
        window: int = 256,
        max_hang_factor: float | None = None,
        learn_margin: float = 1.25,
        recent: int = 10,
        initial_deadline_s: float | None = None,
        slow_step_timeout_s: float | None = None,
        max_excused: float = 0.9,
        noise_iterations: int = 16,
    ) -> None:
        problems = []
        if not (math.isfinite(hang_factor) and hang_factor > 1):
            problems.append(f"hang_factor must be > 1, got {hang_factor}")
        if warmup_iterations < 0:
            problems.append(f"warmup_iterations must be >= 0, got {warmup_iterations}")
        if min_samples < 1:
            problems.append(f"min_samples must be >= 1, got {min_samples}")
        if window < min_samples:
            problems.append(f"window ({window}) must be >= min_samples ({min_samples})")
        if max_hang_factor is not None and not (
            math.isfinite(max_hang_factor) and max_hang_factor >= hang_factor
        ):
            problems.append(f"max_hang_factor must be >= hang_factor ({hang_factor}), got {max_hang_factor}")
        if not (math.isfinite(learn_margin) and learn_margin >= 1):
            problems.append(f"learn_margin must be >= 1, got {learn_margin}")
        if recent < 1:
            problems.append(f"recent must be >= 1, got {recent}")
        if noise_iterations < 0:
            problems.append(f"noise_iterations must be >= 0, got {noise_iterations}")
        if not (0 <= max_excused < 1):
            problems.append(f"max_excused must be in [0, 1), got {max_excused}")
        for name, value in (
            ("initial_deadline_s", initial_deadline_s),
            ("slow_step_timeout_s", slow_step_timeout_s),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                problems.append(f"{name} must be > 0 or None, got {value}")
        if problems:
            raise InvalidArgument("; ".join(problems))
        self.hang_factor = hang_factor
        self.warmup_iterations = warmup_iterations
        self.min_samples = min_samples
        self.window = window
        self.max_hang_factor = max_hang_factor if max_hang_factor is not None else hang_factor
        self.learn_margin = learn_margin
        self.recent = recent
        self.initial_deadline_s = initial_deadline_s
        self.slow_step_timeout_s = slow_step_timeout_s
        self.max_excused = max_excused
        self.noise_iterations = noise_iterations
        self.reset()

    def reset(self) -> None:
        """Forget every rank and everything learned."""
        self._waits: dict[str, CounterSeries] = {}
        self._clock = -math.inf
        self.relaunched(())

    def relaunched(self, sources: Collection[str]) -> None:
        """The ranks were restarted (a restart in place, a roll back, a new layout): forget
        them and their timing; keep what ``sources`` (the agents of the new launch's nodes)
        said of their CPU waits, forget every other source.

        A CPU-wait counter is the agent's, not the ranks': it grows across relaunches and a
        source's next report comes up to a heartbeat later. Forgetting it left the first
        second of the new ranks without any excuse for starvation. A source the new launch
        does not use must go: silence counts only up to the time every source has reported
        for, so one that never reports again would hide every later hang."""
        self._waits = {s: w for s, w in self._waits.items() if s in sources}
        self._ranks: dict[int, _Rank] = {}
        self._pooled: deque[float] = deque(maxlen=self.window)
        self._ratios: deque[float] = deque(maxlen=self.window)
        self._ratio_iterations = 0
        """Train iterations with a ratio in :attr:`_ratios` since the relaunch (counted once each,
        in increasing order), up to ``noise_iterations``."""
        self._last_ratio_iteration = -1
        self._max_ratio: float | None = None
        """``max(self._ratios)``, None when stale: a check reads it for every job several
        times a second, a new ratio comes once an iteration (at 200 jobs, the max over
        the window on every check was 9 % of unicornd's CPU in the scale bench)."""
        self._phase_durations: dict[IterationPhase, deque[float]] = {}
        self._phase_iterations: dict[IterationPhase, deque[int]] = {}
        self._center: float | None = None
        self._dirty = False

    # --- input ------------------------------------------------------------------------

    def register(self, rank: int, now_s: float) -> None:
        """Expect reports from ``rank`` from ``now_s`` on (so a rank that never reports is caught)."""
        _check_clock(now_s, self._clock)
        if rank < 0:
            raise InvalidArgument(f"rank must be >= 0, got {rank}")
        self._clock = now_s
        self._ranks.setdefault(rank, self._new_rank(-1, now_s))

    def observe(
        self,
        rank: int,
        iteration: int,
        duration_s: float,
        phase: IterationPhase | str = IterationPhase.TRAIN,
        *,
        now_s: float,
    ) -> None:
        """``rank`` finished ``iteration`` (of kind ``phase``) in ``duration_s``, reported at ``now_s``.

        Bad input raises ``InvalidArgument`` and changes nothing.
        """
        _check_clock(now_s, self._clock)
        if rank < 0 or iteration < 0:
            raise InvalidArgument(f"rank and iteration must be >= 0, got rank {rank}, iteration {iteration}")
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise InvalidArgument(f"duration_s must be a finite number >= 0, got {duration_s}")
        try:
            phase = IterationPhase(phase)
        except ValueError:
            raise InvalidArgument(f"unknown phase {phase!r}") from None
        self._clock = now_s
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = self._new_rank(iteration, now_s)
        elif iteration < state.last_iteration:
            state.train_count = 0  # restarted from a checkpoint: warm up again
            # ... and the iterations it repeats count towards the noise learned again
            self._last_ratio_iteration = min(self._last_ratio_iteration, iteration - 1)
        state.last_iteration = iteration
        state.last_seen_s = now_s
        if state.announced is not None and iteration >= state.announced[0]:
            state.announced = None
        if phase is not IterationPhase.TRAIN:
            self._phase_durations.setdefault(phase, deque(maxlen=self.window)).append(duration_s)
            seen = self._phase_iterations.setdefault(phase, deque(maxlen=2))
            if not seen or seen[-1] != iteration:
                seen.append(iteration)
            return
        state.train_count += 1
        if state.train_count <= self.warmup_iterations:
            return
        center = self.mean_s()
        if center is not None and center > 0:
            self._ratios.append(duration_s / center)
            self._max_ratio = None
            if iteration > self._last_ratio_iteration and self._ratio_iterations < self.noise_iterations:
                self._last_ratio_iteration = iteration
                self._ratio_iterations += 1
        self._pooled.append(duration_s)
        state.durations.append(duration_s)
        self._dirty = True

    def expect_slow_step(
        self,
        phase: IterationPhase | str,
        now_s: float,
        *,
        iteration: int | None = None,
        rank: int | None = None,
    ) -> None:
        """Iteration ``iteration`` (None: each rank's next one) of ``rank`` (None: of every
        known rank) is a ``phase`` step (checkpoint, eval).

        While a rank works on that iteration it is allowed that phase's learned time
        instead of the train deadline. Announce before the step starts, e.g. when a
        checkpoint is commanded or the trainer says it will save after this iteration.
        """
        _check_clock(now_s, self._clock)
        try:
            phase = IterationPhase(phase)
        except ValueError:
            raise InvalidArgument(f"unknown phase {phase!r}") from None
        if phase is IterationPhase.TRAIN:
            raise InvalidArgument("a train step is not a slow step")
        if rank is not None and rank not in self._ranks:
            raise InvalidArgument(f"unknown rank {rank}")
        if iteration is not None and iteration < 0:
            raise InvalidArgument(f"iteration must be >= 0, got {iteration}")
        self._clock = now_s
        for r, state in self._ranks.items():
            if iteration is None:
                if rank is None or r == rank:
                    state.announced = (state.last_iteration + 1, phase)
            elif state.last_iteration < iteration and (
                state.announced is None or iteration <= state.announced[0]
            ):  # lock-step: the others wait for it in a collective; an earlier notice stands
                state.announced = (iteration, phase)

    def observe_cpu_wait(self, source: str, wait_s: float, now_s: float) -> None:
        """By ``now_s``, ``source``'s most-starved rank had waited ``wait_s`` seconds in all for
        a CPU (module doc). The counter only grows; a smaller one (the agent restarted)
        starts the source afresh. Bad input raises ``InvalidArgument`` and changes nothing."""
        _check_clock(now_s, self._clock)
        if not (math.isfinite(wait_s) and wait_s >= 0):
            raise InvalidArgument(f"wait_s must be a finite number >= 0, got {wait_s}")
        self._clock = now_s
        samples = self._waits.get(source)
        if samples is None or (samples and wait_s < samples.last()[1]):
            samples = self._waits[source] = CounterSeries(CPU_WAIT_SAMPLES)
        samples.append(now_s, wait_s)

    def forget_source(self, source: str) -> None:
        """Stop waiting for ``source``'s CPU-wait reports (its agent was stopped on purpose)."""
        self._waits.pop(source, None)

    def _starved(self, since_s: float) -> tuple[float, float] | None:
        """(until, excused): the time up to which every source has reported, and the most
        CPU wait any source accumulated from ``since_s`` to then; None without sources."""
        if not self._waits:
            return None
        until = min(samples.last()[0] for samples in self._waits.values())
        if until <= since_s:
            return until, 0.0
        return until, max(s.at(until) - s.at(since_s) for s in self._waits.values())

    def silent_s(self, now_s: float) -> float:
        """The longest time any rank has gone without a report at ``now_s`` (0 without ranks):
        a caller samples CPU waits more often once it nears the deadline."""
        return max((now_s - state.last_seen_s for state in self._ranks.values()), default=0.0)

    def _new_rank(self, iteration: int, now_s: float) -> _Rank:
        return _Rank(last_iteration=iteration, last_seen_s=now_s, durations=Samples(self.window))

    def forget(self, rank: int) -> None:
        """Stop watching ``rank`` (its process ended on purpose)."""
        self._ranks.pop(rank, None)

    # --- statistics -------------------------------------------------------------------

    def mean_s(self) -> float | None:
        """Robust mean iteration time (median of the window); None before ``min_samples``."""
        if self._dirty:
            self._center = statistics.median(self._pooled) if len(self._pooled) >= self.min_samples else None
            self._dirty = False
        return self._center

    def effective_hang_factor(self) -> float:
        """``k``: ``hang_factor``, raised towards ``max_hang_factor`` by the noise seen;
        ``max_hang_factor`` until ``noise_iterations`` iterations' ratios are in (module doc)."""
        if self.max_hang_factor <= self.hang_factor:
            return self.hang_factor
        if self._ratio_iterations < self.noise_iterations:
            return self.max_hang_factor
        if self._max_ratio is None:
            self._max_ratio = max(self._ratios, default=0.0)  # none yet: no noise seen
        return min(self.max_hang_factor, max(self.hang_factor, self.learn_margin * self._max_ratio))

    def deadline_s(self) -> float | None:
        """Silence allowed after a train step: ``k`` x mean (``initial_deadline_s`` before learning)."""
        center = self.mean_s()
        if center is None:
            return self.initial_deadline_s
        return self.effective_hang_factor() * center

    def stats(self) -> IterationStats:
        center = self.mean_s()
        spread = None
        if center is not None:
            spread = MAD_TO_SIGMA * statistics.median(abs(d - center) for d in self._pooled)
        return IterationStats(
            len(self._pooled), center, spread, self.effective_hang_factor(), self.deadline_s()
        )

    def _slow_phase(self, state: _Rank) -> IterationPhase | None:
        """The phase of the step ``state``'s rank is working on, when it is a slow one."""
        if state.announced is not None and state.announced[0] == state.last_iteration + 1:
            return state.announced[1]
        for phase, seen in self._phase_iterations.items():
            if len(seen) == 2 and seen[1] > seen[0] and state.last_iteration + 1 == 2 * seen[1] - seen[0]:
                return phase
        return None

    def _limit(self, state: _Rank, base: float | None) -> float | None:
        phase = self._slow_phase(state)
        if phase is None:
            return base
        durations = self._phase_durations.get(phase)
        if durations and base is not None:
            return max(base, self.effective_hang_factor() * statistics.median(durations))
        # Announced, and its duration or the train mean not learned yet. Before the train
        # mean, the first save's own time was the yardstick: a notice outlives the save's
        # report (it names the next iteration), so the train step after the first save of a
        # relaunch was allowed 2 x that save (found by reading the code behind CI's second
        # incident after a shrink; a save of a small model takes milliseconds). A learned
        # phase time above the timeout still counts (a long save is no hang).
        if durations and self.slow_step_timeout_s is not None:
            return max(self.slow_step_timeout_s, self.effective_hang_factor() * statistics.median(durations))
        return self.slow_step_timeout_s

    # --- decisions --------------------------------------------------------------------

    def check(self, now_s: float, heard_until_s: float | None = None) -> HangVerdict | None:
        """A verdict while some rank is silent past its deadline, else None (level-triggered).

        ``heard_until_s``: every report sent before it has been observed (the reader had
        read its streams to the end). Silence is measured up to it when it is earlier than
        ``now_s``: reports the reader has not read yet (it fell behind, or its process
        paused) are no silence of the ranks. None: up to ``now_s``.
        """
        _check_clock(now_s, self._clock)
        self._clock = now_s
        until_s = now_s if heard_until_s is None else min(now_s, heard_until_s)
        base = self.deadline_s()
        stalled: list[tuple[int, _Rank, float, float, float]] = []
        for rank, state in self._ranks.items():
            limit = self._limit(state, base)
            if limit is None:
                continue
            wait = until_s - state.last_seen_s
            if wait <= limit:
                # The silence never exceeds the wait (every source's samples are at or
                # before now_s, and at most the wait is excused): no need to weigh CPU
                # waits, which costs ranks x sources per check (most ranks, most checks).
                continue
            silence, starved = wait, 0.0
            evidence = self._starved(state.last_seen_s)
            if evidence is not None:
                until, starved = evidence
                silence = max(until - state.last_seen_s - starved, (1 - self.max_excused) * wait)
            if silence > limit:
                stalled.append((rank, state, wait, limit, starved))
        if not stalled:
            return None
        lowest = min(s[1].last_iteration for s in stalled)
        suspects = [s for s in stalled if s[1].last_iteration == lowest]
        longest = max(suspects, key=lambda s: s[2])
        return HangVerdict(
            ranks=tuple(sorted(s[0] for s in suspects)),
            stalled_ranks=tuple(sorted(s[0] for s in stalled)),
            last_iteration=lowest,
            waited_s=longest[2],
            deadline_s=longest[3],
            mean_iteration_s=self.mean_s(),
            starved_s=longest[4],
        )

    def straggler_scores(
        self, reference: StragglerReference | str = StragglerReference.BEST_RANK
    ) -> dict[int, float]:
        """Per rank, in [0, 1] (1 = not straggling), for ranks with ``min_samples`` train steps.

        ``best_rank``: the best rank's recent median / this rank's recent median.
        ``own_history``: this rank's median over the window / its recent median (capped at 1).
        "Recent" is the last ``recent`` train steps.
        """
        reference = StragglerReference(reference)
        recent: dict[int, float] = {}
        history: dict[int, float] = {}
        for rank, state in self._ranks.items():
            if len(state.durations) >= self.min_samples:
                tail = state.durations.last(self.recent)
                recent[rank] = statistics.median(tail)
                history[rank] = statistics.median(state.durations)
        if reference is StragglerReference.BEST_RANK:
            best = min(recent.values(), default=0.0)
            return {r: _ratio(best, value) for r, value in sorted(recent.items())}
        return {r: _ratio(history[r], value) for r, value in sorted(recent.items())}

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._ranks))

    def __repr__(self) -> str:
        return f"IterationMonitor(ranks={len(self._ranks)}, stats={self.stats()})"


def _ratio(good: float, value: float) -> float:
    """``good / value`` clamped to [0, 1]; a zero time is never a straggler."""
    if value <= 0:
        return 1.0
    return max(0.0, min(1.0, good / value))
