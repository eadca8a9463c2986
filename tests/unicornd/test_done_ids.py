"""The ids of executed actions are kept a week, by when they ran (unicornd.store.KEEP_DONE_S),
and the untimed set of earlier versions is moved over at start: on a real Redis."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from tests.unicornd.redis_world import run
from unicorn_core.keys import RedisKeys
from unicornd.actions import DrainNode
from unicornd.state import Policy, Snapshot
from unicornd.store import KEEP_DONE_S, Store

KEYS = RedisKeys("doneidstest")


def empty() -> Snapshot:
    return Snapshot(tasks={}, nodes={}, gpus_per_node=8, policy=Policy())


def test_a_finished_action_is_done_and_ids_older_than_a_week_are_dropped(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        await client.delete(KEYS.actions_done_at(), KEYS.actions_done(), KEYS.actions_pending())
        store = Store(client, KEYS, Policy())
        await client.zadd(
            KEYS.actions_done_at(), {"old": time.time() - KEEP_DONE_S - 60, "recent": time.time() - 60}
        )
        drain = DrainNode("inc.1:isolate", "n1", "unicorn: test")
        await store.commit(empty(), [drain])
        (owed,) = await store.owed()
        assert not await store.done(drain.action_id)
        before = time.time()
        await store.commit(empty(), finished=owed)
        assert await store.owed() == []
        assert await store.done(drain.action_id) and await store.done("recent")
        assert not await store.done("old")  # dropped by the commit that recorded the new one
        score = await client.zscore(KEYS.actions_done_at(), drain.action_id)
        assert score is not None and before <= score <= time.time()

    run(redis_url, body)


def test_the_untimed_done_set_is_moved_over_whole(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        await client.delete(KEYS.actions_done_at(), KEYS.actions_done())
        store = Store(client, KEYS, Policy())
        ids = [f"inc.{i}:restart" for i in range(2500)]  # more than one batch of 1,000
        await client.sadd(KEYS.actions_done(), *ids)
        await client.zadd(KEYS.actions_done_at(), {ids[0]: 5.0})  # already timed: kept as it was
        assert await store.move_untimed_done() == 2500
        assert not await client.exists(KEYS.actions_done())
        assert await client.zcard(KEYS.actions_done_at()) == 2500
        assert await client.zscore(KEYS.actions_done_at(), ids[0]) == 5.0
        assert await store.done(ids[-1])
        assert await store.move_untimed_done() == 0  # nothing left: a restart moves nothing

    run(redis_url, body)
