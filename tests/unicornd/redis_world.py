"""Helpers for tests of unicornd's state on a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis

from unicorn_core import redis_io
from unicorn_core.config import load_config
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import reset_logging
from unicorn_core.slurm.backend import SlurmBackend
from unicornd.daemon import Daemon
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


async def until(what: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Wait until ``what()`` holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_daemon(
    slurm: SlurmBackend, redis_url: str, prefix: str, *, exits_cleanly: bool = True
) -> AsyncIterator[Daemon]:
    """A real unicornd on ``slurm`` (agent ACLs off), once its state is loaded; stopped
    after (``exits_cleanly``: its exit status must be 0), its client closed."""
    env = {
        "UNICORN_REDIS__URL": redis_url,
        "UNICORN_REDIS__KEY_PREFIX": prefix,
        "UNICORN_REDIS__AGENT_ACL": "0",
    }
    cfg = load_config(None, env=env)
    client = redis_io.connect(cfg.redis, client_name="test-unicornd")
    daemon = Daemon(cfg, slurm, client)
    running = asyncio.create_task(daemon.run())
    try:
        await until(lambda: daemon.snapshot is not None)
        yield daemon
    finally:
        daemon._stop.set()
        status = await asyncio.wait_for(running, 30)
        await client.aclose()
        reset_logging()
    if exits_cleanly:
        assert status == 0
