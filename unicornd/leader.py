"""Leader election with fencing: any number of unicornd may run, one leads.

Redis holds the lease (``keys.leader()``: ``"<token>:<id>"`` with a TTL of
``[coordinator] lease_s``) and the fence (``keys.fence()``: the newest token ever granted,
a counter that only grows). A unicornd that finds no lease takes it with the next token
(:data:`_ACQUIRE`, one Lua script, so two standbys cannot both win); the leader renews it
every third of the lease. Every commit checks, in the same script that writes, that the
fence still equals the committer's token (:class:`unicornd.store.Store`): a leader that was
paused or cut off past its lease, and replaced, can no longer change anything, even if it
never noticed. A standby takes over at most ``lease_s`` plus one renewal interval after
the leader stopped renewing.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from typing import Final, cast

import redis.asyncio as aioredis

from unicorn_core import redis_io
from unicorn_core.config import LeaderConfig
from unicorn_core.errors import RedisCallError, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import get_logger

log = get_logger(__name__)

_ACQUIRE: Final = """
local held = redis.call('GET', KEYS[1])
if held then
  local token, ident = string.match(held, '^(%d+):(.*)$')
  if ident == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(token)
  end
  return 0
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. ':' .. ARGV[1], 'PX', ARGV[2])
return token
"""
"""KEYS: leader, fence. ARGV: id, lease in ms. Returns the caller's token (0: another leads).
A lease that names the caller is renewed; a free one is taken with the next token."""


class LeaseLost(UnicornError):
    """This unicornd no longer leads: another took the lease (its fence is newer)."""


def default_identity() -> str:
    """``<host>.<pid>``: unique among the unicornd of a cluster (a key component)."""
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname()) or "host"
    return f"{host}.{os.getpid()}"


class Lease:
    """This process's side of the election (see the module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        cfg: LeaderConfig,
        ident: str | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.ident = ident or default_identity()
        self.keys.standby(self.ident)  # validates the id
        self.token = 0

    @property
    def renew_every_s(self) -> float:
        return self.cfg.lease_s / 3

    async def try_acquire(self) -> int:
        """Take or renew the lease; our token, or 0 when another unicornd leads."""
        raw = await redis_io.call(
            ("EVAL", "acquire", self.keys.leader()),
            self.client.eval(
                _ACQUIRE, 2, self.keys.leader(), self.keys.fence(), self.ident, int(self.cfg.lease_s * 1000)
            ),
        )
        return int(cast(int, raw))

    async def acquire(self) -> int:
        """Wait as a standby until the lease is ours; returns the token.

        A Redis that does not answer (a failover in progress) is waited out, not fatal: a
        standby has nothing to lose.
        """
        waiting_since = time.monotonic()
        while True:
            try:
                token = await self.try_acquire()
                if not token:
                    await self._announce_standby()
            except RedisCallError as e:
                log.warning("standby_redis_unavailable", ident=self.ident, error=str(e))
                token = 0
            if token:
                self.token = token
                await redis_io.call(("DEL",), self.client.delete(self.keys.standby(self.ident)))
                log.info(
                    "leading",
                    ident=self.ident,
                    token=token,
                    waited_s=round(time.monotonic() - waiting_since, 3),
                )
                return token
            await asyncio.sleep(self.renew_every_s)

    @property
    def holder(self) -> str:
        """The lease's value while this unicornd leads: ``token:id``."""
        return f"{self.token}:{self.ident}"

    async def keep(self) -> None:
        """Renew the lease every third of it, forever; raises LeaseLost once another leads."""
        while True:
            await asyncio.sleep(self.renew_every_s)
            token = await self.try_acquire()
            if token != self.token:
                raise LeaseLost(
                    f"unicornd {self.ident} lost the lease (token {self.token}, now {token or 'another'})"
                )

    async def check(self) -> None:
        """Raise LeaseLost unless the fence still carries our token and the lease names no
        other holder (before a side effect; the commit script checks the same)."""
        fence, held = await redis_io.call(
            ("MGET", self.keys.fence()), self.client.mget(self.keys.fence(), self.keys.leader())
        )
        if fence is None or int(cast(bytes, fence)) != self.token:
            raise LeaseLost(
                f"unicornd {self.ident} (token {self.token}) is fenced off: the fence is {fence!r}"
            )
        if held is not None and cast(bytes, held).decode() != self.holder:
            raise LeaseLost(
                f"unicornd {self.ident} (token {self.token}) is fenced off: the lease is {held!r}"
            )

    async def release(self) -> None:
        """Give the lease up at a clean stop, so a standby takes over at once."""
        held = await redis_io.call(("GET",), self.client.get(self.keys.leader()))
        if held is not None and cast(bytes, held).decode() == f"{self.token}:{self.ident}":
            await redis_io.call(("DEL",), self.client.delete(self.keys.leader()))

    async def _announce_standby(self) -> None:
        doc = json.dumps(
            {"ident": self.ident, "host": socket.gethostname(), "pid": os.getpid(), "t": time.time()}
        )
        key = self.keys.standby(self.ident)
        await redis_io.call(("SET", key), self.client.set(key, doc, px=int(self.cfg.lease_s * 1000)))


async def election(client: aioredis.Redis, keys: RedisKeys) -> tuple[str | None, int, list[str]]:
    """(the leader's id or None, the current fence, the standbys' ids): for ``unicornctl status``."""
    held = await redis_io.call(("GET",), client.get(keys.leader()))
    fence = await redis_io.call(("GET",), client.get(keys.fence()))
    standbys: list[str] = []
    async for key in client.scan_iter(match=keys.standbys()):
        standbys.append(cast(bytes, key).decode().rsplit(":", 1)[-1])
    leader = cast(bytes, held).decode().split(":", 1)[1] if held is not None else None
    return leader, int(cast(bytes, fence)) if fence is not None else 0, sorted(standbys)
