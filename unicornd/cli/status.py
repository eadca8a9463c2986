"""``unicornctl status``, ``tasks`` and ``incidents``: the cluster and unicornd's state, read only.

``status`` reads Slurm and Redis; ``tasks`` and ``incidents`` read unicornd's persisted
snapshot. ``incidents`` is a group: bare, it lists; ``incidents confirm`` (an operator's
answer to the drain limiter) is :mod:`unicornd.cli.operator`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import click

from unicorn_core import acl, redis_io
from unicorn_core.config import Config
from unicorn_core.errors import InvalidArgument, ProtocolError, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.slurm import JobInfo, NodeInfo, make_backend
from unicorn_core.slurm.hostlist import compress
from unicorn_core.slurm.scope import Scope, resolve_scope
from unicornd import store
from unicornd.alerts import incident_milestones, stage_spans
from unicornd.cli.common import clock, config_of, snapshot_of
from unicornd.leader import election
from unicornd.state import KEEP_CLOSED_S, Incident, Snapshot, TaskRecord


@dataclasses.dataclass(frozen=True)
class ClusterStatus:
    nodes: list[NodeInfo]
    jobs: list[JobInfo]
    redis_ok: bool
    redis_error: str
    daemon_alive: bool = False
    snapshot: Snapshot | None = None
    state_error: str = ""
    leader: str | None = None
    """The leading unicornd's id (None: no lease held)."""
    fence: int = 0
    """The newest fencing token granted (the leader's, unless a takeover is under way)."""
    standbys: tuple[str, ...] = ()
    scope: Scope = dataclasses.field(default_factory=Scope)
    """The nodes unicorn manages (``[slurm]`` partitions, node_feature, reservation)."""
    scope_error: str = ""


def ownership(st: ClusterStatus, node: NodeInfo) -> tuple[str, list[int]]:
    """(``ours`` | ``not ours`` | ``outside``, other users' jobs on the node): outside the
    scope, in it with jobs that are no unicorn task's (unicornd's last Slurm poll), or ours."""
    if not st.scope.admits(node):
        return "outside", []
    others = list(st.snapshot.foreign_jobs(node.name)) if st.snapshot is not None else []
    return ("not ours" if others else "ours"), others


async def gather_status(cfg: Config) -> ClusterStatus:
    slurm = await make_backend(cfg.slurm)
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    try:
        nodes, jobs = await asyncio.gather(slurm.list_nodes(), slurm.list_jobs())
        scope, scope_error = Scope(), ""
        try:
            scope = await resolve_scope(slurm, cfg.slurm)
        except UnicornError as e:
            scope_error = f"bad [slurm] scope: {e}"
        keys = RedisKeys(cfg.redis.key_prefix)
        alive, snap, state_error = False, None, ""
        leader: str | None = None
        fence, standbys = 0, list[str]()
        try:
            await redis_io.call(("PING",), client.ping())
            redis_ok, redis_error = True, ""
            alive = bool(await redis_io.call(("EXISTS",), client.exists(keys.daemon_liveness())))
            leader, fence, standbys = await election(client, keys)
            try:
                snap = await store.read_snapshot(client, keys, cfg.recovery)
            except (ProtocolError, InvalidArgument) as e:  # a document, but not a valid snapshot
                state_error = f"unreadable unicornd state: {e}"
        except UnicornError as e:
            redis_ok, redis_error = False, str(e)
    finally:
        await client.aclose()
    return ClusterStatus(
        nodes,
        jobs,
        redis_ok,
        redis_error,
        alive,
        snap,
        state_error,
        leader,
        fence,
        tuple(standbys),
        scope,
        scope_error,
    )


