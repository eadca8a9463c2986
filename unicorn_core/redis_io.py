"""The one way unicorn talks to Redis: clients built with timeouts, failures typed.

Every client gets ``socket_timeout_s`` and ``connect_timeout_s`` from ``[redis]``, so no
call can hang. :func:`call` turns any redis-py failure into
:class:`~unicorn_core.errors.RedisCallError` carrying the command and the server's
answer, so callers handle one error type (temporary: retry later).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TypeVar, cast
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.sentinel import Sentinel

from unicorn_core.config import RedisConfig
from unicorn_core.errors import RedisCallError

T = TypeVar("T")


def connect(cfg: RedisConfig, *, client_name: str = "unicorn") -> aioredis.Redis:
    """An asyncio client for ``cfg.url`` (connections open lazily, on first command).

    With ``[redis] sentinels``, a client of the primary the sentinels name for
    ``master_name``: redis-py's Sentinel pool asks them again whenever a connection fails
    or the server it reaches answers as a replica (READONLY after a failover), so every
    process follows a failover by reconnecting; its calls fail (as RedisCallError) until
    the new primary is known. Returns raw bytes (``decode_responses=False``): payloads are
    msgpack.
    """
    kwargs: dict[str, object] = {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "decode_responses": False,
        "client_name": client_name,
        "health_check_interval": 30,
    }
    password = cfg.password()
    if password is not None:
        kwargs["password"] = password
    if not cfg.sentinels:
        return aioredis.Redis.from_url(cfg.url, **kwargs)  # type: ignore[arg-type]
    parts = urlsplit(cfg.url)
    if parts.username:
        kwargs["username"] = unquote(parts.username)
    if parts.password and password is None:
        kwargs["password"] = unquote(parts.password)
    db = parts.path.strip("/")
    kwargs["db"] = int(db) if db.isdigit() else 0
    if parts.scheme == "rediss":
        kwargs["ssl"] = True
    sentinel_kwargs: dict[str, object] = {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
    }
    sentinel_password = cfg.sentinel_password()
    if sentinel_password is not None:
        sentinel_kwargs["password"] = sentinel_password
    sentinel = Sentinel(cfg.sentinel_endpoints(), sentinel_kwargs=sentinel_kwargs, **kwargs)  # type: ignore[no-untyped-call]
    return cast(aioredis.Redis, sentinel.master_for(cfg.master_name))


async def eval_replicated(
    client: aioredis.Redis, cfg: RedisConfig, command: Sequence[str], script: str, numkeys: int, *args: object
) -> tuple[object, bool]:
    """Run a Lua script and, with ``[redis] wait_replicas``, WAIT up to
    ``wait_timeout_ms`` for that many replicas to hold it: (the script's answer, whether
    the replicas hold it; True when none is asked for).

    Both go through one pipeline, so they share a connection: WAIT counts the writes of
    the connection it runs on, and from another pooled connection it would answer at once
    about nothing. A script error raises RedisCallError (the WAIT does not run).
    """
    if cfg.wait_replicas <= 0:
        return await call(command, client.eval(script, numkeys, *args)), True  # type: ignore[arg-type]
    pipe = client.pipeline(transaction=False)
    pipe.eval(script, numkeys, *args)  # type: ignore[arg-type]
    pipe.execute_command("WAIT", cfg.wait_replicas, cfg.wait_timeout_ms)
    answer, acked = await call(command, pipe.execute(raise_on_error=True))
    return answer, int(acked) >= cfg.wait_replicas


async def call(command: Sequence[str], awaitable: Awaitable[T]) -> T:
    """Await one Redis operation; redis-py errors become :class:`RedisCallError`.

    ``command`` names the operation for the error (e.g. ``("XADD", key)``); values are
    not included so payloads and secrets never land in logs.
    """
    try:
        return await awaitable
    except redis.exceptions.TimeoutError as e:
        raise RedisCallError(command, None, message=f"timed out: {e}") from e
    except redis.exceptions.RedisError as e:
        raise RedisCallError(command, None, message=f"{type(e).__name__}: {e}") from e
    except OSError as e:
        raise RedisCallError(command, None, message=f"{type(e).__name__}: {e}") from e
