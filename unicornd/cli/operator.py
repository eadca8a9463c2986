"""Operators' requests through unicornd: ``drain``, ``resume``, ``incidents confirm``.

Each is a typed request (:mod:`unicornd.control`) on unicornd's operators' stream, never
an scontrol call, so plans follow. The same steps guard each one (:func:`operator_request`):
the caller must be an operator (root, Slurm's SlurmUser, or a member of
``slurm.operators_group``), unicornd must be alive, the target must exist; without
``--yes`` the preview (:mod:`unicornd.cli.preview`) is printed and nothing is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import os
import pwd
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import click

from unicorn_core import acl, proc, redis_io
from unicorn_core.config import Config
from unicorn_core.errors import InvalidArgument, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.slurm import make_backend
from unicorn_core.slurm.cli import client_env
from unicorn_core.slurm.hostlist import compress, expand
from unicorn_core.slurm.scope import resolve_scope
from unicornd.cli.common import (
    NoDaemonError,
    NotConfirmedError,
    NotOperatorError,
    StateUnreadableError,
    UnknownTargetError,
    config_of,
    read_snapshot,
)
from unicornd.cli.preview import Outlook, outlook, render_outlook
from unicornd.cli.status import incident_json, render_incident
from unicornd.control import (
    ConfirmDrain,
    ControlClient,
    Drain,
    NoDaemon,
    NotOperator,
    Request,
    RequestRefused,
    Resume,
)
from unicornd.decide import on_node_join, on_operator_confirm_drain, on_operator_drain
from unicornd.state import Snapshot

REQUEST_TIMEOUT_S: Final = 30.0
"""How long operators' requests wait for unicornd's reply (it answers once the decision is persisted)."""


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who runs ``unicornctl``: effective uid, its user name, and every group id it holds."""

    uid: int
    user: str
    gids: frozenset[int]

    @classmethod
    def current(cls) -> Caller:
        uid = os.geteuid()
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        return cls(uid, user, frozenset({os.getegid(), *os.getgroups()}))


_SLURM_USER = re.compile(r"^SlurmUser\s*=\s*([^\s(]+)", re.MULTILINE)


def slurm_user_from_config(text: str) -> str:
    """The SlurmUser name in ``scontrol show config`` output (``SlurmUser = slurm(64030)``)."""
    found = _SLURM_USER.search(text)
    if found is None:
        raise InvalidArgument("`scontrol show config` printed no SlurmUser line")
    return found.group(1)


async def slurm_user(cfg: Config) -> str:
    """Slurm's SlurmUser, from ``scontrol show config`` (with the configured SLURM_CONF)."""
    scontrol = str(Path(cfg.slurm.bin_dir) / "scontrol") if cfg.slurm.bin_dir else "scontrol"
    out = await proc.run(
        [scontrol, "show", "config"],
        timeout_s=cfg.slurm.command_timeout_s,
        env=client_env(os.environ, cfg.slurm.conf or None),
    )
    return slurm_user_from_config(out.stdout)


def operator_refusal(caller: Caller, operators_group: str, slurm_user: Callable[[], str]) -> str | None:
    """None when ``caller`` may change the cluster, else why not (a message for the caller).

    Operators are root, Slurm's SlurmUser and members of ``operators_group`` (by group id,
    or listed in the group). ``slurm_user`` is called only when the cheaper checks fail
    (it runs scontrol); a failure to learn it refuses. This is a courtesy check before a
    request is sent: the control stream's Redis ACL is what enforces it.
    """
    if caller.uid == 0:
        return None
    group_note = ""
    if operators_group:
        try:
            group = grp.getgrnam(operators_group)
        except KeyError:
            group_note = f"; group {operators_group!r} (slurm.operators_group) does not exist"
        else:
            if group.gr_gid in caller.gids or caller.user in group.gr_mem:
                return None
            group_note = f", or members of group {operators_group!r}"
    try:
        owner = slurm_user()
    except UnicornError as e:
        return f"{caller.user} is not root or in the operators' group, and the SlurmUser is unknown: {e}"
    if caller.user == owner:
        return None
    return f"{caller.user} is not an operator: operators are root, the SlurmUser ({owner}){group_note}"


async def daemon_alive(cfg: Config) -> bool:
    """unicornd's liveness key exists (it refreshes it every few seconds while running)."""
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    keys = RedisKeys(cfg.redis.key_prefix)
    try:
        return bool(await redis_io.call(("EXISTS",), client.exists(keys.daemon_liveness())))
    finally:
        await client.aclose()


async def _send_operator(cfg: Config, req: Request) -> None:
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    try:
        await ControlClient(client, RedisKeys(cfg.redis.key_prefix), timeout_s=REQUEST_TIMEOUT_S).send(req)
    finally:
        await client.aclose()


