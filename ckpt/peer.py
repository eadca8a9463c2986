"""Peer replication: node agents ship sealed shards to the next nodes of the ring over TCP.

Wire format: each frame is a 4-byte big-endian length and a msgpack message (msgspec
structs, never pickle), followed, for a shard, by exactly ``data_bytes`` raw bytes.

- ``Push``: sender -> receiver, then the bytes; the receiver answers one ``Reply``.
- ``Fetch``: a restoring node asks for a shard; the server answers a ``Reply`` (with the
  metadata and size when it has a verified copy), then the bytes.

A receiver (a ``Push`` to the server, or the reply to ``fetch_shard``) stores the shard
by the one shard commit protocol, :func:`ckpt.commit.commit_shard`: no done marker until
the copy is complete and every entry's checksum matches; a copy that fails the check is
deleted and the sender told why. The sender paces itself with a token bucket so
replication does not compete with training traffic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Final

import msgspec

from ckpt.commit import commit_shard
from ckpt.errors import InvalidArgument, ShardUnavailable
from ckpt.format import ShardMeta, ShardState, encode
from ckpt.shard import OpenShard
from ckpt.tier import TierDir
from unicorn_core.logs import get_logger

_HEADER: Final = struct.Struct(">I")
MAX_FRAME_BYTES: Final = 64 << 20
"""Largest metadata frame accepted (a shard with very many entries); bytes follow outside it."""
DEFAULT_CHUNK_BYTES: Final = 1 << 20
_TOKEN_SLACK: Final = 1e-6


def ring_peers(nodes: Sequence[str], factor: int) -> dict[str, tuple[str, ...]]:
    """Each node's backup holders: the next ``factor`` nodes of ``nodes`` in ring order."""
    if len(set(nodes)) != len(nodes):
        raise InvalidArgument(f"node names must be unique, got {list(nodes)}")
    if (
        isinstance(factor, bool)
        or not isinstance(factor, int)
        or factor < 0
        or (nodes and factor >= len(nodes))
    ):
        raise InvalidArgument(f"replication factor must be in 0..{max(len(nodes) - 1, 0)}, got {factor!r}")
    n = len(nodes)
    return {node: tuple(nodes[(i + k) % n] for k in range(1, factor + 1)) for i, node in enumerate(nodes)}