def _unicorn_json(st: ClusterStatus) -> dict[str, Any]:
    snap = st.snapshot
    election = {"leader": st.leader, "fence": st.fence, "standbys": list(st.standbys)}
    if snap is None:
        return {
            "daemon_alive": st.daemon_alive,
            **election,
            "tasks": [],
            "incidents": [],
            "error": st.state_error,
        }
    return {
        "daemon_alive": st.daemon_alive,
        **election,
        "plan_generation": snap.plan_generation,
        "tasks": [
            {
                "task_id": t.task_id,
                "job_id": t.job_id,
                "state": t.state.value,
                "weight": t.weight,
                "layout": t.layout.describe() if t.layout else None,
                "gpus": t.layout.world_size if t.layout else 0,
                "nodes": list(t.nodes),
                "last_iteration": t.last_iteration,
            }
            for t in sorted(snap.tasks.values(), key=lambda t: t.task_id)
        ],
        "node_health": {
            n.name: {"health": n.health.value, "reason": n.reason, "slurm_down": n.slurm_down}
            for n in snap.nodes.values()
        },
        "incidents": [
            {
                "incident_id": i.incident_id,
                "task_id": i.task_id,
                "node": i.node,
                "status": i.status.value,
                "severity": i.severity.value,
                "stage": i.stage.value,
                "opened_s": i.opened_s,
            }
            for i in sorted(snap.incidents.values(), key=lambda i: i.opened_s)
            if i.is_open
        ],
        "error": st.state_error,
    }


def _node_json(n: NodeInfo, st: ClusterStatus) -> dict[str, Any]:
    owner, others = ownership(st, n)
    return {
        "scope": owner,
        "other_jobs": others,
        "partitions": list(n.partitions),
        "name": n.name,
        "state": n.state.value,
        "flags": sorted(n.flags),
        "reason": n.reason,
        "usable": n.usable,
        "gpus": n.gpus,
        "gpus_used": n.gpus_used,
        "cpus": n.cpus,
    }


