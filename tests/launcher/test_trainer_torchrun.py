"""``unicorn-train`` under real torchrun on CPU (gloo): relaunch at another layout, faults, SIGTERM.

Loss tolerance: relative 1e-5. Layouts compute the same float32 math in a different
order (TP splits matmul sums, DP all-reduces and pipelining accumulate gradients in
another order), which perturbs a loss of ~4.8 by ~1e-7 relative per step; over a few
Adam steps that stays far below 1e-5, while any semantic slip (a skipped or repeated
sample, a lost optimizer moment, a different learning rate) moves it by > 1e-4.
The log prints 7 significant digits, finer than the tolerance.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.torchrun import finish, run, start
from unicorn_core import protocol
from unicorn_core.protocol import ExceptionReport, IterationPhase, IterationTiming, SlowStep

REL_TOL = 1e-5
COMMON = ("--layers=4", "--hidden=32", "--heads=4", "--seq=16", "--vocab=64", "--iterations=6", "--lr=3e-3")


def read_until(proc: subprocess.Popen[str], seen: list[str], marker: str) -> None:
    """Read the launch's output into ``seen`` until a line contains ``marker``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return
    raise AssertionError(f"{marker!r} never printed:\n" + "".join(seen)[-3000:])


def assert_losses_match(resumed: dict[int, float], reference: dict[int, float]) -> None:
    assert resumed, "no loss lines"
    for it, loss in resumed.items():
        assert loss == pytest.approx(reference[it], rel=REL_TOL), f"iteration {it}: {loss} vs {reference[it]}"


