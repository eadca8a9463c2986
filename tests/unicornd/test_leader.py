"""Leader election with fencing on a real Redis: one lease, a token that only grows, and
commits that a deposed leader can no longer make."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from tests.conftest import free_port
from tests.unicornd.coord_world import task, world
from tests.unicornd.redis_world import run, stored
from unicorn_core.config import LeaderConfig
from unicorn_core.keys import RedisKeys
from unicornd.leader import Lease, LeaseLost, election
from unicornd.state import Policy
from unicornd.store import Fenced, Store, snapshot_to_json

KEYS = RedisKeys("leadtest")
CFG = LeaderConfig(lease_s=0.3)
LONG = LeaderConfig(lease_s=1.5)
"""For tests where the lease must outlive a loaded machine's stalls between renewals."""


def test_one_leader_and_a_standby_that_takes_over_with_a_newer_token(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        a, b = Lease(client, KEYS, LONG, "head-a"), Lease(client, KEYS, LONG, "head-b")
        assert await a.acquire() == 1
        assert await b.try_acquire() == 0 and await a.try_acquire() == 1  # renewal keeps the token
        keeping = asyncio.create_task(a.keep())
        waiting = asyncio.create_task(b.acquire())
        deadline = time.monotonic() + 10
        while (seen := await election(client, KEYS)) != ("head-a", 1, ["head-b"]):
            assert time.monotonic() < deadline and not keeping.done(), seen
            await asyncio.sleep(0.02)
        keeping.cancel()  # a stops renewing (dead, hung or cut off)
        stopped = time.monotonic()
        assert await asyncio.wait_for(waiting, 10) == 2
        took = time.monotonic() - stopped
        assert took <= LONG.lease_s + LONG.lease_s / 3 + 2.0, took
        assert await election(client, KEYS) == ("head-b", 2, [])
        with pytest.raises(LeaseLost):
            await a.check()
        await b.check()

    run(redis_url, body)


def test_a_deposed_leaders_commit_is_refused_and_changes_nothing(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        a, b = Lease(client, KEYS, CFG, "head-a"), Lease(client, KEYS, CFG, "head-b")
        old = Store(client, KEYS, Policy(), token=await a.acquire(), holder=a.holder)
        snap = world(2, [task("t", 1, ["n1"])])
        await old.commit(snap)
        await asyncio.sleep(CFG.lease_s + 0.1)  # a paused past its lease
        new = Store(client, KEYS, Policy(), token=await b.acquire(), holder=b.holder)
        moved = snap.apply(nodes=[snap.nodes["n2"]], plan_generation=7)
        await new.commit(moved)
        with pytest.raises(Fenced, match="another unicornd leads"):
            await old.commit(snap)  # a resumes and tries to commit what it decided
        assert await stored(client, KEYS) == snapshot_to_json(moved)
        assert await client.hgetall(KEYS.commits()) == {b"1": b"1", b"2": b"1"}  # the refused one uncounted
        assert await old.owed() == []

    run(redis_url, body)


def test_renewal_notices_a_lost_lease_and_a_clean_stop_hands_over_at_once(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        a, b = Lease(client, KEYS, LONG, "head-a"), Lease(client, KEYS, LONG, "head-b")
        await a.acquire()
        await a.release()
        assert await b.try_acquire() == 2, "no wait for the lease to run out"
        with pytest.raises(LeaseLost, match="lost the lease"):
            await asyncio.wait_for(a.keep(), 5)

    run(redis_url, body)


def test_a_second_leader_with_the_same_token_is_told_apart_by_the_lease(redis_url: str) -> None:
    """A Sentinel failover can lose the primary's last writes: here the fence's increment
    and the lease that gave head-a token 1. head-b then gets token 1 too. head-a's commit
    and side effects are refused (the lease names head-b), head-b's go through."""

    async def body(client: aioredis.Redis) -> None:
        a, b = Lease(client, KEYS, CFG, "head-a"), Lease(client, KEYS, CFG, "head-b")
        old = Store(client, KEYS, Policy(), token=await a.acquire(), holder=a.holder)
        await client.delete(KEYS.leader(), KEYS.fence())  # the promoted replica never saw them
        new = Store(client, KEYS, Policy(), token=await b.acquire(), holder=b.holder)
        assert new.token == old.token == 1
        snap = world(2, [task("t", 1, ["n1"])])
        await new.commit(snap)
        with pytest.raises(Fenced, match="lease held by 1:head-b"):
            await old.commit(snap.apply(plan_generation=9))
        assert await stored(client, KEYS) == snapshot_to_json(snap)
        with pytest.raises(LeaseLost, match="the lease is"):
            await a.check()
        await b.check()

    run(redis_url, body)


def test_a_standby_waits_out_a_redis_it_cannot_reach() -> None:
    """During a failover nothing answers: a standby keeps trying instead of exiting."""

    async def main() -> None:
        client = aioredis.Redis(port=free_port(), socket_connect_timeout=0.1)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(Lease(client, KEYS, CFG, "head-c").acquire(), 0.8)
        finally:
            await client.aclose()

    asyncio.run(main())
