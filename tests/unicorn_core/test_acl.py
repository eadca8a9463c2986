"""Redis ACL users against a real redis-server: each role can do exactly its job.

The agent user is exercised with the agent's own code path (:class:`launcher.outbox.Outbox`
writes heartbeats and events through it), and every forbidden write is checked to fail
with NOPERM and to leave the key untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from tests.unicornd.coord_world import task, world
from unicorn_core import acl, redis_io
from unicorn_core.config import RedisConfig
from unicorn_core.errors import ConfigError, InvalidArgument
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicornd.control import ControlClient, Drain, NotOperator, Stop, encode_request
from unicornd.state import Policy
from unicornd.store import Store, read_snapshot

KEYS = RedisKeys("t")


def _denied(what: Callable[[], object]) -> str:
    with pytest.raises(redis.exceptions.NoPermissionError) as info:
        what()
    return str(info.value)


async def _setup(url: str, name: str, rules: list[str]) -> None:
    admin = aioredis.Redis.from_url(url)
    try:
        await acl.set_user(admin, name, rules)
    finally:
        await admin.aclose()


async def test_an_agent_user_writes_only_its_own_job(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    await _setup(redis_url, acl.agent_user(KEYS, 7), acl.agent_rules(KEYS, 7, "pw-7"))
    await _setup(redis_url, acl.agent_user(KEYS, 8), acl.agent_rules(KEYS, 8, "pw-8"))
    url = acl.url_with_user(redis_url, "t-agent-7", "pw-7")
    agent = redis.Redis.from_url(url, client_name="agent-7-n1")

    # What an agent does: heartbeat, events, command results, read and delete its commands.
    agent.set(KEYS.heartbeat(7, "n1"), b"hb", px=5000)
    agent.xadd(KEYS.events(7), {PAYLOAD_FIELD: b"e"}, maxlen=1000, approximate=True)
    agent.xadd(KEYS.command_results(7), {PAYLOAD_FIELD: b"r"})
    cmd = admin.xadd(KEYS.agent_commands(7, "n1"), {PAYLOAD_FIELD: b"c"})
    assert [e for _, e in agent.xread({KEYS.agent_commands(7, "n1"): "0-0"})[0][1]] == [{b"msg": b"c"}]
    assert agent.xdel(KEYS.agent_commands(7, "n1"), cmd) == 1
    assert agent.delete(KEYS.heartbeat(7, "n1")) == 1
    admin.set(KEYS.agent_launch(7, "n1"), b"launch")  # a whole-job step's training command
    assert agent.get(KEYS.agent_launch(7, "n1")) == b"launch"
    assert admin.xlen(KEYS.events(7)) == 1 and admin.xlen(KEYS.command_results(7)) == 1

    # Another job's streams and keys, and everything of the coordinator: refused, unchanged.
    admin.xadd(KEYS.agent_commands(8, "n2"), {PAYLOAD_FIELD: b"c8"})
    admin.set(KEYS.state(), b"{}")
    admin.set(KEYS.agent_password(8), b"pw-8")
    forbidden: list[Callable[[], object]] = [
        lambda: agent.xadd(KEYS.events(8), {PAYLOAD_FIELD: b"forged"}),
        lambda: agent.xadd(KEYS.command_results(8), {PAYLOAD_FIELD: b"forged"}),
        lambda: agent.set(KEYS.heartbeat(8, "n2"), b"forged"),
        lambda: agent.xread({KEYS.agent_commands(8, "n2"): "0-0"}),
        lambda: agent.get(KEYS.agent_launch(8, "n2")),
        lambda: agent.xadd(KEYS.agent_commands(8, "n2"), {PAYLOAD_FIELD: b"forged"}),
        lambda: agent.xadd(KEYS.control(), {PAYLOAD_FIELD: encode_request(Stop(task="t"))}),
        lambda: agent.xadd(KEYS.operator_control(), {PAYLOAD_FIELD: encode_request(Drain("n1", "x"))}),
        lambda: agent.set(KEYS.state(), b"forged"),
        lambda: agent.get(KEYS.state()),
        lambda: agent.get(KEYS.agent_password(8)),
        lambda: agent.xrange(KEYS.events(7)),  # write-only: an agent cannot read back events
        lambda: agent.execute_command("ACL", "SETUSER", "t-agent-7", "+@all"),
        agent.flushall,
    ]
    for call in forbidden:
        assert "no permissions" in _denied(call)
    assert admin.xlen(KEYS.events(8)) == 0 and admin.xlen(KEYS.command_results(8)) == 0
    assert admin.xlen(KEYS.agent_commands(8, "n2")) == 1 and admin.get(KEYS.state()) == b"{}"
    assert not admin.exists(KEYS.heartbeat(8, "n2"), KEYS.control(), KEYS.operator_control())
    # A wrong password does not authenticate at all.
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(acl.url_with_user(redis_url, "t-agent-7", "pw-8")).ping()


async def test_the_agents_outbox_works_through_its_user(redis_url: str) -> None:
    from launcher.outbox import Outbox
    from unicorn_core.protocol import Heartbeat, IterationTiming, decode

    await _setup(redis_url, acl.agent_user(KEYS, 3), acl.agent_rules(KEYS, 3, "pw"))
    cfg = RedisConfig(url=acl.url_with_user(redis_url, "t-agent-3", "pw"), key_prefix="t")
    client = redis_io.connect(cfg, client_name="agent-3-n1")
    outbox = Outbox(client, KEYS, job_id=3, node="n1", heartbeat_ttl_s=5.0)
    runner = asyncio.create_task(outbox.run())
    try:
        outbox.put(Heartbeat(job_id=3, node="n1", wall_time_s=1.0, agent_pid=1, pids=[], iteration=0, seq=1))
        outbox.put(
            IterationTiming(
                job_id=3, node="n1", wall_time_s=1.0, rank=0, iteration=1, duration_s=0.1, samples=8
            )
        )
        assert await outbox.flush(5.0)
        await outbox.clear_heartbeat()
    finally:
        runner.cancel()
        await client.aclose()
    admin = redis.Redis.from_url(redis_url)
    kinds = [type(decode(f[b"msg"])).__name__ for _, f in admin.xrange(KEYS.events(3))]
    assert kinds == ["Heartbeat", "IterationTiming"] and outbox.stats.failures == 0
    assert not admin.exists(KEYS.heartbeat(3, "n1"))


async def test_users_may_register_but_only_operators_may_drain(redis_url: str) -> None:
    await _setup(redis_url, acl.reader_user(KEYS), acl.reader_rules(KEYS, "user-pw"))
    await _setup(redis_url, acl.operator_user(KEYS), acl.operator_rules(KEYS, "op-pw"))
    admin = redis.Redis.from_url(redis_url)
    admin.set(KEYS.state(), b"{}")
    admin.set(KEYS.agent_password(1), b"secret")
    user = redis.Redis.from_url(acl.url_with_user(redis_url, "t-user", "user-pw"))
    operator = redis.Redis.from_url(acl.url_with_user(redis_url, "t-operator", "op-pw"))
    for who in (user, operator):
        assert who.get(KEYS.state()) == b"{}"
        who.xadd(KEYS.control(), {PAYLOAD_FIELD: b"{}"})
        assert "no permissions" in _denied(lambda w=who: w.get(KEYS.agent_password(1)))  # type: ignore[misc]
        assert "no permissions" in _denied(lambda w=who: w.set(KEYS.state(), b"x"))  # type: ignore[misc]
        assert "no permissions" in _denied(lambda w=who: w.xadd(KEYS.events(1), {PAYLOAD_FIELD: b"x"}))  # type: ignore[misc]
    assert "no permissions" in _denied(lambda: user.xadd(KEYS.operator_control(), {PAYLOAD_FIELD: b"{}"}))
    operator.xadd(KEYS.operator_control(), {PAYLOAD_FIELD: b"{}"})
    assert admin.xlen(KEYS.operator_control()) == 1 and admin.get(KEYS.state()) == b"{}"

    # The control client: a user's drain is refused by Redis, before unicornd.
    client = aioredis.Redis.from_url(acl.url_with_user(redis_url, "t-user", "user-pw"))
    try:
        with pytest.raises(NotOperator, match="not an operator"):
            await ControlClient(client, KEYS, timeout_s=1).drain("n1", "x")
        # A user reads the committed snapshot (its hashes, in one MULTI/EXEC).
        coordinator = aioredis.Redis.from_url(redis_url)
        snap = world(2, [task("t", 1, ["n1"])])
        await Store(coordinator, KEYS, Policy()).commit(snap)
        await coordinator.aclose()
        assert await read_snapshot(client, KEYS, Policy()) == snap
    finally:
        await client.aclose()
    assert admin.xlen(KEYS.operator_control()) == 1


def test_caller_config_picks_the_most_privileged_readable_password(tmp_path: Path) -> None:
    coordinator, operator, user = (tmp_path / n for n in ("coord.pass", "op.pass", "user.pass"))
    operator.write_text("op-pw\n")
    user.write_text("user-pw\n")
    base = RedisConfig(
        url="redis://127.0.0.1:6400/0",
        key_prefix="t",
        password_file=str(coordinator),
        operator_password_file=str(operator),
        user_password_file=str(user),
    )
    coordinator.write_text("root-pw\n")
    assert acl.caller_config(base) is base
    coordinator.unlink()
    picked = acl.caller_config(base)
    assert picked.url == "redis://t-operator:op-pw@127.0.0.1:6400/0" and picked.password_file == ""
    operator.unlink()
    assert acl.caller_config(base).url == "redis://t-user:user-pw@127.0.0.1:6400/0"
    user.unlink()
    with pytest.raises(ConfigError, match="no readable Redis credentials") as info:
        acl.caller_config(base)
    assert all(str(p) in str(info.value) for p in (coordinator, operator, user))
    # Without a password file the url's own credentials (or none) are unicornd's: used as is.
    plain = dataclasses.replace(base, password_file="")
    assert acl.caller_config(plain) is plain


def test_status_reads_name_only_keys_unicorn_writes() -> None:
    reads = [rule for rule in acl.reader_rules(KEYS, "pw") if rule.startswith("%R~")]
    names = [
        "t:state",
        "t:state:meta",
        "t:state:tasks",
        "t:state:nodes",
        "t:state:incidents",
        "t:goodput",
        "t:incidents",
        "t:unicornd:alive",
        "t:unicornd:leader",
        "t:unicornd:fence",
        "t:unicornd:standby:*",
        "t:hb:*",
        "t:control:reply:*",
    ]
    assert reads == [f"%R~{name}" for name in names]
    operator_reads = [rule for rule in acl.operator_rules(KEYS, "pw") if rule.startswith("%R~")]
    assert operator_reads == [*reads, "%R~t:ops:reply:*"]


def test_url_with_user_replaces_credentials_and_quotes_them() -> None:
    assert acl.url_with_user("redis://:old@h:1/2", "u", "p w@:") == "redis://u:p%20w%40%3A@h:1/2"
    assert acl.url_with_user("rediss://a:b@[::1]:6379/0?x=1", "u", "p") == "rediss://u:p@[::1]:6379/0?x=1"
    assert acl.url_with_user("redis://h", "u", "p") == "redis://u:p@h"
    assert (
        acl.url_with_user("unix:///run/r.sock?db=1&password=old", "u", "p")
        == "unix:///run/r.sock?db=1&username=u&password=p"
    )


def test_agent_user_names_round_trip_and_bad_input_is_refused() -> None:
    assert acl.agent_user(KEYS, 12) == "t-agent-12"
    assert acl.agent_job(KEYS, "t-agent-12") == 12
    assert acl.agent_job(KEYS, "other-agent-12") is None and acl.agent_job(KEYS, "t-agent-x") is None
    assert acl.agent_job(RedisKeys("t-agent-1"), "t-agent-1-agent-5") == 5
    with pytest.raises(InvalidArgument, match="job id"):
        acl.agent_user(KEYS, -1)
    with pytest.raises(InvalidArgument, match="password"):
        acl.agent_rules(KEYS, 1, "")
    rules = acl.agent_rules(KEYS, 1, "pw")
    assert rules[0] == "reset" and "pw" not in " ".join(rules)  # only the digest travels


async def test_the_coordinator_user_manages_agent_users_and_nothing_dangerous(redis_url: str) -> None:
    await _setup(redis_url, "unicornd", acl.coordinator_rules(KEYS, "coord-pw"))
    coord = aioredis.Redis.from_url(acl.url_with_user(redis_url, "unicornd", "coord-pw"))
    try:
        await acl.set_user(coord, acl.agent_user(KEYS, 5), acl.agent_rules(KEYS, 5, "pw"))
        assert "t-agent-5" in await acl.users(coord)
        await acl.delete_user(coord, "t-agent-5")
        assert "t-agent-5" not in await acl.users(coord)
        await coord.set(KEYS.state(), b"{}")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await coord.set("other-installation:state", b"x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await coord.flushall()
    finally:
        await coord.aclose()
