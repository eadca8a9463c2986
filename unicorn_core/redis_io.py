"""The one way unicorn talks to Redis: clients built with timeouts, failures typed.

Every client gets ``socket_timeout_s`` and ``connect_timeout_s`` from ``[redis]``, so no
call can hang. :func:`call` turns any redis-py failure into
:class:`~unicorn_core.errors.RedisCallError` carrying the command and the server's
answer, so callers handle one error type (temporary: retry later).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from unicorn_core.config import RedisConfig
from unicorn_core.errors import RedisCallError

T = TypeVar("T")


def connect(cfg: RedisConfig, *, client_name: str = "unicorn") -> aioredis.Redis:
    """An asyncio client for ``cfg.url`` (connections open lazily, on first command).

    Returns raw bytes (``decode_responses=False``): payloads are msgpack.
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
    return aioredis.Redis.from_url(cfg.url, **kwargs)  # type: ignore[arg-type]


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