def _job_json(j: JobInfo) -> dict[str, Any]:
    return {
        "job_id": j.job_id,
        "name": j.name,
        "state": j.state.value,
        "nodes": list(j.nodes),
        "reason": j.reason,
        "user": j.user,
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--check", is_flag=True, help="Exit 1 unless unicornd is alive (its liveness key exists).")
@click.pass_context
def status(ctx: click.Context, as_json: bool, check: bool) -> None:
    """Nodes (state, reason, GPUs), jobs, unicornd's tasks and open incidents, Redis.

    Exits 1 when Slurm or Redis cannot be reached, and with ``--check`` when unicornd is
    not running.
    """
    cfg = config_of(ctx)
    try:
        st = asyncio.run(gather_status(cfg))
    except UnicornError as e:
        raise click.ClickException(f"cannot read cluster state: {e}") from None
    if as_json:
        doc = {
            "nodes": [_node_json(n, st) for n in st.nodes],
            "scope": {"nodes": st.scope.describe(), "error": st.scope_error},
            "jobs": [_job_json(j) for j in st.jobs],
            "redis": {"ok": st.redis_ok, "error": st.redis_error},
            "unicorn": _unicorn_json(st),
        }
        click.echo(json.dumps(doc, indent=2))
    else:
        usable = sum(n.usable for n in st.nodes)
        gpus = sum(n.gpus for n in st.nodes if n.usable)
        click.echo(f"nodes: {len(st.nodes)} ({usable} usable, {gpus} GPUs usable)")
        for n in st.nodes:
            flags = "+".join(sorted(n.flags))
            state = n.state.value.lower() + (f"+{flags.lower()}" if flags else "")
            reason = f"  reason: {n.reason}" if n.reason else ""
            owner, others = ownership(st, n)
            whose = f"  [{owner}: jobs {','.join(map(str, others))}]" if others else ""
            whose = "  [outside scope]" if owner == "outside" else whose
            click.echo(f"  {n.name:<10} {state:<22} gpus {n.gpus_used}/{n.gpus}{reason}{whose}")
        if not st.scope.everything or st.scope_error:
            click.echo(f"  scope: {st.scope_error or st.scope.describe()}")
        active = [j for j in st.jobs if not j.state.finished]
        click.echo(f"jobs: {len(active)} active")
        for j in active:
            click.echo(f"  {j.job_id:<8} {j.state.value:<10} {j.name:<20} {compress(j.nodes) or j.reason}")
        click.echo(f"redis: {'ok' if st.redis_ok else 'UNREACHABLE: ' + st.redis_error}")
        u = _unicorn_json(st)
        click.echo(f"unicornd: {'alive' if st.daemon_alive else 'NOT RUNNING'}")
        standing = ", ".join(st.standbys) or "none"
        click.echo(f"  leader: {st.leader or 'none'} (fencing token {st.fence}); standbys: {standing}")
        for t in u["tasks"]:
            click.echo(
                f"  task {t['task_id']:<12} {t['state']:<10} {t['layout'] or '-':<24} "
                f"nodes {','.join(t['nodes']) or '-':<16} weight {t['weight']:g}  "
                f"iteration {t['last_iteration']}"
            )
        down = sorted(name for name, h in u.get("node_health", {}).items() if h["slurm_down"])
        if down:  # unicornd's view at its last poll: idle ones are left out of every plan
            click.echo(f"  Slurm holds down (NOT_RESPONDING/DOWN): {compress(down)}")
        for i in u["incidents"]:
            click.echo(
                f"  incident {i['incident_id']} {i['status']} {i['severity']} on {i['node']}: {i['stage']}"
            )
        if u["error"]:
            click.echo(f"  {u['error']}")
    if not st.redis_ok:
        sys.exit(1)
    if check and not st.daemon_alive:
        click.echo("unicornd is not running (no liveness key)", err=True)
        sys.exit(1)


def incident_json(inc: Incident, now_s: float) -> dict[str, Any]:
    """One incident with its timeline (``since_detected_s``, ``duration_s`` per stage) and the
    seconds from detection to each milestone reached (``milestones_s``)."""
    m = incident_milestones(inc)
    end_s = m.closed_s if m.closed_s is not None else now_s
    return {
        "incident_id": inc.incident_id,
        "task_id": inc.task_id,
        "node": inc.node,
        "rank": inc.rank,
        "status": inc.status.value,
        "severity": inc.severity.value,
        "rule": inc.rule,
        "evidence": inc.evidence,
        "stage": inc.stage.value,
        "open": inc.is_open,
        "detected_s": m.detected_s,
        "duration_s": end_s - m.detected_s,
        "note": inc.note,
        "isolated_nodes": list(inc.isolated_nodes),
        "pending_drain": inc.pending_drain,
        "attempts": {stage.value: n for stage, n in inc.attempts.items()},
        "milestones_s": m.since_detected(),
        "timeline": [
            {
                "stage": s.stage.value,
                "t_s": s.start_s,
                "since_detected_s": s.since_detected_s,
                "duration_s": s.duration_s,
                "ongoing": s.ongoing,
            }
            for s in stage_spans(inc, now_s)
        ],
    }


def incidents_json(snap: Snapshot, *, include_closed: bool, now_s: float) -> list[dict[str, Any]]:
    """Open incidents (and with ``include_closed`` the closed ones still kept), oldest first."""
    chosen = [i for i in snap.incidents.values() if include_closed or i.is_open]
    return [incident_json(i, now_s) for i in sorted(chosen, key=lambda i: (i.opened_s, i.incident_id))]


def render_incident(d: dict[str, Any]) -> list[str]:
    """The human view of one :func:`incident_json`: a header, the milestones, the timeline."""
    where = f"task {d['task_id']}" if d["task_id"] is not None else "no task"
    rank = f" rank {d['rank']}" if d["rank"] is not None else ""
    state = "open" if d["open"] else "closed"
    lines = [
        f"{d['incident_id']}  {state}  {d['status']} {d['severity']}  {where}  node {d['node']}{rank}  "
        f"stage {d['stage']}  {d['duration_s']:.1f} s{' so far' if d['open'] else ''}",
        f"  rule {d['rule'] or '-'}: {d['evidence'] or '-'}",
    ]
    if d["note"]:
        lines.append(f"  note: {d['note']}")
    if d["pending_drain"]:
        lines.append(
            f"  waiting for the operator to confirm the drain of {d['pending_drain']} "
            f"(unicornctl incidents confirm {d['incident_id']})"
        )
    milestones = ", ".join(f"{name} +{s:.1f} s" for name, s in d["milestones_s"].items())
    lines.append(f"  detected {clock(d['detected_s'])}" + (f"; {milestones}" if milestones else ""))
    for e in d["timeline"]:
        offset = f"+{e['since_detected_s']:.1f} s"
        lasted = "" if e["stage"] == "closed" else f"{e['duration_s']:.1f} s"
        ongoing = " (ongoing)" if e["ongoing"] else ""
        row = f"    {clock(e['t_s'])}  {offset:>10}  {e['stage']:<22}{lasted:>10}{ongoing}"
        lines.append(row.rstrip())
    return lines


def render_incidents(snap: Snapshot, *, include_closed: bool, now_s: float) -> str:
    """The human view of :func:`incidents_json`, one :func:`render_incident` after another."""
    docs = incidents_json(snap, include_closed=include_closed, now_s=now_s)
    if not docs:
        closed = sum(1 for i in snap.incidents.values() if not i.is_open)
        hint = f"; {closed} closed in the last {KEEP_CLOSED_S / 3600:g} h (--all)" if closed else ""
        return f"no open incidents{hint}"
    lines: list[str] = []
    for d in docs:
        lines += [*render_incident(d), ""]
    return "\n".join(lines).rstrip()


def task_json(task: TaskRecord, snap: Snapshot) -> dict[str, Any]:
    """One task as ``unicornctl tasks --json`` shows it."""
    inc = snap.open_incident(task.task_id)
    return {
        "task_id": task.task_id,
        "name": task.name,
        "job_id": task.job_id,
        "state": task.state.value,
        "framework": task.framework,
        "weight": task.weight,
        "min_gpus": task.min_gpus,
        "max_gpus": task.max_gpus,
        "layout": task.layout.describe() if task.layout else None,
        "gpus": task.layout.world_size if task.layout else 0,
        "nodes": list(task.nodes),
        "last_iteration": task.last_iteration,
        "recoveries_without_progress": task.recoveries_without_progress,
        "incidents_opened": task.incidents_opened,
        "open_incident": None
        if inc is None
        else {"incident_id": inc.incident_id, "stage": inc.stage.value, "status": inc.status.value},
    }


def render_tasks(snap: Snapshot) -> str:
    """The human table of every task, by id."""
    tasks = [task_json(t, snap) for t in sorted(snap.tasks.values(), key=lambda t: t.task_id)]
    if not tasks:
        return "no tasks"
    rows = [("TASK", "JOB", "STATE", "GPUS", "LAYOUT", "NODES", "WEIGHT", "ITERATION", "INCIDENT")]
    for t in tasks:
        inc = t["open_incident"]
        rows.append(
            (
                t["task_id"],
                "-" if t["job_id"] is None else str(t["job_id"]),
                t["state"],
                str(t["gpus"]),
                t["layout"] or "-",
                compress(t["nodes"]) or "-",
                f"{t['weight']:g}",
                "-" if t["last_iteration"] is None else str(t["last_iteration"]),
                "-" if inc is None else f"{inc['incident_id']} ({inc['stage']})",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "include_closed", is_flag=True, help="Closed incidents too (those kept: last 24 h).")
@click.pass_context
def incidents(ctx: click.Context, as_json: bool, include_closed: bool) -> None:
    """Open incidents (``--all``: closed ones too) with their timeline: detected,
    classified, drained, replanned, resumed, closed, and the time between stages.
    ``incidents confirm ID`` (operators): confirm the drain an incident waits for.

    Exit codes: 0 shown; 1 Redis unreachable, state unreadable or a bad config;
    2 bad usage; 3 no unicornd state in Redis (unicornd never ran against it).
    """
    if ctx.invoked_subcommand is not None:
        if as_json or include_closed:
            raise click.UsageError(f"--json and --all list incidents; {ctx.invoked_subcommand} takes neither")
        return
    snap = snapshot_of(ctx)
    now_s = time.time()
    if as_json:
        doc = incidents_json(snap, include_closed=include_closed, now_s=now_s)
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(render_incidents(snap, include_closed=include_closed, now_s=now_s))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def tasks(ctx: click.Context, as_json: bool) -> None:
    """unicornd's tasks: state, job, GPUs and layout, nodes, weight, iteration, open incident.

    Exit codes: 0 shown; 1 Redis unreachable, state unreadable or a bad config;
    2 bad usage; 3 no unicornd state in Redis (unicornd never ran against it).
    """
    snap = snapshot_of(ctx)
    if as_json:
        click.echo(
            json.dumps(
                [task_json(t, snap) for t in sorted(snap.tasks.values(), key=lambda t: t.task_id)], indent=2
            )
        )
    else:
        click.echo(render_tasks(snap))
