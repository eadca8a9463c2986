"""Megatron-LM after a roll back: its own ``--iterations-to-skip``, and the runner's choice
of the version to load (never one trained on the skipped data)."""

from __future__ import annotations

from pathlib import Path

from launcher.megatron import SKIPPED_FILE, TRACKER_FILE, rollback_load, skip_args, skipped_ranges

BASE = ["pretrain_gpt.py", "--lr", "1e-4"]


def save(load: Path, iteration: int, skipped: str = "", *, complete: bool = True) -> None:
    folder = load / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "metadata.json").write_text("{}")
    if skipped:
        (folder / SKIPPED_FILE).write_text(f"{skipped}\n")


def test_megatron_numbers_a_step_by_the_steps_done() -> None:
    kept, flag = skip_args([*BASE, "--iterations-to-skip", "7", "9", "--seed", "3"], ((40, 41),))
    assert kept == [*BASE, "--seed", "3"]
    assert flag == ["--iterations-to-skip", "7", "9", "39", "40"]
    assert skip_args(BASE, ()) == (BASE, [])
    assert skipped_ranges([*BASE, *flag]) == ((8, 8), (10, 10), (40, 41))


def test_the_runner_loads_the_newest_version_older_than_the_skipped_data(tmp_path: Path) -> None:
    load = tmp_path / "ckpt"
    for it in (20, 30, 40, 45):  # 40 and 45: saved by the run that trained on iteration 32
        save(load, it)
    save(load, 50, complete=False)
    (load / TRACKER_FILE).write_text("45\n")
    args = [*BASE, "--load", str(load), "--iterations-to-skip", "31"]  # skips log iteration 32
    assert rollback_load(args) == [*args, "--ckpt-step", "30"]
    # the rolled-back run saved 40 again, recording the skip: a later restart resumes there
    (load / "iter_0000040" / SKIPPED_FILE).write_text("32-32\n")
    (load / TRACKER_FILE).write_text("40\n")
    assert rollback_load(args) == args
    # without skips, or with an explicit --ckpt-step, nothing changes
    plain = [*BASE, "--load", str(load)]
    assert rollback_load(plain) == plain
    chosen = [*args, "--ckpt-step", "20"]
    assert rollback_load(chosen) == chosen


def test_with_no_version_older_than_the_skipped_data_the_run_starts_from_its_initial_state(
    tmp_path: Path,
) -> None:
    load = tmp_path / "ckpt"
    save(load, 10)
    (load / TRACKER_FILE).write_text("10\n")
    args = [*BASE, "--load", str(load), "--iterations-to-skip", "4"]
    assert rollback_load(args) == [*BASE, "--iterations-to-skip", "4"]
    empty = [*BASE, "--load", str(tmp_path / "none"), "--iterations-to-skip", "4"]
    assert rollback_load(empty) == empty  # nothing saved yet: Megatron starts fresh anyway
