#!/usr/bin/env python3
"""What parsing Redis replies costs unicornd's event loop: prints one JSON object.

unicornd reads every agent event with XREADGROUP, and redis-py parses each reply on the
event loop's thread. This bench writes ``--streams`` streams of ``--entries`` entries of
``--bytes`` bytes (a heartbeat's size) into a private redis-server, then reads them all
with one XREAD (RESP3, as unicornd's clients speak) through each of redis-py's two
parsers, in the same run, best of ``--repeats``: ``python_ms`` (redis-py's own parser),
``hiredis_ms`` (the hiredis C parser, which redis-py uses when hiredis is installed; a
dependency of unicorn for this), and their ratio. The physical limit is Redis's own time
to produce the reply plus the socket copy: ``raw_ms`` reads the same reply's bytes with
no parsing at all.

Run: ``.venv/bin/python scripts/bench/redis_parse.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def timed_xread(
    port: int, parser: type[Any], streams: dict[str, str], repeats: int
) -> tuple[float, int]:
    pool = aioredis.ConnectionPool(host="127.0.0.1", port=port, protocol=3, parser_class=parser)
    client = aioredis.Redis(connection_pool=pool)
    best, n = float("inf"), 0
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            reply = await client.xread(streams, count=1_000_000)
            best = min(best, time.perf_counter() - t)
            # RESP3: {stream: [[(id, fields), ...]]}
            n = sum(len(v[0]) if v and isinstance(v[0], list) else len(v) for v in reply.values())
    finally:
        await client.aclose()
        await pool.disconnect()
    return best, n


async def timed_raw(port: int, streams: dict[str, str], repeats: int) -> float:
    """The same XREAD over a plain socket, its reply read to the end unparsed."""
    args = ["XREAD", "COUNT", "1000000", "STREAMS", *streams, *streams.values()]
    wire = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"HELLO 3\r\n")
    await writer.drain()
    await reader.read(65536)  # the HELLO map: small, one read
    # Size of the reply: read it once, fully (the first call also warms Redis).
    writer.write(wire)
    await writer.drain()
    size = await _read_reply(reader)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        writer.write(wire)
        await writer.drain()
        got = 0
        while got < size:
            got += len(await reader.read(1 << 20))
        best = min(best, time.perf_counter() - t)
    writer.close()
    await writer.wait_closed()
    return best


async def _read_reply(reader: asyncio.StreamReader) -> int:
    """Bytes of one reply, read until the socket is quiet for 0.2 s (used once, to size it)."""
    size = 0
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 0.2)
        except TimeoutError:
            return size
        size += len(chunk)


async def run(args: argparse.Namespace, port: int) -> dict[str, Any]:
    writer = aioredis.Redis(port=port, protocol=3)
    payload = os.urandom(args.bytes)
    names = [f"ev{s}" for s in range(args.streams)]
    for name in names:
        pipe = writer.pipeline(transaction=False)
        for _ in range(args.entries):
            pipe.xadd(name, {"m": payload})
        await pipe.execute()
    await writer.aclose()
    streams = dict.fromkeys(names, "0")
    python_s, n = await timed_xread(port, _AsyncRESP3Parser, streams, args.repeats)
    hiredis_s, n2 = await timed_xread(port, _AsyncHiredisParser, streams, args.repeats)
    raw_s = await timed_raw(port, streams, args.repeats)
    assert n == n2 == args.streams * args.entries, (n, n2)
    return {
        "bench": "redis_parse",
        "entries": n,
        "entry_bytes": args.bytes,
        "python_ms": round(python_s * 1000, 2),
        "hiredis_ms": round(hiredis_s * 1000, 2),
        "raw_ms": round(raw_s * 1000, 2),
        "python_over_hiredis": round(python_s / hiredis_s, 2),
        "hiredis_over_raw": round(hiredis_s / raw_s, 2),
        "python_us_per_entry": round(python_s / n * 1e6, 2),
        "hiredis_us_per_entry": round(hiredis_s / n * 1e6, 2),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--entries", type=int, default=512, help="per stream (unicornd reads 512 at most)")
    ap.add_argument("--bytes", type=int, default=180)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (scripts/bootstrap installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="unicorn-bench-redis-parse-") as folder:
        server = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", folder],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            print(json.dumps(asyncio.run(run(args, port))))
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()
