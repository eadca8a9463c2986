"""The coordinator's stream reader against a real redis-server: a changing set of streams,
acknowledgement after handling, and replay of what a killed reader had not acknowledged."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from unicorn_core.keys import COORDINATOR_GROUP, PAYLOAD_FIELD, RedisKeys
from unicorn_core.protocol import Heartbeat, Message, encode
from unicornd.ingest import StreamIngest, trim_bound

KEYS = RedisKeys("t")


def _hb(job: int, seq: int) -> bytes:
    return encode(
        Heartbeat(job_id=job, node="n1", wall_time_s=1.0, agent_pid=1, pids=[], iteration=seq, seq=seq)
    )


async def test_streams_come_and_go_and_unacked_entries_are_replayed(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    streams = [KEYS.events(1)]
    seen: list[tuple[str, int]] = []
    fail_on: set[int] = set()

    async def handler(msg: Message, _now: float, _eid: str, stream: str) -> None:
        assert isinstance(msg, Heartbeat)
        if msg.seq in fail_on:
            raise RuntimeError("handler crashed")
        seen.append((stream, msg.seq))

    ingest = StreamIngest(client, lambda: streams, "c1", handler)
    await client.xadd(KEYS.events(1), {PAYLOAD_FIELD: _hb(1, 1)})
    await client.xadd(KEYS.events(2), {PAYLOAD_FIELD: _hb(2, 2)})  # not read yet: not listed
    assert await ingest.step(10) == 1 and seen == [(KEYS.events(1), 1)]
    streams.append(KEYS.events(2))  # a new job: its stream is opened and read from its start
    await ingest.step(10)
    assert seen[-1] == (KEYS.events(2), 2)
    await client.xadd(KEYS.events(2), {PAYLOAD_FIELD: b"garbage"})  # counted, acknowledged
    await ingest.step(10)
    assert sum(ingest.decoder.failures.values()) == 1

    # The handler dies mid-entry: the entry stays pending and a new reader replays it.
    fail_on.add(3)
    await client.xadd(KEYS.events(1), {PAYLOAD_FIELD: _hb(1, 3)})
    with pytest.raises(RuntimeError, match="handler crashed"):
        await ingest.step(10)
    assert (await client.xpending(KEYS.events(1), COORDINATOR_GROUP))["pending"] == 1
    fail_on.clear()
    again = StreamIngest(client, lambda: streams, "c1", handler)
    await again.step(10)
    assert seen[-1] == (KEYS.events(1), 3)
    for s in streams:
        assert (await client.xpending(s, COORDINATOR_GROUP))["pending"] == 0

    # A stream deleted under the reader (its job's user and streams were cleaned up) is
    # recreated with its group when listed again, and no stream at all just waits.
    await client.delete(KEYS.events(2))
    await again.step(10)
    await client.xadd(KEYS.events(2), {PAYLOAD_FIELD: _hb(2, 4)})
    for _ in range(3):
        await again.step(10)
    assert seen[-1] == (KEYS.events(2), 4)
    # ... also while the reader is blocked on it (Redis answers UNBLOCKED).
    blocked = asyncio.create_task(again.step(3000))
    await asyncio.sleep(0.3)
    await client.delete(KEYS.events(2))
    assert await asyncio.wait_for(blocked, 5) == 0
    streams.clear()
    assert await asyncio.wait_for(again.step(10), 5) == 0
    await client.aclose()


async def test_caught_up_reports_how_far_the_reader_has_read(redis_url: str) -> None:
    """The reader says it has read everything only when it has: a read that filled
    ``READ_COUNT`` entries of a stream leaves more behind; one that did not, or that timed
    out empty, read to the end (the detector measures silence up to that time)."""
    from unicornd import ingest as ingest_mod

    client = aioredis.Redis.from_url(redis_url)
    stream = KEYS.events(7)
    horizons: list[float] = []

    async def handler(_msg: Message, _now: float, _eid: str, _stream: str) -> None:
        return None

    reader = StreamIngest(client, stream, "c1", handler, on_caught_up=horizons.append)
    n = ingest_mod.READ_COUNT + 3
    for seq in range(n):
        await client.xadd(stream, {PAYLOAD_FIELD: _hb(7, seq)})
    await ingest_mod.ensure_group(client, stream)
    before = asyncio.get_running_loop().time()
    assert await reader.step(10) == ingest_mod.READ_COUNT  # a full batch: more are waiting
    assert horizons == []
    assert await reader.step(10) == 3  # the rest: read to the end as of the read's sending
    assert len(horizons) == 1 and horizons[0] >= before
    sent = asyncio.get_running_loop().time()
    assert await reader.step(100) == 0  # nothing until the timeout: heard until then
    assert len(horizons) == 2 and sent + 0.09 <= horizons[1] <= asyncio.get_running_loop().time()
    await client.aclose()


def test_trim_bound_keeps_what_a_group_needs_and_the_recent_history() -> None:
    idle = {"name": "g", "pending": 0, "last-delivered-id": "100000-3"}
    assert trim_bound([idle], {}, 60_000) == "40000-0"  # a minute before the newest delivered
    assert trim_bound([idle], {}, 0) == "100000-0"  # all acknowledged before the newest ms may go
    busy = {"name": "g", "pending": 2, "last-delivered-id": "100000-3"}
    assert trim_bound([busy], {"g": "90000-1"}, 0) == "90000-1"  # never the first pending one
    assert trim_bound([busy], {}, 0) is None  # pending entries of unknown ids: keep all
    behind = {"name": "h", "pending": 0, "last-delivered-id": "20000-0"}
    assert trim_bound([idle, behind], {}, 0) == "20000-0"  # the slowest group decides
    assert trim_bound([idle], {}, 200_000) is None and trim_bound([], {}, 0) is None


async def test_trimming_removes_only_acknowledged_history(redis_url: str) -> None:
    """Acknowledged entries older than the retention go; what the group has not acknowledged
    (a handler that crashed on it) and what it has not read yet stay."""
    client = aioredis.Redis.from_url(redis_url)
    stream = KEYS.events(7)
    fail_on: set[int] = set()

    async def handler(msg: Message, _now: float, _eid: str, _stream: str) -> None:
        assert isinstance(msg, Heartbeat)
        if msg.seq in fail_on:
            raise RuntimeError("handler crashed")

    ingest = StreamIngest(client, lambda: [stream], "c1", handler, retention_s=0.0)
    for seq in range(1, 201):
        await client.xadd(stream, {PAYLOAD_FIELD: _hb(7, seq)}, id=f"{seq}-0")
    while await ingest.step(10):
        pass
    fail_on.add(201)
    for seq in range(201, 301):
        await client.xadd(stream, {PAYLOAD_FIELD: _hb(7, seq)}, id=f"{seq}-0")
    with pytest.raises(RuntimeError, match="handler crashed"):
        await ingest.step(10)  # 201-300 delivered, 201 never acknowledged: all pending
    for seq in range(301, 321):  # not delivered yet
        await client.xadd(stream, {PAYLOAD_FIELD: _hb(7, seq)}, id=f"{seq}-0")
    removed = await ingest.trim([stream])
    left = [int(eid.decode().split("-")[0]) for eid, _ in await client.xrange(stream)]
    assert removed > 0 and removed == 320 - len(left) and ingest.trimmed == removed
    assert min(left) <= 201 and set(range(201, 321)) <= set(left)
    # Approximate trimming removes whole nodes of the stream (100 entries by default) only.
    assert min(left) > 100, min(left)
    await client.aclose()
