"""``unicornctl``: the operator's view of the cluster unicorn manages.

Read-only commands talk to Slurm and Redis directly. Mutating commands (``drain``,
``resume``) are requests to unicornd on its control stream, never scontrol calls, so
plans follow; only operators may send them (root, Slurm's SlurmUser, or members of
``slurm.operators_group``). ``plan --what-if-fail NODE`` runs unicornd's own decision and
planner on its live snapshot and applies nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import json
import os
import pwd
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from detect.cli import classify as classify_command
from detect.statuses import ErrorStatus, Severity
from launcher.nodecheck import Outcome, run_local_checks
from plan.cli import plan as plan_group
from plan.hardware import gpu_spec
from plan.objective import FailureModel
from plan.planner import Plan
from plan.sim.cli import simulate as simulate_command
from unicorn_core import acl, proc, redis_io
from unicorn_core.config import Config, describe, load_config
from unicorn_core.errors import ConfigError, InvalidArgument, ProtocolError, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import configure_logging
from unicorn_core.slurm import JobInfo, NodeInfo, make_backend
from unicorn_core.slurm.cli import client_env
from unicorn_core.slurm.hostlist import compress, expand
from unicornd import store
from unicornd.actions import Decision, Replan, action_to_dict
from unicornd.alerts import incident_milestones, stage_spans
from unicornd.decide import LIVE_TASK_STATES, Finding, on_finding, on_node_join, on_operator_drain
from unicornd.launch import renderer
from unicornd.paircheck import PairedCheckReport, paired_check
from unicornd.registry import NoDaemon, NotOperator, RequestRefused, request
from unicornd.replan import plan_for, plan_transition
from unicornd.state import Incident, NodeHealth, Snapshot, TaskRecord
from unicornd.store import KEEP_CLOSED_S
from unicornd.taskcli import task_group


@dataclasses.dataclass(frozen=True)
class ClusterStatus:
    nodes: list[NodeInfo]
    jobs: list[JobInfo]
    redis_ok: bool
    redis_error: str
    daemon_alive: bool = False
    snapshot: Snapshot | None = None
    state_error: str = ""


async def gather_status(cfg: Config) -> ClusterStatus:
    slurm = await make_backend(cfg.slurm)
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    try:
        nodes, jobs = await asyncio.gather(slurm.list_nodes(), slurm.list_jobs())
        keys = RedisKeys(cfg.redis.key_prefix)
        alive, snap, state_error = False, None, ""
        try:
            await redis_io.call(("PING",), client.ping())
            redis_ok, redis_error = True, ""
            alive = bool(await redis_io.call(("EXISTS",), client.exists(keys.daemon_liveness())))
            try:
                snap = await store.read_snapshot(client, keys)
            except (ProtocolError, InvalidArgument) as e:  # a document, but not a valid snapshot
                state_error = f"unreadable unicornd state: {e}"
        except UnicornError as e:
            redis_ok, redis_error = False, str(e)
    finally:
        await client.aclose()
    return ClusterStatus(nodes, jobs, redis_ok, redis_error, alive, snap, state_error)


def _unicorn_json(st: ClusterStatus) -> dict[str, Any]:
    snap = st.snapshot
    if snap is None:
        return {"daemon_alive": st.daemon_alive, "tasks": [], "incidents": [], "error": st.state_error}
    return {
        "daemon_alive": st.daemon_alive,
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
        "node_health": {n.name: {"health": n.health.value, "reason": n.reason} for n in snap.nodes.values()},
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


def _node_json(n: NodeInfo) -> dict[str, Any]:
    return {
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


@click.group()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="unicorn.toml (default: $UNICORN_CONFIG, else built-in defaults).",
)
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None) -> None:
    """Operate unicorn: self-healing LLM training on Slurm."""
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path


def _config(ctx: click.Context) -> Config:
    try:
        cfg = load_config(ctx.obj.get("config_path"))
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    configure_logging(
        cfg.log.level, "console" if cfg.log.format == "auto" else cfg.log.format, stream=sys.stderr
    )
    return cfg


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--check", is_flag=True, help="Exit 1 unless unicornd is alive (its liveness key exists).")
@click.pass_context
def status(ctx: click.Context, as_json: bool, check: bool) -> None:
    """Nodes (state, reason, GPUs), jobs, unicornd's tasks and open incidents, Redis.

    Exits 1 when Slurm or Redis cannot be reached, and with ``--check`` when unicornd is
    not running.
    """
    cfg = _config(ctx)
    try:
        st = asyncio.run(gather_status(cfg))
    except UnicornError as e:
        raise click.ClickException(f"cannot read cluster state: {e}") from None
    if as_json:
        doc = {
            "nodes": [_node_json(n) for n in st.nodes],
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
            click.echo(f"  {n.name:<10} {state:<22} gpus {n.gpus_used}/{n.gpus}{reason}")
        active = [j for j in st.jobs if not j.state.finished]
        click.echo(f"jobs: {len(active)} active")
        for j in active:
            click.echo(f"  {j.job_id:<8} {j.state.value:<10} {j.name:<20} {compress(j.nodes) or j.reason}")
        click.echo(f"redis: {'ok' if st.redis_ok else 'UNREACHABLE: ' + st.redis_error}")
        u = _unicorn_json(st)
        click.echo(f"unicornd: {'alive' if st.daemon_alive else 'NOT RUNNING'}")
        for t in u["tasks"]:
            click.echo(
                f"  task {t['task_id']:<12} {t['state']:<10} {t['layout'] or '-':<24} "
                f"nodes {','.join(t['nodes']) or '-':<16} weight {t['weight']:g}  "
                f"iteration {t['last_iteration']}"
            )
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


@cli.command("config")
@click.option("--describe", "show_docs", is_flag=True, help="Every setting with its env var and meaning.")
@click.pass_context
def config_cmd(ctx: click.Context, show_docs: bool) -> None:
    """Print the effective configuration (after file and UNICORN_* overrides)."""
    if show_docs:
        for s in describe():
            click.echo(f"{s.key} = {s.default!r}   [{s.env_var}; {s.expected}]\n    {s.doc}")
        return
    cfg = _config(ctx)
    click.echo(json.dumps(dataclasses.asdict(cfg), indent=2))


@cli.command("node-check")
@click.option(
    "--disk",
    "disk_paths",
    multiple=True,
    type=click.Path(path_type=Path),
    default=("/tmp",),  # noqa: S108 - checked for free space, never written
    show_default=True,
    help="Paths that need free space (repeatable).",
)
@click.option("--min-free-gib", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option(
    "--inject-gpu-faults",
    "fault_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TEST ONLY: a GPU fault file (JSON lines); any fault in it fails the check.",
)
@click.option(
    "--paired",
    "paired",
    default=None,
    metavar="NODES",
    help="Instead: the two-round paired check across NODES (a Slurm hostlist, e.g. n[1-4]).",
)
@click.option("--job", "job_id", type=int, default=None, help="--paired: run as steps of this job.")
@click.option("--master-addr", default=None, help="--paired: rendezvous address (default: first node).")
@click.option("--timeout-s", type=click.FloatRange(min=5), default=60.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def node_check(  # noqa: PLR0917 - click passes options positionally
    ctx: click.Context,
    disk_paths: tuple[Path, ...],
    min_free_gib: float,
    fault_file: Path | None,
    paired: str | None,
    job_id: int | None,
    master_addr: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Check this node (GPUs through NVML, disk space, stuck GPU processes).

    Exits 0 when healthy, 1 with the failed checks as the reason otherwise (for Slurm's
    HealthCheckProgram and for unicornd before a node rejoins). With ``--paired NODES``
    runs a small all-gather and matmul per pair of nodes, re-pairs suspects with
    healthy nodes, and exits 1 naming the bad node(s).
    """
    if paired is not None:
        _paired_check(
            ctx, paired, job_id=job_id, master_addr=master_addr, timeout_s=timeout_s, as_json=as_json
        )
        return
    results = run_local_checks(disk_paths=list(disk_paths), min_free_gib=min_free_gib, fault_file=fault_file)
    failed = [r for r in results if r.outcome == Outcome.FAILED]
    if as_json:
        click.echo(json.dumps({"healthy": not failed, "checks": [r.to_json() for r in results]}, indent=2))
    else:
        for r in results:
            click.echo(f"{r.outcome.value:<8} {r.name:<16} {r.detail}")
    if failed:
        reason = "; ".join(f"{r.name}: {r.detail}" for r in failed)
        click.echo(f"unhealthy: {reason}", err=True)
        sys.exit(1)


