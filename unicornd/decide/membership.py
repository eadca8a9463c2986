"""Membership inputs: nodes join, pass or fail their check, are drained; tasks arrive,
finish, stop; a requeued job runs again."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from unicorn_core.errors import InvalidArgument
from unicornd.actions import (
    CheckNode,
    CloseIncident,
    Decision,
    DrainNode,
    LaunchAgents,
    NodeArgv,
    NotifyOperator,
    Replan,
    ResumeNode,
)
from unicornd.decide.common import (
    Draft,
    drain_reason,
    recent,
)
from unicornd.launch import Render
from unicornd.state import (
    ENDED_STATES,
    LIVE_TASK_STATES,
    LadderStage,
    NodeHealth,
    Snapshot,
    TaskRecord,
    TaskState,
)

_L = LadderStage

# --- membership: nodes and tasks ----------------------------------------------------


def on_node_join(
    snapshot: Snapshot,
    node: str,
    now_s: float,
    *,
    by_operator: bool = False,
    gpus: tuple[int, str] | None = None,
    slurm_down: bool | None = None,
) -> Decision:
    """A node appeared or came back in Slurm (``by_operator``: ``unicornctl node resume``).
    ``gpus``: its (GPU count, GPU type) as Slurm's GRES says, recorded with it (a new
    node's kind decides its planning pool from its first replan on). ``slurm_down``:
    whether this same poll saw Slurm hold it NOT_RESPONDING/DOWN, recorded with it, so
    that the join's own replan never plans onto it (None: keep what is recorded).

    A held node (too many failures) that an operator did not resume is drained again
    and the operator told. Otherwise it runs the node check first (``returning``), or
    with ``Policy.node_check_on_join`` off becomes healthy and triggers a replan.
    Joining again while healthy or returning changes nothing.
    """
    draft = Draft(snapshot, now_s)
    known = node in snapshot.nodes
    rec = snapshot.node(node)
    if known and rec.health in (NodeHealth.HEALTHY, NodeHealth.RETURNING, NodeHealth.SUSPECT):
        return Decision(notes=(f"node {node} is {rec.health}; join ignored",))
    joins = rec.joins + 1
    base = f"join/{node}/{joins}"
    if rec.held and not by_operator and snapshot.foreign_jobs(node):
        others = list(snapshot.foreign_jobs(node))
        draft.put(replace(rec, joins=joins))
        why = f"node {node} came back but is held; it runs other users' jobs {others}: not drained"
        draft.act(NotifyOperator(f"{base}/notify", None, why))
        return draft.note(why)
    if rec.held and not by_operator:
        reason = drain_reason(
            draft, "held", f"{len(rec.failures_s)} failures; resume with unicornctl node resume {node}"
        )
        draft.put(replace(rec, joins=joins, reason=reason))
        draft.act(DrainNode(f"{base}/drain", node, reason))
        draft.act(NotifyOperator(f"{base}/notify", None, f"node {node} came back but is held: {reason}"))
        return draft.decision()
    rec = replace(rec, joins=joins, held=False if by_operator else rec.held)
    if gpus is not None:
        rec = replace(rec, gpus=gpus[0], gpu_type=gpus[1])
    if slurm_down is not None:
        rec = replace(rec, slurm_down=slurm_down)
    if by_operator:
        draft.act(ResumeNode(f"{base}/resume", node, "unicorn: resumed by operator"))
    if not known:
        rec = replace(rec, health=NodeHealth.RETURNING, reason="new node")
    else:
        rec = rec.with_health(NodeHealth.RETURNING, "returning")
    if draft.policy.node_check_on_join:
        draft.put(rec)
        draft.act(CheckNode(f"{base}/check", node))
    else:
        draft.put(rec.with_health(NodeHealth.HEALTHY, ""))
        draft.act(Replan(f"{base}/replan", f"node {node} joined"))
    return draft.decision()


def on_node_gpus(snapshot: Snapshot, gpus: Mapping[str, tuple[int, str]], now_s: float) -> Decision:
    """A Slurm poll's (GPU count, GPU type) per node: known nodes whose GRES changed are
    recorded anew, and a replan follows (their planning pool changed). Unknown nodes are
    left to their join; nothing changed: an empty decision."""
    changed = [
        replace(rec, gpus=gpus[name][0], gpu_type=gpus[name][1])
        for name, rec in sorted(snapshot.nodes.items())
        if name in gpus and (rec.gpus, rec.gpu_type) != gpus[name]
    ]
    if not changed:
        return Decision()
    names = ", ".join(n.name for n in changed)
    key = ",".join(f"{n.name}:{n.gpus}:{n.gpu_type}" for n in changed)
    return Decision(
        actions=(Replan(f"gpus/{zlib.crc32(key.encode()):08x}", f"GPUs of {names} changed"),),
        nodes=tuple(changed),
        notes=(f"GPUs of {names} as Slurm's GRES now says: replan",),
    )


def on_node_jobs(snapshot: Snapshot, jobs: Mapping[str, tuple[int, ...]], now_s: float) -> Decision:
    """A Slurm poll says which jobs hold each node (``jobs``; a node not in it: none).

    Each node's record keeps its jobs; those that are no task's are other users'
    (:meth:`Snapshot.foreign_jobs`), and the planner leaves such a node alone. A node that
    becomes plannable again (their job ended) asks for a replan, as a joining node does.
    Nodes unicorn does not know are ignored; nothing changed: an empty decision.
    """
    changed = []
    for name, rec in sorted(snapshot.nodes.items()):
        now_jobs = tuple(sorted(set(jobs.get(name, ()))))
        if now_jobs != rec.jobs:
            changed.append(replace(rec, jobs=now_jobs))
    if not changed:
        return Decision()
    after = snapshot.apply(nodes=changed)
    freed = sorted(set(after.plannable()) - set(snapshot.plannable()))
    taken = sorted(
        n.name for n in changed if after.foreign_jobs(n.name) and not snapshot.foreign_jobs(n.name)
    )
    notes = [f"node {n} runs other users' jobs {list(after.foreign_jobs(n))}: not ours" for n in taken]
    actions: tuple[Replan, ...] = ()
    if freed:
        key = ",".join(
            f"{n}:{after.node(n).joins}:{'-'.join(map(str, snapshot.node(n).jobs))}" for n in freed
        )
        actions = (
            Replan(f"jobs/{zlib.crc32(key.encode()):08x}", f"other users' jobs left {', '.join(freed)}"),
        )
        notes.append(f"other users' jobs left {', '.join(freed)}: replan")
    return Decision(actions=actions, nodes=tuple(changed), notes=tuple(notes))


def on_node_check(snapshot: Snapshot, node: str, passed: bool, now_s: float, detail: str = "") -> Decision:
    """Outcome of the node check of a returning node: healthy + replan, or drained again."""
    rec = snapshot.nodes.get(node)
    if rec is None or rec.health is not NodeHealth.RETURNING:
        return Decision(notes=(f"node {node}: check result while not returning; ignored",))
    draft = Draft(snapshot, now_s)
    base = f"join/{node}/{rec.joins}"
    if passed:
        # The check ran there through srun, so slurmd answers, whatever the last poll said
        # (a resumed node is NOT_RESPONDING for a moment): the join's replan may use it.
        draft.put(replace(rec.with_health(NodeHealth.HEALTHY, ""), slurm_down=False))
        draft.act(Replan(f"{base}/replan", f"node {node} joined"))
        return draft.decision()
    pol = draft.policy
    failures = recent((*rec.failures_s, now_s), now_s, pol.node_failure_window_s)
    others = snapshot.foreign_jobs(node)
    if others:  # stays returning (never planned) until it joins again; the operator decides
        why = (
            f"node {node} failed its check ({detail}) but runs other users' jobs {list(others)}: not drained"
        )
        draft.put(replace(rec, failures_s=failures, reason=f"check failed: {detail}"[:200]))
        draft.act(NotifyOperator(f"{base}/notify-check", None, why))
        return draft.note(why)
    reason = drain_reason(draft, "node_check_failed", detail)
    draft.put(
        replace(
            rec.with_health(NodeHealth.DRAINING, reason),
            failures_s=failures,
            held=rec.held or len(failures) >= pol.node_failure_limit,
        )
    )
    draft.act(DrainNode(f"{base}/drain-check", node, reason))
    return draft.decision()


def on_node_drained(snapshot: Snapshot, node: str, now_s: float, reason: str = "") -> Decision:
    """Slurm shows the node drained or down: ``draining -> drained``.

    A healthy node drained by someone else also leaves every plan: if a live task uses
    it, the caller turns that into a finding; here it only triggers a replan.
    """
    rec = snapshot.node(node)
    if rec.health is NodeHealth.DRAINED:
        return Decision()
    if rec.health is NodeHealth.RETURNING:
        return Decision(notes=(f"node {node} drained while returning; waiting for its check",))
    draft = Draft(snapshot, now_s)
    external = rec.health is not NodeHealth.DRAINING
    draft.put(rec.with_health(NodeHealth.DRAINED, reason or rec.reason))
    if external:
        draft.act(
            Replan(f"drained/{node}/{rec.joins}/{len(rec.drains_s)}", f"node {node} drained outside unicorn")
        )
    return draft.decision()


def on_task_arrived(snapshot: Snapshot, task: TaskRecord, now_s: float) -> Decision:
    """Register a new task (state pending) and replan. Registering the same record again
    changes nothing; a different record under an existing id raises InvalidArgument."""
    existing = snapshot.tasks.get(task.task_id)
    if existing is not None:
        if existing == task:
            return Decision()
        raise InvalidArgument(f"task {task.task_id!r} is already registered with different fields")
    if task.state is not TaskState.PENDING:
        raise InvalidArgument(f"a new task must be pending, got {task.state}")
    return Decision(
        actions=(Replan(f"task/{task.task_id}/arrived", f"task {task.task_id} arrived"),), tasks=(task,)
    )


def on_task_finished(snapshot: Snapshot, task_id: str, now_s: float, *, ok: bool = True) -> Decision:
    """The task's job ended (``ok``: finished, else failed): release its nodes, close its
    incident, replan. Unknown task: InvalidArgument; already ended: no change."""
    task = snapshot.tasks.get(task_id)
    if task is None:
        raise InvalidArgument(f"unknown task {task_id!r}")
    if task.state in (TaskState.FINISHED, TaskState.FAILED):
        return Decision()
    draft = Draft(snapshot, now_s)
    end = TaskState.FINISHED if ok else TaskState.FAILED
    draft.put(replace(task.with_state(end), nodes=(), requeue=None, ended_s=now_s))
    inc = snapshot.open_incident(task_id)
    if inc is not None:
        draft.put(replace(inc.moved(_L.CLOSED, now_s), note=f"task {end}"))
        draft.act(CloseIncident(f"{inc.incident_id}/close", inc.incident_id))
    draft.act(Replan(f"task/{task_id}/{end.value}", f"task {task_id} {end}"))
    return draft.decision()


def on_task_stop(snapshot: Snapshot, task_id: str, now_s: float, *, why: str) -> Decision:
    """The task's owner asked it to stop (scancel, or the job's time limit is near).

    Its agents are told to stop (the ranks save at the end of the iteration and exit),
    the task becomes ``stopped``, its nodes are released, its incident is closed, and the
    rest of the cluster is replanned. Unknown task: InvalidArgument; already ended or
    stopped: no change (a repeated request is a no-op).
    """
    task = snapshot.tasks.get(task_id)
    if task is None:
        raise InvalidArgument(f"unknown task {task_id!r}")
    if task.state in ENDED_STATES:
        return Decision()
    draft = Draft(snapshot, now_s)
    draft.put(replace(task.with_state(TaskState.STOPPED), nodes=(), requeue=None, ended_s=now_s))
    for name in task.nodes:
        if task.job_id is not None:
            draft.stop_agent(f"task/{task_id}/stop/{name}", task.job_id, name)
    inc = snapshot.open_incident(task_id)
    if inc is not None:
        draft.put(replace(inc.moved(_L.CLOSED, now_s), note=f"task stopped: {why}"))
        draft.act(CloseIncident(f"{inc.incident_id}/close", inc.incident_id))
    draft.act(Replan(f"task/{task_id}/stopped", f"task {task_id} stopped: {why}"))
    draft.notes.append(f"task {task_id} stopped: {why}")
    return draft.decision()


def on_node_finished(snapshot: Snapshot, job_id: int, node: str, now_s: float) -> Decision:
    """The agent of ``job_id`` on ``node`` saw the training exit 0 there.

    Recorded on the task (``finished_nodes``, cleared by every restart of its ranks);
    once every node of the task has, the task finished (:func:`on_task_finished`). A
    task in recovery counts too: a restarted run may resume at its last iteration and
    end at once, with no new iteration to close the incident first. Ignored while its
    job is being requeued (its processes end on purpose).
    """
    task = snapshot.task_of_job(job_id)
    if (
        task is None
        or task.state not in LIVE_TASK_STATES
        or task.requeue is not None
        or node not in task.nodes
        or node in task.finished_nodes
    ):
        return Decision()
    done = (*task.finished_nodes, node)
    if set(task.nodes) <= set(done):
        ended = on_task_finished(snapshot, task.task_id, now_s, ok=True)
        return replace(ended, notes=(*ended.notes, f"task {task.task_id}: training finished on every node"))
    return Decision(tasks=(replace(task, finished_nodes=done),))


def on_job_running(
    snapshot: Snapshot, job_id: int, observed_s: float, now_s: float, render: Callable[[int], Render]
) -> Decision:
    """Slurm showed ``job_id`` RUNNING at a poll started at ``observed_s``.

    For a task whose requeue has been done (before ``observed_s``) this is the job
    running again: its agents are launched on its nodes at its layout
    (``render(generation)`` gives the argv), and the wait ends. Anything else: no change.
    """
    task = snapshot.task_of_job(job_id)
    wait = task.requeue if task is not None else None
    if task is None or wait is None or wait.done_s is None or observed_s <= wait.done_s:
        return Decision()
    draft = Draft(snapshot, now_s)
    if task.state not in LIVE_TASK_STATES or task.layout is None or not task.nodes:
        draft.put(replace(task, requeue=None))
        return draft.note(f"task {task.task_id}: job {job_id} runs again; nothing to launch ({task.state})")
    argv = render(task.generation)(task, task.layout, task.nodes)
    commands = tuple(NodeArgv(n, tuple(argv[n])) for n in task.nodes)
    draft.act(LaunchAgents(f"{wait.action_id}/launch", task.task_id, job_id, commands))
    draft.put(replace(task, requeue=None, launched_s=now_s))
    return draft.note(f"task {task.task_id}: job {job_id} runs again; agents on {', '.join(task.nodes)}")


def on_node_slurm_down(
    snapshot: Snapshot, polled: Collection[str], down: Collection[str], now_s: float
) -> Decision:
    """A Slurm poll of the nodes ``polled`` says which of them are NOT_RESPONDING or DOWN
    (``down``; the other polled ones: up). Nodes not polled keep what they had.

    Each node's record keeps it (``slurm_down``). Slurm starts no job on such a node, so
    an idle one leaves the plannable set: a plan that gave it to a task (a requeue onto a
    dead spare) would wait for a start that never comes. Health is unchanged: Slurm's view
    alone convicts nothing. A node that responds again is plannable for the next plan but
    asks for none: a node flapping between polls (a resumed node is NOT_RESPONDING for a
    moment) must not cost a solve per flap. Unknown nodes are ignored; nothing changed: an
    empty decision. ``now_s`` is unused (the decision signature).
    """
    polled_set, down_set = frozenset(polled), frozenset(down)
    changed = [
        replace(rec, slurm_down=name in down_set)
        for name, rec in sorted(snapshot.nodes.items())
        if name in polled_set and rec.slurm_down != (name in down_set)
    ]
    if not changed:
        return Decision()
    went = "NOT_RESPONDING or DOWN: no new work there"
    notes = tuple(f"slurmctld: {rec.name} {went if rec.slurm_down else 'up again'}" for rec in changed)
    return Decision(nodes=tuple(changed), notes=notes)
