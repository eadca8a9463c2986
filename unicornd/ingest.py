"""Reading agent events from Redis through the coordinator's consumer group.

Entries are read with XREADGROUP and acknowledged (XACK) only after the handler
returned and, with unicornd's :class:`AckPolicy`, only once the state they changed is
committed, so an event being handled when unicornd is killed stays pending and is
delivered again on restart (pending entries are read first, from id ``0``). The handler
must therefore be idempotent; the decision layer is (findings are keyed, actions carry
ids). Undecodable entries are counted, logged once per kind, and acknowledged: they can
never become valid, and leaving them pending would replay garbage forever.

Bounded history: with ``retention_s``, every ``TRIM_EVERY_S`` each stream read is trimmed
(``XTRIM MINID ~``) to what some group still needs (its first pending entry, else the one
it last delivered) or to ``retention_s`` before the last delivered entry, whichever is
older. Nothing unacknowledged is ever trimmed, and the recent history stays for operators
and tools; the agents' ``XADD MAXLEN ~`` cap remains the bound for a stream nobody reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol, cast

import redis.asyncio as aioredis
import redis.exceptions

from unicorn_core import redis_io
from unicorn_core.errors import RedisCallError
from unicorn_core.keys import COORDINATOR_GROUP, PAYLOAD_FIELD
from unicorn_core.logs import get_logger
from unicorn_core.protocol import Message, SafeDecoder

log = get_logger(__name__)

Handler = Callable[[Message, float, str, str], Awaitable[None]]
"""(message, monotonic arrival time, stream entry id, stream) -> None."""
RawHandler = Callable[[dict[bytes, bytes], str, str], Awaitable[None]]
"""(entry fields, stream entry id, stream) -> None: for streams that do not carry protocol messages."""

_Entries = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
READ_COUNT: Final = 512
TRIM_EVERY_S: Final = 30.0
"""How often :class:`StreamIngest` trims its streams when it keeps a bounded history."""


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def trim_bound(
    groups: Sequence[Mapping[str, Any]], pending_min: Mapping[str, str], retention_ms: int
) -> str | None:
    """The ``MINID`` to trim a stream to, from its groups (``XINFO GROUPS``: name, pending,
    last-delivered-id) and each group's first pending id: the older of what any group still
    needs and ``retention_ms`` before the newest delivered entry. None: keep everything (no
    group, or one whose pending entries are unknown). Pure."""
    if not groups:
        return None
    needed: list[tuple[int, int]] = []
    newest = (0, 0)
    for group in groups:
        delivered = _id_key(str(group["last-delivered-id"]))
        newest = max(newest, delivered)
        if int(group["pending"]) > 0:
            first = pending_min.get(str(group["name"]))
            if first is None:
                return None
            needed.append(_id_key(first))
        else:
            needed.append(delivered)
    keep_from = min(*needed, (max(newest[0] - retention_ms, 0), 0))
    return f"{keep_from[0]}-{keep_from[1]}" if keep_from > (0, 0) else None


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


Streams = Callable[[], Sequence[str]]
"""The streams to read now (re-evaluated before every read: agents' streams come and go)."""


class AckPolicy(Protocol):
    """When handled entries may be acknowledged (:class:`unicornd.core.Core` holds back
    those whose effect is not committed yet)."""

    def handled(self, stream: str, entry_id: str) -> None: ...
    def ackable(self) -> dict[str, list[str]]: ...


class _AckAtOnce:
    def __init__(self) -> None:
        self._ready: dict[str, list[str]] = {}

    def handled(self, stream: str, entry_id: str) -> None:
        self._ready.setdefault(stream, []).append(entry_id)

    def ackable(self) -> dict[str, list[str]]:
        out, self._ready = self._ready, {}
        return out


class StreamIngest:
    """One consumer, in the coordinator group, of ``stream`` or of every stream ``streams()`` names.

    The group is created on a stream the first time it is read, and entries this consumer
    was handed before a restart but never acknowledged are replayed from it first. Entries
    are acknowledged after each batch, as ``acks`` allows (default: every handled one).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str | Streams,
        consumer: str,
        handler: Handler | None = None,
        *,
        raw_handler: RawHandler | None = None,
        acks: AckPolicy | None = None,
        on_caught_up: Callable[[float], None] | None = None,
        retention_s: float | None = None,
    ) -> None:
        """``retention_s``: keep that much acknowledged history per stream and trim the rest
        (see the module doc); None: never trim."""
        if (handler is None) == (raw_handler is None):
            raise ValueError("give exactly one of handler and raw_handler")
        self.client = client
        self.streams: Streams = (lambda: (stream,)) if isinstance(stream, str) else stream
        self.consumer = consumer
        self.handler = handler
        self.raw_handler = raw_handler
        self.acks: AckPolicy = acks or _AckAtOnce()
        self.on_caught_up = on_caught_up
        """Called, after a read's entries are handled, with a monotonic time before which
        every entry of the streams read was handled: the read's send time when no stream
        filled ``READ_COUNT`` (Redis served every entry it held), or its timeout when it
        blocked and found nothing."""
        self.decoder = SafeDecoder()
        self.handled = 0
        self.retention_s = retention_s
        self.trimmed = 0
        """Entries removed by trimming (what ``XTRIM`` reported)."""
        self._next_trim = time.monotonic() + TRIM_EVERY_S
        self._ready: set[str] = set()

    async def _read(self, streams: Mapping[str, str], block_ms: int | None) -> _Entries:
        raw = await redis_io.call(
            ("XREADGROUP", *streams),
            self.client.xreadgroup(
                COORDINATOR_GROUP,
                self.consumer,
                dict(streams),  # type: ignore[arg-type]
                count=READ_COUNT,
                block=block_ms,
            ),
        )
        return cast(_Entries, raw or [])

    async def _handle(self, entries: _Entries) -> int:
        n = 0
        for stream_raw, items in entries:
            stream = stream_raw.decode()
            for entry_id, fields in items:
                now = time.monotonic()
                eid = entry_id.decode()
                if self.raw_handler is not None:
                    await self.raw_handler(fields, eid, stream)
                    self.handled += 1
                else:
                    assert self.handler is not None
                    msg = self.decoder.decode(fields.get(PAYLOAD_FIELD.encode(), b""))
                    if msg is None:
                        log.warning(
                            "event_rejected", id=eid, stream=stream, error=str(self.decoder.last_error)
                        )
                    else:
                        await self.handler(msg, now, eid, stream)
                        self.handled += 1
                self.acks.handled(stream, eid)
                n += 1
        await self.ack_ready()
        return n

    async def ack_ready(self) -> None:
        """Acknowledge what the ack policy allows now: one round trip for every stream (at
        200 jobs, one XACK per stream after each read was 200 round trips a batch)."""
        ready = self.acks.ackable()
        if not ready:
            return
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in ready.items():
            pipe.xack(stream, COORDINATOR_GROUP, *ids)
        await redis_io.call(("XACK", *ready), pipe.execute())

    async def trim(self, streams: Sequence[str]) -> int:
        """Trim each of ``streams`` to :func:`trim_bound`; returns the entries removed.
        Two round trips for all streams, plus one when some group has pending entries."""
        assert self.retention_s is not None
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        infos = await redis_io.call(("XINFO", "GROUPS", *streams), pipe.execute(raise_on_error=False))
        groups = {
            stream: [{_text(k): _text(v) for k, v in g.items()} for g in info]
            for stream, info in zip(streams, infos, strict=True)
            if isinstance(info, list)  # an error: the stream is gone
        }
        busy = [(s, str(g["name"])) for s, gs in groups.items() for g in gs if int(g["pending"]) > 0]
        pending_min: dict[str, dict[str, str]] = {}
        if busy:
            pipe = self.client.pipeline(transaction=False)
            for stream, group in busy:
                pipe.xpending(stream, group)
            for (stream, group), info in zip(
                busy,
                await redis_io.call(("XPENDING", *groups), pipe.execute(raise_on_error=False)),
                strict=True,
            ):
                if isinstance(info, dict) and info.get("min") is not None:
                    pending_min.setdefault(stream, {})[group] = _text(info["min"])
        bounds = {
            stream: bound
            for stream, gs in groups.items()
            if (bound := trim_bound(gs, pending_min.get(stream, {}), int(self.retention_s * 1000)))
        }
        if not bounds:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for stream, bound in bounds.items():
            pipe.xtrim(stream, minid=bound, approximate=True)
        removed = await redis_io.call(("XTRIM", *bounds), pipe.execute(raise_on_error=False))
        n = sum(r for r in removed if isinstance(r, int))
        self.trimmed += n
        return n

    async def _open(self, stream: str) -> None:
        """Create the group on a stream seen for the first time, then replay its pending entries."""
        await ensure_group(self.client, stream)
        replayed = 0
        while True:
            n = await self._handle(await self._read({stream: "0"}, None))
            replayed += n
            if n == 0:
                break
        if replayed:
            log.info("events_replayed", stream=stream, count=replayed)
        self._ready.add(stream)

    async def step(self, block_ms: int | None) -> int:
        """Open new streams, then handle one batch of new entries (waits up to ``block_ms``)."""
        streams = list(dict.fromkeys(self.streams()))
        for stream in streams:
            if stream not in self._ready:
                await self._open(stream)
        self._ready.intersection_update(streams)
        await self.ack_ready()
        if self.retention_s is not None and streams and time.monotonic() >= self._next_trim:
            self._next_trim = time.monotonic() + TRIM_EVERY_S
            await self.trim(streams)
        sent = time.monotonic()
        if not streams:
            await asyncio.sleep((block_ms or 0) / 1000)
            self._caught_up(sent)
            return 0
        try:
            entries = await self._read(dict.fromkeys(streams, ">"), block_ms)
            n = await self._handle(entries)
            if not entries:  # Redis answered at the timeout: it held nothing until then
                self._caught_up(min(time.monotonic(), sent + (block_ms or 0) / 1000))
            elif all(len(items) < READ_COUNT for _, items in entries):
                self._caught_up(sent)
            return n
        except RedisCallError as e:
            gone = ("NOGROUP", "UNBLOCKED")  # a stream was deleted before or while we waited on it
            if isinstance(e.__cause__, redis.exceptions.ResponseError) and any(g in str(e) for g in gone):
                self._ready.clear()  # reopen what is still listed
                return 0
            raise

    def _caught_up(self, t_s: float) -> None:
        if self.on_caught_up is not None:
            self.on_caught_up(t_s)

    async def run(self, block_ms: int = 200) -> None:
        """Replay pending entries, then handle new ones forever."""
        while True:
            await self.step(block_ms)


def _text(value: Any) -> Any:
    """A Redis reply value as text when it is bytes (the client may not decode responses)."""
    return value.decode() if isinstance(value, bytes) else value
