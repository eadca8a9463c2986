"""The goodput ledger in Redis (``keys.goodput()``): saved by the leading unicornd, read by
``unicornctl goodput``.

The ledger is advanced in memory after every commit (:class:`unicornd.core.Core`) and saved
at most every :data:`SAVE_EVERY_S`, fenced like a commit: a deposed leader's save changes
nothing. It is not in the commit's transaction on purpose: it is advisory, and a ledger
behind the snapshot loses nothing but precision (the next advance books the missed time at
the rates it saved). A stored ledger that does not decode is never overwritten: unicornd
keeps no ledger until an operator removes the key (``unicornctl goodput`` says why).
"""

from __future__ import annotations

from typing import Final

import redis.asyncio as aioredis

from unicorn_core import redis_io
from unicorn_core.keys import RedisKeys
from unicornd.goodput import Ledger, decode, encode

SAVE_EVERY_S: Final = 5.0

_SAVE: Final = """
local token = tonumber(ARGV[1])
if token > 0 then
  if tonumber(redis.call('GET', KEYS[2]) or '0') ~= token then
    return 0
  end
  local held = redis.call('GET', KEYS[3])
  if held and held ~= ARGV[2] then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[3])
return 1
"""
"""KEYS: ledger, fence, lease. ARGV: token (0: no election), the lease holder ``token:id``,
the ledger. 0: fenced, nothing written: the fence moved past the token, or the lease names
another holder (as :class:`unicornd.store.Store`'s commit checks: after a Sentinel failover
two leaders can hold the same token, and only the lease tells them apart)."""


async def read_ledger(client: aioredis.Redis, keys: RedisKeys) -> Ledger | None:
    """The stored ledger; None when there is none. Raises RedisCallError, or ProtocolError
    when the stored document is not a ledger (nothing is changed)."""
    raw = await redis_io.call(("GET", keys.goodput()), client.get(keys.goodput()))
    return None if raw is None else decode(raw)


async def save_ledger(
    client: aioredis.Redis, keys: RedisKeys, ledger: Ledger, *, token: int = 0, holder: str = ""
) -> bool:
    """Store ``ledger`` unless the fence moved past ``token`` or the lease names another
    holder than ``holder``; whether it was written."""
    written = await redis_io.call(
        ("EVAL", "save_ledger", keys.goodput()),
        client.eval(_SAVE, 3, keys.goodput(), keys.fence(), keys.leader(), token, holder, encode(ledger)),
    )
    return bool(written)
