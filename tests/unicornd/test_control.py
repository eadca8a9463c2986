"""The typed control plane (:mod:`unicornd.control`): every request on the wire and back,
every malformed payload refused with a clear message, and the client against a real
redis-server with a stand-in unicornd that answers on the reply key."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.unicornd.coord_world import task
from unicorn_core import acl, munge
from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.jobenv import JobEnvironment
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicornd import control
from unicornd.control import (
    OPERATOR_REQUESTS,
    ConfirmDrain,
    ControlClient,
    Drain,
    InvalidRequest,
    NoDaemon,
    NotOperator,
    Register,
    Reply,
    Request,
    RequestRefused,
    Resume,
    Stop,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    registration_digest,
)
from unicornd.state import TaskState

KEYS = RedisKeys("ctltest")
TASK = task("a", 7, [], state=TaskState.PENDING)
ENV = JobEnvironment(cwd="/home/u", env={"TRAINING_MARKER": "x"})


def register() -> Register:
    return Register(task=TASK.to_dict(), credential="MUNGE:cred:", environment=ENV.to_dict())


EVERY: list[Request] = [
    register(),
    Register(task=TASK.to_dict(), credential="MUNGE:cred:"),
    Stop(task="a", why="time limit near"),
    Stop(task="a"),
    Drain(node="n1", reason="fan failing"),
    Resume(node="n1"),
    ConfirmDrain(incident="node.n1.lost:7:n1:1700000000.000"),
]


@pytest.mark.parametrize("req", EVERY, ids=lambda r: type(r).__name__)
def test_every_request_survives_the_wire(req: Request) -> None:
    payload = encode_request(req)
    doc = json.loads(payload)
    assert doc["op"] == type(req).__struct_config__.tag
    assert decode_request(payload) == req


def test_register_gives_back_the_task_and_environment() -> None:
    req = decode_request(encode_request(register()))
    assert isinstance(req, Register)
    assert req.record() == TASK and req.job_environment() == ENV
    assert Register(task=TASK.to_dict(), credential="MUNGE:c").job_environment() is None


def test_registration_digest_is_the_munge_digest_of_task_and_environment() -> None:
    """The same value as before the typed requests, so signed requests stay valid."""
    req = register()
    assert registration_digest(req) == munge.digest({"task": TASK.to_dict(), "environment": ENV.to_dict()})
    bare = Register(task=TASK.to_dict(), credential="MUNGE:other")
    assert registration_digest(bare) == munge.digest({"task": TASK.to_dict(), "environment": None})
    assert registration_digest(bare) != registration_digest(req)


def test_only_drain_resume_and_confirm_are_operators_requests() -> None:
    assert (Drain, Resume, ConfirmDrain) == OPERATOR_REQUESTS


# --- malformed payloads: each refused with ProtocolError and a message that says why -----------

TASK_DOC = TASK.to_dict()
MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    # register
    ("register: no task", {"op": "register", "credential": "MUNGE:c"}, "missing required field `task`"),
    ("register: no credential", {"op": "register", "task": TASK_DOC}, "missing required field `credential`"),
    ("register: task not an object", {"op": "register", "task": [1], "credential": "MUNGE:c"}, "`object`"),
    ("register: credential not a string", {"op": "register", "task": TASK_DOC, "credential": 5}, "`str`"),
    (
        "register: unknown field",
        {"op": "register", "task": TASK_DOC, "credential": "MUNGE:c", "ok": True},
        "unknown field `ok`",
    ),
    ("register: unsigned", {"op": "register", "task": TASK_DOC, "credential": ""}, "no MUNGE credential"),
    ("register: empty task", {"op": "register", "task": {}, "credential": "MUNGE:c"}, "task_id"),
    (
        "register: invalid task",
        {"op": "register", "task": {**TASK_DOC, "command": []}, "credential": "MUNGE:c"},
        "command must not be empty",
    ),
    (
        "register: megatron command that sets the layout",
        {
            "op": "register",
            "task": {
                **TASK_DOC,
                "framework": "megatron",
                "command": [
                    "/w/pretrain_gpt.py",
                    "--save",
                    "/c",
                    "--save-interval",
                    "5",
                    "--micro-batch-size=2",
                ],
            },
            "credential": "MUNGE:c",
        },
        "--micro-batch-size cannot be given to a task under unicorn",
    ),
    (
        "register: invalid environment",
        {"op": "register", "task": TASK_DOC, "credential": "MUNGE:c", "environment": {"cwd": "x", "env": {}}},
        "absolute path",
    ),
    # stop
    ("stop: no task", {"op": "stop", "why": "x"}, "missing required field `task`"),
    ("stop: task not a string", {"op": "stop", "task": 3}, "Expected `str`, got `int` - at `$.task`"),
    ("stop: why not a string", {"op": "stop", "task": "a", "why": None}, "at `$.why`"),
    ("stop: unknown field", {"op": "stop", "task": "a", "ok": False}, "unknown field `ok`"),
    ("stop: empty task", {"op": "stop", "task": ""}, "task must not be empty"),
    ("stop: task not a name", {"op": "stop", "task": "a b"}, "must match [A-Za-z0-9_.-]+"),
    # drain
    ("drain: no reason", {"op": "drain", "node": "n1"}, "missing required field `reason`"),
    ("drain: no node", {"op": "drain", "reason": "x"}, "missing required field `node`"),
    ("drain: node not a string", {"op": "drain", "node": ["n1"], "reason": "x"}, "at `$.node`"),
    (
        "drain: unknown field",
        {"op": "drain", "node": "n1", "reason": "x", "force": 1},
        "unknown field `force`",
    ),
    ("drain: empty node", {"op": "drain", "node": "", "reason": "x"}, "node must not be empty"),
    ("drain: blank reason", {"op": "drain", "node": "n1", "reason": "  \n"}, "reason must not be empty"),
    # resume
    ("resume: no node", {"op": "resume"}, "missing required field `node`"),
    ("resume: node not a string", {"op": "resume", "node": 1}, "Expected `str`, got `int`"),
    ("resume: unknown field", {"op": "resume", "node": "n1", "reason": "x"}, "unknown field `reason`"),
    ("resume: empty node", {"op": "resume", "node": ""}, "node must not be empty"),
    # confirm_drain
    ("confirm_drain: no incident", {"op": "confirm_drain"}, "missing required field `incident`"),
    ("confirm_drain: incident not a string", {"op": "confirm_drain", "incident": 1.5}, "at `$.incident`"),
    (
        "confirm_drain: unknown field",
        {"op": "confirm_drain", "incident": "a.1", "node": "n1"},
        "unknown field `node`",
    ),
    ("confirm_drain: empty incident", {"op": "confirm_drain", "incident": " "}, "incident must not be empty"),
]


@pytest.mark.parametrize(("doc", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_requests_are_refused_clearly(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_request(json.dumps(doc).encode())
    err = caught.value
    assert err.kind == "invalid" and message in str(err), str(err)
    assert str(err).startswith(f"invalid: {doc['op']} request: ")  # names the request...
    assert "(fields: " in str(err)  # ...and the fields it takes


def test_every_request_type_has_malformed_cases() -> None:
    ops = {m[1]["op"] for m in MALFORMED}
    assert ops == set(control.KNOWN_OPS)


@pytest.mark.parametrize(
    ("payload", "kind", "message"),
    [
        (b'{"op": "finish", "task": "a", "ok": true}', "unknown_type", "unknown op 'finish'"),
        (b'{"op": 7}', "unknown_type", "unknown op 7"),
        (b'{"node": "n1"}', "unknown_type", "control request has no 'op'"),
        (b'["drain", "n1"]', "invalid", "must be a JSON object"),
        (b"drain n1", "malformed", "not JSON"),
        (b"", "malformed", "not JSON"),
        (b"\xff\xfe", "malformed", "not JSON"),
    ],
)
def test_unknown_ops_and_non_json_are_refused_listing_the_known_ops(
    payload: bytes, kind: str, message: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_request(payload)
    assert caught.value.kind == kind and message in str(caught.value)
    assert "register, stop, drain, resume, confirm_drain" in str(caught.value)


def test_requests_that_cannot_be_valid_cannot_be_built() -> None:
    """The client refuses bad input before anything is sent (InvalidArgument)."""
    for build, message in [
        (lambda: Drain(node="n1", reason=" "), "reason must not be empty"),
        (lambda: Drain(node="", reason="x"), "node must not be empty"),
        (lambda: Resume(node="n1;rm"), "must match"),
        (lambda: Stop(task=""), "task must not be empty"),
        (lambda: ConfirmDrain(incident=""), "incident must not be empty"),
        (lambda: Register(task=TASK_DOC, credential=""), "no MUNGE credential"),
        (lambda: Register(task={"task_id": "a"}, credential="MUNGE:c"), "TaskRecord"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            build()
    assert issubclass(InvalidRequest, InvalidArgument)


def test_replies_round_trip_and_bad_ones_are_protocol_errors() -> None:
    for reply in (Reply(ok=True), Reply(ok=False, detail="unknown node 'n9'")):
        assert decode_reply(encode_reply(reply)) == reply
    # What unicornd wrote before the typed replies (json.dumps) still reads.
    assert decode_reply(b'{"ok": false, "detail": "no"}') == Reply(False, "no")
    for bad in (b"yes", b'{"detail": "x"}', b'{"ok": "yes"}'):
        with pytest.raises(ProtocolError):
            decode_reply(bad)


# --- the client against a real Redis -----------------------------------------------------------


async def _serve(
    client: aioredis.Redis, answer: Callable[[str, Request], Reply], seen: list[Request]
) -> None:
    """A stand-in unicornd: decodes each request of both streams and replies as ``answer`` says."""
    last = {KEYS.control(): "0-0", KEYS.operator_control(): "0-0"}
    while True:
        got = await client.xread(last, block=50)  # type: ignore[arg-type]
        for raw_stream, entries in got or []:
            stream = raw_stream.decode()
            for raw_id, fields in entries:
                entry_id = raw_id.decode()
                last[stream] = entry_id
                try:
                    req = decode_request(fields[PAYLOAD_FIELD.encode()])
                except ProtocolError as e:
                    reply = Reply(ok=False, detail=str(e))
                else:
                    seen.append(req)
                    reply = answer(stream, req)
                await client.set(KEYS.reply(stream, entry_id), encode_reply(reply))


async def _with_daemon(
    url: str, answer: Callable[[str, Request], Reply], body: Callable[[ControlClient], Awaitable[None]]
) -> list[Request]:
    client = aioredis.Redis.from_url(url)
    seen: list[Request] = []
    serving = asyncio.create_task(_serve(aioredis.Redis.from_url(url), answer, seen))
    try:
        await body(ControlClient(client, KEYS, timeout_s=10))
    finally:
        serving.cancel()
        await client.aclose()
    return seen


def _yes(stream: str, req: Request) -> Reply:
    # Operators' requests must arrive on the operators' stream, the others on the users'.
    right = KEYS.operator_control() if isinstance(req, OPERATOR_REQUESTS) else KEYS.control()
    return Reply(ok=stream == right, detail="" if stream == right else f"wrong stream {stream}")


async def test_client_sends_each_request_on_its_stream(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def sign(payload: str, *, socket: str = "", timeout_s: float = 0) -> str:
        return f"MUNGE:{socket}:{payload}"

    monkeypatch.setattr(munge, "sign", sign)

    async def body(c: ControlClient) -> None:
        await c.register(TASK, environment=ENV, munge_socket="/run/m.sock")
        await c.stop("a", "done")
        await c.drain("n1", "fan")
        await c.resume("n1")
        await c.confirm_drain("a.1")
        assert await c.send(Stop(task="b")) == Reply(ok=True)

    seen = await _with_daemon(redis_url, _yes, body)
    assert [type(r) for r in seen] == [Register, Stop, Drain, Resume, ConfirmDrain, Stop]
    reg = seen[0]
    assert isinstance(reg, Register) and reg.record() == TASK and reg.job_environment() == ENV
    assert reg.credential == f"MUNGE:/run/m.sock:{registration_digest(reg)}"
    assert seen[1:5] == [Stop("a", "done"), Drain("n1", "fan"), Resume("n1"), ConfirmDrain("a.1")]


async def test_client_raises_refusals_and_sends_nothing_invalid(redis_url: str) -> None:
    def no(_stream: str, req: Request) -> Reply:
        return Reply(ok=False, detail=f"unknown node {getattr(req, 'node', '?')!r}")

    async def body(c: ControlClient) -> None:
        with pytest.raises(RequestRefused, match="unknown node 'n9'"):
            await c.resume("n9")
        with pytest.raises(InvalidArgument, match="must not be empty"):
            await c.drain("n1", "")
        with pytest.raises(InvalidArgument, match="needs the Slurm job"):
            await c.register(replace(TASK, job_id=None))
        # A malformed payload sent as is: the stand-in's decode_request refuses it.
        with pytest.raises(RequestRefused, match="unknown op 'finish'"):
            await c.send_payload(b'{"op": "finish", "task": "a"}')

    seen = await _with_daemon(redis_url, no, body)
    assert seen == [Resume("n9")]


async def test_no_reply_is_no_daemon(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        with pytest.raises(NoDaemon, match=r"did not answer within 0\.3s"):
            await ControlClient(client, KEYS, timeout_s=0.3).stop("a", "x")
        assert await client.xlen(KEYS.control()) == 1  # queued for unicornd
    finally:
        await client.aclose()


async def test_a_users_operator_request_is_refused_by_redis(redis_url: str) -> None:
    admin = aioredis.Redis.from_url(redis_url)
    await acl.set_user(admin, "t-user", acl.reader_rules(KEYS, "user-pw"))
    user = aioredis.Redis.from_url(acl.url_with_user(redis_url, "t-user", "user-pw"))
    try:
        with pytest.raises(NotOperator, match="not an operator"):
            await ControlClient(user, KEYS, timeout_s=1).confirm_drain("a.1")
        assert await admin.exists(KEYS.operator_control()) == 0
    finally:
        await user.aclose()
        await admin.aclose()