def _paired_check(
    ctx: click.Context,
    hostlist: str,
    *,
    job_id: int | None,
    master_addr: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    cfg = _config(ctx)
    try:
        nodes = expand(hostlist)
    except UnicornError as e:
        raise click.BadParameter(str(e), param_hint="--paired") from None
    if len(nodes) < 2:
        raise click.BadParameter("needs at least 2 nodes", param_hint="--paired")

    async def go() -> PairedCheckReport:
        slurm = await make_backend(cfg.slurm)
        known = {n.name for n in await slurm.list_nodes()}
        unknown = [n for n in nodes if n not in known]
        if unknown:
            raise click.BadParameter(f"unknown node(s) {unknown}", param_hint="--paired")
        return await paired_check(slurm, nodes, master_addr=master_addr, timeout_s=timeout_s, job_id=job_id)

    try:
        report = asyncio.run(go())
    except UnicornError as e:
        raise click.ClickException(f"paired check failed to run: {e}") from None
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for r in report.results:
            click.echo(f"{'ok' if r.ok else 'FAILED':<7} {','.join(r.nodes):<16} {r.detail}")
        d = report.diagnosis
        click.echo(f"bad: {', '.join(d.bad) or '-'}   unresolved: {', '.join(d.unresolved) or '-'}")
    if report.diagnosis.bad or report.diagnosis.unresolved:
        sys.exit(1)


# --- incidents and tasks: unicornd's snapshot, read from Redis ---------------------------

EXIT_STATE_UNREADABLE = 1
"""``incidents``/``tasks``: Redis unreachable, unicornd's state unreadable, or a bad config."""
EXIT_NO_STATE = 3
"""``incidents``/``tasks``: Redis holds no unicornd state under the configured key prefix
(unicornd never ran against this Redis, or ``redis.key_prefix`` differs)."""


class _StateUnreadableError(click.ClickException):
    exit_code = EXIT_STATE_UNREADABLE


class _NoStateError(click.ClickException):
    exit_code = EXIT_NO_STATE


async def read_snapshot(cfg: Config) -> Snapshot | None:
    """unicornd's persisted snapshot; None when there is none. Raises ``RedisCallError``
    (unreachable, auth), ``ProtocolError`` (not a snapshot this version wrote)."""
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    try:
        return await store.read_snapshot(client, RedisKeys(cfg.redis.key_prefix))
    finally:
        await client.aclose()


def _snapshot(ctx: click.Context) -> Snapshot:
    cfg = _config(ctx)
    try:
        snap = asyncio.run(read_snapshot(cfg))
    except (UnicornError, KeyError, TypeError, ValueError) as e:
        raise _StateUnreadableError(f"cannot read unicornd's state: {e}") from None
    if snap is None:
        raise _NoStateError(
            f"no unicornd state in Redis ({cfg.redis.url.rpartition('@')[2]}, key prefix "
            f"{cfg.redis.key_prefix!r}): unicornd has not run against it"
        )
    return snap


def _clock(t_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_s))


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


