"""unicornd's side of the control plane: every request type, malformed, unsigned, unknown or
on the wrong stream, is answered with a clear refusal and changes nothing (no record, no
owed action, no Slurm call, no stored job environment)."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from plan.hardware import gpu_spec
from plan.objective import FailureModel
from tests.fakes.slurm import FakeSlurm
from tests.unicornd.coord_world import render, task, world
from unicorn_core.config import load_config
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicornd.control import ConfirmDrain, Drain, Resume, Stop, decode_reply, encode_request
from unicornd.core import Core
from unicornd.replan import PlanContext
from unicornd.requests import Requests
from unicornd.state import Policy, TaskState
from unicornd.store import Store, read_snapshot, snapshot_to_json

PREFIX = "reqtest"
PENDING = task("c", 3, [], state=TaskState.PENDING).to_dict()
MEGATRON_REFUSED = {
    **PENDING,
    "framework": "megatron",
    "command": ["/w/pretrain_gpt.py", "--save", "/c", "--save-interval", "5", "--no-load-optim"],
}


def malformed() -> list[tuple[str, bytes, bool, str]]:
    """(case, payload, on the operators' stream, what the refusal says)."""
    j = lambda doc: json.dumps(doc).encode()  # noqa: E731
    return [
        ("not json", b"{nope", False, "malformed"),
        ("not an object", b"[1, 2]", False, "invalid"),
        ("no op", j({"task": "a"}), False, "register"),
        ("unknown op", j({"op": "finish", "task": "a"}), False, "finish"),
        ("register: no credential", j({"op": "register", "task": PENDING}), False, "credential"),
        (
            "register: empty credential",
            j({"op": "register", "task": PENDING, "credential": " "}),
            False,
            "credential",
        ),
        (
            "register: bad task",
            j({"op": "register", "task": {"task_id": "x"}, "credential": "M"}),
            False,
            "register",
        ),
        (
            "register: unknown field",
            j({"op": "register", "task": PENDING, "credential": "M", "x": 1}),
            False,
            "x",
        ),
        (
            "register: unsigned",
            j({"op": "register", "task": PENDING, "credential": "MUNGE:forged"}),
            False,
            "",
        ),
        (
            "register: megatron command that breaks resuming",
            j({"op": "register", "task": MEGATRON_REFUSED, "credential": "M"}),
            False,
            "--no-load-optim cannot be given",
        ),
        ("stop: empty task", j({"op": "stop", "task": ""}), False, "task"),
        ("stop: wrong type", j({"op": "stop", "task": 7}), False, "task"),
        ("stop: unknown task", encode_request(Stop(task="zz", why="x")), False, "unknown task"),
        ("drain: empty reason", j({"op": "drain", "node": "n1", "reason": " "}), True, "reason"),
        ("drain: bad node name", j({"op": "drain", "node": "n 1", "reason": "x"}), True, "node"),
        ("drain: unknown node", encode_request(Drain(node="n9", reason="x")), True, "unknown node"),
        ("drain: users' stream", encode_request(Drain(node="n1", reason="x")), False, "operator"),
        ("resume: missing node", j({"op": "resume"}), True, "node"),
        ("resume: unknown node", encode_request(Resume(node="n9")), True, "unknown node"),
        ("resume: users' stream", encode_request(Resume(node="n1")), False, "operator"),
        ("confirm_drain: empty", j({"op": "confirm_drain", "incident": ""}), True, "incident"),
        ("confirm_drain: none waits", encode_request(ConfirmDrain(incident="a.1")), True, "no drain waiting"),
        ("confirm_drain: users' stream", encode_request(ConfirmDrain(incident="a.1")), False, "operator"),
    ]


@pytest.mark.parametrize(
    ("case", "payload", "operator", "says"), malformed(), ids=[m[0] for m in malformed()]
)
def test_a_bad_request_is_refused_and_changes_nothing(
    redis_url: str, case: str, payload: bytes, operator: bool, says: str
) -> None:
    async def main() -> None:
        cfg = load_config(None, env={"UNICORN_REDIS__URL": redis_url, "UNICORN_REDIS__KEY_PREFIX": PREFIX})
        client = aioredis.Redis.from_url(redis_url)
        keys = RedisKeys(PREFIX)
        slurm = FakeSlurm(["n1", "n2", "n3", "n4"])
        core = Core(
            Store(client, keys, Policy()),
            PlanContext(gpu_spec("a100-80g"), FailureModel(24.0), lambda _g, _n: render),
        )
        try:
            await core.start(world(4, [task("a", 1, ["n1", "n2"])]))
            before = snapshot_to_json(core.snap)
            requests = Requests(cfg, core, slurm, client)
            stream = keys.operator_control() if operator else keys.control()
            await requests.on_entry({PAYLOAD_FIELD.encode(): payload}, "1700000000000-0", stream)
            reply = decode_reply(await client.get(keys.reply(stream, "1700000000000-0")))
            assert not reply.ok and says.lower() in reply.detail.lower(), reply
            after = await read_snapshot(client, keys, Policy())
            assert after is not None and snapshot_to_json(after) == before
            assert await core.store.owed() == [] and not slurm.calls
            assert not await client.exists(keys.job_env(3))
        finally:
            await client.aclose()

    asyncio.run(main())