@dataclasses.dataclass(frozen=True)
class Target:
    """What an operator's request is about: ``what`` (``node n2``, ``incident a.1``) for
    messages; ``unknown``: why the snapshot has no such thing (None: it has);
    ``describe``: what to show about it before the preview; ``refusals``: texts in
    unicornd's refusal that mean the target is unknown (exit 2)."""

    what: str
    unknown: Callable[[Snapshot], str | None]
    describe: Callable[[Snapshot, float], str] = lambda _snap, _now: ""
    refusals: tuple[str, ...] = ("unknown node",)


def operator_request(
    ctx: click.Context,
    target: Target,
    req: Request,
    *,
    yes: bool,
    preview: Callable[[Snapshot, Config, float], Outlook],
    command: str,
    verb: str,
) -> None:
    """Shared by ``drain``, ``resume`` and ``incidents confirm``: operator check, unicornd
    alive, target known, then the preview (without ``--yes``) or the request. Every
    refusal changes nothing. ``command``: the verb as typed (``drain n2``), for the
    preview's title; ``verb``: what it does, for the messages."""
    cfg = config_of(ctx)
    caller: Caller = (ctx.obj or {}).get("caller") or Caller.current()  # tests pass another one in obj
    refusal = operator_refusal(caller, cfg.slurm.operators_group, lambda: asyncio.run(slurm_user(cfg)))
    if refusal is not None:
        raise NotOperatorError(f"{refusal}; nothing changed")
    try:
        alive = asyncio.run(daemon_alive(cfg))
        snap = asyncio.run(read_snapshot(cfg)) if alive else None
    except (UnicornError, KeyError, TypeError, ValueError) as e:
        raise StateUnreadableError(f"cannot read unicornd's state: {e}; nothing changed") from None
    if not alive:
        raise NoDaemonError(
            f"unicornd is not running (no liveness key under {cfg.redis.key_prefix!r}); "
            f"start it (systemctl start unicornd) and retry; nothing changed"
        )
    if snap is None:
        raise UnknownTargetError(f"unknown {target.what}: unicornd has no state yet; nothing changed")
    unknown = target.unknown(snap)
    if unknown is not None:
        raise UnknownTargetError(f"{unknown}; nothing changed")
    now_s = time.time()
    try:
        seen = preview(snap, cfg, now_s)
    except InvalidArgument as e:
        raise click.UsageError(f"{e}; nothing changed") from None
    if not yes:
        shown = target.describe(snap, now_s)
        click.echo((shown + "\n" if shown else "") + render_outlook(seen, f"unicornctl {command} would:"))
        raise NotConfirmedError(f"nothing changed; run again with --yes to {verb}")
    try:
        asyncio.run(_send_operator(cfg, req))
    except NotOperator as e:
        raise NotOperatorError(f"{e}; nothing changed") from None
    except NoDaemon as e:
        raise NoDaemonError(f"{e}; the request stays queued for unicornd") from None
    except RequestRefused as e:
        if any(text in str(e) for text in target.refusals):
            raise UnknownTargetError(f"unicornd refused: {e}") from None
        raise click.ClickException(f"unicornd refused: {e}") from None
    except UnicornError as e:
        raise click.ClickException(f"cannot reach unicornd: {e}") from None
    click.echo(f"unicornd accepted: {verb}" + "".join(f"\n  {n}" for n in seen.decision.notes))


async def outside_scope(cfg: Config, node: str) -> str | None:
    """Why Slurm's ``node`` is outside ``[slurm]``'s scope (None: in it, unscoped, or not a
    node Slurm has)."""
    if not cfg.slurm.scoped:
        return None
    slurm = await make_backend(cfg.slurm)
    scope = await resolve_scope(slurm, cfg.slurm)
    for info in await slurm.list_nodes():
        if info.name == node:
            return scope.why_outside(info)
    return None


def _node(node: str, cfg: Config | None = None) -> Target:
    """``node``: a node, or a Slurm hostlist (``n[1-16]``); unknown if any of it is."""

    def unknown(snap: Snapshot) -> str | None:
        try:
            names = expand(node)
        except InvalidArgument as e:
            return f"unknown node {node!r}: {e}"
        missing = [n for n in names if n not in snap.nodes] if names else [node]
        if not missing:
            return None
        try:
            outside = asyncio.run(outside_scope(cfg, missing[0])) if cfg is not None else None
        except UnicornError as e:
            outside = f"node {missing[0]!r}: cannot check [slurm] scope: {e}"
        if outside is not None:
            return f"{outside}: outside unicorn's scope, so unicorn never drains, resumes or plans it"
        return f"unknown node {compress(missing)!r}; unicornd knows: {compress(sorted(snap.nodes)) or 'none'}"

    return Target(f"node {node!r}", unknown)


