"""The agent's only path to Redis: a bounded outbox that survives Redis outages.

The agent never awaits Redis on its supervision path. It puts messages in the outbox;
one writer task drains them to the ``events()`` stream (or the ``command_results()``
stream) in order. When Redis fails, the writer keeps the messages, backs off
exponentially (capped) and retries; nothing buffered is lost when Redis returns.

The buffer is bounded (``capacity`` messages). When it is full, the oldest
*iteration timing* is dropped first (they are statistics; a newer one supersedes them);
exits, exceptions, faults, GPU events and command results are only dropped when the
buffer holds nothing else, and every drop is counted in :attr:`Outbox.dropped`.
Heartbeats are not buffered: the latest one is kept aside and written first after a
reconnect (an old heartbeat is worthless; the liveness key matters).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Final

import redis.asyncio as aioredis

from unicorn_core import protocol, redis_io
from unicorn_core.errors import RedisCallError
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.logs import get_logger
from unicorn_core.protocol import CommandResult, Heartbeat, IterationTiming, Message

STREAM_MAXLEN: Final = 100_000
"""Approximate cap on the events stream (XADD MAXLEN ~), so Redis memory stays bounded."""

_BACKOFF_START_S: Final = 0.1
_BACKOFF_MAX_S: Final = 2.0

log = get_logger(__name__)


@dataclass
class OutboxStats:
    written: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    failures: int = 0
    connected: bool = True


class Outbox:
    """Ordered, bounded, reconnecting writer of agent messages (see module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        *,
        job_id: int,
        node: str,
        heartbeat_ttl_s: float,
        capacity: int = 10_000,
    ) -> None:
        self._client = client
        self._keys = keys
        self._job_id = job_id
        self._node = node
        self._ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self._capacity = capacity
        self._queue: deque[Message] = deque()
        self._heartbeat: Heartbeat | None = None
        self._wakeup = asyncio.Event()
        self.stats = OutboxStats()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, msg: Message) -> None:
        """Queue ``msg`` for Redis (never blocks, never raises)."""
        if isinstance(msg, Heartbeat):
            self._heartbeat = msg
        else:
            if len(self._queue) >= self._capacity:
                self._evict()
            self._queue.append(msg)
        self._wakeup.set()

    def _evict(self) -> None:
        for i, queued in enumerate(self._queue):
            if isinstance(queued, IterationTiming):
                del self._queue[i]
                self.stats.dropped["iter"] += 1
                return
        dropped = self._queue.popleft()
        self.stats.dropped[type(dropped).__name__] += 1

    async def run(self) -> None:
        """Drain forever; cancelled by the agent at shutdown (after :meth:`flush`)."""
        backoff = _BACKOFF_START_S
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self._drain()
            except RedisCallError as e:
                self.stats.failures += 1
                if self.stats.connected:
                    log.warning("redis_unavailable", error=str(e), buffered=len(self._queue))
                self.stats.connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                self._wakeup.set()
                continue
            if not self.stats.connected:
                log.info("redis_back", written=self.stats.written)
                self.stats.connected = True
            backoff = _BACKOFF_START_S

    async def _drain(self) -> None:
        hb = self._heartbeat
        if hb is not None:
            await self._write_heartbeat(hb)
            if self._heartbeat is hb:
                self._heartbeat = None
        while self._queue:
            # Write in batches through one pipeline; pop only what Redis accepted.
            batch = list(self._queue)[:256]
            pipe = self._client.pipeline(transaction=False)
            for msg in batch:
                stream = (
                    self._keys.command_results(self._job_id)
                    if isinstance(msg, CommandResult)
                    else self._keys.events(self._job_id)
                )
                pipe.xadd(
                    stream,
                    {PAYLOAD_FIELD: protocol.encode(msg)},
                    maxlen=STREAM_MAXLEN,
                    approximate=True,
                )
            await redis_io.call(("XADD", self._keys.events(self._job_id)), pipe.execute())
            for _ in batch:
                self._queue.popleft()
            self.stats.written += len(batch)

    async def _write_heartbeat(self, hb: Heartbeat) -> None:
        data = protocol.encode(hb)
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._keys.heartbeat(self._job_id, self._node), data, px=self._ttl_ms)
        pipe.xadd(
            self._keys.events(self._job_id), {PAYLOAD_FIELD: data}, maxlen=STREAM_MAXLEN, approximate=True
        )
        await redis_io.call(("SET", "XADD", self._keys.events(self._job_id)), pipe.execute())
        self.stats.written += 1

    async def flush(self, timeout_s: float) -> bool:
        """Try to write everything queued within ``timeout_s``; True when empty."""
        deadline = time.monotonic() + timeout_s
        while (self._queue or self._heartbeat is not None) and time.monotonic() < deadline:
            self._wakeup.set()
            await asyncio.sleep(0.02)
        return not self._queue

    async def clear_heartbeat(self) -> None:
        """Delete the liveness key (clean shutdown: the coordinator sees the agent left)."""
        with contextlib.suppress(RedisCallError):
            await redis_io.call(
                ("DEL", self._keys.heartbeat(self._job_id, self._node)),
                self._client.delete(self._keys.heartbeat(self._job_id, self._node)),
            )
