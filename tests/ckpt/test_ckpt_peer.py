"""Peer replication: ring assignment, pacing, verified transfer in both directions."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from ckpt.errors import ShardUnavailable
from ckpt.format import encode
from ckpt.peer import PeerServer, Reply, TokenBucket, _recv, _send, fetch_shard, push_shard, ring_peers
from ckpt.shard import OpenShard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Tier, TierDir
from unicorn_core.errors import InvalidArgument


def test_ring_peers() -> None:
    nodes = ["n1", "n2", "n3", "n4"]
    assert ring_peers(nodes, 1) == {"n1": ("n2",), "n2": ("n3",), "n3": ("n4",), "n4": ("n1",)}
    assert ring_peers(nodes, 2)["n4"] == ("n1", "n2")
    assert ring_peers(nodes, 0)["n1"] == ()
    for bad in (4, -1):
        with pytest.raises(InvalidArgument, match="replication factor"):
            ring_peers(nodes, bad)
    with pytest.raises(InvalidArgument, match="unique"):
        ring_peers(["a", "a"], 1)


async def test_token_bucket_paces_to_its_rate() -> None:
    now = [0.0]

    async def sleep(seconds: float) -> None:
        now[0] += seconds

    bucket = TokenBucket(1000.0, 100, clock=lambda: now[0], sleep=sleep)
    for _ in range(50):
        await bucket.take(100)
    # 5,000 B at 1,000 B/s with a 100 B head start: 4.9 s of (fake) time.
    assert now[0] == pytest.approx(4.9)
    with pytest.raises(InvalidArgument):
        await bucket.take(101)


def _sealed_shard(root: Path, iteration: int) -> TierDir:
    writer = SnapshotWriter(root, "job", 3, 4)
    writer.snapshot({"w": torch.arange(300_000, dtype=torch.float32), "step": iteration}, iteration).seal()
    writer.close()
    return TierDir(root, "job", Tier.SHM)


async def test_push_then_fetch_back_round_trip(tmp_path: Path, shm_root: Path) -> None:
    shm = _sealed_shard(shm_root, 8)
    backup = TierDir(tmp_path / "backup", "job", Tier.PEER)
    server = PeerServer(backup, [backup])
    host, port = await server.start()
    try:
        with OpenShard(shm.shard(8, 3)) as shard:
            await push_shard(host, port, shard, bucket=TokenBucket(50e6, 256 << 10), chunk_bytes=64 << 10)
        assert backup.done_ranks(8) == {3}
        fetched = TierDir(tmp_path / "fetched", "job", Tier.SHM)
        meta = await fetch_shard(host, port, "job", 8, 3, target=fetched)
        assert meta.iteration == 8
        with OpenShard(fetched.shard(8, 3)) as copy:
            copy.verify()
            assert torch.equal(copy.value("w"), torch.arange(300_000, dtype=torch.float32))
        with pytest.raises(ShardUnavailable, match="refused"):
            await fetch_shard(host, port, "job", 9, 3, target=fetched)
    finally:
        await server.close()


async def test_a_corrupt_push_is_rejected_and_not_stored(tmp_path: Path, shm_root: Path) -> None:
    shm = _sealed_shard(shm_root, 8)
    with shm.shard(8, 3).bin.open("r+b") as f:  # rot after sealing: the sender does not notice
        f.seek(4000)
        f.write(b"\xff\xff")
    backup = TierDir(tmp_path / "backup", "job", Tier.PEER)
    server = PeerServer(backup, [backup])
    host, port = await server.start()
    try:
        with OpenShard(shm.shard(8, 3)) as shard, pytest.raises(ShardUnavailable, match=r"refused.*checksum"):
            await push_shard(host, port, shard)
        assert backup.done_ranks(8) == set()
        assert not backup.shard(8, 3).bin.exists()
    finally:
        await server.close()


@pytest.mark.parametrize("stall", [True, False], ids=["timeout", "dropped"])
async def test_a_fetch_cut_off_midway_leaves_no_file(tmp_path: Path, shm_root: Path, stall: bool) -> None:
    shm = _sealed_shard(shm_root, 8)

    async def half_then_stop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _recv(reader)
        with OpenShard(shm.shard(8, 3)) as shard:
            await _send(writer, Reply(ok=True, meta=encode(shard.meta), data_bytes=shard.meta.data_bytes))
            writer.write(shard.data()[: shard.meta.data_bytes // 2])
            await writer.drain()
        if stall:
            await asyncio.sleep(30)
        writer.close()

    server = await asyncio.start_server(half_then_stop, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    target = TierDir(tmp_path / "fetched", "job", Tier.SHM)
    try:
        start = time.monotonic()
        with pytest.raises(ShardUnavailable, match="unreachable"):
            await fetch_shard(host, port, "job", 8, 3, target=target, chunk_bytes=64 << 10, timeout_s=1.0)
        assert time.monotonic() - start < 10, "the commit's thread waited for the stalled sender"
        # The commit's thread has finished and removed its temp file before fetch_shard returned.
        directory = target.shard(8, 3).directory
        assert directory.is_dir() and list(directory.iterdir()) == []
        assert target.done_ranks(8) == set()
    finally:
        server.close()
        await server.wait_closed()
