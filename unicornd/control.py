"""unicornd's control plane: typed requests, their replies, and the one client that sends them.

A request is one msgspec tagged struct (the tag is ``op``), sent as JSON under
:data:`~unicorn_core.keys.PAYLOAD_FIELD` on a control stream: users' requests
(:class:`Register`, :class:`Stop`) on ``keys.control()``, operators' (:data:`OPERATOR_REQUESTS`:
:class:`Drain`, :class:`Resume`, :class:`ConfirmDrain`) on ``keys.operator_control()``, which
Redis ACLs let only operators write. unicornd decodes it with :func:`decode_request`, handles
it, persists the outcome, and stores a :class:`Reply` (:func:`encode_reply`) with ``SET`` under
``keys.reply(stream, entry id)``. :class:`ControlClient` sends a request and waits for that
reply, so its callers (``unicornctl``, the sbatch wrapper, tests) learn whether it was taken.

Every request is validated when it is built and again when it is decoded: an empty node,
task, reason or incident, an unsigned registration, a malformed task, an unknown field or op
is refused with a clear message before anything changes (:class:`InvalidRequest` on the
client side, :class:`~unicorn_core.errors.ProtocolError` from :func:`decode_request`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final, TypeAlias, cast

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from unicorn_core import munge, redis_io
from unicorn_core.errors import InvalidArgument, ProtocolError, RedisCallError, UnicornError
from unicorn_core.jobenv import JobEnvironment
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys, check_name
from unicorn_core.slurm.hostlist import expand
from unicornd.state import TaskRecord

# --- errors ---------------------------------------------------------------------------------


class InvalidRequest(InvalidArgument, ValueError):
    """A request that cannot be valid (empty node, unsigned registration, malformed task).

    A ValueError too: msgspec turns it into a validation error while decoding, so
    :func:`decode_request` reports it as a ProtocolError.
    """


class RequestRefused(UnicornError):
    """unicornd refused the request (the reason is its message)."""


class NotOperator(UnicornError):
    """Redis refused to take the request: the caller's Redis user is not an operator."""


class NoDaemon(UnicornError):
    """No reply in time: unicornd is not running (or far behind)."""

    temporary = True


# --- requests -------------------------------------------------------------------------------


def _named(value: str, what: str) -> None:
    """A node name or task id: a non-empty Redis key component (``[A-Za-z0-9_.-]+``)."""
    if not value:
        raise InvalidRequest(f"{what} must not be empty")
    try:
        check_name(value, what)
    except InvalidArgument as e:
        raise InvalidRequest(str(e)) from None


def _filled(value: str, what: str) -> None:
    if not value.strip():
        raise InvalidRequest(f"{what} must not be empty")


class Register(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="register"):
    """A user registers a task for its Slurm job (the sbatch wrapper sends it).

    ``task``: :meth:`TaskRecord.to_dict`; ``environment``: :meth:`JobEnvironment.to_dict`
    (None: the agents' own); ``credential``: the sender's MUNGE credential over
    :func:`registration_digest`, which unicornd verifies (only the job's owner, root or the
    SlurmUser may register a task in a job).
    """

    task: dict[str, Any]
    credential: str
    environment: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.credential.strip():
            raise InvalidRequest("the request carries no MUNGE credential (credential is empty)")
        try:
            self.record()
            self.job_environment()
        except UnicornError as e:
            raise InvalidRequest(str(e)) from e

    def record(self) -> TaskRecord:
        """The task, its command checked as a registration's; raises ProtocolError (shape,
        types) or InvalidArgument (values)."""
        task = TaskRecord.from_dict(self.task)
        task.check_command()
        return task

    def job_environment(self) -> JobEnvironment | None:
        """What the training command inherits; None: the agents' own environment."""
        return None if self.environment is None else JobEnvironment.from_dict(self.environment)


class Stop(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="stop"):
    """The task's owner stops it: its agents stop (ranks save and exit), it becomes ``stopped``.
    ``why``: shown in its history (empty: unicornd says "stop requested")."""

    task: str
    why: str = ""

    def __post_init__(self) -> None:
        _named(self.task, "task")


class Drain(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="drain"):
    """An operator takes ``node`` out of service (drained in Slurm, held, tasks replanned).

    ``node``: a node, or a Slurm hostlist of nodes (``n[1-16]``, ``n1,n3``) drained with
    one reason, one replan and one Slurm call."""

    node: str
    reason: str

    def __post_init__(self) -> None:
        try:
            nodes = expand(self.node)
        except InvalidArgument as e:
            raise InvalidRequest(f"node: {e}") from None
        if not nodes:
            raise InvalidRequest("node must not be empty")
        for n in nodes:
            _named(n, "node")
        _filled(self.reason, "reason")


class Resume(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="resume"):
    """An operator brings ``node`` back (resumed in Slurm, released from hold, checked, rejoins)."""

    node: str

    def __post_init__(self) -> None:
        _named(self.node, "node")


class ConfirmDrain(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="confirm_drain"
):
    """An operator answers the drain limiter: drain the node ``incident`` waits on, then replan."""

    incident: str

    def __post_init__(self) -> None:
        _filled(self.incident, "incident")


Request: TypeAlias = Register | Stop | Drain | Resume | ConfirmDrain
OPERATOR_REQUESTS: Final = (Drain, Resume, ConfirmDrain)
"""Requests unicornd takes only from the operators' stream (which only operators may write)."""

