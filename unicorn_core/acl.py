"""Redis ACL users: who may read and write which of unicorn's keys.

Four kinds of Redis user share one server (names derive from the key prefix, so
installations sharing a Redis never share users):

============================  ===========================================================
user                          may
============================  ===========================================================
unicornd's own (``[redis]``)  everything under the prefix, and ``ACL SETUSER/DELUSER``
``<prefix>-agent-<job>``      the agents of one Slurm job: write their heartbeats and their
                              job's ``events``/``cmd-results`` streams, read and delete
                              their own commands, read their job's environment. Nothing
                              else: not another job's streams, not the state, not the
                              control streams.
``<prefix>-operator``         read the status keys; write ``control`` and ``ops`` (drain,
                              resume, register, stop)
``<prefix>-user``             read the status keys; write ``control`` (register and stop
                              tasks). Not ``ops``: a user cannot drain, whatever client
                              they run.
============================  ===========================================================

unicornd creates an agent user with a random password when it first launches a job's
agents and deletes it when the job's task is gone; the operator and user roles are
(re)created at its start from the password files in ``[redis]``. Rules are built here as
pure functions of the key names, so the tests check the exact grants against a real
redis-server. Passwords travel only as SHA-256 digests (``#<hex>``) in ``ACL SETUSER``,
so they never appear in Redis's command log or in errors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import secrets
from collections.abc import Awaitable, Sequence
from typing import Final, cast
from urllib.parse import quote, urlsplit, urlunsplit

import redis.asyncio as aioredis

from unicorn_core import redis_io
from unicorn_core.config import RedisConfig, read_secret
from unicorn_core.errors import ConfigError, InvalidArgument
from unicorn_core.keys import RedisKeys

_CONNECT: Final = ("+ping", "+client|setname", "+select")
"""What redis-py sends on connect (AUTH and HELLO are always allowed; its CLIENT SETINFO
may be refused, which redis-py ignores, and is unknown before Redis 7.2 anyway)."""

AGENT_COMMANDS: Final = ("+get", "+set", "+del", "+xadd", "+xread", "+xdel", *_CONNECT)
"""An agent's whole command set: job environment GET, heartbeat SET/DEL, event XADD,
command XREAD/XDEL."""

_READER_COMMANDS: Final = ("+@read", "-@dangerous", "+xadd", "+multi", "+exec", "+discard", *_CONNECT)
"""Reads (the snapshot's keys in one MULTI/EXEC: a consistent view), and requests."""


def agent_user(keys: RedisKeys, job_id: int) -> str:
    """The Redis user of ``job_id``'s agents."""
    keys.events(job_id)  # validates the job id
    return f"{keys.prefix}-agent-{job_id}"


def operator_user(keys: RedisKeys) -> str:
    """The Redis user of operators (``unicornctl drain/resume``)."""
    return f"{keys.prefix}-operator"


def reader_user(keys: RedisKeys) -> str:
    """The Redis user of everyone else (``unicornctl status``, the sbatch wrapper)."""
    return f"{keys.prefix}-user"


_AGENT_USER: Final = re.compile(r"(?P<prefix>.+)-agent-(?P<job>[0-9]+)")


def agent_job(keys: RedisKeys, user: str) -> int | None:
    """The job id of an agent user name of this prefix, else None."""
    m = _AGENT_USER.fullmatch(user)
    if m is None or m["prefix"] != keys.prefix:
        return None
    return int(m["job"])


def _digest(password: str) -> str:
    if not password:
        raise InvalidArgument("an ACL user needs a non-empty password")
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def _status_keys(keys: RedisKeys) -> list[str]:
    """Read grants for what ``unicornctl status`` and the wrapper read (never secrets)."""
    names = [
        keys.state(),
        keys.state_meta(),
        *(keys.state_records(kind) for kind in ("tasks", "nodes", "incidents")),
        keys.goodput(),
        keys.incidents(),
        keys.daemon_liveness(),
        keys.leader(),
        keys.fence(),
        keys.standbys(),
        f"{keys.prefix}:hb:*",
        f"{keys.control()}:reply:*",
    ]
    return [f"%R~{name}" for name in names]


def agent_rules(keys: RedisKeys, job_id: int, password: str) -> list[str]:
    """``ACL SETUSER`` rules for the agents of ``job_id`` (``reset`` first: nothing else)."""
    p = keys.prefix
    return [
        "reset",
        "on",
        _digest(password),
        f"~{p}:hb:{job_id}:*",
        f"~{p}:cmd:{job_id}:*",
        f"%W~{keys.events(job_id)}",
        f"%W~{keys.command_results(job_id)}",
        f"%R~{keys.job_env(job_id)}",
        *AGENT_COMMANDS,
    ]


def reader_rules(keys: RedisKeys, password: str) -> list[str]:
    """Rules for ``<prefix>-user``: status reads, and requests on ``control`` only."""
    return ["reset", "on", _digest(password), *_status_keys(keys), f"%W~{keys.control()}", *_READER_COMMANDS]


def operator_rules(keys: RedisKeys, password: str) -> list[str]:
    """Rules for ``<prefix>-operator``: the user's, plus requests on ``ops``."""
    ops = keys.operator_control()
    return [
        *reader_rules(keys, password),
        f"%W~{ops}",
        f"%R~{ops}:reply:*",
    ]


def coordinator_rules(keys: RedisKeys, password: str) -> list[str]:
    """Rules for unicornd's own Redis user: every key under the prefix, no dangerous commands
    but the ACL ones it needs to manage the agents' users. An administrator applies them once
    (``scripts/install`` writes them out); unicornd never changes its own user."""
    return [
        "reset",
        "on",
        _digest(password),
        f"~{keys.prefix}:*",
        "+@all",
        "-@dangerous",
        "+acl|setuser",
        "+acl|deluser",
        "+acl|users",
    ]


def new_password() -> str:
    """A random password for an agent user (192 bits, URL-safe)."""
    return secrets.token_urlsafe(24)


def url_with_user(url: str, user: str, password: str) -> str:
    """``url`` with its credentials replaced by ``user``/``password`` (redis://, rediss://, unix://)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = "&".join(
            q for q in parts.query.split("&") if q and not q.startswith(("username=", "password="))
        )
        auth = f"username={quote(user, safe='')}&password={quote(password, safe='')}"
        return f"unix://{parts.path}?{query}&{auth}" if query else f"unix://{parts.path}?{auth}"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


async def _acl(client: aioredis.Redis, *args: str) -> object:
    """``ACL <args>``; the error names only the subcommand and user (rules hold a digest)."""
    pending: Awaitable[object] = client.execute_command("ACL", *args)  # type: ignore[no-untyped-call]
    return await redis_io.call(("ACL", *args[:2]), pending)


async def set_user(client: aioredis.Redis, name: str, rules: Sequence[str]) -> None:
    """``ACL SETUSER name rules...``."""
    await _acl(client, "SETUSER", name, *rules)


async def delete_user(client: aioredis.Redis, name: str) -> None:
    """``ACL DELUSER name`` (Redis also closes that user's connections)."""
    await _acl(client, "DELUSER", name)


async def users(client: aioredis.Redis) -> list[str]:
    """``ACL USERS``."""
    raw = await _acl(client, "USERS")
    return [u.decode() if isinstance(u, bytes) else str(u) for u in cast(list[object], raw)]


def caller_config(cfg: RedisConfig) -> RedisConfig:
    """``cfg`` as the most privileged user whose password the caller can read.

    unicornd's own credentials (``password_file``, or the url's when there is no file), then
    ``<prefix>-operator`` (``operator_password_file``), then ``<prefix>-user``
    (``user_password_file``). What each may do is enforced by Redis, not by this choice: a
    caller who reads only the user password cannot drain whatever client they run.
    Raises ConfigError naming every file tried when none is readable.
    """
    if not cfg.password_file:
        return cfg
    tried: list[str] = []
    try:
        cfg.password()
        return cfg
    except ConfigError as e:
        tried.append(str(e))
    keys = RedisKeys(cfg.key_prefix)
    for key, path, user in (
        ("redis.operator_password_file", cfg.operator_password_file, operator_user(keys)),
        ("redis.user_password_file", cfg.user_password_file, reader_user(keys)),
    ):
        if not path:
            continue
        try:
            password = read_secret(key, path)
        except ConfigError as e:
            tried.append(str(e))
            continue
        return dataclasses.replace(cfg, url=url_with_user(cfg.url, user, password), password_file="")
    raise ConfigError("no readable Redis credentials: " + "; ".join(tried))


def connect_caller(cfg: RedisConfig, *, client_name: str) -> aioredis.Redis:
    """:func:`redis_io.connect` as the caller's most privileged readable user
    (:func:`caller_config`): every client a person runs (unicornctl, the sbatch wrapper)."""
    return redis_io.connect(caller_config(cfg), client_name=client_name)


async def apply_roles(client: aioredis.Redis, cfg: RedisConfig) -> list[str]:
    """(Re)create ``<prefix>-operator`` and ``<prefix>-user`` from their password files
    (those configured); returns the users set. Run by unicornd at start."""
    keys = RedisKeys(cfg.key_prefix)
    done = []
    for key, path, user, rules in (
        ("redis.operator_password_file", cfg.operator_password_file, operator_user(keys), operator_rules),
        ("redis.user_password_file", cfg.user_password_file, reader_user(keys), reader_rules),
    ):
        if path:
            await set_user(client, user, rules(keys, read_secret(key, path)))
            done.append(user)
    return done
