"""The shard commit protocol (``ckpt.commit.commit_shard``): all or no done marker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

import ckpt.commit
from ckpt.commit import commit_shard
from ckpt.errors import ShardUnavailable
from ckpt.format import TMP_MARK, ShardPaths, ShardState
from ckpt.format import write_atomic as format_write_atomic
from ckpt.shard import OpenShard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Tier, TierDir
from tests.ckpt._procs import COMMIT_CRASH_POINTS
from tests.ckpt.conftest import assert_same, training_state
from unicorn_core.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[2]
WriteData = Callable[[int], object]


@pytest.fixture
def source(shm_root: Path) -> Iterator[OpenShard]:
    """Rank 0's sealed shard of iteration 4 in shm, open."""
    writer = SnapshotWriter(shm_root, "job", 0, 1)
    writer.snapshot(training_state(4), 4).seal()
    writer.close()
    with OpenShard(TierDir(shm_root, "job", Tier.SHM).shard(4, 0)) as shard:
        yield shard


def write_all(fd: int, data: memoryview | bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def copy_of(source: OpenShard) -> WriteData:
    return lambda fd: write_all(fd, source.data())


def leftovers(paths: ShardPaths) -> list[str]:
    """Every file of this shard in its folder: final names and temp files."""
    if not paths.directory.is_dir():
        return []
    return sorted(p.name for p in paths.directory.iterdir() if p.name.startswith(paths.stem))


def test_a_commit_leaves_data_metadata_and_marker(source: OpenShard, tmp_path: Path) -> None:
    target = TierDir(tmp_path, "job", Tier.LOCAL)
    paths = commit_shard(target, source.meta, copy_of(source))
    assert paths == target.shard(4, 0)
    assert leftovers(paths) == [paths.bin.name, paths.done.name, paths.meta.name]
    assert target.complete_iterations(0) == [4]
    with OpenShard(paths) as copy:
        assert copy.meta == source.meta and copy.meta.state == ShardState.SEALED
        assert_same(copy.state_dict(), training_state(4))


def _fail_midway(source: OpenShard) -> WriteData:
    def write(fd: int) -> None:
        write_all(fd, source.data()[:100])
        raise ConnectionResetError("sender went away")

    return write


def _corrupt(source: OpenShard) -> WriteData:
    def write(fd: int) -> None:
        data = bytearray(source.data())
        data[source.meta.entries[0].offset] ^= 0xFF
        write_all(fd, data)

    return write


@pytest.mark.parametrize(
    ("sabotage", "error"),
    [
        (_fail_midway, "sender went away"),
        (lambda s: lambda fd: write_all(fd, s.data()[:-1]), r"incomplete: .* holds \d+ B"),
        (lambda s: lambda fd: write_all(fd, bytes(s.data()) + b"x"), "incomplete"),
        (_corrupt, "corrupt: .*checksum"),
    ],
    ids=["write-raises", "short", "long", "corrupt"],
)
def test_a_failed_commit_leaves_no_marker_and_no_file(
    source: OpenShard, tmp_path: Path, sabotage: Callable[[OpenShard], WriteData], error: str
) -> None:
    target = TierDir(tmp_path, "job", Tier.LOCAL)
    commit_shard(target, source.meta, copy_of(source))  # an older complete copy: its marker must go too
    with pytest.raises((ShardUnavailable, ConnectionResetError), match=error):
        commit_shard(target, source.meta, sabotage(source))
    paths = target.shard(4, 0)
    assert not paths.done.exists() and target.complete_iterations(0) == []
    assert not [name for name in leftovers(paths) if TMP_MARK in name]
    if "corrupt" in error:  # the bad copy had replaced the old one: deleted, metadata too
        assert leftovers(paths) == []
    with pytest.raises(ShardUnavailable):
        OpenShard(paths).close()


def test_a_failure_writing_the_marker_removes_the_copy(
    source: OpenShard, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = format_write_atomic

    def write_atomic(path: Path, data: bytes, *, durable: bool) -> None:
        real(path, data, durable=durable)
        if path.suffix == ".done":
            raise OSError("fsync failed")  # renamed in place, but not known to be durable

    monkeypatch.setattr(ckpt.commit, "write_atomic", write_atomic)
    target = TierDir(tmp_path, "job", Tier.LOCAL)
    with pytest.raises(OSError, match="fsync failed"):
        commit_shard(target, source.meta, copy_of(source))
    assert leftovers(target.shard(4, 0)) == []


def test_only_a_sealed_shard_of_the_same_job_is_committed(source: OpenShard, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="job other"):
        commit_shard(TierDir(tmp_path, "other", Tier.LOCAL), source.meta, copy_of(source))
    copied = msgspec.structs.replace(source.meta, state=ShardState.COPIED)
    target = TierDir(tmp_path, "job", Tier.LOCAL)
    with pytest.raises(ShardUnavailable, match="incomplete"):
        commit_shard(target, copied, copy_of(source))
    assert leftovers(target.shard(4, 0)) == []


@pytest.mark.parametrize("point", COMMIT_CRASH_POINTS)
def test_a_crash_at_any_point_leaves_no_marker(
    source: OpenShard, shm_root: Path, tmp_path: Path, point: str
) -> None:
    target = TierDir(tmp_path, "job", Tier.LOCAL)
    commit_shard(target, source.meta, copy_of(source))  # a complete copy from before: its marker goes first
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.ckpt._procs",
            "commit",
            str(shm_root),
            str(tmp_path),
            "job",
            "4",
            "0",
            point,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    paths = target.shard(4, 0)
    assert not paths.done.exists() and target.complete_iterations(0) == []
    with pytest.raises(ShardUnavailable, match=r"missing|incomplete"):
        OpenShard(paths).close()

    # The next agent removes the dead writer's temp files and commits again.
    target.clean_tmp()
    assert not [name for name in leftovers(paths) if TMP_MARK in name]
    commit_shard(target, source.meta, copy_of(source))
    assert target.complete_iterations(0) == [4]
    with OpenShard(paths) as copy:
        assert torch.equal(copy.value("model/0.weight"), source.value("model/0.weight"))
