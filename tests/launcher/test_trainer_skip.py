"""``unicorn-train --skip-iterations`` and its test-only bad batches, under real torchrun.

A run whose batch at iteration K is corrupted spikes there; rolled back with K skipped, it
restores the newest version older than K (never a version trained on K's data, although
newer ones are in the tier) and from then on trains exactly as a run that skipped K from
the start: the same data positions, so the same losses.
"""

from __future__ import annotations

import contextlib
import re
import socket
from pathlib import Path

import pytest

from launcher.trainer.config import (
    BatchCorruption,
    format_ranges,
    parse_ranges,
    skipped_before,
)
from tests.launcher.test_trainer_torchrun import assert_losses_match
from tests.launcher.torchrun import run
from unicorn_core import protocol
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import IterationPhase, IterationTiming

K = 9
TOTAL = 14
COMMON = (
    "--layers=2",
    "--hidden=32",
    "--heads=4",
    "--seq=16",
    "--vocab=64",
    f"--iterations={TOTAL}",
    "--lr=3e-3",
    "--micro-batch=1",
    "--global-batch=4",
)
SKIPPED_LINE = re.compile(r"skipped iteration (\d+): samples (\d+)\.\.(\d+) consumed and discarded")


def test_ranges_parse_merge_and_refuse_nonsense() -> None:
    assert parse_ranges("7, 3-4,5,10-12") == ((3, 5), (7, 7), (10, 12))
    assert parse_ranges("") == ()
    assert format_ranges(parse_ranges("3-5,7")) == "3-5,7-7"
    assert skipped_before(((3, 5), (7, 7)), 4) == ((3, 4),)
    assert skipped_before(((3, 5), (7, 7)), 2) == ()
    for bad in ("0", "5-3", "x", "3-"):
        with pytest.raises(InvalidArgument):
            parse_ranges(bad)
    with pytest.raises(InvalidArgument):
        BatchCorruption(())


def test_a_rolled_back_run_skips_the_bad_batch_exactly_as_a_run_that_always_skipped_it(
    tmp_path: Path,
) -> None:
    snap = tmp_path / "snap"
    tiers = (f"--snapshot-dir={snap}", "--snapshot-every=4", "--snapshot-slots=4")
    # the run that meets the bad batch: it spikes at K and goes on past it (snapshots at 12)
    bad = run(2, *COMMON, *tiers, f"--corrupt-iterations={K}", "--exit-at-iteration=12")
    assert bad.returncode == 0, bad.output[-3000:]
    before = [bad.losses[i] for i in range(K - 4, K)]
    assert bad.losses[K] > 1.6 * max(before), bad.losses  # the injected spike is a spike
    # roll back: K's data skipped; the newest versions (12, and K's own snapshot at 12 was
    # trained on it) are passed over for the newest one older than K
    back = run(2, *COMMON, *tiers, f"--corrupt-iterations={K}", f"--skip-iterations={K}")
    assert back.returncode == 0, back.output[-3000:]
    assert "restored iteration 8 from the memory tiers" in back.output, back.output[-3000:]
    assert "iteration 12: saved by a run that skipped []" in back.output
    assert sorted(back.losses) == [i for i in range(9, TOTAL + 1) if i != K]
    # a run that skipped K from the start: same data positions after K, same losses
    clean = run(2, *COMMON, f"--skip-iterations={K}")
    assert clean.returncode == 0, clean.output[-3000:]
    assert K not in clean.losses and sorted(clean.losses) == [i for i in range(1, TOTAL + 1) if i != K]
    assert (
        SKIPPED_LINE.findall(back.output)
        == SKIPPED_LINE.findall(clean.output)
        == [(str(K), str((K - 1) * 4), str(K * 4 - 1))]
    )
    assert_losses_match(back.losses, clean.losses)
    assert_losses_match({i: bad.losses[i] for i in range(1, K)}, clean.losses)
    # the roll back's own snapshots carry the skip, so a later restart may restore them
    again = run(2, *COMMON, *tiers, f"--skip-iterations={K}")
    assert again.returncode == 0, again.output[-3000:]
    assert f"restored iteration {TOTAL} from the memory tiers" in again.output


def test_a_nan_batch_makes_its_loss_and_every_later_one_nan() -> None:
    launch = run(1, *COMMON, "--iterations=4", "--corrupt-iterations=3", "--corrupt-mode=nan")
    assert launch.returncode == 0, launch.output[-3000:]
    assert sorted(launch.losses) == [1, 2]  # finite losses only (the line regex reads numbers)
    nan_lines = re.findall(r" iteration +(\d+)/.*lm loss: NAN .*number of nan iterations: +1 ", launch.output)
    assert nan_lines == ["3", "4"], launch.output[-2000:]


def test_a_version_on_disk_trained_on_skipped_data_is_never_loaded(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    disk = (f"--save-dir={ckpt}", "--save-interval=4", f"--load={ckpt}")
    bad = run(1, *COMMON, *disk, f"--corrupt-iterations={K}", "--exit-at-iteration=12")
    assert bad.returncode == 0, bad.output[-3000:]
    back = run(1, *COMMON, *disk, f"--skip-iterations={K}", "--exit-at-iteration=12")
    assert back.returncode == 0, back.output[-3000:]
    assert f"restored iteration 8 from --load {ckpt}" in back.output
    again = run(1, *COMMON, *disk, f"--skip-iterations={K}")
    assert f"restored iteration 12 from --load {ckpt}" in again.output, again.output[-3000:]


def test_the_hook_reports_a_skipped_iteration_without_a_loss_and_the_last_one_as_final(
    tmp_path: Path,
) -> None:
    """A skipped iteration is progress (no loss to judge); the last iteration is ``final``, so
    the silence of ranks ending the run is no hang."""
    path = tmp_path / "agent.sock"
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(path))
    try:
        env = {"UNICORN_HOOK_SOCKET": str(path), "UNICORN_JOB_ID": "5", "UNICORN_NODE": "n1"}
        launch = run(
            2, *COMMON, "--iterations=4", "--skip-iterations=2", f"--save-dir={tmp_path / 'c'}", env=env
        )
        assert launch.returncode == 0, launch.output[-3000:]
        agent.setblocking(False)
        messages = []
        with contextlib.suppress(BlockingIOError):
            while True:
                messages.append(protocol.decode(agent.recv(65536)))
    finally:
        agent.close()
    train = {
        (m.rank, m.iteration): m
        for m in messages
        if isinstance(m, IterationTiming) and m.phase is IterationPhase.TRAIN
    }
    assert sorted(train) == [(r, i) for r in (0, 1) for i in (1, 2, 3, 4)]
    assert all(train[(r, 2)].loss is None for r in (0, 1))
    assert all(train[(r, i)].loss is not None for r in (0, 1) for i in (1, 3, 4))
    assert [k for k, m in sorted(train.items()) if m.final] == [(0, 4), (1, 4)]
    saves = [m for m in messages if isinstance(m, IterationTiming) and m.phase is IterationPhase.CHECKPOINT]
    assert saves and all(m.final == (m.iteration == 4) for m in saves)