class TokenBucket:
    """At most ``rate_bytes_s`` on average, bursts of ``burst_bytes``. Clock and sleep injectable."""

    def __init__(
        self,
        rate_bytes_s: float,
        burst_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate_bytes_s <= 0 or burst_bytes < 1:
            raise InvalidArgument(f"rate {rate_bytes_s} B/s and burst {burst_bytes} B must be positive")
        self.rate_bytes_s = float(rate_bytes_s)
        self.burst_bytes = burst_bytes
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst_bytes)
        self._last = clock()

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` (<= burst) may be sent, then spend them."""
        if nbytes > self.burst_bytes:
            raise InvalidArgument(f"{nbytes} B exceeds the burst of {self.burst_bytes} B")
        while True:
            now = self._clock()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._last) * self.rate_bytes_s)
            self._last = now
            if self._tokens >= nbytes - _TOKEN_SLACK:  # slack: float refill may land a hair short
                self._tokens = max(0.0, self._tokens - nbytes)
                return
            await self._sleep((nbytes - self._tokens) / self.rate_bytes_s)


class Push(msgspec.Struct, frozen=True, tag="push"):
    meta: bytes
    data_bytes: int


class Fetch(msgspec.Struct, frozen=True, tag="fetch"):
    job_id: str
    iteration: int
    rank: int


class Reply(msgspec.Struct, frozen=True, tag="reply"):
    ok: bool
    reason: str = ""
    meta: bytes = b""
    data_bytes: int = 0


Message = Push | Fetch | Reply
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


async def _send(writer: asyncio.StreamWriter, message: Message) -> None:
    body = _encoder.encode(message)
    writer.write(_HEADER.pack(len(body)) + body)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> Message:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ShardUnavailable("corrupt", f"frame of {size} B exceeds {MAX_FRAME_BYTES} B")
    try:
        message: Message = _decoder.decode(await reader.readexactly(size))
        return message
    except msgspec.MsgspecError as exc:
        raise ShardUnavailable("corrupt", f"bad frame: {exc}") from None


async def _send_bytes(
    writer: asyncio.StreamWriter, data: memoryview, bucket: TokenBucket | None, chunk_bytes: int
) -> None:
    if bucket is not None:
        chunk_bytes = min(chunk_bytes, bucket.burst_bytes)
    for offset in range(0, len(data), chunk_bytes):
        chunk = data[offset : offset + chunk_bytes]
        if bucket is not None:
            await bucket.take(len(chunk))
        writer.write(chunk)
        await writer.drain()


async def _receive_shard(
    reader: asyncio.StreamReader, meta_bytes: bytes, data_bytes: int, target: TierDir, chunk_bytes: int
) -> ShardMeta:
    """Commit a shard arriving on ``reader`` into ``target`` (``commit_shard``, in a thread).

    The bytes are read on the event loop, a chunk at a time, and written by the commit's
    thread, so neither the file I/O nor the verification blocks the loop.
    """
    try:
        meta = msgspec.json.decode(meta_bytes, type=ShardMeta)
    except msgspec.MsgspecError as exc:
        raise ShardUnavailable("corrupt", f"shard metadata: {exc}") from None
    if meta.job_id != target.job_id or meta.state != ShardState.SEALED or meta.data_bytes != data_bytes:
        raise ShardUnavailable(
            "refused",
            f"shard {meta.job_id}/{meta.iteration}/{meta.rank} ({meta.state}, {meta.data_bytes} B) "
            f"does not fit job {target.job_id} with {data_bytes} B announced",
        )
    loop = asyncio.get_running_loop()
    abandoned = threading.Event()
    pending: list[concurrent.futures.Future[bytes] | None] = [None]

    def receive(fd: int) -> None:  # in the commit's thread; each read runs on the event loop
        remaining = data_bytes
        while remaining:
            read = asyncio.run_coroutine_threadsafe(reader.readexactly(min(chunk_bytes, remaining)), loop)
            pending[0] = read
            if abandoned.is_set():  # checked after publishing the read: the loop cancels it, or we do
                read.cancel()
            chunk = memoryview(read.result())
            remaining -= len(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]

    commit = asyncio.ensure_future(asyncio.to_thread(commit_shard, target, meta, receive))
    try:
        await asyncio.shield(commit)
    except asyncio.CancelledError:
        # Stop the reads and let the commit remove what it wrote before the caller goes on.
        abandoned.set()
        read = pending[0]
        if read is not None:
            read.cancel()
        await asyncio.wait([commit])
        if not commit.cancelled():
            commit.exception()  # retrieved: the cancellation is what propagates
        raise
    return meta


class PeerServer:
    """One agent's replication endpoint for one job.

    Stores pushed shards in ``backup`` (this node's copy of its ring predecessors'
    snapshots) and answers fetches from ``serve`` (folders searched in order, typically
    ``backup`` and this node's shm, so a DP replica's snapshot can be served too).
    """

    def __init__(
        self, backup: TierDir, serve: Sequence[TierDir], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        self.backup = backup
        self.serve = tuple(serve)
        self.chunk_bytes = chunk_bytes
        self._server: asyncio.Server | None = None
        self._log = get_logger("ckpt.peer", job_id=backup.job_id)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen; return the bound (host, port) (``port=0`` picks a free one)."""
        self._server = await asyncio.start_server(self._handle, host, port)
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _recv(reader)
            if isinstance(request, Push):
                try:
                    meta = await _receive_shard(
                        reader, request.meta, request.data_bytes, self.backup, self.chunk_bytes
                    )
                    self._log.info("backup received", iteration=meta.iteration, rank=meta.rank)
                    await _send(writer, Reply(ok=True))
                except ShardUnavailable as exc:
                    self._log.warning("backup rejected", reason=exc.reason, detail=exc.detail)
                    await _send(writer, Reply(ok=False, reason=str(exc)))
            elif isinstance(request, Fetch):
                await self._serve_fetch(request, writer)
        except (asyncio.IncompleteReadError, ConnectionError, ShardUnavailable) as exc:
            self._log.warning("peer connection dropped", error=str(exc))
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve_fetch(self, request: Fetch, writer: asyncio.StreamWriter) -> None:
        reasons = []
        for tier in self.serve:
            if request.job_id != tier.job_id:
                reasons.append(f"{tier.tier}: serves job {tier.job_id}")
                continue
            try:
                shard = OpenShard(tier.shard(request.iteration, request.rank))
            except ShardUnavailable as exc:
                reasons.append(f"{tier.tier}: {exc}")
                continue
            with shard:
                try:
                    await asyncio.to_thread(shard.verify)
                except ShardUnavailable as exc:
                    reasons.append(f"{tier.tier}: {exc}")
                    continue
                await _send(writer, Reply(ok=True, meta=encode(shard.meta), data_bytes=shard.meta.data_bytes))
                await _send_bytes(writer, shard.data(), None, self.chunk_bytes)
                return
        await _send(writer, Reply(ok=False, reason="; ".join(reasons) or "nothing to serve"))


@contextlib.asynccontextmanager
async def _peer(
    host: str, port: int, timeout_s: float
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A connection to a peer for one exchange, all of it within ``timeout_s``; a network
    failure or timeout becomes ``ShardUnavailable("unreachable")``."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                yield reader, writer
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise ShardUnavailable("unreachable", f"peer {host}:{port}: {exc!r}") from None


async def push_shard(
    host: str,
    port: int,
    source: OpenShard,
    *,
    bucket: TokenBucket | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float = 300.0,
) -> None:
    """Send an open, sealed shard to a peer; ``ShardUnavailable`` if it was not stored."""
    async with _peer(host, port, timeout_s) as (reader, writer):
        await _send(writer, Push(meta=encode(source.meta), data_bytes=source.meta.data_bytes))
        await _send_bytes(writer, source.data(), bucket, chunk_bytes)
        reply = await _recv(reader)
    if not isinstance(reply, Reply) or not reply.ok:
        raise ShardUnavailable("refused", f"peer {host}:{port}: {getattr(reply, 'reason', reply)}")


async def fetch_shard(
    host: str,
    port: int,
    job_id: str,
    iteration: int,
    rank: int,
    *,
    target: TierDir,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float = 300.0,
) -> ShardMeta:
    """Fetch a verified copy of a shard from a peer into ``target`` (usually this node's shm)."""
    async with _peer(host, port, timeout_s) as (reader, writer):
        await _send(writer, Fetch(job_id=job_id, iteration=iteration, rank=rank))
        reply = await _recv(reader)
        if not isinstance(reply, Reply) or not reply.ok:
            raise ShardUnavailable("refused", f"peer {host}:{port}: {getattr(reply, 'reason', reply)}")
        return await _receive_shard(reader, reply.meta, reply.data_bytes, target, chunk_bytes)