def render_incidents(snap: Snapshot, *, include_closed: bool, now_s: float) -> str:
    """The human view of :func:`incidents_json`: a header, the milestones, the timeline."""
    docs = incidents_json(snap, include_closed=include_closed, now_s=now_s)
    if not docs:
        closed = sum(1 for i in snap.incidents.values() if not i.is_open)
        hint = f"; {closed} closed in the last {KEEP_CLOSED_S / 3600:g} h (--all)" if closed else ""
        return f"no open incidents{hint}"
    lines = []
    for d in docs:
        where = f"task {d['task_id']}" if d["task_id"] is not None else "no task"
        rank = f" rank {d['rank']}" if d["rank"] is not None else ""
        state = "open" if d["open"] else "closed"
        lines.append(
            f"{d['incident_id']}  {state}  {d['status']} {d['severity']}  {where}  node {d['node']}{rank}  "
            f"stage {d['stage']}  {d['duration_s']:.1f} s{' so far' if d['open'] else ''}"
        )
        lines.append(f"  rule {d['rule'] or '-'}: {d['evidence'] or '-'}")
        if d["note"]:
            lines.append(f"  note: {d['note']}")
        if d["pending_drain"]:
            lines.append(f"  waiting for the operator to confirm the drain of {d['pending_drain']}")
        milestones = ", ".join(f"{name} +{s:.1f} s" for name, s in d["milestones_s"].items())
        lines.append(f"  detected {_clock(d['detected_s'])}" + (f"; {milestones}" if milestones else ""))
        for e in d["timeline"]:
            offset = f"+{e['since_detected_s']:.1f} s"
            lasted = "" if e["stage"] == "closed" else f"{e['duration_s']:.1f} s"
            ongoing = " (ongoing)" if e["ongoing"] else ""
            row = f"    {_clock(e['t_s'])}  {offset:>10}  {e['stage']:<22}{lasted:>10}{ongoing}"
            lines.append(row.rstrip())
        lines.append("")
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


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "include_closed", is_flag=True, help="Closed incidents too (those kept: last 24 h).")
@click.pass_context
def incidents(ctx: click.Context, as_json: bool, include_closed: bool) -> None:
    """Open incidents (``--all``: closed ones too) with their timeline: detected,
    classified, drained, replanned, resumed, closed, and the time between stages.

    Exit codes: 0 shown; 1 Redis unreachable, state unreadable or a bad config;
    2 bad usage; 3 no unicornd state in Redis (unicornd never ran against it).
    """
    snap = _snapshot(ctx)
    now_s = time.time()
    if as_json:
        doc = incidents_json(snap, include_closed=include_closed, now_s=now_s)
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(render_incidents(snap, include_closed=include_closed, now_s=now_s))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def tasks(ctx: click.Context, as_json: bool) -> None:
    """unicornd's tasks: state, job, GPUs and layout, nodes, weight, iteration, open incident.

    Exit codes: 0 shown; 1 Redis unreachable, state unreadable or a bad config;
    2 bad usage; 3 no unicornd state in Redis (unicornd never ran against it).
    """
    snap = _snapshot(ctx)
    if as_json:
        click.echo(
            json.dumps(
                [task_json(t, snap) for t in sorted(snap.tasks.values(), key=lambda t: t.task_id)], indent=2
            )
        )
    else:
        click.echo(render_tasks(snap))


