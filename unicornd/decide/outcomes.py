"""Outcomes of actions, fed back into the decisions (:func:`on_outcome`).

Every action the executor performs, and every command an agent answers, comes back as an
:class:`~unicornd.actions.Outcome`. Action ids say what each action was for (see
:mod:`unicornd.actions`), so the outcome finds its incident rung, plan step or node check
without any state outside the snapshot:

=====================================  =================================================
failed action (or agent's answer)      decision
=====================================  =================================================
a rung's ``restart_ranks``/new agent   the rung failed at once (:func:`rung_failed`), the
                                       agent's error in the incident's timeline; a command
                                       that fails to start never isolates a node: the
                                       operator is asked once restarts are used up
a plan's ``relaunch``/``launch``       the transition's rung fails; a healthy task moved
                                       by the plan gets an incident at ``restart_processes``
a plan's shrink or grow                the job is requeued onto its planned nodes instead
                                       (Slurm without slurmdbd resizes once; no GPU job
                                       grows); the plan's later steps for it are void
a requeue                              the operator is asked (:func:`start_failed`)
a returning node's check               :func:`on_node_check` (passed or not)
an incident's node check (either way)  :func:`on_check_outcome`: the nodes it convicts are
                                       drained; all passed: the task stops, none drained
a drain, resume, stop, checkpoint      recorded (the operator sees it in the incident)
=====================================  =================================================

A requeue that succeeded starts the wait for the job to run again
(:func:`unicornd.decide.on_job_running`). Outcomes of actions whose incident, plan
generation or join has moved on are stale and only noted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from detect.statuses import ErrorStatus, Severity
from unicornd.actions import Decision, Outcome, Requeue
from unicornd.decide.common import Draft, Finding
from unicornd.decide.ladder import on_check_outcome, on_finding, rung_failed, start_failed
from unicornd.decide.membership import on_node_check
from unicornd.replan import REQUEUE_QUEUED_LIMIT_S, REQUEUE_TIMEOUT_S
from unicornd.state import LIVE_TASK_STATES, Incident, LadderStage, RequeueWait, Snapshot, TaskRecord

_L = LadderStage
_STARTS: Final = frozenset({"restart_ranks", "restart_agent", "relaunch", "launch"})
"""Steps that (re)start a task's ranks: their failure fails the rung."""


def on_outcome(snapshot: Snapshot, outcome: Outcome, now_s: float) -> Decision:
    """Decide on one action's outcome (see the module docstring). Pure."""
    aid = outcome.action_id
    parts = aid.split("/")
    if parts[0] == "join" and aid.endswith("/check") and len(parts) == 4:
        return on_node_check(snapshot, parts[1], outcome.ok, now_s, outcome.detail or outcome.status.value)
    if parts[0].startswith("plan-") and len(parts) >= 3:
        return _plan_step(snapshot, outcome, parts, now_s)
    for inc in snapshot.incidents.values():
        if aid.startswith(f"{inc.incident_id}/") and inc.is_open:
            return _rung_step(snapshot, inc, outcome, aid[len(inc.incident_id) + 1 :].split("/"), now_s)
    return _noted(snapshot, outcome, now_s)


def _what(outcome: Outcome) -> str:
    where = f" on {outcome.node}" if outcome.node else ""
    return f"{outcome.action_id}{where} {outcome.status.value}: {outcome.detail}".strip()


def _noted(snapshot: Snapshot, outcome: Outcome, now_s: float) -> Decision:
    if outcome.ok:
        return Decision()
    return Decision(notes=(f"outcome {_what(outcome)}; nothing to decide",))


def _rung_step(
    snapshot: Snapshot, inc: Incident, outcome: Outcome, rest: list[str], now_s: float
) -> Decision:
    """``rest`` = stage / attempt / kind / target of an action of ``inc``'s ladder."""
    draft = Draft(snapshot, now_s)
    if len(rest) < 3:
        return draft.decision()
    stage, attempt, kind = rest[0], rest[1], rest[2]
    task = snapshot.tasks.get(inc.task_id) if inc.task_id is not None else None
    current = stage == inc.stage.value and attempt == str(inc.attempts_at(inc.stage))
    if kind == "check":
        if not current or task is None or not inc.pending_check or task.state not in LIVE_TASK_STATES:
            draft.put(inc.noted(_what(outcome), now_s))
            return draft.note(f"{inc.incident_id}: {_what(outcome)} (stale check, recorded)")
        detail = outcome.detail or outcome.status.value
        on_check_outcome(draft, task, inc, ok=outcome.ok, nodes=outcome.nodes, detail=detail)
        return draft.decision()
    if outcome.ok:
        if current and kind in _STARTS and now_s > inc.last_action_s:
            # The settle time runs from when the step was performed, not decided: a decision
            # replayed after a takeover is dated at its finding's time, seconds before the
            # new leader performs it, and the consequences of the restart (the old ranks
            # killed, a stopped rank after the grace) must still be absorbed. Seen in the
            # soak bench: a stopped rank's SIGKILL 5 s after the restart was taken for a new
            # failure and the task was stopped.
            draft.put(replace(inc, last_action_s=now_s))
        return draft.decision()
    if task is None or kind not in _STARTS or not current or task.state not in LIVE_TASK_STATES:
        draft.put(inc.noted(_what(outcome), now_s))
        return draft.note(f"{inc.incident_id}: {_what(outcome)} (recorded)")
    rung_failed(draft, task, inc, _what(outcome), start_error=outcome.kind == Outcome.AGENT_COMMAND)
    return draft.decision()


