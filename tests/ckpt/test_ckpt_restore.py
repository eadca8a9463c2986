"""Restore nearest first, with verified fallbacks and reasons."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckpt.errors import RestoreFailed
from ckpt.peer import push_shard
from ckpt.persist import Persister
from ckpt.restore import PeerAddress, Restorer
from ckpt.shard import OpenShard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Retention, Tier, TierDir
from tests.ckpt.conftest import assert_same, training_state


def _flip(path: Path, offset: int = 200) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _node(root: Path, name: str) -> TierDir:
    return TierDir(root / name / "shm", "job", Tier.SHM)


def _replicate(shm: TierDir, iteration: int, rank: int, host: str, port: int) -> None:
    with OpenShard(shm.shard(iteration, rank)) as shard:
        asyncio.run(push_shard(host, port, shard))


def test_corrupt_disk_shard_and_corrupt_peer_copy_fall_back_with_reasons(
    shm_root: Path, tmp_path: Path, server_factory: Any
) -> None:
    state = training_state(3)
    a_shm, b_shm = _node(shm_root, "a"), _node(shm_root, "b")
    b_backup = TierDir(shm_root / "b" / "backup", "job", Tier.PEER)
    local = TierDir(tmp_path / "a-disk", "job", Tier.LOCAL)
    remote = TierDir(tmp_path / "nfs", "job", Tier.REMOTE)
    SnapshotWriter(a_shm.root, "job", 0, 1).snapshot(state, 30).seal()
    Persister(a_shm, [(local, Retention(2)), (remote, Retention(2))]).persist(30, 0)
    b = server_factory(b_backup, [b_backup, b_shm])
    _replicate(a_shm, 30, 0, b.host, b.port)

    _flip(a_shm.shard(30, 0).bin)  # own memory: a bit flipped
    _flip(b_backup.shard(30, 0).bin)  # the ring backup: silently corrupt
    _flip(local.shard(30, 0).bin, offset=1000)  # local disk: corrupt too
    restorer = Restorer(a_shm, peers=[PeerAddress("b", b.host, b.port)], local=local, remote=remote)
    restored, report = restorer.restore(30, 0)

    assert report.tier == Tier.REMOTE
    assert [(a.tier, a.reason) for a in report.attempts] == [
        (Tier.SHM, "corrupt"),
        (Tier.PEER, "refused"),
        (Tier.LOCAL, "corrupt"),
        (Tier.REMOTE, "ok"),
    ]
    assert "checksum" in report.attempts[0].detail and "checksum" in report.attempts[1].detail
    assert "checksum" in report.attempts[2].detail
    assert_same(state, restored)


def test_node_loss_replacement_restores_from_the_peer_copy_without_touching_remote(
    shm_root: Path, tmp_path: Path, server_factory: Any
) -> None:
    state = training_state(4)
    a_shm, b_shm = _node(shm_root, "a"), _node(shm_root, "b")
    b_backup = TierDir(shm_root / "b" / "backup", "job", Tier.PEER)
    remote = TierDir(tmp_path / "nfs", "job", Tier.REMOTE)
    SnapshotWriter(a_shm.root, "job", 2, 4).snapshot(state, 50).seal()
    Persister(a_shm, [(remote, Retention(2))]).persist(50, 2)  # a good remote copy exists
    b = server_factory(b_backup, [b_backup, b_shm])
    _replicate(a_shm, 50, 2, b.host, b.port)

    shutil.rmtree(a_shm.root.parent)  # node a is gone, with its memory and its disk
    replacement = _node(shm_root, "a2")
    restorer = Restorer(replacement, peers=[PeerAddress("b", b.host, b.port)], remote=remote)
    restored, report = restorer.restore(50, 2)

    assert report.tier == Tier.PEER
    assert [a.tier for a in report.attempts] == [Tier.SHM, Tier.PEER]  # remote never tried
    assert report.attempts[0].reason == "missing"
    assert_same(state, restored)
    assert replacement.complete_iterations(2) == [50]  # the fetched copy now lives in its memory


def test_no_usable_copy_raises_with_the_report(shm_root: Path) -> None:
    shm = _node(shm_root, "a")
    with pytest.raises(RestoreFailed, match=r"shm.*missing") as info:
        Restorer(shm, peers=[PeerAddress("gone", "127.0.0.1", 1)], fetch_timeout_s=2).open(1, 0)
    report = info.value.report
    assert [a.reason for a in report.attempts] == ["missing", "unreachable"]
