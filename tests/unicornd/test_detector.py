"""unicornd's detector on agent messages that race a restart."""

from __future__ import annotations

from detect.classify import load_classifier
from unicorn_core.config import AgentConfig, DetectConfig
from unicorn_core.protocol import IterationPhase, IterationTiming, SlowStep
from unicornd.detector import Detector


def timing(rank: int, iteration: int, node: str = "n1") -> IterationTiming:
    return IterationTiming(
        job_id=4, node=node, wall_time_s=1.0, rank=rank, iteration=iteration, duration_s=0.1, samples=12
    )


def slow(rank: int, iteration: int) -> SlowStep:
    return SlowStep(
        job_id=4, node="n1", wall_time_s=1.0, rank=rank, iteration=iteration, phase=IterationPhase.CHECKPOINT
    )


def test_a_slow_step_announced_by_a_rank_the_restart_forgot_is_ignored() -> None:
    """Seen in CI: scancel made the old ranks announce their SIGTERM save just after the
    job's restart had dropped its timing; the announcement raised and stopped unicornd."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    assert d.on_message(timing(0, 3), 10.0) == [] and d.on_message(timing(1, 3), 10.0) == []
    assert d.on_message(slow(1, 4), 10.1) == []  # a known rank: its next step may be slow
    d.restart_job(4)
    assert d.on_message(slow(1, 4), 10.2) == []  # stale: nothing to extend, no error
    assert d.on_message(timing(0, 4), 10.3) == [] and d.last_iteration(4) == 4


def test_a_hang_names_the_node_of_the_stopped_rank() -> None:
    """Not the task's first node: the rank that stopped reporting ran on n2."""
    d = Detector(DetectConfig(warmup_iterations=1), AgentConfig(), load_classifier(None))
    now = 10.0
    for it in range(1, 30):
        now += 0.1
        d.on_message(timing(0, it, "n1"), now)
        if it < 20:
            d.on_message(timing(1, it, "n2"), now)
    found = []
    while not found and now < 200:
        now += 0.5
        found = d.check(now)
    assert found and found[0].evidence.source == "hang"
    assert found[0].evidence.rank == 1 and found[0].evidence.node == "n2", found
