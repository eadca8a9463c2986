"""Control requests to unicornd: one dispatch table from request type to pure decision.

Requests arrive on two streams (:mod:`unicornd.control`): users' (register, stop) on
``control``, operators' (drain, resume, confirm a drain) on ``operator_control``, which
Redis ACLs let only operators write. Each is decoded into its typed request, checked
(stream, MUNGE signature), decided, committed, and answered with a
:class:`~unicornd.control.Reply` under ``keys.reply(stream, entry id)``. A malformed,
unknown, unsigned or misplaced request gets ``ok: false`` with the reason and changes
nothing.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, Final

import redis.asyncio as aioredis

from unicorn_core import munge, redis_io
from unicorn_core.config import Config
from unicorn_core.errors import InvalidArgument, UnicornError
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.logs import get_logger
from unicorn_core.slurm.backend import SlurmBackend
from unicorn_core.slurm.scope import Scope
from unicornd import decide
from unicornd.control import (
    OPERATOR_REQUESTS,
    ConfirmDrain,
    Drain,
    Register,
    Reply,
    Request,
    Resume,
    Stop,
    decode_request,
    encode_reply,
    registration_digest,
)
from unicornd.core import Core
from unicornd.inputs import entry_time
from unicornd.state import TaskRecord

log = get_logger(__name__)

REPLY_TTL_S: Final = 3600


class Requests:
    """Handles the entries of the control streams (see the module docstring)."""

    def __init__(self, cfg: Config, core: Core, slurm: SlurmBackend, client: aioredis.Redis) -> None:
        self.cfg = cfg
        self.core = core
        self.slurm = slurm
        self.client = client
        self.keys = RedisKeys(cfg.redis.key_prefix)
        self.scope = Scope()
        """The nodes unicorn manages (unicornd sets the resolved ``[slurm]`` scope at start)."""
        self.handlers: dict[type[Any], Callable[[Any, float], Awaitable[None]]] = {
            Register: self._register,
            Stop: self._stop,
            Drain: self._drain,
            Resume: self._resume,
            ConfirmDrain: self._confirm_drain,
        }

    def streams(self) -> tuple[str, str]:
        return (self.keys.control(), self.keys.operator_control())

    async def on_entry(self, fields: dict[bytes, bytes], entry_id: str, stream: str) -> None:
        try:
            req = decode_request(fields.get(PAYLOAD_FIELD.encode(), b""))
            await self.handle(
                req, operator=stream == self.keys.operator_control(), now_s=entry_time(entry_id)
            )
        except (ValueError, UnicornError) as e:
            log.warning("control_rejected", id=entry_id, stream=stream, error=str(e))
            await self._reply(stream, entry_id, Reply(ok=False, detail=str(e)))
            return
        await self._reply(stream, entry_id, Reply(ok=True))

    async def handle(self, req: Request, *, operator: bool, now_s: float | None = None) -> None:
        """One request; ``operator``: it came on the operators' stream (only they can write it)."""
        if isinstance(req, OPERATOR_REQUESTS) and not operator:
            raise InvalidArgument(
                f"{type(req).__name__} is an operator's request: send it with unicornctl as an operator "
                f"(it goes on {self.keys.operator_control()!r}, which only operators may write)"
            )
        await self.handlers[type(req)](req, time.time() if now_s is None else now_s)

    async def _register(self, req: Register, now: float) -> None:
        task = req.record()
        environment = req.job_environment()
        await self._authenticate(req, task)
        await self._in_scope(task)
        self._gpu_types_exist(task)
        task = await self._with_slurm_facts(task)
        arrived = partial(decide.on_task_arrived, task=task, now_s=now)
        if environment is None or task.job_id is None:
            await self.core.decide(now, arrived)
            return
        # Stored before the decision, so the agents it launches find it; out of the
        # snapshot, which every user may read (the variables may hold the user's tokens).
        key = self.keys.job_env(task.job_id)
        await redis_io.call(("SET", key), self.client.set(key, environment.to_json()))
        try:
            await self.core.decide(now, arrived)
        except BaseException:
            await redis_io.call(("DEL", key), self.client.delete(key))
            raise

    async def _stop(self, req: Stop, now: float) -> None:
        why = req.why or "stop requested"
        await self.core.decide(now, partial(decide.on_task_stop, task_id=req.task, now_s=now, why=why))

    async def _drain(self, req: Drain, now: float) -> None:
        await self.core.decide(
            now, partial(decide.on_operator_drain, node=req.node, reason=req.reason, now_s=now)
        )

    async def _resume(self, req: Resume, now: float) -> None:
        if req.node not in self.core.snap.nodes:
            raise InvalidArgument(f"unknown node {req.node!r}")
        await self.core.decide(now, partial(decide.on_node_join, node=req.node, now_s=now, by_operator=True))

    async def _confirm_drain(self, req: ConfirmDrain, now: float) -> None:
        await self.core.decide(
            now, partial(decide.on_operator_confirm_drain, incident_id=req.incident, now_s=now)
        )

    def _gpu_types_exist(self, task: TaskRecord) -> None:
        """A task whose accepted GPU types no managed node has is refused: it would never
        get a GPU (a misspelt type, or a cluster without that type)."""
        kinds = {rec.gpu_type for rec in self.core.snap.nodes.values()}
        if task.gpu_types and not set(task.gpu_types) & kinds:
            have = ", ".join(sorted(k for k in kinds if k)) or "untyped GPUs only"
            raise InvalidArgument(
                f"task {task.task_id}: no node unicorn manages has GPU type {' or '.join(task.gpu_types)} "
                f"(it has: {have})"
            )

    async def _with_slurm_facts(self, task: TaskRecord) -> TaskRecord:
        """``task`` as Slurm's facts about its job make it: the GRES the job holds (a job
        holding GPUs grows by requeue) and, as its ``max_gpus``, the most GPUs Slurm's own
        policy (partition, QoS, association) lets the job hold, so no plan asks Slurm for
        more. Raises InvalidArgument (nothing registered) when that policy allows fewer
        GPUs than the task's ``min_gpus``. Facts Slurm cannot give now leave the task as
        sent (logged): a refused expansion still ends in a requeue."""
        job_id = task.job_id
        if job_id is None:
            return task
        try:
            job = await self.slurm.get_job(job_id)
        except UnicornError as e:
            log.warning("job_facts_unknown", task=task.task_id, job_id=task.job_id, error=str(e))
            return task
        task = replace(task, job_gres=job.gres) if job.gres != task.job_gres else task
        try:
            limits = await self.slurm.job_limits(job_id)
        except UnicornError as e:
            log.warning("job_limits_unknown", task=task.task_id, job_id=task.job_id, error=str(e))
            return task
        per_node = self.core.snap.gpus_per_node_of(task)
        # A job holding GRES grows only by a requeue, and 22.05 refuses to requeue a job onto
        # more nodes than it holds now ("Node count specification invalid", measured): its
        # own size bounds it (24.11 allows more; not told apart yet).
        own = job.num_nodes * per_node if job.holds_gres and job.num_nodes > 0 else None
        sources = (*limits.sources, *((f"job {job_id} holds GRES on {job.num_nodes} nodes",) if own else ()))
        caps = [
            c
            for c in (
                task.max_gpus,
                limits.max_gpus,
                None if limits.max_nodes is None else limits.max_nodes * per_node,
                own,
            )
            if c is not None
        ]
        max_gpus = min(caps) if caps else None
        if max_gpus is not None and max_gpus < task.min_gpus:
            raise InvalidArgument(
                f"job {task.job_id}: Slurm's policy ({'; '.join(sources) or 'max_gpus'}) allows at "
                f"most {max_gpus} GPUs; task {task.task_id} needs at least {task.min_gpus} (--min-gpus)"
            )
        if max_gpus != task.max_gpus:
            log.info(
                "task_capped_by_slurm_policy",
                task=task.task_id,
                max_gpus=max_gpus,
                limits=list(sources),
            )
        return replace(task, max_gpus=max_gpus) if max_gpus != task.max_gpus else task

    async def _in_scope(self, task: TaskRecord) -> None:
        """A task whose job holds nodes outside ``[slurm]``'s scope is refused: unicorn would
        have to probe, drain or plan nodes it does not manage."""
        if self.scope.everything or not task.nodes:
            return
        known = {n.name: n for n in await self.slurm.list_nodes()}
        why = [self.scope.why_outside(known[n]) for n in task.nodes if n in known]
        outside = [w for w in why if w is not None]
        if outside:
            raise InvalidArgument(
                f"job {task.job_id} holds nodes unicorn does not manage ({self.scope.describe()}): "
                + "; ".join(outside)
            )

    async def _authenticate(self, req: Register, task: TaskRecord) -> None:
        """The registration was signed (MUNGE) for exactly this request by the owner of the
        task's job, root, or unicornd's own user (the SlurmUser). Without this, anyone who
        may write the control stream could run a command inside another user's job."""
        signed = await munge.verify(req.credential, socket=self.cfg.slurm.munge_socket)
        if signed.payload != registration_digest(req):
            raise munge.NotAuthenticated("the MUNGE credential signs another request")
        if signed.uid in (0, os.getuid()):
            return
        job = await self.slurm.get_job(task.job_id or 0)
        try:
            owner = pwd.getpwnam(job.user).pw_uid
        except KeyError:
            owner = int(job.user) if job.user.isdigit() else -1
        if signed.uid != owner:
            raise munge.NotAuthenticated(
                f"job {job.job_id} belongs to {job.user}; the request was signed by uid {signed.uid}"
            )

    async def _reply(self, stream: str, entry_id: str, reply: Reply) -> None:
        key = self.keys.reply(stream, entry_id)
        await redis_io.call(("SET", "reply"), self.client.set(key, encode_reply(reply), ex=REPLY_TTL_S))
