"""The built-in trainer's compute time per iteration (``compute_s``) and its test-only straggler
(``--slow-rank R --slow-factor F``), under real torchrun.

In lock-step data parallelism every rank's wall time per iteration is the slowest rank's;
the compute time (CPU time on CPU ranks: a rank waiting in a collective accrues none) is
what tells the straggler apart (:mod:`detect.stragglers`).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
from pathlib import Path

import pytest

from launcher.trainer.config import SlowRank, TrainConfig, resolve_layout
from tests.launcher.torchrun import run
from unicorn_core import protocol
from unicorn_core.errors import InvalidArgument
from unicorn_core.model import ModelSpec
from unicorn_core.protocol import IterationPhase, IterationTiming

COMMON = (
    "--layers=2",
    "--hidden=32",
    "--heads=4",
    "--seq=16",
    "--vocab=64",
    "--iterations=16",
    "--micro-batch=1",
    "--global-batch=4",
)


def test_a_slow_rank_must_be_in_the_world_and_its_factor_sane() -> None:
    model = ModelSpec(layers=2, hidden=32, heads=4, sequence=16, vocabulary=64, global_batch=4)
    layout = resolve_layout(
        tp=1, pp=1, dp=None, micro_batch=1, global_batch=4, world_size=2, local_world_size=2, model=model
    )
    assert TrainConfig(model, layout, 4, slowdown=SlowRank(1, 3.0)).slowdown == SlowRank(1, 3.0)
    with pytest.raises(InvalidArgument, match="outside the world of 2 ranks"):
        TrainConfig(model, layout, 4, slowdown=SlowRank(2))
    for bad in (0.5, 101.0):
        with pytest.raises(InvalidArgument, match="--slow-factor"):
            SlowRank(0, bad)
    with pytest.raises(InvalidArgument, match="--slow-rank"):
        SlowRank(-1)


def _train_reports(tmp_path: Path, *args: str) -> dict[int, list[IterationTiming]]:
    """Run 2 ranks with a hook socket read while they train (a full queue drops reports);
    returns each rank's training-step reports, in order."""
    path = tmp_path / "agent.sock"
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(path))
    agent.settimeout(0.2)
    messages: list[protocol.Message] = []
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                messages.append(protocol.decode(agent.recv(65536)))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        env = {"UNICORN_HOOK_SOCKET": str(path), "UNICORN_JOB_ID": "5", "UNICORN_NODE": "n1"}
        launch = run(2, *COMMON, *args, env=env)
        assert launch.returncode == 0, launch.output[-3000:]
    finally:
        done.set()
        reader.join(timeout=5)
        agent.close()
    out: dict[int, list[IterationTiming]] = {0: [], 1: []}
    for m in messages:
        if isinstance(m, IterationTiming) and m.phase is IterationPhase.TRAIN:
            out[m.rank].append(m)
    return out


def test_the_slow_rank_reports_a_longer_compute_time_at_the_same_wall_time(tmp_path: Path) -> None:
    """DP2, rank 1 slowed 3x: both ranks' iterations take the same wall time (lock-step), but
    rank 1's compute time is about 3x rank 0's; every report carries stage 0.

    A wider model and more iterations than the other tests: at hidden 32 an iteration
    computes ~5 ms, so a few ms of CPU the fast rank spends around its waits (gloo's
    threads, the hook) moved its median enough to fail once in CI on a loaded machine."""
    reports = _train_reports(tmp_path, "--slow-rank=1", "--slow-factor=3", "--hidden=64", "--iterations=32")
    for rank in (0, 1):
        assert len(reports[rank]) >= 24, f"rank {rank}: {len(reports[rank])} of 32 reports arrived"
        assert all(m.compute_s is not None and m.stage == 0 for m in reports[rank])
    late = {r: reports[r][8:] for r in (0, 1)}  # past the first iterations' warm-up
    compute = {r: statistics.median(m.compute_s or 0.0 for m in late[r]) for r in (0, 1)}
    wall = {r: statistics.median(m.duration_s for m in late[r]) for r in (0, 1)}
    assert compute[1] / compute[0] > 2.0, compute
    assert 0.8 < wall[1] / wall[0] < 1.25, wall
    assert compute[0] < 0.8 * wall[0], "the fast rank's compute time leaves out its wait for the slow one"


def test_pipeline_ranks_report_their_stage(tmp_path: Path) -> None:
    reports = _train_reports(tmp_path, "--pp=2")
    assert {m.stage for m in reports[0]} == {0} and {m.stage for m in reports[1]} == {1}
    assert all(m.compute_s is not None and m.compute_s > 0 for r in (0, 1) for m in reports[r])
