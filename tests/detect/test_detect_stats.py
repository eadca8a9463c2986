"""IterationMonitor on replayed synthetic traces: no false alarms under noise, fast stop detection."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detect.stats import CounterSeries, HangVerdict, IterationMonitor, Samples, StragglerReference
from detect.statuses import ErrorStatus, Severity
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import IterationPhase

CHECK_PERIOD_S = 0.05
"""How often the replay calls check(): the detection delay is measured to this resolution."""


@dataclass
class Trace:
    """Lock-step data-parallel training, as a time-ordered list of reports.

    Every rank finishes iteration i at the same moment (the all-reduce) plus a small
    per-rank reporting jitter. Noise: log-normal iteration times, bursts of CPU
    contention that slow several iterations, slow warm-up iterations, and checkpoint
    steps that take many iteration times.
    """

    seed: int
    ranks: int = 8
    iterations: int = 600
    mean_s: float = 1.0
    sigma: float = 0.05
    warmup_s: float = 6.0
    spike_probability: float = 0.03
    spike_factor: tuple[float, float] = (1.2, 1.7)
    checkpoints: dict[int, float] = field(default_factory=lambda: {300: 15.0})
    """iteration -> its duration (announced before it starts)."""
    stop_rank: int | None = None
    stop_at_s: float | None = None
    """SIGSTOP ``stop_rank`` at this time: it never reports again, and (lock-step) neither
    does any other rank after the iteration in flight."""

    def events(self) -> list[tuple[float, int, int, str, float, int]]:
        """(time, order, rank, kind, duration, iteration); kind is 'report' or 'announce'."""
        rng = random.Random(self.seed)
        out: list[tuple[float, int, int, str, float, int]] = []
        t, burst, order = 0.0, 0, 0
        for i in range(self.iterations):
            phase_duration = self.checkpoints.get(i)
            if phase_duration is not None:
                out.append((t, order, -1, "announce", 0.0, i))
                order += 1
                duration = phase_duration
            elif i < 2:
                duration = self.warmup_s
            else:
                if burst == 0 and rng.random() < self.spike_probability:
                    burst = rng.randint(1, 5)
                factor = rng.uniform(*self.spike_factor) if burst else 1.0
                burst = max(0, burst - 1)
                duration = self.mean_s * math.exp(rng.gauss(0, self.sigma)) * factor
            end = t + duration
            if self.stop_at_s is not None and end > self.stop_at_s:
                break  # the stopped rank never joins this iteration's all-reduce
            for rank in range(self.ranks):
                jitter = rng.uniform(0, 0.02)
                out.append((end + jitter, order, rank, "report", duration, i))
                order += 1
            t = end
        return sorted(out)

    def phase_of(self, iteration: int) -> IterationPhase:
        return IterationPhase.CHECKPOINT if iteration in self.checkpoints else IterationPhase.TRAIN


def replay(
    trace: Trace, monitor: IterationMonitor, until_s: float | None = None
) -> list[tuple[float, HangVerdict]]:
    """Feed the trace and check() every CHECK_PERIOD_S; the verdicts with their times."""
    events = trace.events()
    heapq.heapify(events)
    end = until_s if until_s is not None else (max(e[0] for e in events) if events else 0.0)
    verdicts = []
    now = 0.0
    while now <= end:
        while events and events[0][0] <= now:
            time_s, _, rank, kind, duration, iteration = heapq.heappop(events)
            if kind == "announce":
                if monitor.ranks:
                    monitor.expect_slow_step(IterationPhase.CHECKPOINT, time_s, iteration=iteration)
            else:
                monitor.observe(rank, iteration, duration, trace.phase_of(iteration), now_s=time_s)
        verdict = monitor.check(now)
        if verdict is not None:
            verdicts.append((now, verdict))
        now = round(now + CHECK_PERIOD_S, 6)
    return verdicts


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_at_k2_under_noise(seed: int) -> None:
    """600 iterations (~10 min at 1 s) with contention bursts up to 1.7x, warm-up and a
    15 s checkpoint step: k = 2 raises nothing."""
    trace = Trace(seed=seed)
    monitor = IterationMonitor(hang_factor=2.0, warmup_iterations=2, min_samples=5)
    verdicts = replay(trace, monitor)
    assert verdicts == []
    stats = monitor.stats()
    assert stats.mean_s is not None and abs(stats.mean_s - trace.mean_s) < 0.05
    assert stats.samples == monitor.window  # the window is full: learning happened


@pytest.mark.parametrize("seed", [11, 12, 13, 14, 15])
def test_stop_detected_within_2x_mean_iteration(seed: int) -> None:
    rng = random.Random(seed)
    stop_at = rng.uniform(120.0, 400.0)
    trace = Trace(seed=seed, stop_rank=3, stop_at_s=stop_at, checkpoints={})
    monitor = IterationMonitor(hang_factor=2.0, warmup_iterations=2, min_samples=5)
    verdicts = replay(trace, monitor, until_s=stop_at + 10.0)
    assert verdicts, "the stop was never detected"
    first_time, first = verdicts[0]
    mean = first.mean_iteration_s
    assert mean is not None
    delay_over_iter = (first_time - stop_at) / mean
    assert 0 < delay_over_iter <= 2.0 + CHECK_PERIOD_S / mean
    # lock-step: every rank stalls at the same iteration; within the reporting jitter
    # (20 ms) after the first verdict, all are named
    assert first.ranks and first.stalled_ranks == first.ranks
    later = next(v for t, v in verdicts if t >= first_time + 0.02)
    assert later.ranks == tuple(range(8)) and later.last_iteration == first.last_iteration
    assert first.deadline_s == pytest.approx(2.0 * mean)
    cls = first.classification()
    assert (cls.status, cls.severity, cls.rule, cls.secondary) == (
        ErrorStatus.TASK_HANG,
        Severity.SEV2,
        "iteration_stall",
        True,
    )
    assert "rank(s) 0, 1, 2, 3, 4, 5, 6, 7 " in later.classification().evidence


def test_lagging_rank_is_named_alone() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = 0.0
    for i in range(10):
        t += 1.0
        for rank in range(4):
            if not (rank == 2 and i >= 8):
                m.observe(rank, i, 1.0, now_s=t)
    assert m.check(t) is None  # rank 2 silent for 2 s: exactly the deadline
    verdict = m.check(t + 0.5)  # rank 2 silent for 2.5 s (> 2 s); the others 0.5 s
    assert verdict is not None and verdict.ranks == (2,) and verdict.last_iteration == 7
    assert verdict.waited_s == pytest.approx(2.5)


def test_silence_counts_only_as_far_as_the_reader_has_heard() -> None:
    """Reports the reader has not read yet (it fell behind, or its process paused) are no
    silence: a rank is judged up to ``heard_until_s`` when that is earlier than the clock."""
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = 0.0
    for i in range(10):
        t += 1.0
        for rank in range(2):
            m.observe(rank, i, 1.0, now_s=t)
    assert m.check(t + 5.0, heard_until_s=t + 1.5) is None  # 1.5 s heard of silence: < 2 s
    verdict = m.check(t + 6.0, heard_until_s=t + 2.5)
    assert verdict is not None and verdict.waited_s == pytest.approx(2.5)
    assert m.check(t + 7.0, heard_until_s=t + 9.0) is not None  # a horizon past the clock: the clock
    assert m.check(t + 7.0, heard_until_s=t - 3.0) is None  # heard nothing since: no silence at all


def test_nothing_before_learning_unless_an_initial_deadline() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=2, min_samples=5)
    m.register(0, now_s=0.0)
    assert m.deadline_s() is None and m.check(1000.0) is None
    first = IterationMonitor(hang_factor=2.0, initial_deadline_s=60.0)
    first.register(0, now_s=0.0)
    first.register(1, now_s=0.0)
    first.observe(1, 0, 30.0, now_s=30.0)
    verdict = first.check(61.0)
    assert verdict is not None and verdict.ranks == (0,) and verdict.last_iteration == -1


WARMUP = [(30.0, "train"), (20.0, "train")]


def test_warmup_and_slow_phases_do_not_feed_statistics() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=2, min_samples=3)
    t = 0.0
    for i, (d, phase) in enumerate(
        [*WARMUP, (1.0, "train"), (1.0, "train"), (50.0, "checkpoint"), (9.0, "eval"), (1.0, "train")]
    ):
        t += d
        m.observe(0, i, d, phase, now_s=t)
    stats = m.stats()
    assert (stats.samples, stats.mean_s, stats.spread_s) == (3, 1.0, 0.0)


def test_restart_from_checkpoint_warms_up_again() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=1, min_samples=2)
    for i in range(5):
        m.observe(0, 100 + i, 1.0, now_s=float(i + 1))
    m.observe(0, 90, 40.0, now_s=50.0)  # iteration went back: a relaunch; its first step is warm-up
    assert m.mean_s() == 1.0


def _steady(m: IterationMonitor, iterations: range, t: float) -> float:
    for i in iterations:
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
    return t


def test_unlearned_announced_checkpoint_gets_slow_step_timeout() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3, slow_step_timeout_s=100.0)
    t = _steady(m, range(5), 0.0)
    m.expect_slow_step("checkpoint", t, iteration=5)
    assert m.check(t + 90.0) is None
    stalled = m.check(t + 101.0)
    assert stalled is not None and stalled.deadline_s == 100.0


def test_learned_checkpoint_time_bounds_the_next_one() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = _steady(m, range(5), 0.0)
    m.expect_slow_step("checkpoint", t, iteration=5)
    assert m.check(t + 1000.0) is None  # not learned and no slow_step_timeout_s: no limit
    t += 1000.0
    m.observe(0, 5, 10.0, "checkpoint", now_s=t)  # learned: checkpoints take 10 s
    t = _steady(m, range(6, 9), t)
    m.expect_slow_step("checkpoint", t)  # each rank's next iteration (9)
    assert m.check(t + 19.0) is None
    hung = m.check(t + 21.0)
    assert hung is not None and hung.deadline_s == pytest.approx(20.0)
    m.observe(0, 9, 10.0, "checkpoint", now_s=t + 22.0)
    assert m.check(t + 23.0) is None
    assert m.check(t + 24.5) is not None  # back to the train deadline (2 s)


def test_the_train_step_after_the_first_save_of_a_launch_is_not_judged_by_that_save() -> None:
    """A relaunched task saves before its train mean is learned. The trainer's notice names
    the next iteration, so it outlives the save's report: the train step after the save
    was allowed 2 x the save's time (here 0.02 s), a false stall of a healthy rank on the
    first CPU-wait sample after it. Until the train mean is learned, it is allowed what an
    unlearned slow step is (``slow_step_timeout_s``)."""
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=2, min_samples=5, slow_step_timeout_s=600.0)
    t = 0.0
    for i in range(11, 16):  # resumed at 10: 2 warm-up steps, 3 pooled (< min_samples)
        t += 0.2
        m.observe(0, i, 0.2, now_s=t)
    assert m.mean_s() is None
    m.expect_slow_step("checkpoint", t, iteration=16, rank=0)  # the hook: "my next report is slow"
    t += 0.01
    m.observe(0, 15, 0.01, "checkpoint", now_s=t)  # the save's report: iteration 15 again
    m.observe_cpu_wait("n1", 0.0, t)
    m.observe_cpu_wait("n1", 0.0, t + 0.3)  # a heartbeat 0.3 s into step 16: no CPU wait
    assert m.check(t + 0.3) is None  # was: "reported no iteration for 0.3 s, allowed 0.02 s"
    m.observe_cpu_wait("n1", 0.0, t + 601.0)
    stuck = m.check(t + 601.0)
    assert stuck is not None and stuck.deadline_s == 600.0  # a save that never ends is still caught


def test_before_the_train_mean_a_learned_save_longer_than_the_timeout_still_counts() -> None:
    """The unlearned-step timeout is a floor, not a cap: a save learned at 5 s is allowed
    k x 5 s even with a 1 s timeout (review of the change above)."""
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=50, slow_step_timeout_s=1.0)
    t = 0.0
    for i in range(1, 4):
        t += 0.2
        m.observe(0, i, 0.2, now_s=t)
    m.expect_slow_step("checkpoint", t, iteration=4, rank=0)
    t += 5.0
    m.observe(0, 4, 5.0, "checkpoint", now_s=t)  # one save learned: 5 s
    m.expect_slow_step("checkpoint", t, iteration=5, rank=0)
    m.observe_cpu_wait("n1", 0.0, t)
    m.observe_cpu_wait("n1", 0.0, t + 8.0)
    assert m.check(t + 8.0) is None  # 8 s of a save allowed 2 x 5 s
    m.observe_cpu_wait("n1", 0.0, t + 10.5)
    stuck = m.check(t + 10.5)
    assert stuck is not None and stuck.deadline_s == 10.0


def test_periodic_checkpoints_are_predicted_without_announcement() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = 0.0
    for i in range(1, 301):
        slow = i % 100 == 0
        d = 12.0 if slow else 1.0
        if slow and i == 300:
            # the third checkpoint is due; nobody announced it
            assert m.check(t + 20.0) is None
            assert m.check(t + 24.5) is not None  # 2 x the learned 12 s
            return
        t += d
        m.observe(0, i, d, "checkpoint" if slow else "train", now_s=t)


def test_learned_hang_factor_follows_noise_within_bounds() -> None:
    fixed = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    learned = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3, max_hang_factor=3.0)
    t = 0.0
    for i, d in enumerate([1.0] * 40 + [2.0] + [1.0] * 5):
        t += d
        fixed.observe(0, i, d, now_s=t)
        learned.observe(0, i, d, now_s=t)
    assert fixed.effective_hang_factor() == 2.0
    assert learned.effective_hang_factor() == pytest.approx(2.5)  # 1.25 x the 2x spike
    assert learned.deadline_s() == pytest.approx(2.5)
    t += 4.0
    learned.observe(0, 99, 4.0, now_s=t)
    assert learned.effective_hang_factor() == 3.0  # capped


def test_until_the_noise_is_learned_the_factor_is_the_most_lenient() -> None:
    """A few steady steps say little about the next one: ``k`` is ``max_hang_factor`` until
    ``noise_iterations`` iterations' ratios are in, also after a relaunch, which forgets
    them; ranks reporting the same iteration count once."""
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3, max_hang_factor=4.0)
    t, i = 0.0, 0
    for _ in range(1 + 15):  # iterations 0 and 1 learn the mean (3 samples), 1..15 add ratios
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
        m.observe(1, i, 1.0, now_s=t)
        i += 1
    assert m.effective_hang_factor() == 4.0
    assert m.check(t + 3.9) is None  # 2 x mean would have called this a hang
    assert m.check(t + 4.1) is not None
    t += 4.2
    m.observe(0, i, 1.0, now_s=t)  # the 16th iteration: from here k is learned (1.25 x 1.0, at least 2)
    m.observe(1, i, 1.0, now_s=t)
    assert m.effective_hang_factor() == 2.0
    m.relaunched(())
    for j in range(10):
        t += 1.0
        m.observe(0, j, 1.0, now_s=t)
    assert m.effective_hang_factor() == 4.0


def test_iterations_repeated_after_going_back_count_towards_the_noise() -> None:
    """Ranks that went back (a restart from a checkpoint the monitor was not told of) warm
    up again; the iterations they repeat count towards the noise learned, so the lenient
    start does not last until the old maximum is passed (found in review)."""
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3, max_hang_factor=4.0)
    t = 0.0
    for i in range(3 + 10):  # 3 learn the mean, 10 iterations' ratios
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
    for i in range(5, 11):  # back to 5: 6 more, 16 in all
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
    assert m.effective_hang_factor() == 2.0


def test_a_relaunch_keeps_the_agents_cpu_waits() -> None:
    """The new ranks' silence counts only as far as every agent has said how long they
    waited for a CPU, as before the relaunch: the agent's counter outlives the ranks, and
    its next report may be a heartbeat away. A source the new launch does not use is
    forgotten (it never reports again, and would hide every later hang); a reset forgets
    them all."""

    def run(forget: str) -> tuple[bool, bool]:
        m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3, noise_iterations=0)
        m.observe_cpu_wait("n1", 0.0, 0.0)
        m.observe_cpu_wait("n3", 0.0, 0.0)  # a node the new launch does not use: forgotten
        if forget == "relaunched":
            m.relaunched(["n1", "n2"])
        else:
            m.reset()
        t = 0.0
        for i in range(5):
            t += 1.0
            m.observe(0, i, 1.0, now_s=t)
        before_the_beat = m.check(t + 3.0) is None  # n1 has not reported since the last step
        m.observe_cpu_wait("n1", 0.0, t + 3.5)  # it has now: not starved at all
        return before_the_beat, m.check(t + 3.5) is None

    assert run("relaunched") == (True, False)
    assert run("reset") == (False, False)


def test_straggler_scores() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=5, recent=5)
    t = 0.0
    for i in range(20):
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
        m.observe(1, i, 1.0 if i < 15 else 2.0, now_s=t)  # rank 1 slowed down lately
        m.observe(2, i, 1.25, now_s=t)  # rank 2 always a bit slower
    best = m.straggler_scores()
    assert best == {0: 1.0, 1: 0.5, 2: 0.8}
    own = m.straggler_scores(StragglerReference.OWN_HISTORY)
    assert own == {0: 1.0, 1: 0.5, 2: 1.0}
    assert all(0.0 <= v <= 1.0 for v in best.values())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=1, max_size=40))
def test_straggler_scores_are_ratios_in_0_1(durations: list[float]) -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=1)
    t = 0.0
    for i, d in enumerate(durations):
        t += 1.0
        m.observe(i % 3, i, d, now_s=t)
    for reference in StragglerReference:
        scores = m.straggler_scores(reference)
        assert scores and all(0.0 <= v <= 1.0 for v in scores.values())


def test_bad_input_is_rejected_and_changes_nothing() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=1)
    m.observe(0, 0, 1.0, now_s=10.0)
    for bad in (
        lambda: m.observe(0, 1, -1.0, now_s=11.0),
        lambda: m.observe(0, 1, math.nan, now_s=11.0),
        lambda: m.observe(-1, 1, 1.0, now_s=11.0),
        lambda: m.observe(0, 1, 1.0, "warp", now_s=11.0),
        lambda: m.observe(0, 1, 1.0, now_s=9.0),  # the clock went back
        lambda: m.check(5.0),
        lambda: m.expect_slow_step("train", 11.0),
        lambda: m.expect_slow_step("checkpoint", 11.0, rank=7),
    ):
        with pytest.raises(InvalidArgument):
            bad()
    assert m.stats().samples == 1 and m.ranks == (0,)
    m.observe(0, 1, 1.0, now_s=10.5)  # the clock still reads 10.0 as its last value


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hang_factor": 1.0},
        {"warmup_iterations": -1},
        {"min_samples": 0},
        {"window": 2, "min_samples": 5},
        {"max_hang_factor": 1.5, "hang_factor": 2.0},
        {"learn_margin": 0.5},
        {"initial_deadline_s": 0.0},
        {"slow_step_timeout_s": -3.0},
    ],
)
def test_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        IterationMonitor(**kwargs)  # type: ignore[arg-type]


def test_forget_and_reset() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=1)
    m.observe(0, 0, 1.0, now_s=1.0)
    m.observe(1, 0, 1.0, now_s=1.0)
    m.forget(1)
    assert m.ranks == (0,)
    m.reset()
    assert m.ranks == () and m.mean_s() is None


def test_a_slow_step_announced_by_one_rank_covers_every_rank_at_that_iteration() -> None:
    """Lock-step: the ranks that did not announce the checkpoint wait for it in a collective
    (seen in scripts/bench/detection.py: one rank's SIGUSR1 came after its announcement point)."""
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = 0.0
    for i in range(5):
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
        m.observe(1, i, 1.0, now_s=t)
    m.observe(1, 4, 10.0, "checkpoint", now_s=t)  # checkpoints take 10 s
    m.observe(0, 5, 1.0, now_s=t + 1.0)  # rank 0 is one iteration ahead
    m.expect_slow_step("checkpoint", t + 1.0, iteration=6, rank=0)
    assert m.check(t + 1.5) is None
    m.observe(1, 5, 1.0, now_s=t + 2.0)  # rank 1 announced nothing for 6
    assert m.check(t + 21.0) is None  # both wait in iteration 6: 2 x the learned 10 s
    late = m.check(t + 23.0)
    assert late is not None and late.ranks == (0, 1) and late.deadline_s == pytest.approx(20.0)


def _lock_step(m: IterationMonitor, iterations: range, t: float, wait: float = 0.0) -> float:
    """Ranks 0 and 1 report each 1 s iteration; node "n1" reports its CPU wait ``wait`` after each."""
    for i in iterations:
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
        m.observe(1, i, 1.0, now_s=t)
        m.observe_cpu_wait("n1", wait, t)
    return t


def test_cpu_starvation_is_excused_and_a_stop_is_not() -> None:
    """Replays what the detection bench saw: a silence of ~3 mean iterations, most of it
    spent runnable but off the CPU, is no hang; the same silence without that wait is."""
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = _lock_step(m, range(10), 0.0, wait=5.0)
    m.observe_cpu_wait("n1", 5.5, t + 1.0)
    m.observe_cpu_wait("n1", 6.5, t + 2.0)
    m.observe_cpu_wait("n1", 7.0, t + 3.0)
    assert m.check(t + 3.0) is None  # silent 3 s, 2 s of it waiting for a CPU: 1 s of work
    assert m.silent_s(t + 3.0) == 3.0
    m.observe_cpu_wait("n1", 7.0, t + 4.5)  # the wait stopped growing: a stop
    hung = m.check(t + 4.5)
    assert hung is not None and hung.ranks == (0, 1) and hung.waited_s == 4.5 and hung.starved_s == 2.0
    assert "(2 s of it waiting for a CPU)" in hung.classification().evidence


def test_silence_counts_only_as_far_as_every_source_has_reported() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = _lock_step(m, range(10), 0.0)
    m.observe_cpu_wait("n2", 0.0, t)
    m.observe_cpu_wait("n1", 0.0, t + 5.0)
    assert m.check(t + 5.0) is None  # n2 said nothing since t: its ranks may have been starved
    m.observe_cpu_wait("n2", 2.5, t + 5.0)  # n2's rank waited 2.5 s: 2.5 s of work, > 2 s
    hung = m.check(t + 5.0)
    assert hung is not None and hung.starved_s == 2.5


def test_a_rank_starved_without_end_is_caught_after_max_excused() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3, max_excused=0.75)
    t = _lock_step(m, range(10), 0.0)
    for second in range(1, 9):
        m.observe_cpu_wait("n1", float(second), t + second)  # waiting all the time
        assert m.check(t + second) is None
    m.observe_cpu_wait("n1", 9.0, t + 9.0)
    hung = m.check(t + 9.0)  # 1/4 of 9 s is more than the 2 s deadline
    assert hung is not None and hung.starved_s == 9.0


