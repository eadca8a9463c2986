"""Helpers for tests of unicornd's state on a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from unicorn_core.keys import RedisKeys
from unicornd.state import Policy
from unicornd.store import read_snapshot, snapshot_to_json


def run(redis_url: str, body: Callable[[aioredis.Redis], Awaitable[None]]) -> None:
    """``body`` with a client of ``redis_url``, closed after."""

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await body(client)
        finally:
            await client.aclose()

    asyncio.run(main())


async def stored(client: aioredis.Redis, keys: RedisKeys) -> str:
    """The snapshot committed under ``keys`` as one document (records in their committed
    order)."""
    snap = await read_snapshot(client, keys, Policy())
    assert snap is not None
    return snapshot_to_json(snap)