def _plan_step(snapshot: Snapshot, outcome: Outcome, parts: list[str], now_s: float) -> Decision:
    """``parts`` = plan-GEN / task / kind [/ node]."""
    draft = Draft(snapshot, now_s)
    task = snapshot.tasks.get(parts[1])
    generation = parts[0].removeprefix("plan-")
    if task is None or str(task.generation) != generation or task.state not in LIVE_TASK_STATES:
        return _noted(snapshot, outcome, now_s)
    if parts[-1] == "requeue":
        return _requeue_step(draft, task, outcome)
    if outcome.ok:
        return draft.decision()
    return _plan_step_failed(draft, task, outcome, parts)


def _plan_step_failed(draft: Draft, task: TaskRecord, outcome: Outcome, parts: list[str]) -> Decision:
    kind = parts[2]
    if kind in ("shrink", "grow") and len(parts) == 3:
        return _resize_refused(draft, task, outcome)
    if kind not in _STARTS and parts[-1] not in _STARTS:
        return _noted(draft.snap, outcome, draft.now_s)
    inc = draft.snap.open_incident(task.task_id)
    if inc is not None and inc.stage in (_L.TRANSITION, _L.RETRY_IN_PLACE):
        # Waiting in place cannot help a task whose processes did not start. Found in CI: the
        # old ranks' reactions to the relaunch's SIGTERM opened a SEV3 wait just before the
        # relaunch failed, and the failure was only recorded: no ranks, no action for minutes.
        rung_failed(draft, task, inc, _what(outcome), start_error=outcome.kind == Outcome.AGENT_COMMAND)
        return draft.decision()
    if inc is not None:
        draft.put(inc.noted(_what(outcome), draft.now_s))
        return draft.note(f"{inc.incident_id}: {_what(outcome)} (recorded)")
    node = outcome.node or (task.nodes[0] if task.nodes else "")
    if not node:
        return _noted(draft.snap, outcome, draft.now_s)
    # A healthy task the plan moved could not start: a fault of its own, on that node.
    finding = Finding(
        finding_id=f"outcome:{outcome.action_id}",
        job_id=task.job_id,
        node=node,
        rank=None,
        status=ErrorStatus.OTHER_SOFTWARE_ERROR,
        severity=Severity.SEV2,
        rule="start_failed",
        evidence=_what(outcome),
        rank_died=True,
    )
    return on_finding(draft.snap, finding, draft.now_s)


def _requeue_step(draft: Draft, task: TaskRecord, outcome: Outcome) -> Decision:
    """The outcome of the requeue that (re)starts ``task`` on its planned nodes."""
    wait = task.requeue
    if wait is None or wait.action_id != outcome.action_id:
        return draft.note(f"outcome {_what(outcome)}: no requeue of {task.task_id} waits for it")
    if outcome.ok:
        # The wait for the job to run again starts now, not at the plan's commit: the
        # requeue may have waited minutes behind other allocation changes (RequeueWait).
        done = replace(wait, done_s=draft.now_s, deadline_s=draft.now_s + REQUEUE_TIMEOUT_S)
        draft.put(replace(task, requeue=done))
        return draft.note(f"task {task.task_id}: job {task.job_id} requeued; launching once it runs")
    start_failed(draft, task, f"requeue failed: {_what(outcome)}")
    return draft.decision()


def _resize_refused(draft: Draft, task: TaskRecord, outcome: Outcome) -> Decision:
    """Slurm refused the plan's shrink or grow: requeue the job onto the planned nodes; the
    plan's later steps for this task (relaunch, launch) are void."""
    if task.job_id is None or task.requeue is not None:
        return draft.note(f"outcome {_what(outcome)}: {task.task_id} is already being requeued")
    base = outcome.action_id.rsplit("/", 1)[0]  # plan-GEN/task/kind
    requeue = Requeue(f"{outcome.action_id}/requeue", task.task_id, task.job_id, task.nodes)
    draft.cancel(f"plan-{task.generation}/{task.task_id}/")
    draft.act(requeue)
    wait_s = draft.now_s + REQUEUE_QUEUED_LIMIT_S
    draft.put(replace(task, resizes_this_run=0, requeue=RequeueWait(requeue.action_id, wait_s)))
    return draft.note(f"{base}: {outcome.status.value} ({outcome.detail}); requeue {task.task_id} instead")
