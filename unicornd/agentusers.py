"""The Redis users of jobs' agents: made when a job's agents are first launched, deleted
(with the job's streams) once no task may run under that job again.

With ``redis.agent_acl`` each job gets its own Redis user (:func:`unicorn_core.acl.agent_rules`),
confined to that job's heartbeats, events, command results and commands. Its password is
made once per job and kept under a key only unicornd reads, so relaunching some of a job's
agents does not lock out the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import redis.asyncio as aioredis

from unicorn_core import acl, redis_io
from unicorn_core.config import RedisConfig
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import get_logger
from unicorn_core.slurm.types import JobInfo
from unicornd.state import ENDED_STATES, Snapshot

log = get_logger(__name__)


class AgentUsers:
    """Agent users and the set of jobs whose streams are gone for good."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, cfg: RedisConfig) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.forgotten: set[int] = set()
        """Jobs whose streams were deleted: no longer read (this only avoids reading a
        stream that is gone; it changes no decision)."""

    async def env(self, job_id: int) -> dict[str, str]:
        """The Redis credentials of ``job_id``'s agents, as config overrides for their environment."""
        self.forgotten.discard(job_id)
        if not self.cfg.agent_acl:
            return {}
        key = self.keys.agent_password(job_id)
        await redis_io.call(("SET", key), self.client.set(key, acl.new_password(), nx=True))
        password = cast(bytes, await redis_io.call(("GET", key), self.client.get(key))).decode()
        user = acl.agent_user(self.keys, job_id)
        await acl.set_user(self.client, user, acl.agent_rules(self.keys, job_id, password))
        return {
            "UNICORN_REDIS__URL": acl.url_with_user(self.cfg.url, user, password),
            "UNICORN_REDIS__PASSWORD_FILE": "",
        }

    async def restore(self, snap: Snapshot) -> list[int]:
        """Make again the users of the jobs whose tasks may still run, from their stored
        passwords: Redis keeps users in its config, not in its data, so a Redis restart
        (its append-only file brings the passwords back) leaves the running agents unable to
        log in until unicornd, starting, restores them. Returns the jobs restored."""
        if not self.cfg.agent_acl:
            return []
        restored = []
        for job in sorted(
            {t.job_id for t in snap.tasks.values() if t.job_id is not None and t.state not in ENDED_STATES}
        ):
            key = self.keys.agent_password(job)
            password = await redis_io.call(("GET", key), self.client.get(key))
            if password is None:
                continue  # its agents were never launched
            rules = acl.agent_rules(self.keys, job, cast(bytes, password).decode())
            await acl.set_user(self.client, acl.agent_user(self.keys, job), rules)
            restored.append(job)
        return restored

    async def forget_gone(self, snap: Snapshot, jobs: Mapping[int, JobInfo]) -> None:
        """Delete the Redis user, password and streams of jobs whose agents are gone for good:
        no task that may still run holds the job, and Slurm has no running or pending job by
        that id (the job's steps, agents included, end with it)."""
        if not self.cfg.agent_acl:
            return
        held = {
            t.job_id
            for t in snap.tasks.values()
            if t.job_id is not None
            and (t.state not in ENDED_STATES or (t.job_id in jobs and not jobs[t.job_id].state.finished))
        }
        for user in await acl.users(self.client):
            job = acl.agent_job(self.keys, user)
            if job is None or job in held:
                continue
            self.forgotten.add(job)  # stop reading its streams before they are deleted
            await acl.delete_user(self.client, user)
            gone = (
                self.keys.agent_password(job),
                self.keys.job_env(job),
                self.keys.events(job),
                self.keys.command_results(job),
            )
            await redis_io.call(("DEL", *gone), self.client.delete(*gone))
            log.info("agent_user_deleted", job_id=job, user=user)