# --- operator mutations through unicornd, and what-if plans -------------------------------

EXIT_NOT_CONFIRMED = 1
"""``drain``/``resume`` without ``--yes``: what would happen was printed, nothing was sent."""
EXIT_UNKNOWN_NODE = 2
"""``drain``/``resume``/``plan --what-if-fail``: unicornd does not know the node (or bad usage)."""
EXIT_NO_DAEMON = 3
"""``drain``/``resume``: unicornd is not running (no liveness key) or did not answer."""
EXIT_NOT_OPERATOR = 4
"""``drain``/``resume``: the caller is not an operator (root, SlurmUser, ``slurm.operators_group``)."""

REQUEST_TIMEOUT_S = 30.0
"""How long ``drain``/``resume`` wait for unicornd's reply (it answers once the decision is persisted)."""


class _NotConfirmedError(click.ClickException):
    exit_code = EXIT_NOT_CONFIRMED


class _UnknownNodeError(click.ClickException):
    exit_code = EXIT_UNKNOWN_NODE


class _NoDaemonError(click.ClickException):
    exit_code = EXIT_NO_DAEMON


class _NotOperatorError(click.ClickException):
    exit_code = EXIT_NOT_OPERATOR


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


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What unicornd would do with one input, computed and not applied.

    ``decision``: its pure decision on the snapshot. ``plan``/``transition``: the plan and
    the actions of the replan that decision asks for (None: it asks for none, or there is
    no task to plan). ``after``: the snapshot the replan would see.
    """

    decision: Decision
    after: Snapshot
    plan: Plan | None = None
    transition: Decision | None = None


def outlook(snap: Snapshot, decision: Decision, cfg: Config, now_s: float) -> Outlook:
    """Follow ``decision`` through the replan it asks for, with unicornd's own planner call."""
    after = decision.applied_to(snap)
    if not any(isinstance(a, Replan) for a in decision.actions):
        return Outlook(decision, after)
    plan = plan_for(after, gpu_spec(cfg.plan.gpu), FailureModel(cfg.plan.node_mtbf_h))
    if plan is None:
        return Outlook(decision, after)
    render = renderer(cfg.agent, after.gpus_per_node, after.plan_generation + 1)
    return Outlook(decision, after, plan, plan_transition(after, plan, render, now_s))


