"""Snapshot tier: copy into shared memory, seal off the training thread, survive kill -9."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt.errors import ShardUnavailable, SnapshotBusy
from ckpt.persist import Persister
from ckpt.restore import Restorer
from ckpt.shard import VERIFY_THREADS, OpenShard, seal_shard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Retention, Tier, TierDir
from tests.ckpt.conftest import assert_same, training_state

REPO = Path(__file__).resolve().parents[2]


def test_snapshot_seal_and_read_back_every_dtype(shm_root: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "f32": base,
        "t": base.t(),  # not contiguous
        "bf16": base.to(torch.bfloat16),
        "bool": base > 5,
        "c64": torch.complex(base, -base),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
    }
    writer = SnapshotWriter(shm_root, "job", 0, 1)
    handle = writer.snapshot(state, 10)
    with pytest.raises(ShardUnavailable, match="incomplete"):  # copied but not sealed: not restorable yet
        OpenShard(handle.paths)
    handle.seal()
    with OpenShard(handle.paths) as shard:
        assert_same(state, shard.state_dict(copy=False))
        owned = shard.state_dict(copy=True)
    assert_same({k: v.contiguous() for k, v in state.items()}, owned)


def test_slots_are_reused_and_a_reader_pins_its_slot(shm_root: Path) -> None:
    writer = SnapshotWriter(shm_root, "job", 0, 1, slots=2, lock_timeout_s=0.05)
    for iteration in range(1, 6):
        writer.snapshot({"w": torch.full((1024,), float(iteration))}, iteration).seal()
    shm = TierDir(shm_root, "job", Tier.SHM)
    assert shm.complete_iterations(0) == [4, 5]
    assert len(list(shm_root.rglob("*.bin"))) == 2
    with OpenShard(shm.shard(5, 0)) as pinned:
        writer.snapshot({"w": torch.full((1024,), 6.0)}, 6).seal()  # takes the other slot (iteration 4)
        assert shm.complete_iterations(0) == [5, 6]
        with OpenShard(shm.shard(6, 0)), pytest.raises(SnapshotBusy):  # both pinned: wait, then give up
            writer.snapshot({"w": torch.full((1024,), 7.0)}, 7)
        assert torch.equal(pinned.value("w"), torch.full((1024,), 5.0))
    assert shm.complete_iterations(0) == [5, 6]  # the refused snapshot changed nothing


def test_an_iteration_written_again_waits_for_its_own_slot(shm_root: Path) -> None:
    """A version written a second time (a just-in-time copy of an iteration saved already)
    reuses its own slot once readers let go, never a spare one: two slots of one iteration
    would share one path, the older file unlinked under its reader."""
    writer = SnapshotWriter(shm_root, "job", 0, 1, slots=2, lock_timeout_s=0.05)
    writer.snapshot({"w": torch.full((1024,), 1.0)}, 1).seal()
    shm = TierDir(shm_root, "job", Tier.SHM)
    with OpenShard(shm.shard(1, 0)) as pinned:
        with pytest.raises(SnapshotBusy):  # the spare slot stays unused
            writer.snapshot({"w": torch.full((1024,), 2.0)}, 1)
        assert torch.equal(pinned.value("w"), torch.full((1024,), 1.0))
    writer.snapshot({"w": torch.full((1024,), 2.0)}, 1).seal()
    assert len(list(shm_root.rglob("*.bin"))) == 1
    with OpenShard(shm.shard(1, 0)) as shard:
        assert torch.equal(shard.value("w"), torch.full((1024,), 2.0))


def test_a_corrupt_byte_in_memory_is_detected(shm_root: Path) -> None:
    writer = SnapshotWriter(shm_root, "job", 0, 1)
    handle = writer.snapshot({"w": torch.ones(4096)}, 1)
    handle.seal()
    with handle.paths.bin.open("r+b") as f:
        f.seek(100)
        f.write(b"\x7f")
    with OpenShard(handle.paths) as shard, pytest.raises(ShardUnavailable, match=r"corrupt.*checksum"):
        shard.verify()


@pytest.mark.skipif(VERIFY_THREADS < 2, reason="one checksum thread: the serial path is the one tested above")
def test_parallel_verification_reports_the_first_corrupt_entry(shm_root: Path) -> None:
    """Large shards are hashed on several threads; a mismatch still names the first bad
    entry in entry order, and the entries verified before it stay verified."""
    state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(6)}  # 4 MiB each, 24 MiB
    handle = SnapshotWriter(shm_root, "job", 0, 1).snapshot(state, 1)
    handle.seal()
    with OpenShard(handle.paths) as shard:
        bad = [shard.entry("w2"), shard.entry("w4")]
    with handle.paths.bin.open("r+b") as f:
        for entry in bad:
            f.seek(entry.offset + 123)
            f.write(b"\x7f")
    with OpenShard(handle.paths) as shard:
        with pytest.raises(ShardUnavailable, match=r"corrupt.*entry w2 checksum"):
            shard.verify()
        assert_same(shard.value("w1", copy=True, verify=True), state["w1"])  # a good entry still reads
        with pytest.raises(ShardUnavailable, match="entry w4"):
            shard.value("w4", verify=True)


def test_kill_9_after_snapshot_agent_persists_and_restart_restores_from_memory(
    shm_root: Path, tmp_path: Path
) -> None:
    rank = subprocess.run(
        [sys.executable, "-m", "tests.ckpt._procs", "rank", str(shm_root), "job", "21"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert rank.returncode == -signal.SIGKILL, rank.stderr

    # The agent: seals and persists what the dead rank left in shared memory.
    shm = TierDir(shm_root, "job", Tier.SHM)
    local = TierDir(tmp_path / "local", "job", Tier.LOCAL)
    results = Persister(shm, [(local, Retention(2))]).persist(21, 0)
    assert results[0].published and local.latest_complete() == 21

    # The restarted rank: restores from its own memory, then snapshots again into adopted slots.
    state, report = Restorer(shm, local=local).restore(21, 0)
    assert report.tier == Tier.SHM and not report.skipped
    assert_same(training_state(21), state)
    writer = SnapshotWriter(shm_root, "job", 0, 1)
    seal_shard(writer.snapshot(state, 22).paths)
    assert shm.complete_iterations(0) == [21, 22]
