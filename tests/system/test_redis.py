"""The dev cluster's Redis: password-protected, streams carry the wire protocol."""

from __future__ import annotations

import os
import time

import pytest

from tests.conftest import DevCluster
from unicorn_core import redis_io
from unicorn_core.config import RedisConfig
from unicorn_core.errors import RedisCallError
from unicorn_core.keys import COORDINATOR_GROUP, PAYLOAD_FIELD, RedisKeys
from unicorn_core.protocol import Heartbeat, IterationTiming, SafeDecoder, decode, encode

pytestmark = pytest.mark.system


def cfg(cluster: DevCluster, **kw: object) -> RedisConfig:
    return RedisConfig(url=cluster.redis_url, **kw)  # type: ignore[arg-type]


async def test_password_required(cluster: DevCluster) -> None:
    good = redis_io.connect(cfg(cluster))
    assert await redis_io.call(("PING",), good.ping()) is True
    await good.aclose()
    no_password = cluster.redis_url.split("@", 1)[1]
    bad = redis_io.connect(RedisConfig(url=f"redis://{no_password}"))
    with pytest.raises(RedisCallError) as ei:
        await redis_io.call(("SET", "x"), bad.set("x", "1"))
    assert ei.value.command == ("SET", "x")
    await bad.aclose()


async def test_unreachable_server_is_a_typed_timely_error() -> None:
    client = redis_io.connect(RedisConfig(url="redis://127.0.0.1:1/0", connect_timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(RedisCallError) as ei:
        await redis_io.call(("PING",), client.ping())
    assert time.monotonic() - t0 < 10 and ei.value.temporary
    await client.aclose()


async def test_stream_carries_protocol_and_garbage_is_counted(cluster: DevCluster) -> None:
    keys = RedisKeys(prefix=f"t{os.getpid()}")
    r = redis_io.connect(cfg(cluster))
    stream = keys.events(7)
    await r.xgroup_create(stream, COORDINATOR_GROUP, id="0", mkstream=True)
    hb = Heartbeat(
        job_id=7, node="n1", wall_time_s=time.time(), agent_pid=42, pids=[43, 44], iteration=5, seq=1
    )
    it = IterationTiming(
        job_id=7, node="n1", wall_time_s=time.time(), rank=0, iteration=6, duration_s=0.04, samples=8
    )
    await r.xadd(stream, {PAYLOAD_FIELD: encode(hb)})
    await r.xadd(stream, {PAYLOAD_FIELD: b"\xc1garbage"})
    await r.xadd(stream, {PAYLOAD_FIELD: encode(it)[:-3]})
    await r.xadd(stream, {PAYLOAD_FIELD: encode(it)})
    got = await r.xreadgroup(COORDINATOR_GROUP, "c1", {stream: ">"}, count=10, block=1000)
    entries = got[0][1]
    decoder = SafeDecoder()
    messages = [decoder.decode(fields[PAYLOAD_FIELD.encode()]) for _, fields in entries]
    assert messages == [hb, None, None, it]
    assert decoder.decoded == 2 and sum(decoder.failures.values()) == 2
    assert decode(encode(hb)) == hb
    await r.xack(stream, COORDINATOR_GROUP, *[eid for eid, _ in entries])
    pending = await r.xpending(stream, COORDINATOR_GROUP)
    assert pending["pending"] == 0
    await r.delete(stream)
    await r.aclose()