def _incident(incident_id: str) -> Target:
    def unknown(snap: Snapshot) -> str | None:
        if incident_id in snap.incidents:
            return None
        waiting = sorted(i.incident_id for i in snap.incidents.values() if i.pending_drain)
        return (
            f"unknown incident {incident_id!r}; incidents waiting for a confirmed drain: "
            f"{', '.join(waiting) or 'none'} (unicornctl incidents)"
        )

    def describe(snap: Snapshot, now_s: float) -> str:
        inc = snap.incidents[incident_id]
        lines = render_incident(incident_json(inc, now_s))
        if inc.pending_drain:
            lines.append(
                f"confirming drains {inc.pending_drain} (the drain limiter held it back), "
                "then replans every task without it"
            )
        return "\n".join(lines)

    return Target(f"incident {incident_id!r}", unknown, describe, ("no drain waiting", "unknown incident"))


_MUTATION_CODES = """

    Exit codes: 0 done (unicornd accepted and persisted it); 1 not confirmed (no --yes:
    what would happen is printed), Redis unreachable, or unicornd refused; 2 unknown {what} or
    bad usage; 3 unicornd not running (no liveness key) or no answer; 4 not an operator
    (root, the SlurmUser, or a member of slurm.operators_group), or Redis refused the
    request because the caller's Redis user is not the operator's.
"""


@click.command()
@click.argument("node")
@click.option("--reason", required=True, help="Why; Slurm shows 'unicorn: operator: <reason>'.")
@click.option("--yes", is_flag=True, help="Do it (without: print what would happen, exit 1).")
@click.pass_context
def drain(ctx: click.Context, node: str, reason: str, yes: bool) -> None:
    """Take NODE out of service through unicornd: it is drained in Slurm, held until an
    operator resumes it, and every task is replanned without it (its task moves off it).

    NODE may be a Slurm hostlist (``n[1-16]``: a rack): one decision drains them all
    with one reason, in one Slurm call, and replans once."""

    def preview(snap: Snapshot, cfg: Config, now_s: float) -> Outlook:
        return outlook(snap, on_operator_drain(snap, node, reason, now_s), cfg, now_s)

    req = _request(lambda: Drain(node=node, reason=reason))
    operator_request(
        ctx,
        _node(node, config_of(ctx)),
        req,
        yes=yes,
        preview=preview,
        command=f"drain {node}",
        verb=f"drain {node}",
    )


@click.command()
@click.argument("node")
@click.option("--yes", is_flag=True, help="Do it (without: print what would happen, exit 1).")
@click.pass_context
def resume(ctx: click.Context, node: str, yes: bool) -> None:
    """Bring NODE back through unicornd: resumed in Slurm, released from hold, node check,
    then it rejoins the plans (a healthy node is left alone)."""

    def preview(snap: Snapshot, cfg: Config, now_s: float) -> Outlook:
        return outlook(snap, on_node_join(snap, node, now_s, by_operator=True), cfg, now_s)

    req = _request(lambda: Resume(node=node))
    operator_request(
        ctx,
        _node(node, config_of(ctx)),
        req,
        yes=yes,
        preview=preview,
        command=f"resume {node}",
        verb=f"resume {node}",
    )


@click.command()
@click.argument("incident_id")
@click.option(
    "--yes", is_flag=True, help="Do it (without: print the incident and what would happen, exit 1)."
)
@click.pass_context
def confirm(ctx: click.Context, incident_id: str, yes: bool) -> None:
    """Answer the drain limiter for INCIDENT_ID: drain the node the incident waits on (the
    limiter held that drain back, too many nodes were drained recently), then replan every
    task without it. Without --yes: the incident and what confirming would do."""

    def preview(snap: Snapshot, cfg: Config, now_s: float) -> Outlook:
        return outlook(snap, on_operator_confirm_drain(snap, incident_id, now_s), cfg, now_s)

    req = _request(lambda: ConfirmDrain(incident=incident_id))
    operator_request(
        ctx,
        _incident(incident_id),
        req,
        yes=yes,
        preview=preview,
        command=f"incidents confirm {incident_id}",
        verb=f"confirm the drain of incident {incident_id}",
    )


def _request(build: Callable[[], Request]) -> Request:
    """The request, or a usage error (exit 2, nothing sent) when it cannot be valid."""
    try:
        return build()
    except InvalidArgument as e:
        raise click.UsageError(f"{e}; nothing changed") from None


drain.help = (drain.help or "") + _MUTATION_CODES.format(what="node")
resume.help = (resume.help or "") + _MUTATION_CODES.format(what="node")
confirm.help = (confirm.help or "") + _MUTATION_CODES.format(what="incident (or it waits for no drain)")