def what_if_fail(snap: Snapshot, node: str, cfg: Config, now_s: float) -> Outlook:
    """What unicornd would do if ``node`` failed now: a SEV1 lost connection on it (what a dead
    node gives), decided by :func:`unicornd.decide.on_finding`, then its replan. Raises
    InvalidArgument for a node unicornd does not know."""
    if node not in snap.nodes:
        raise InvalidArgument(
            f"unknown node {node!r}; unicornd knows: {compress(sorted(snap.nodes)) or 'none'}"
        )
    users = sorted(
        (t for t in snap.tasks.values() if node in t.nodes and t.state in LIVE_TASK_STATES),
        key=lambda t: t.task_id,
    )
    finding = Finding(
        finding_id=f"what-if/{node}",
        job_id=users[0].job_id if users else None,
        node=node,
        rank=None,
        status=ErrorStatus.LOST_CONNECTION,
        severity=Severity.SEV1,
        rule="what_if",
        evidence=f"unicornctl plan --what-if-fail {node}",
    )
    return outlook(snap, on_finding(snap, finding, now_s), cfg, now_s)


def outlook_json(o: Outlook) -> dict[str, Any]:
    """``--json`` of an outlook: the decision, then (when a replan follows) the plan per task
    (GPUs, layout, nodes before and after) and the transition's actions in order."""
    doc: dict[str, Any] = {
        "decision": {
            "actions": [action_to_dict(a) for a in o.decision.actions],
            "notes": list(o.decision.notes),
        },
        "replan": o.plan is not None,
    }
    if o.plan is None or o.transition is None:
        return doc
    moved = {t.task_id: t for t in o.transition.tasks}
    by_name = {a.task: a for a in o.plan.assignments}
    tasks = []
    for t in sorted(o.after.tasks.values(), key=lambda t: t.task_id):
        a = by_name.get(t.name)
        if a is None:
            continue
        new = moved.get(t.task_id, t)
        tasks.append(
            {
                "task_id": t.task_id,
                "gpus": a.gpus,
                "previous_gpus": t.layout.world_size if t.layout else 0,
                "layout": new.layout.describe() if new.layout else None,
                "nodes": list(new.nodes),
                "previous_nodes": list(t.nodes),
                "changed": t.task_id in moved,
                "waf_tflops": round(a.waf_tflops, 2),
            }
        )
    healthy = sum(1 for n in o.after.nodes.values() if n.health is NodeHealth.HEALTHY and not n.held)
    doc["plan"] = {
        "generation": o.transition.plan_generation,
        "healthy_nodes": healthy,
        "total_waf_tflops": round(o.plan.total_waf_tflops, 2),
        "tasks": tasks,
    }
    doc["actions"] = [action_to_dict(a) for a in o.transition.actions]
    doc["notes"] = list(o.transition.notes)
    return doc


_ACTION_FIELDS = ("action", "node", "job_id", "nodes", "add", "reason", "why")


def _action_text(doc: dict[str, Any]) -> str:
    parts = [doc["kind"]]
    for key in _ACTION_FIELDS:
        value = doc.get(key)
        if value in (None, "", [], ()):
            continue
        shown = compress(value) if key in ("nodes", "add") else value
        parts.append(f"{key}={shown!r}" if key in ("reason", "why") else f"{key}={shown}")
    return " ".join(parts)