def test_a_source_that_restarts_or_is_forgotten_starts_afresh() -> None:
    m = IterationMonitor(hang_factor=2.0, warmup_iterations=0, min_samples=3)
    t = _lock_step(m, range(10), 0.0, wait=50.0)
    m.observe_cpu_wait("n1", 0.5, t + 1.0)  # a new agent process: its counter starts at 0
    m.observe_cpu_wait("n1", 2.5, t + 3.0)  # so its ranks waited 2 s since t + 1
    assert m.check(t + 3.0) is None  # 3 s silent; the wait since t + 1 s is 2 s: 1 s of work
    m.forget_source("n1")  # its agent stopped: silence counts on the clock alone
    assert m.check(t + 3.0) is not None
    with pytest.raises(InvalidArgument):
        m.observe_cpu_wait("n1", math.inf, t + 3.0)
    with pytest.raises(InvalidArgument):
        m.observe_cpu_wait("n1", 1.0, t + 2.0)  # the clock went back


@given(st.integers(1, 9), st.lists(st.floats(allow_nan=False), max_size=40), st.integers(0, 12))
def test_samples_keep_the_newest_like_a_bounded_deque(capacity: int, values: list[float], n: int) -> None:
    ring, reference = Samples(capacity), deque[float](maxlen=capacity)
    for v in values:
        ring.append(v)
        reference.append(v)
        assert list(ring) == list(reference) and len(ring) == len(reference)
    assert ring.last(n) == (list(reference)[-n:] if n else [])