_BY_OP: Final[dict[str, type[Request]]] = {
    str(cls.__struct_config__.tag): cls for cls in (Register, Stop, Drain, Resume, ConfirmDrain)
}
KNOWN_OPS: Final = tuple(_BY_OP)


class Reply(msgspec.Struct, frozen=True):
    """unicornd's verdict on one request: ``ok``, else why not (``detail``)."""

    ok: bool
    detail: str = ""


# --- the wire -------------------------------------------------------------------------------


def encode_request(req: Request) -> bytes:
    """The JSON payload of ``req`` (stored under PAYLOAD_FIELD)."""
    return msgspec.json.encode(req)


def _fields(cls: type[Request]) -> str:
    """``node, reason`` (``?``: optional)."""
    return ", ".join(f"{f.name}{'' if f.required else '?'}" for f in msgspec.structs.fields(cls))


def decode_request(payload: bytes) -> Request:
    """The request in ``payload``; ProtocolError (``malformed``: not JSON; ``unknown_type``: no
    or unknown ``op``; ``invalid``: missing, mistyped, unknown or empty fields) otherwise."""
    known = ", ".join(KNOWN_OPS)
    try:
        doc = msgspec.json.decode(payload)
    except msgspec.DecodeError as e:
        raise ProtocolError("malformed", f"control request is not JSON ({e}); known ops: {known}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(
            "invalid", f"control request must be a JSON object with a string 'op' (one of {known})"
        )
    op = doc.get("op")
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        what = "control request has no 'op'" if op is None else f"unknown op {op!r}"
        raise ProtocolError("unknown_type", f"{what}; known: {known}")
    try:
        return msgspec.convert(doc, cls)
    except msgspec.ValidationError as e:
        raise ProtocolError("invalid", f"{op} request: {e} (fields: {_fields(cls)})") from None


def encode_reply(r: Reply) -> bytes:
    return msgspec.json.encode(r)


def decode_reply(b: bytes) -> Reply:
    """ProtocolError when ``b`` is not a reply."""
    try:
        return msgspec.json.decode(b, type=Reply)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProtocolError("malformed", f"control reply: {e}") from None


def _digest(task: dict[str, Any], environment: dict[str, Any] | None) -> str:
    return munge.digest({"task": task, "environment": environment})


def registration_digest(req: Register) -> str:
    """What a registration's credential signs: its task and environment."""
    return _digest(req.task, req.environment)


# --- the client -----------------------------------------------------------------------------


class ControlClient:
    """Sends requests to unicornd and waits for its verdict (``unicornctl``, the wrapper, tests)."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, *, timeout_s: float = 30.0) -> None:
        self.client = client
        self.keys = keys
        self.timeout_s = timeout_s

    async def send(self, req: Request) -> Reply:
        """Send ``req`` on its stream and wait for the reply; raises RequestRefused (unicornd
        refused: the reason), NoDaemon (no reply in time), NotOperator (Redis refused an
        operator's request from a user)."""
        return await self.send_payload(encode_request(req), operator=isinstance(req, OPERATOR_REQUESTS))

    async def send_payload(self, payload: bytes, *, operator: bool = False) -> Reply:
        """:meth:`send` for a payload as is: for tests that send malformed requests on purpose."""
        stream = self.keys.operator_control() if operator else self.keys.control()
        try:
            entry = await redis_io.call(("XADD", stream), self.client.xadd(stream, {PAYLOAD_FIELD: payload}))
        except RedisCallError as e:
            if isinstance(e.__cause__, redis.exceptions.NoPermissionError):
                raise NotOperator(
                    f"Redis refused the request ({e}): these credentials are not an operator's"
                ) from e
            raise
        entry_id = entry.decode() if isinstance(entry, bytes) else str(entry)
        reply_key = self.keys.reply(stream, entry_id)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            raw = await redis_io.call(("GET", reply_key), self.client.get(reply_key))
            if raw is not None:
                reply = decode_reply(cast(bytes, raw))
                if not reply.ok:
                    raise RequestRefused(reply.detail or "refused")
                return reply
            await asyncio.sleep(0.05)
        raise NoDaemon(f"unicornd did not answer within {self.timeout_s:g}s (is it running?)")

    async def register(
        self, task: TaskRecord, *, environment: JobEnvironment | None = None, munge_socket: str = ""
    ) -> None:
        """Register ``task`` (state pending; ``job_id`` and ``nodes`` from its Slurm job), signed
        with the caller's MUNGE credential. ``environment``: what the training command
        inherits; None = the agents' own."""
        if task.job_id is None:
            raise InvalidArgument(f"task {task.task_id}: a task needs the Slurm job that holds its nodes")
        doc = task.to_dict()
        env = None if environment is None else environment.to_dict()
        credential = await munge.sign(_digest(doc, env), socket=munge_socket)
        await self.send(Register(task=doc, credential=credential, environment=env))

    async def stop(self, task_id: str, why: str) -> None:
        """Stop ``task_id``; stopping a task that already ended is accepted and changes nothing."""
        await self.send(Stop(task=task_id, why=why))

    async def drain(self, node: str, reason: str) -> None:
        await self.send(Drain(node=node, reason=reason))

    async def resume(self, node: str) -> None:
        await self.send(Resume(node=node))

    async def confirm_drain(self, incident_id: str) -> None:
        await self.send(ConfirmDrain(incident=incident_id))