def render_outlook(o: Outlook, title: str) -> str:
    """The human view of :func:`outlook_json`."""
    doc = outlook_json(o)
    lines = [title]
    lines += [f"  decides: {_action_text(a)}" for a in doc["decision"]["actions"]]
    lines += [f"  note: {n}" for n in doc["decision"]["notes"]]
    plan = doc.get("plan")
    if plan is None:
        lines.append("  no replan follows")
        return "\n".join(lines)
    lines.append(
        f"  then plans generation {plan['generation']} on {plan['healthy_nodes']} healthy nodes "
        f"(total WAF {plan['total_waf_tflops']:.1f} TFLOP/s):"
    )
    for t in plan["tasks"]:
        was = (
            f"  (was {t['previous_gpus']} GPUs on {compress(t['previous_nodes']) or '-'})"
            if t["changed"]
            else ""
        )
        lines.append(
            f"    {t['task_id']:<12} {t['gpus']:>4} GPUs  {t['layout'] or '-':<28} "
            f"nodes {compress(t['nodes']) or '-'}{was}"
        )
    lines += [f"  acts: {_action_text(a)}" for a in doc["actions"]] or ["  acts: nothing (no task changes)"]
    return "\n".join(lines)


async def daemon_alive(cfg: Config) -> bool:
    """unicornd's liveness key exists (it refreshes it every few seconds while running)."""
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    keys = RedisKeys(cfg.redis.key_prefix)
    try:
        return bool(await redis_io.call(("EXISTS",), client.exists(keys.daemon_liveness())))
    finally:
        await client.aclose()


async def _send_operator(cfg: Config, doc: dict[str, Any]) -> None:
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    try:
        await request(
            client, RedisKeys(cfg.redis.key_prefix), doc, timeout_s=REQUEST_TIMEOUT_S, operator=True
        )
    finally:
        await client.aclose()


def _operator_request(
    ctx: click.Context,
    node: str,
    doc: dict[str, Any],
    *,
    yes: bool,
    preview: Callable[[Snapshot, Config, float], Outlook],
    verb: str,
) -> None:
    """Shared by ``drain`` and ``resume``: operator check, unicornd alive, node known, then
    the preview (without ``--yes``) or the request. Every refusal changes nothing."""
    cfg = _config(ctx)
    caller: Caller = ctx.obj.get("caller") or Caller.current()  # tests pass another one in obj
    refusal = operator_refusal(caller, cfg.slurm.operators_group, lambda: asyncio.run(slurm_user(cfg)))
    if refusal is not None:
        raise _NotOperatorError(f"{refusal}; nothing changed")
    try:
        alive = asyncio.run(daemon_alive(cfg))
        snap = asyncio.run(read_snapshot(cfg)) if alive else None
    except (UnicornError, KeyError, TypeError, ValueError) as e:
        raise _StateUnreadableError(f"cannot read unicornd's state: {e}; nothing changed") from None
    if not alive:
        raise _NoDaemonError(
            f"unicornd is not running (no liveness key under {cfg.redis.key_prefix!r}); "
            f"start it (systemctl start unicornd) and retry; nothing changed"
        )
    if snap is None or node not in snap.nodes:
        known = compress(sorted(snap.nodes)) if snap is not None else ""
        raise _UnknownNodeError(f"unknown node {node!r}; unicornd knows: {known or 'none'}; nothing changed")
    try:
        seen = preview(snap, cfg, time.time())
    except InvalidArgument as e:
        raise click.UsageError(str(e)) from None
    if not yes:
        click.echo(render_outlook(seen, f"unicornctl {verb} {node} would:"))
        raise _NotConfirmedError(f"nothing changed; run again with --yes to {verb} {node}")
    try:
        asyncio.run(_send_operator(cfg, doc))
    except NotOperator as e:
        raise _NotOperatorError(f"{e}; nothing changed") from None
    except NoDaemon as e:
        raise _NoDaemonError(f"{e}; the request stays queued for unicornd") from None
    except RequestRefused as e:
        if "unknown node" in str(e):
            raise _UnknownNodeError(f"unicornd refused: {e}") from None
        raise click.ClickException(f"unicornd refused: {e}") from None
    except UnicornError as e:
        raise click.ClickException(f"cannot reach unicornd: {e}") from None
    click.echo(f"unicornd accepted: {verb} {node}" + "".join(f"\n  {n}" for n in seen.decision.notes))