def test_samples_need_room_for_one() -> None:
    with pytest.raises(InvalidArgument, match="capacity"):
        Samples(0)


def _interpolated(samples: list[tuple[float, float]], t: float) -> float:
    """The reference: a counter's value at ``t`` from (time, value) samples, oldest first."""
    if t < samples[0][0]:
        return samples[0][1]
    for (t0, v0), (t1, v1) in itertools.pairwise(samples):
        if t0 <= t < t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return samples[-1][1]


@given(
    st.integers(1, 9),
    # (time step, counter step): equal times, and times a query lands on exactly, come up often
    st.lists(
        st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.5]) | st.floats(0.0, 5.0), st.floats(0.0, 3.0)),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([-1.0, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0]) | st.floats(-2.0, 250.0),
)
def test_a_counter_series_keeps_the_newest_samples_and_interpolates_between_them(
    capacity: int, steps: list[tuple[float, float]], t: float
) -> None:
    series, reference = CounterSeries(capacity), deque[tuple[float, float]](maxlen=capacity)
    now, value = 0.0, 0.0
    for dt, dv in steps:
        now, value = now + dt, value + dv
        series.append(now, value)
        reference.append((now, value))
        assert len(series) == len(reference) and series.last() == reference[-1]
    assert series.at(t) == pytest.approx(_interpolated(list(reference), t))


def test_a_counter_series_needs_room_for_one() -> None:
    with pytest.raises(InvalidArgument, match="capacity"):
        CounterSeries(0)


def test_without_a_lenient_start_the_factor_is_the_base_one_before_any_ratio() -> None:
    """``noise_iterations=0`` (the node agent's monitor) with ``max_hang_factor`` above
    ``hang_factor``: once the mean is learned and before any iteration's ratio is in, ``k``
    is ``hang_factor``. It raised ``ValueError`` (the max of no ratios), which ended the
    agent's hang task in every run and with it its stopped-rank reports (session 26)."""
    m = IterationMonitor(
        hang_factor=2.0, warmup_iterations=0, min_samples=3, max_hang_factor=4.0, noise_iterations=0
    )
    t = 0.0
    for i in range(3):  # the third sample learns the mean; no ratio yet
        t += 1.0
        m.observe(0, i, 1.0, now_s=t)
    assert m.effective_hang_factor() == 2.0
    assert m.deadline_s() == pytest.approx(2.0)
    assert m.check(t + 1.9) is None
    verdict = m.check(t + 2.1)
    assert verdict is not None and verdict.ranks == (0,)