def test_relaunch_tp2_pp2_to_pp2_on_two_ranks(tmp_path: Path) -> None:
    """TP2.PP2.DP1 on 4 ranks runs uninterrupted, saving at 3; TP1.PP2.DP1 on 2 ranks resumes from 3."""
    ckpt = str(tmp_path / "ckpt")
    l1 = ("--tp=2", "--pp=2", "--micro-batch=2", "--global-batch=8")
    reference = run(4, *COMMON, *l1, f"--save-dir={ckpt}", "--save-interval=3")
    assert reference.returncode == 0, reference.output[-3000:]
    assert sorted(reference.losses) == [1, 2, 3, 4, 5, 6]
    assert reference.losses[6] < reference.losses[1]  # it does learn
    resumed = run(
        2, *COMMON, "--pp=2", "--micro-batch=2", "--global-batch=8", f"--load={ckpt}", "--ckpt-step=3"
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "layout TP1.PP2.DP1" in resumed.output and "resumed_from=3" in resumed.output
    assert sorted(resumed.losses) == [4, 5, 6]
    assert_losses_match(resumed.losses, reference.losses)


def test_relaunch_dp4_to_dp3_keeps_global_batch(tmp_path: Path) -> None:
    """DP4 stops after 3 (save, exit 0); DP3 resumes from the published version.

    Global batch 12 = DP4 x 3 micro-batches = DP3 x 4 micro-batches: gradient
    accumulation adapts so each iteration is the same optimizer step.
    """
    layout = ("--micro-batch=1", "--global-batch=12")
    reference = run(4, *COMMON, *layout)
    assert reference.returncode == 0, reference.output[-3000:]
    ckpt = str(tmp_path / "ckpt")
    part1 = run(4, *COMMON, *layout, f"--save-dir={ckpt}", "--exit-at-iteration=3")
    assert part1.returncode == 0, part1.output[-3000:]
    assert sorted(part1.losses) == [1, 2, 3]
    assert (tmp_path / "ckpt" / "latest").read_text() == "3\n"
    part2 = run(3, *COMMON, *layout, f"--load={ckpt}")
    assert part2.returncode == 0, part2.output[-3000:]
    assert "layout TP1.PP1.DP3" in part2.output and "resumed_from=3" in part2.output
    assert sorted(part2.losses) == [4, 5, 6]
    assert_losses_match(part1.losses, reference.losses)
    assert_losses_match(part2.losses, reference.losses)


@pytest.mark.parametrize(
    ("world", "args", "needle"),
    [
        (2, ("--tp=2", "--heads=3", "--hidden=48"), "tp=2 does not divide the model's 3 attention heads"),
        (2, ("--dp=4",), "needs tp*pp*dp = 4 ranks, but torchrun started 2"),
        (
            2,
            ("--micro-batch=3", "--global-batch=16"),
            "dp*micro_batch = 2*3 = 6 does not divide global_batch 16",
        ),
        (4, ("--tp=4",), "tp=4 must divide gpus_per_node=2"),
    ],
)
def test_invalid_layout_exits_2_without_importing_torch(
    world: int, args: tuple[str, ...], needle: str
) -> None:
    """The CLI validates from torchrun's environment first (no torch import, no process group)."""
    env = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "2", "RANK": "0"}
    code = (
        "import sys, launcher.train as t\ntry:\n    t.main()\nfinally:\n    assert 'torch' not in sys.modules"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("unicorn-train: error: ")
    assert needle in proc.stderr


def test_invalid_layout_under_torchrun_fails_with_2() -> None:
    launch = run(2, "--tp=2", "--heads=3", "--hidden=48", timeout_s=60)
    assert launch.returncode != 0
    assert "exitcode  : 2" in launch.output  # torchrun lists the first failed rank (others if seen)
    assert "unicorn-train: error: tp=2 does not divide the model's 3 attention heads" in launch.output
    assert "lm loss" not in launch.output


def test_injected_exception_fails_the_launch_and_names_the_rank() -> None:
    launch = run(
        2, *COMMON, "--fail-at-iteration=2", "--fail-rank=1", "--fail-mode=raise", "--dist-timeout-s=20"
    )
    assert launch.returncode != 0
    assert "InjectedFault: injected fault at iteration 2 on rank 1" in launch.output
    assert sorted(launch.losses) == [1]


def test_sigterm_saves_just_in_time_and_exits_0(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = start(2, *COMMON[:-2], "--iterations=100000", "--pp=2", f"--save-dir={ckpt}", "--log-interval=1")
    seen: list[str] = []
    try:
        read_until(proc, seen, " iteration        2/")
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: the group id is still ours
        proc.communicate()
        raise
    # What an agent does: SIGTERM every training process. torchrun forwards it to its workers.
    os.kill(proc.pid, signal.SIGTERM)
    rest = finish(proc, timeout_s=60)
    output = "".join(seen) + rest.output
    saved = int((ckpt / "latest").read_text())
    assert saved >= 2
    assert f"stopping after iteration {saved} (SIGTERM)" in output
    assert "exitcode" not in output or "exitcode  : 0" in output
    # The worker exit codes are 0; resuming continues right after the saved iteration.
    resumed = run(2, *COMMON[:-2], f"--iterations={saved + 1}", "--pp=2", f"--load={ckpt}")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert sorted(resumed.losses) == [saved + 1]


def test_sigusr1_to_one_rank_saves_on_every_rank_and_training_goes_on(tmp_path: Path) -> None:
    from launcher.supervisor import descendants, read_environ

    ckpt = tmp_path / "ckpt"
    proc = start(2, *COMMON[:-2], "--iterations=100000", "--pp=2", f"--save-dir={ckpt}", "--log-interval=1")
    seen: list[str] = []
    try:
        read_until(proc, seen, " iteration        2/")
        rank1 = next(p for p in descendants(proc.pid) if read_environ(p, ["RANK"]).get("RANK") == "1")
        os.kill(rank1, signal.SIGUSR1)  # what the agent does for checkpoint_now
        read_until(proc, seen, "on request (SIGUSR1)")
        saved = int((ckpt / "latest").read_text())
        read_until(proc, seen, f" iteration {saved + 2:8d}/")  # still training after the save
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        finish(proc, timeout_s=60)
    assert saved >= 2 and any(f" iteration {saved + 2:8d}/" in line for line in seen)


def test_reports_to_the_agent_through_the_hook(tmp_path: Path) -> None:
    """Every rank sends iteration timings (with the global loss), slow-step notices before
    saves, checkpoint timings, and the injected exception, to the agent's datagram socket."""
    path = tmp_path / "agent.sock"
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(path))
    try:
        env = {"UNICORN_HOOK_SOCKET": str(path), "UNICORN_JOB_ID": "77", "UNICORN_NODE": "n9"}
        args = (
            *COMMON[:-2],
            "--iterations=3",
            "--pp=2",
            f"--save-dir={tmp_path / 'ckpt'}",
            "--save-interval=2",
        )
        launch = run(2, *args, "--fail-at-iteration=3", "--fail-rank=0", "--dist-timeout-s=20", env=env)
        assert launch.returncode != 0
        agent.setblocking(False)
        messages = []
        with contextlib.suppress(BlockingIOError):
            while True:
                messages.append(protocol.decode(agent.recv(65536)))
    finally:
        agent.close()
    timings = [m for m in messages if isinstance(m, IterationTiming)]
    train = {(m.rank, m.iteration): m for m in timings if m.phase is IterationPhase.TRAIN}
    assert sorted(train) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(
        m.job_id == 77 and m.node == "n9" and m.samples == 16 and m.duration_s > 0 for m in train.values()
    )
    loss = train[(0, 2)].loss
    assert loss is not None and loss == train[(1, 2)].loss  # every rank reports the global loss
    assert loss == pytest.approx(launch.losses[2], rel=1e-6)  # the log prints 7 digits
    saves = [m for m in timings if m.phase is IterationPhase.CHECKPOINT]
    assert sorted((m.rank, m.iteration) for m in saves) == [(0, 2), (1, 2)]
    assert sorted(m.rank for m in messages if isinstance(m, SlowStep)) == [0, 1]
    errors = [m for m in messages if isinstance(m, ExceptionReport)]
    # Rank 1 may also report its broken collective; the root cause is the earliest report.
    first = min(errors, key=lambda e: e.wall_time_s)
    assert (first.rank, first.exc_type) == (0, "launcher.trainer.loop.InjectedFault")
    assert "injected fault at iteration 3 on rank 0" in first.message