_MUTATION_CODES = """
    Exit codes: 0 done (unicornd accepted and persisted it); 1 not confirmed (no --yes:
    what would happen is printed), Redis unreachable, or unicornd refused; 2 unknown node or
    bad usage; 3 unicornd not running (no liveness key) or no answer; 4 not an operator
    (root, the SlurmUser, or a member of slurm.operators_group), or Redis refused the
    request because the caller's Redis user is not the operator's.
"""


@cli.command()
@click.argument("node")
@click.option("--reason", required=True, help="Why; Slurm shows 'unicorn: operator: <reason>'.")
@click.option("--yes", is_flag=True, help="Do it (without: print what would happen, exit 1).")
@click.pass_context
def drain(ctx: click.Context, node: str, reason: str, yes: bool) -> None:
    """Take NODE out of service through unicornd: it is drained in Slurm, held until an
    operator resumes it, and every task is replanned without it (its task moves off it)."""

    def preview(snap: Snapshot, cfg: Config, now_s: float) -> Outlook:
        return outlook(snap, on_operator_drain(snap, node, reason, now_s), cfg, now_s)

    doc = {"op": "drain", "node": node, "reason": reason}
    _operator_request(ctx, node, doc, yes=yes, preview=preview, verb="drain")


@cli.command()
@click.argument("node")
@click.option("--yes", is_flag=True, help="Do it (without: print what would happen, exit 1).")
@click.pass_context
def resume(ctx: click.Context, node: str, yes: bool) -> None:
    """Bring NODE back through unicornd: resumed in Slurm, released from hold, node check,
    then it rejoins the plans (a healthy node is left alone)."""

    def preview(snap: Snapshot, cfg: Config, now_s: float) -> Outlook:
        return outlook(snap, on_node_join(snap, node, now_s, by_operator=True), cfg, now_s)

    _operator_request(ctx, node, {"op": "resume", "node": node}, yes=yes, preview=preview, verb="resume")


drain.help = (drain.help or "") + _MUTATION_CODES
resume.help = (resume.help or "") + _MUTATION_CODES


def _what_if(ctx: click.Context, node: str, *, as_json: bool) -> None:
    snap = _snapshot(ctx)
    cfg = _config(ctx)
    try:
        seen = what_if_fail(snap, node, cfg, time.time())
    except InvalidArgument as e:
        raise _UnknownNodeError(str(e)) from None
    except UnicornError as e:
        raise click.ClickException(f"cannot plan: {e}") from None
    if as_json:
        click.echo(json.dumps({"node": node, **outlook_json(seen)}, indent=2))
    else:
        click.echo(render_outlook(seen, f"if {node} failed now (SEV1 lost connection), unicornd:"))


def _plan_command() -> click.Group:
    """:mod:`plan.cli`'s offline ``plan`` plus ``--what-if-fail NODE`` on unicornd's live snapshot
    (the planner library cannot read unicornd's state, so the option is added here)."""
    offline = plan_group.callback
    assert offline is not None
    what_if = click.Option(
        ["--what-if-fail", "what_if_fail"],
        metavar="NODE",
        default=None,
        help="Instead: the plan unicornd would apply if NODE failed now (live state; applies nothing). "
        "Exit 2 for an unknown node, 3 without unicornd state.",
    )

    @click.pass_context
    def callback(ctx: click.Context, /, what_if_fail: str | None, **options: Any) -> None:
        if what_if_fail is None:
            ctx.invoke(offline, **options)
            return
        given = [
            name
            for name in options
            if name != "as_json" and ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        ]
        if given or ctx.invoked_subcommand is not None:
            extra = ", ".join(given) or ctx.invoked_subcommand
            raise click.UsageError(
                f"--what-if-fail plans the live cluster; it takes only --json (got {extra})"
            )
        _what_if(ctx, what_if_fail, as_json=bool(options["as_json"]))

    return click.Group(
        name="plan",
        commands=plan_group.commands,
        callback=callback,
        params=[*plan_group.params, what_if],
        invoke_without_command=True,
        help=plan_group.help,
        short_help=plan_group.short_help,
    )


cli.add_command(_plan_command())
cli.add_command(classify_command)
cli.add_command(simulate_command)
cli.add_command(task_group)


def main() -> None:
    cli(prog_name="unicornctl")
