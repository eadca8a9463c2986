"""Persistence tiers: the commit protocol, crash safety, retention, latest complete version."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt.format import TMP_MARK
from ckpt.persist import Persister
from ckpt.shard import OpenShard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import VERSION_FILE, Retention, Tier, TierDir, latest_common, listing
from unicorn_core.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[2]


def snapshot_all(shm_root: Path, iteration: int, world_size: int, numel: int = 1024) -> None:
    for rank in range(world_size):
        writer = SnapshotWriter(shm_root, "job", rank, world_size)
        writer.snapshot({"w": torch.full((numel,), float(iteration * 10 + rank))}, iteration).seal()
        writer.close()


def test_a_version_is_published_only_when_every_rank_is_done(shm_root: Path, tmp_path: Path) -> None:
    snapshot_all(shm_root, 5, world_size=2)
    local = TierDir(tmp_path, "job", Tier.LOCAL)
    persister = Persister(TierDir(shm_root, "job", Tier.SHM), [(local, Retention(3))])
    assert not persister.persist(5, 0)[0].published
    assert local.latest_complete() is None and local.done_ranks(5) == {0}
    assert persister.persist(5, 1)[0].published
    assert local.latest_complete() == 5
    manifest = local.manifest(5)
    assert manifest is not None and [s.rank for s in manifest.shards] == [0, 1]
    with OpenShard(local.shard(5, 1)) as shard:
        shard.verify()
        assert torch.equal(shard.value("w"), torch.full((1024,), 51.0))


def test_crash_during_persistence_leaves_no_half_published_version(shm_root: Path, tmp_path: Path) -> None:
    local = TierDir(tmp_path, "job", Tier.LOCAL)
    shm = TierDir(shm_root, "job", Tier.SHM)
    snapshot_all(shm_root, 1, world_size=1)
    Persister(shm, [(local, Retention(3))]).persist(1, 0)
    snapshot_all(shm_root, 2, world_size=1, numel=1 << 18)
    agent = subprocess.run(
        [sys.executable, "-m", "tests.ckpt._procs", "persist", str(shm_root), str(tmp_path), "job", "2", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    half = list(local.shard(2, 0).directory.glob(f"*{TMP_MARK}*"))
    assert half, "the child should have died mid-write"
    assert local.done_ranks(2) == set()
    assert not (local.shard(2, 0).directory / VERSION_FILE).exists()
    assert local.latest_complete() == 1

    # The restarted agent cleans the dead writer's temp files and completes the version.
    results = Persister(shm, [(local, Retention(3))]).persist(2, 0)
    assert not list(local.job_dir.rglob(f"*{TMP_MARK}*"))
    assert results[0].published and local.latest_complete() == 2


def test_retention_keeps_n_versions_and_m_bytes_oldest_first(shm_root: Path, tmp_path: Path) -> None:
    shm = TierDir(shm_root, "job", Tier.SHM)
    by_count = TierDir(tmp_path / "a", "job", Tier.LOCAL)
    by_bytes = TierDir(tmp_path / "b", "job", Tier.REMOTE)
    shard_bytes = 4096 * 4
    persister = Persister(
        shm, [(by_count, Retention(2)), (by_bytes, Retention(10, keep_bytes=3 * shard_bytes + 2048))]
    )
    for iteration in range(1, 6):
        snapshot_all(shm_root, iteration, world_size=1, numel=4096)
        persister.persist(iteration, 0)
    assert by_count.iterations() == [4, 5]
    assert by_bytes.iterations() == [3, 4, 5]
    assert by_count.latest_complete() == by_bytes.latest_complete() == 5


def test_latest_common_is_the_highest_iteration_every_rank_holds() -> None:
    assert latest_common({0: [1, 2, 3], 1: [2, 3], 2: [1, 3, 4]}, 3) == 3
    assert latest_common({0: [1, 2], 1: [3]}, 2) is None
    assert latest_common({0: [5]}, 2) is None  # rank 1 holds nothing
    with pytest.raises(InvalidArgument):
        latest_common({}, 0)


def test_a_folder_removed_while_listed_reads_as_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer reclaims an old iteration's folder at any moment, also between a scan that
    listed it and the glob inside it (a ckpt agent died of the FileNotFoundError once)."""
    folder = tmp_path / "it-000000000005"
    folder.mkdir()
    (folder / "shard-00000.json").write_text("{}")
    assert listing(folder, "shard-*.json") == [folder / "shard-00000.json"]

    def vanished(self: Path, pattern: str) -> Iterator[Path]:
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "glob", vanished)
    assert listing(folder, "shard-*.json") == []
