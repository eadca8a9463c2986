"""What every ``unicornctl`` verb group shares: the config, unicornd's snapshot, exit codes.

The exit codes are part of the interface (scripts branch on them); each command documents
the ones it uses. Every error class here is a ``click.ClickException`` with its code.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Final

import click

from unicorn_core import acl
from unicorn_core.config import Config, load_config
from unicorn_core.errors import ConfigError, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import configure_logging
from unicornd import store
from unicornd.state import Snapshot

# --- read commands (incidents, tasks) ---------------------------------------------------------

EXIT_STATE_UNREADABLE: Final = 1
"""``incidents``/``tasks``: Redis unreachable, unicornd's state unreadable, or a bad config."""
EXIT_NO_STATE: Final = 3
"""``incidents``/``tasks``: Redis holds no unicornd state under the configured key prefix
(unicornd never ran against this Redis, or ``redis.key_prefix`` differs)."""

# --- operator mutations (drain, resume, incidents confirm) and plan --what-if-fail ------------

EXIT_NOT_CONFIRMED: Final = 1
"""Without ``--yes``: what would happen was printed, nothing was sent."""
EXIT_UNKNOWN_NODE: Final = 2
"""unicornd does not know the node (or the incident), or bad usage."""
EXIT_UNKNOWN_INCIDENT: Final = EXIT_UNKNOWN_NODE
"""``incidents confirm``: unicornd knows no such incident, or it waits for no drain."""
EXIT_NO_DAEMON: Final = 3
"""unicornd is not running (no liveness key) or did not answer."""
EXIT_NOT_OPERATOR: Final = 4
"""The caller is not an operator (root, SlurmUser, ``slurm.operators_group``)."""


class StateUnreadableError(click.ClickException):
    exit_code = EXIT_STATE_UNREADABLE


class NoStateError(click.ClickException):
    exit_code = EXIT_NO_STATE


class NotConfirmedError(click.ClickException):
    exit_code = EXIT_NOT_CONFIRMED


class UnknownTargetError(click.ClickException):
    """An unknown node or incident."""

    exit_code = EXIT_UNKNOWN_NODE


class NoDaemonError(click.ClickException):
    exit_code = EXIT_NO_DAEMON


class NotOperatorError(click.ClickException):
    exit_code = EXIT_NOT_OPERATOR


def config_of(ctx: click.Context) -> Config:
    """The effective config (``unicornctl --config``, else ``$UNICORN_CONFIG``); logs to stderr."""
    try:
        cfg = load_config((ctx.obj or {}).get("config_path"))
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    configure_logging(
        cfg.log.level, "console" if cfg.log.format == "auto" else cfg.log.format, stream=sys.stderr
    )
    return cfg


async def read_snapshot(cfg: Config) -> Snapshot | None:
    """unicornd's persisted snapshot; None when there is none. Raises ``RedisCallError``
    (unreachable, auth), ``ProtocolError`` (not a snapshot this version wrote)."""
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    try:
        return await store.read_snapshot(client, RedisKeys(cfg.redis.key_prefix), cfg.recovery)
    finally:
        await client.aclose()


def snapshot_of(ctx: click.Context) -> Snapshot:
    """unicornd's snapshot for a read command; exits 1 (unreadable) or 3 (none)."""
    cfg = config_of(ctx)
    try:
        snap = asyncio.run(read_snapshot(cfg))
    except (UnicornError, KeyError, TypeError, ValueError) as e:
        raise StateUnreadableError(f"cannot read unicornd's state: {e}") from None
    if snap is None:
        raise NoStateError(
            f"no unicornd state in Redis ({cfg.redis.url.rpartition('@')[2]}, key prefix "
            f"{cfg.redis.key_prefix!r}): unicornd has not run against it"
        )
    return snap


def clock(t_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_s))
