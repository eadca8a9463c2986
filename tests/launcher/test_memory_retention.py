"""The memory tier keeps a version older than the loss detector's window (issue 23, item 3).

The number of versions derives from ``detect.loss_stop_window`` and ``ckpt.snapshot_every``; a
configuration that sets fewer is refused; the agent hands the number to the ranks; and a
real snapshot writer with that many slots still holds a version older than the window
after saving for as long as one likes, one slot fewer does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Tier, TierDir
from launcher.ckptagent import ENV_SLOTS, CkptPlan
from unicorn_core.config import CkptConfig, DetectConfig, load_config
from unicorn_core.config.node import memory_versions_needed
from unicorn_core.errors import ConfigError


def test_the_versions_needed_cover_the_window_plus_one_older() -> None:
    assert memory_versions_needed(100, 10) == 11
    assert memory_versions_needed(100, 30) == 5  # 30, 60, 90 and 120 back: 4 cover 100, one older
    assert memory_versions_needed(20, 50) == 2
    assert memory_versions_needed(100, 0) == 2  # no periodic snapshots: nothing to derive
    assert CkptConfig().memory_keep(100) == 11
    assert CkptConfig().memory_keep(DetectConfig().loss_stop_window) == 2  # the defaults: 10 / 10 + 1
    assert CkptConfig(memory_versions=15).memory_keep(100) == 15


def test_a_config_keeping_too_few_versions_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "unicorn.toml"
    toml.write_text("[ckpt]\nmemory_versions = 4\nsnapshot_every = 10\n[detect]\nloss_stop_window = 100\n")
    with pytest.raises(ConfigError, match=r"ckpt.memory_versions = 4 .* needs >= 11"):
        load_config(toml, env={})
    toml.write_text("[ckpt]\nmemory_versions = 4\nsnapshot_every = 40\n[detect]\nloss_stop_window = 100\n")
    assert load_config(toml, env={}).ckpt.memory_versions == 4
    toml.write_text("[ckpt]\nsnapshot_every = 25\n[detect]\nloss_stop_window = 100\n")
    cfg = load_config(toml, env={})
    assert cfg.ckpt.memory_keep(cfg.detect.loss_stop_window) == 5


def test_the_agent_passes_the_derived_versions_to_the_ranks(tmp_path: Path) -> None:
    cfg = CkptConfig(shm_dir=str(tmp_path / "shm"), local_dir="", snapshot_every=10)
    plan = CkptPlan.from_config(cfg, job_id=3, node="n1", env={}, loss_stop_window=60)
    assert plan is not None and plan.memory_versions == 7
    assert plan.rank_env()[ENV_SLOTS] == "7"


@pytest.mark.parametrize("spare", [0, -1])
def test_the_derived_slots_always_hold_a_version_older_than_the_window(tmp_path: Path, spare: int) -> None:
    window, every = 40, 10
    slots = memory_versions_needed(window, every) + spare
    root = tmp_path / f"shm{spare}"
    writer = SnapshotWriter(root, "job", 0, 1, slots=slots)
    state = {"w": torch.zeros(4)}
    tier = TierDir(root, "job", Tier.SHM)
    held_older = []
    try:
        for iteration in range(every, 200 + 1, every):
            writer.snapshot(state, iteration)
            # the newest bad iteration the window can still name is the current one; the
            # first bad one may lie up to ``window`` iterations back
            held_older.append(min(tier.iterations()) <= iteration - window)
    finally:
        writer.close()
    steady = held_older[slots:]
    assert steady and all(steady) is (spare == 0)
