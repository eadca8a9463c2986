"""Requests to a running unicornd: register a task, resume a node, confirm a drain.

A request is one JSON document on a control stream: users' requests (register, stop) on
``control``, operators' (drain, resume) on ``operator_control``, which Redis ACLs let
only operators write. unicornd handles it, persists the outcome, and writes a reply under
``keys.reply(stream, entry id)``. :func:`request` waits
for that reply, so callers (the sbatch wrapper, ``unicornctl``, tests) learn whether it
was accepted. Requests are validated here first, so bad input is refused before it is
sent and changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions

from unicorn_core import munge, redis_io
from unicorn_core.errors import InvalidArgument, RedisCallError, UnicornError
from unicorn_core.jobenv import JobEnvironment
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicornd.state import TaskRecord


class RequestRefused(UnicornError):
    """unicornd refused the request (the reason is its message)."""


class NotOperator(UnicornError):
    """Redis refused to take the request: the caller's Redis user is not an operator."""


class NoDaemon(UnicornError):
    """No reply in time: unicornd is not running (or far behind)."""

    temporary = True


async def request(
    client: aioredis.Redis,
    keys: RedisKeys,
    doc: Mapping[str, Any],
    *,
    timeout_s: float = 30.0,
    operator: bool = False,
) -> None:
    """Send ``doc`` to unicornd and wait for its verdict; raises RequestRefused / NoDaemon.

    ``operator``: send it on the operators' stream (drain, resume), which only the
    operator and coordinator Redis users may write; a user's client gets NotOperator.
    """
    stream = keys.operator_control() if operator else keys.control()
    try:
        entry = await redis_io.call(
            ("XADD", stream), client.xadd(stream, {PAYLOAD_FIELD: json.dumps(dict(doc))})
        )
    except RedisCallError as e:
        if isinstance(e.__cause__, redis.exceptions.NoPermissionError):
            raise NotOperator(
                f"Redis refused the request ({e}): these credentials are not an operator's"
            ) from e
        raise
    reply_key = keys.reply(stream, cast(bytes, entry).decode())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = await redis_io.call(("GET", reply_key), client.get(reply_key))
        if raw is not None:
            reply = json.loads(cast(bytes, raw))
            if not reply.get("ok"):
                raise RequestRefused(str(reply.get("detail", "refused")))
            return
        await asyncio.sleep(0.05)
    raise NoDaemon(f"unicornd did not answer within {timeout_s:g}s (is it running?)")


async def register_task(
    client: aioredis.Redis,
    keys: RedisKeys,
    task: TaskRecord,
    *,
    timeout_s: float = 30.0,
    environment: JobEnvironment | None = None,
    munge_socket: str = "",
) -> None:
    """Register ``task`` (state pending; ``job_id`` and ``nodes`` from its Slurm job).

    ``environment``: what the training command inherits (the job's exported variables and
    working directory); None = the agents' own (unicornd's) environment. The request is
    signed with the caller's MUNGE credential (:func:`registration_digest`): unicornd takes
    it only from the job's owner, root or the SlurmUser.
    """
    if task.job_id is None:
        raise InvalidArgument(f"task {task.task_id}: a task needs the Slurm job that holds its nodes")
    doc: dict[str, Any] = {"op": "register", "task": task.to_dict()}
    if environment is not None:
        doc["environment"] = environment.to_dict()
    doc["credential"] = await munge.sign(registration_digest(doc), socket=munge_socket)
    await request(client, keys, doc, timeout_s=timeout_s)


def registration_digest(doc: Mapping[str, Any]) -> str:
    """What a registration's credential signs: its task and environment."""
    return munge.digest({"task": doc.get("task"), "environment": doc.get("environment")})


async def resume_node(client: aioredis.Redis, keys: RedisKeys, node: str, *, timeout_s: float = 30.0) -> None:
    """An operator's resume: unicornd resumes the node in Slurm and lets it rejoin (after its check)."""
    await request(client, keys, {"op": "resume", "node": node}, timeout_s=timeout_s, operator=True)


async def stop_task(
    client: aioredis.Redis, keys: RedisKeys, task_id: str, why: str, *, timeout_s: float = 30.0
) -> None:
    """The task's owner stops it: its agents stop (ranks save and exit), it becomes ``stopped``.

    Stopping a task that already ended or stopped is accepted and changes nothing.
    """
    await request(client, keys, {"op": "stop", "task": task_id, "why": why}, timeout_s=timeout_s)
