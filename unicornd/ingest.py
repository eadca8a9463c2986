"""Reading agent events from Redis through the coordinator's consumer group.

Entries are read with XREADGROUP and acknowledged (XACK) only after the handler
returned, so an event being handled when unicornd is killed stays pending and is
delivered again on restart (pending entries are read first, from id ``0``). The handler
must therefore be idempotent; the decision layer is (findings are keyed, actions carry
ids). Undecodable entries are counted, logged once per kind, and acknowledged: they can
never become valid, and leaving them pending would replay garbage forever.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Final, cast

import redis.asyncio as aioredis
import redis.exceptions

from unicorn_core import redis_io
from unicorn_core.errors import RedisCallError
from unicorn_core.keys import COORDINATOR_GROUP, PAYLOAD_FIELD
from unicorn_core.logs import get_logger
from unicorn_core.protocol import Message, SafeDecoder

log = get_logger(__name__)

Handler = Callable[[Message, float, str], Awaitable[None]]
"""(message, monotonic arrival time, stream entry id) -> None."""
RawHandler = Callable[[dict[bytes, bytes], str], Awaitable[None]]
"""(entry fields, stream entry id) -> None: for streams that do not carry protocol messages."""

_Entries = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
READ_COUNT: Final = 512


async def ensure_group(client: aioredis.Redis, stream: str) -> None:
    """Create the coordinator group on ``stream`` (and the stream) if missing."""
    try:
        await redis_io.call(
            ("XGROUP", "CREATE", stream),
            client.xgroup_create(stream, COORDINATOR_GROUP, id="0", mkstream=True),
        )
    except RedisCallError as e:
        if "BUSYGROUP" not in str(e):
            raise


class StreamIngest:
    """One consumer of ``stream`` in the coordinator group."""

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        consumer: str,
        handler: Handler | None = None,
        *,
        raw_handler: RawHandler | None = None,
    ) -> None:
        if (handler is None) == (raw_handler is None):
            raise ValueError("give exactly one of handler and raw_handler")
        self.client = client
        self.stream = stream
        self.consumer = consumer
        self.handler = handler
        self.raw_handler = raw_handler
        self.decoder = SafeDecoder()
        self.handled = 0

    async def _read(self, start: str, block_ms: int | None) -> _Entries:
        raw = await redis_io.call(
            ("XREADGROUP", self.stream),
            self.client.xreadgroup(
                COORDINATOR_GROUP, self.consumer, {self.stream: start}, count=READ_COUNT, block=block_ms
            ),
        )
        return cast(_Entries, raw or [])

    async def _handle(self, entries: _Entries) -> int:
        n = 0
        for _stream, items in entries:
            for entry_id, fields in items:
                now = time.monotonic()
                eid = entry_id.decode()
                if self.raw_handler is not None:
                    await self.raw_handler(fields, eid)
                    self.handled += 1
                else:
                    assert self.handler is not None
                    msg = self.decoder.decode(fields.get(PAYLOAD_FIELD.encode(), b""))
                    if msg is None:
                        log.warning("event_rejected", id=eid, error=str(self.decoder.last_error))
                    else:
                        await self.handler(msg, now, eid)
                        self.handled += 1
                await redis_io.call(
                    ("XACK", self.stream), self.client.xack(self.stream, COORDINATOR_GROUP, entry_id)
                )
                n += 1
        return n

    async def replay_pending(self) -> int:
        """Handle entries delivered to this consumer before a restart but never acknowledged."""
        total = 0
        while True:
            n = await self._handle(await self._read("0", None))
            total += n
            if n == 0:
                return total

    async def run(self, block_ms: int = 200) -> None:
        """Replay pending entries, then handle new ones forever."""
        await ensure_group(self.client, self.stream)
        replayed = await self.replay_pending()
        if replayed:
            log.info("events_replayed", stream=self.stream, count=replayed)
        while True:
            try:
                await self._handle(await self._read(">", block_ms))
            except RedisCallError as e:
                if isinstance(e.__cause__, redis.exceptions.ResponseError) and "NOGROUP" in str(e):
                    await ensure_group(self.client, self.stream)
                    continue
                raise
