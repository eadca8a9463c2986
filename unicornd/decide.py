"""The coordinator's decisions: pure functions of (snapshot, input, clock) -> :class:`Decision`.

Nothing here performs I/O or reads a clock: ``now_s`` is wall-clock seconds passed in by
the caller (see :mod:`unicornd.state` for why wall time). The same snapshot and input
always give the same decision, action ids included, so unicornd can re-decide after a
crash and its executor skips what it already did.

The ladder (Unicron Fig. 7), per task, one open incident at a time:

==========================  ===========================================================
finding                     rung
==========================  ===========================================================
SEV3                        ``retry_in_place``: wait (``restart_ranks`` on the node if
                            the rank died); a failed retry climbs
SEV2, or retries exhausted  ``restart_processes``: ``restart_ranks`` on every node of
                            the task, same nodes, same layout, nearest saved state
SEV1, or restarts exhausted ``isolate``: drain the node (``unicorn: <status> <detail>``),
                            then ``replan``; :func:`unicornd.replan.plan_transition`
                            moves the incident to ``transition``
an iteration after that     ``resumed`` then ``closed`` (:func:`on_progress`)
==========================  ===========================================================

A rung *failed* when a finding no better than it arrives more than
:attr:`Policy.settle_s` after its action, or when no iteration arrives within its
timeout (:func:`on_tick`). Findings inside the settle time are consequences of the
action (peers time out, restarted ranks exit) and are only recorded. Breakers: the
per-task recovery budget and the no-progress breaker stop the task and notify the
operator; the drain limiter turns a drain beyond its quota into a request for the
operator's confirmation (:func:`on_operator_confirm_drain`).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, replace
from typing import Final, Protocol

from detect.statuses import ErrorStatus, Severity, worst
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import AgentAction
from unicornd.actions import (
    Action,
    CheckNode,
    CloseIncident,
    Decision,
    DrainNode,
    NotifyOperator,
    Replan,
    RestartAgent,
    ResumeNode,
    SendCommand,
)
from unicornd.state import (
    Incident,
    LadderStage,
    NodeHealth,
    NodeRecord,
    Snapshot,
    StageEntry,
    TaskRecord,
    TaskState,
)

_L = LadderStage

AGENT_LOST: Final = "agent_lost"
AGENT_SILENT: Final = "agent_silent"
AGENT_RULES: Final = frozenset({AGENT_LOST, AGENT_SILENT})
"""Rules of a silent agent on a node that is up (:mod:`unicornd.oob`): its restart rung
starts a new agent there instead of commanding the gone one."""
SSH_UNREACHABLE: Final = "ssh_unreachable"
"""The out-of-band probe could not reach the node: dead, its drain sets it DOWN first."""

LIVE_TASK_STATES: Final = frozenset({TaskState.LAUNCHING, TaskState.RUNNING, TaskState.RECOVERING})
"""States in which a task has processes that can fail."""

RUNG_OF_SEVERITY: Final[dict[Severity, LadderStage]] = {
    Severity.SEV3: _L.RETRY_IN_PLACE,
    Severity.SEV2: _L.RESTART_PROCESSES,
    Severity.SEV1: _L.ISOLATE,
}
"""The first rung a finding of each severity asks for."""

_RUNG_LEVEL: Final[dict[LadderStage, int]] = {
    _L.DETECTED: 0,
    _L.RETRY_IN_PLACE: 1,
    _L.RESTART_PROCESSES: 2,
    _L.TRANSITION: 2,  # a relaunch: findings up to SEV2 right after it are its consequences
    _L.ISOLATE: 3,
    _L.REPLAN: 3,
}

_WAITING_FOR_PLAN: Final = frozenset({_L.ISOLATE, _L.REPLAN})
_AWAITING_PROGRESS: Final = frozenset({_L.RETRY_IN_PLACE, _L.RESTART_PROCESSES, _L.TRANSITION})
_UNPRINTABLE: Final = re.compile(r"[^\x20-\x7e]+")
_EVIDENCE_CHARS: Final = 500


class ClassificationLike(Protocol):
    """What :meth:`Finding.of` reads from a ``detect`` classification."""

    @property
    def status(self) -> ErrorStatus: ...
    @property
    def severity(self) -> Severity | None: ...
    @property
    def rule(self) -> str: ...
    @property
    def evidence(self) -> str: ...
    @property
    def secondary(self) -> bool: ...


@dataclass(frozen=True)
class Finding:
    """A classified fault, as the event ingest hands it to :func:`on_finding`.

    ``finding_id`` identifies the evidence (e.g. the stream entry id): the same finding
    delivered twice has the same id and the second delivery changes nothing.
    ``job_id`` None means evidence from outside a job (e.g. an SSH probe found the node
    dead). ``rank_died``: the rank's process is gone (so a retry must restart it).
    ``secondary``: usually a consequence of a failure elsewhere (peers' NCCL timeouts).
    """

    finding_id: str
    job_id: int | None
    node: str
    rank: int | None
    status: ErrorStatus
    severity: Severity
    rule: str = ""
    evidence: str = ""
    rank_died: bool = False
    secondary: bool = False

    def __post_init__(self) -> None:
        if not self.finding_id:
            raise InvalidArgument("finding_id must be non-empty")
        if not self.node:
            raise InvalidArgument("finding node must be non-empty")

    @classmethod
    def of(
        cls,
        classification: ClassificationLike,
        *,
        finding_id: str,
        job_id: int | None,
        node: str,
        rank: int | None = None,
        rank_died: bool = False,
    ) -> Finding | None:
        """A finding from a classification; None when it is benign (no severity)."""
        if classification.severity is None:
            return None
        return cls(
            finding_id=finding_id,
            job_id=job_id,
            node=node,
            rank=rank,
            status=classification.status,
            severity=classification.severity,
            rule=classification.rule,
            evidence=classification.evidence,
            rank_died=rank_died,
            secondary=classification.secondary,
        )


class _Draft:
    """The records and actions one decision builds up (local to one call), and its clock."""

    def __init__(self, snapshot: Snapshot, now_s: float) -> None:
        self.snap = snapshot
        self.policy = snapshot.policy
        self.now_s = now_s
        self.tasks: dict[str, TaskRecord] = {}
        self.nodes: dict[str, NodeRecord] = {}
        self.incidents: dict[str, Incident] = {}
        self.actions: list[Action] = []
        self.notes: list[str] = []

    def task(self, task_id: str) -> TaskRecord:
        return self.tasks.get(task_id) or self.snap.tasks[task_id]

    def node(self, name: str) -> NodeRecord:
        return self.nodes.get(name) or self.snap.node(name)

    def put(self, record: TaskRecord | NodeRecord | Incident) -> None:
        if isinstance(record, TaskRecord):
            self.tasks[record.task_id] = record
        elif isinstance(record, NodeRecord):
            self.nodes[record.name] = record
        else:
            self.incidents[record.incident_id] = record

    def stop_agent(self, action_id: str, job_id: int, node: str) -> None:
        """Order the agent of ``job_id`` on ``node`` to stop (ranks save and exit)."""
        self.act(
            SendCommand(
                action_id=action_id,
                job_id=job_id,
                node=node,
                action=AgentAction.STOP,
                deadline_s=self.policy.command_deadline_s,
            )
        )

    def act(self, action: Action) -> None:
        if all(a.action_id != action.action_id for a in self.actions):
            self.actions.append(action)

    def note(self, text: str) -> Decision:
        self.notes.append(text)
        return self.decision()

    def drains_within_window(self) -> int:
        window = self.policy.drain_window_s
        merged = {**self.snap.nodes, **self.nodes}
        return sum(1 for n in merged.values() for t in n.drains_s if self.now_s - t < window)

    def decision(self) -> Decision:
        return Decision(
            actions=tuple(self.actions),
            tasks=tuple(self.tasks.values()),
            nodes=tuple(self.nodes.values()),
            incidents=tuple(self.incidents.values()),
            notes=tuple(self.notes),
        )


@dataclass(frozen=True)
class _Fault:
    """What a rung acts on: the node, the status for the drain reason, and a detail."""

    node: str
    status: str
    detail: str
    rank_died: bool = False
    rule: str = ""

    @classmethod
    def of(cls, finding: Finding) -> _Fault:
        rank = "" if finding.rank is None else f" rank {finding.rank}"
        detail = f"{finding.rule}{rank}: {finding.evidence}".strip()
        return cls(finding.node, finding.status.value, detail, finding.rank_died, finding.rule)


def _recent(times: tuple[float, ...], now_s: float, window_s: float) -> tuple[float, ...]:
    """Timestamps still inside the window (records stay bounded)."""
    return tuple(t for t in times if now_s - t < window_s)


def _drain_reason(draft: _Draft, status: str, detail: str) -> str:
    """``unicorn: <status> <detail>`` on one printable line, without double quotes, capped."""
    text = _UNPRINTABLE.sub(" ", f"unicorn: {status} {detail}")
    text = " ".join(text.replace('"', "'").split())
    return text[: draft.policy.drain_reason_chars]


def _remember(draft: _Draft, inc: Incident, finding: Finding) -> Incident:
    keep = draft.policy.remembered_findings
    severity = worst((inc.severity, finding.severity)) or inc.severity
    return replace(inc, finding_ids=(*inc.finding_ids, finding.finding_id)[-keep:], severity=severity)


def _seen(snapshot: Snapshot, finding_id: str) -> Incident | None:
    for inc in snapshot.incidents.values():
        if finding_id in inc.finding_ids:
            return inc
    return None


def _step_id(inc: Incident, stage: LadderStage, attempt: int, kind: str, target: str) -> str:
    """Deterministic action id: incident + rung + attempt + what + where."""
    return f"{inc.incident_id}/{stage.value}/{attempt}/{kind}/{target}"


# --- the ladder ----------------------------------------------------------------------


def _target_rung(draft: _Draft, inc: Incident, wanted: LadderStage) -> LadderStage:
    """The rung to run now: the wanted one, never below the current in-place rung, and one
    up for every rung whose attempts are used up."""
    pol = draft.policy
    target = wanted
    if (
        inc.stage in (_L.RETRY_IN_PLACE, _L.RESTART_PROCESSES)
        and _RUNG_LEVEL[inc.stage] > _RUNG_LEVEL[target]
    ):
        target = inc.stage
    if target is _L.RETRY_IN_PLACE and inc.attempts_at(_L.RETRY_IN_PLACE) >= pol.max_retries_in_place:
        target = _L.RESTART_PROCESSES
    if target is _L.RESTART_PROCESSES and inc.attempts_at(_L.RESTART_PROCESSES) >= pol.max_process_restarts:
        target = _L.ISOLATE
    return target


def _enter(inc: Incident, stage: LadderStage, now_s: float) -> Incident:
    """Move to ``stage`` (a transition when it differs) and count one attempt there."""
    moved = inc if inc.stage is stage else inc.moved(stage, now_s)
    attempts = {**moved.attempts, stage: moved.attempts_at(stage) + 1}
    return replace(moved, attempts=attempts, last_action_s=now_s)


def _count_recovery(draft: _Draft, task_id: str) -> None:
    """One more recovery for the breaker and the budget (old budget entries dropped)."""
    task = draft.task(task_id)
    now_s = draft.now_s
    times = _recent((*task.recovery_times_s, now_s), now_s, draft.policy.budget_window_s)
    task = replace(
        task, recoveries_without_progress=task.recoveries_without_progress + 1, recovery_times_s=times
    )
    draft.put(task.with_state(TaskState.RECOVERING))


def _breaker(draft: _Draft, task: TaskRecord) -> str | None:
    """Why the task must not be recovered again (None: it may)."""
    pol = draft.policy
    if task.recoveries_without_progress >= pol.no_progress_limit:
        mark = "no iteration yet" if task.last_iteration is None else f"iteration {task.last_iteration}"
        return (
            f"no-progress breaker: {task.recoveries_without_progress} recoveries without passing {mark} "
            f"(limit {pol.no_progress_limit})"
        )
    used = task.budget_used(draft.now_s, pol.budget_window_s)
    if used >= pol.recovery_budget:
        return (
            f"recovery budget used up: {used} recoveries in {pol.budget_window_s:g} s "
            f"(budget {pol.recovery_budget})"
        )
    return None


def _stop_task(draft: _Draft, task: TaskRecord, inc: Incident, why: str) -> None:
    """Breaker tripped: ranks save and stop, the task is stopped, the operator is told."""
    inc = replace(inc.moved(_L.ESCALATED_TO_OPERATOR, draft.now_s), note=why, last_action_s=draft.now_s)
    draft.put(inc)
    draft.put(draft.task(task.task_id).with_state(TaskState.STOPPED))
    if task.job_id is not None:
        for node in task.nodes:
            if draft.node(node).health is NodeHealth.HEALTHY:
                draft.stop_agent(f"{inc.incident_id}/stop/{node}", task.job_id, node)
    why = f"task {task.task_id} stopped: {why}"
    draft.act(NotifyOperator(f"{inc.incident_id}/notify/stopped", inc.incident_id, why))
    draft.notes.append(f"{inc.incident_id}: {why}")


def _drain(draft: _Draft, inc: Incident, fault: _Fault, *, confirmed: bool) -> Incident | None:
    """Drain the fault's node for ``inc`` unless the drain limiter says no (then None).

    Records the drain and the failure on the node; a node over the failure limit is held.
    ``confirmed``: the operator confirmed this drain, the limiter does not apply.
    """
    pol, now_s, node = draft.policy, draft.now_s, fault.node
    rec = draft.node(node)
    if rec.health in (NodeHealth.DRAINING, NodeHealth.DRAINED):  # out already: never drain twice
        draft.notes.append(f"node {node} is already {rec.health}; not drained again")
        return replace(inc, isolated_nodes=(*inc.isolated_nodes, node), pending_drain=None)
    if not confirmed and draft.drains_within_window() >= pol.drain_limit(max(len(draft.snap.nodes), 1)):
        return None
    failures = _recent((*rec.failures_s, now_s), now_s, pol.node_failure_window_s)
    held = rec.held or len(failures) >= pol.node_failure_limit
    reason = _drain_reason(draft, fault.status, f"{inc.incident_id} {fault.detail}")
    draft.put(
        replace(
            rec.with_health(NodeHealth.DRAINING, reason),
            failures_s=failures,
            drains_s=_recent((*rec.drains_s, now_s), now_s, pol.drain_window_s),
            held=held,
        )
    )
    step = _step_id(inc, _L.ISOLATE, inc.attempts_at(_L.ISOLATE), "drain", node)
    draft.act(DrainNode(step, node, reason, down=fault.rule == SSH_UNREACHABLE))
    if held and not rec.held:
        draft.notes.append(
            f"node {node}: {len(failures)} failures in {pol.node_failure_window_s:g} s; "
            "held until an operator resumes it"
        )
    return replace(inc, isolated_nodes=(*inc.isolated_nodes, node), pending_drain=None)


def _isolate(
    draft: _Draft, task: TaskRecord | None, inc: Incident, fault: _Fault, *, confirmed: bool = False
) -> None:
    """Rung SEV1: drain the node and ask for a replan, or ask the operator to confirm."""
    pol, now_s = draft.policy, draft.now_s
    was_waiting = inc.stage in _WAITING_FOR_PLAN
    drained = _drain(draft, _enter(inc, _L.ISOLATE, now_s), fault, confirmed=confirmed)
    if drained is None:
        why = (
            f"drain limit reached: {draft.drains_within_window()} drains "
            f"in the last {pol.drain_window_s:g} s "
            f"(limit {pol.drain_limit(max(len(draft.snap.nodes), 1))} of {len(draft.snap.nodes)} nodes); "
            f"confirm the drain of {fault.node} for {fault.status}"
        )
        if inc.stage is not _L.ESCALATED_TO_OPERATOR:
            inc = inc.moved(_L.ESCALATED_TO_OPERATOR, now_s)
        draft.put(replace(inc, pending_drain=fault.node, note=why, last_action_s=now_s))
        _mark_suspect(draft, fault)
        draft.act(NotifyOperator(f"{inc.incident_id}/notify/drain-limit/{fault.node}", inc.incident_id, why))
        draft.notes.append(f"{inc.incident_id}: {why}")
        return
    attempt = drained.attempts_at(_L.ISOLATE)
    waiting = drained.moved(_L.REPLAN, now_s)
    reason = f"{drained.incident_id}: drained {fault.node} ({fault.status})"
    draft.act(Replan(_step_id(drained, _L.REPLAN, attempt, "replan", "cluster"), reason))
    draft.notes.append(f"{drained.incident_id}: isolate {fault.node} ({fault.status}), replan")
    if task is None:  # an idle node: nothing to resume once it is out
        draft.put(replace(waiting.moved(_L.CLOSED, now_s), note="idle node drained"))
        draft.act(CloseIncident(f"{drained.incident_id}/close", drained.incident_id))
        return
    draft.put(waiting)
    if not was_waiting:  # more nodes lost before the plan came: still one recovery
        _count_recovery(draft, task.task_id)


def _mark_suspect(draft: _Draft, fault: _Fault) -> None:
    """While the operator decides, a node a SEV1 points at is marked suspect (visible in status)."""
    rec = draft.node(fault.node)
    if rec.health is NodeHealth.HEALTHY:
        draft.put(rec.with_health(NodeHealth.SUSPECT, _drain_reason(draft, fault.status, fault.detail)))


def _climb(draft: _Draft, task: TaskRecord, inc: Incident, target: LadderStage, fault: _Fault) -> None:
    """Run rung ``target`` for the task's incident (breakers first)."""
    acts = target is not _L.RETRY_IN_PLACE or fault.rank_died
    why = _breaker(draft, task) if acts else None
    if why is not None:
        if target is _L.ISOLATE:  # the node is faulty whatever happens to the task
            inc = _drain(draft, inc, fault, confirmed=False) or inc
        _stop_task(draft, task, inc, why)
        return
    if target is _L.ISOLATE:
        _isolate(draft, task, inc, fault)
        return
    if task.job_id is None:
        raise InvalidArgument(f"task {task.task_id} is {task.state} without a Slurm job id")
    inc = _enter(inc, target, draft.now_s)
    attempt = inc.attempts_at(target)
    nodes = (fault.node,) if target is _L.RETRY_IN_PLACE else task.nodes
    draft.put(draft.task(task.task_id).with_state(TaskState.RECOVERING))
    if acts:
        for n in nodes:
            if n == fault.node and fault.rule in AGENT_RULES:  # no agent to take the command
                draft.act(
                    RestartAgent(
                        _step_id(inc, target, attempt, "restart_agent", n), task.task_id, task.job_id, n
                    )
                )
                continue
            draft.act(
                SendCommand(
                    action_id=_step_id(inc, target, attempt, "restart_ranks", n),
                    job_id=task.job_id,
                    node=n,
                    action=AgentAction.RESTART_RANKS,
                    deadline_s=draft.policy.command_deadline_s,
                )
            )
        _count_recovery(draft, task.task_id)
    draft.put(inc)
    what = f"restart_ranks on {', '.join(nodes)}" if acts else "wait"
    draft.notes.append(f"{inc.incident_id}: {target.value} #{attempt} ({fault.status}): {what}")


def _new_incident(incident_id: str, task_id: str | None, finding: Finding, now_s: float) -> Incident:
    return Incident(
        incident_id=incident_id,
        task_id=task_id,
        node=finding.node,
        rank=finding.rank,
        status=finding.status,
        severity=finding.severity,
        rule=finding.rule,
        evidence=finding.evidence[:_EVIDENCE_CHARS],
        opened_s=now_s,
        timeline=(StageEntry(_L.DETECTED, now_s),),
        last_action_s=now_s,
        finding_ids=(finding.finding_id,),
    )


def on_finding(snapshot: Snapshot, finding: Finding, now_s: float) -> Decision:
    """Open or update the incident of the finding's task and run the ladder.

    Ignored (notes only): a finding seen before (same id), of a job no task has, or for
    a task that is not live or no longer uses the node (stale). A finding without a job
    on a node no live task uses opens a node incident (SEV1 drains it, else noted).
    """
    draft = _Draft(snapshot, now_s)
    seen = _seen(snapshot, finding.finding_id)
    if seen is not None:
        return draft.note(f"finding {finding.finding_id}: already handled in {seen.incident_id}")
    task = _task_for(snapshot, finding)
    if task is None:
        return _on_node_finding(draft, finding)
    if task.state not in LIVE_TASK_STATES or finding.node not in task.nodes:
        return draft.note(
            f"finding {finding.finding_id}: task {task.task_id} is {task.state} "
            f"on {list(task.nodes)}; ignored"
        )
    inc = snapshot.open_incident(task.task_id)
    if inc is None:
        number = task.incidents_opened + 1
        inc = _new_incident(f"{task.task_id}.{number}", task.task_id, finding, now_s)
        draft.put(replace(task, incidents_opened=number).with_state(TaskState.RECOVERING))
        target = _target_rung(draft, inc, RUNG_OF_SEVERITY[finding.severity])
        _climb(draft, draft.task(task.task_id), inc, target, _Fault.of(finding))
        return draft.decision()
    _update_incident(draft, task, _remember(draft, inc, finding), finding)
    return draft.decision()


def _update_incident(draft: _Draft, task: TaskRecord, inc: Incident, finding: Finding) -> None:
    """A further finding for a task with an open incident: absorb it or climb."""
    wanted = RUNG_OF_SEVERITY[finding.severity]
    fault = _Fault.of(finding)
    where = f"{finding.status} on {finding.node}"
    if inc.stage is _L.ESCALATED_TO_OPERATOR:
        if wanted is _L.ISOLATE:
            _mark_suspect(draft, fault)
        draft.put(inc)
        draft.notes.append(f"{inc.incident_id}: waiting for the operator; {where} recorded")
        return
    if inc.stage in _WAITING_FOR_PLAN or (inc.stage is _L.TRANSITION and wanted is _L.ISOLATE):
        # Only another faulty node matters now: it must be out before the plan is applied.
        if (
            wanted is _L.ISOLATE
            and finding.node not in inc.isolated_nodes
            and _drainable(draft, finding.node)
        ):
            _isolate(draft, task, inc, fault)
        else:
            draft.put(inc)
            draft.notes.append(f"{inc.incident_id}: {where} absorbed while {inc.stage}")
        return
    settling = draft.now_s - inc.last_action_s < draft.policy.settle_s
    if (
        finding.rule in AGENT_RULES
        and inc.stage is _L.RESTART_PROCESSES
        and settling
        and task.job_id is not None
    ):
        # The restart just ordered sent this node a command its dead agent cannot take.
        # (Found dead again later, after the settle time: the restart failed; climb.)
        attempt = inc.attempts_at(_L.RESTART_PROCESSES)
        aid = _step_id(inc, _L.RESTART_PROCESSES, attempt, "restart_agent", finding.node)
        draft.act(RestartAgent(aid, task.task_id, task.job_id, finding.node))
        draft.put(replace(inc, last_action_s=draft.now_s))
        draft.notes.append(f"{inc.incident_id}: agent on {finding.node} gone during the restart; new agent")
        return
    if finding.secondary or (settling and _RUNG_LEVEL[wanted] <= _RUNG_LEVEL[inc.stage]):
        draft.put(inc)
        why = "secondary" if finding.secondary else f"within {draft.policy.settle_s:g} s of the last action"
        draft.notes.append(f"{inc.incident_id}: {where} absorbed ({why})")
        return
    _climb(draft, task, inc, _target_rung(draft, inc, wanted), fault)


def _drainable(draft: _Draft, node: str) -> bool:
    return draft.node(node).health in (NodeHealth.HEALTHY, NodeHealth.SUSPECT)


def _task_for(snapshot: Snapshot, finding: Finding) -> TaskRecord | None:
    if finding.job_id is not None:
        return snapshot.task_of_job(finding.job_id)
    for task in snapshot.tasks.values():
        if finding.node in task.nodes and task.state in LIVE_TASK_STATES:
            return task
    return None


def _on_node_finding(draft: _Draft, finding: Finding) -> Decision:
    """A fault outside any known job: only a SEV1 on a node in service matters (drain, replan)."""
    if finding.job_id is not None:
        return draft.note(f"finding {finding.finding_id}: no task has job {finding.job_id}; ignored")
    existing = draft.snap.open_node_incident(finding.node)
    if existing is not None:  # waiting for the operator: record only
        draft.put(_remember(draft, existing, finding))
        return draft.decision()
    if finding.severity is not Severity.SEV1 or not _drainable(draft, finding.node):
        return draft.note(f"finding {finding.finding_id}: {finding.severity} on idle {finding.node}; noted")
    inc = _new_incident(f"node.{finding.node}.{finding.finding_id}", None, finding, draft.now_s)
    _isolate(draft, None, inc, _Fault.of(finding))
    return draft.decision()


# --- progress, time, operator -------------------------------------------------------


def on_progress(
    snapshot: Snapshot,
    task_id: str,
    iteration: int,
    now_s: float,
    *,
    reported_s: float | None = None,
    launch_id: str = "",
) -> Decision:
    """An iteration was reported (``reported_s``: when the rank finished it; default ``now_s``).

    Passing the task's highest iteration resets the no-progress breaker. An iteration
    reported after the latest recovery action, by ranks that action started, closes the
    open incident (``resumed`` then ``closed``) and the task is running again; so does one
    after a launch. ``launch_id`` is the action that started the reporting ranks (the
    agent's tag; "" = unknown, then the time alone decides): an iteration finished by ranks
    about to be replaced arrives after the action but must not count as its success.
    Empty decision when nothing changes (most calls).
    """
    if iteration < 0:
        raise InvalidArgument(f"iteration must be >= 0, got {iteration}")
    task = snapshot.tasks.get(task_id)
    if task is None or task.state not in LIVE_TASK_STATES:
        return Decision()
    at = now_s if reported_s is None else reported_s
    draft = _Draft(snapshot, now_s)
    new = task
    if task.last_iteration is None or iteration > task.last_iteration:
        new = replace(new, last_iteration=iteration, recoveries_without_progress=0)
    inc = snapshot.open_incident(task_id)
    if inc is not None:
        if inc.stage in _AWAITING_PROGRESS and at > inc.last_action_s and _started_by(inc, task, launch_id):
            closed = inc.moved(_L.RESUMED, now_s).moved(_L.CLOSED, now_s)
            draft.put(replace(closed, note=f"resumed at iteration {iteration}"))
            draft.act(CloseIncident(f"{inc.incident_id}/close", inc.incident_id))
            new = new.with_state(TaskState.RUNNING)
            draft.notes.append(f"{inc.incident_id}: resumed at iteration {iteration}, closed")
    elif (
        task.state is TaskState.LAUNCHING
        and (task.launched_s is None or at > task.launched_s)
        and _launched_by_plan(task, launch_id)
    ):
        new = new.with_state(TaskState.RUNNING)
    if new != task:
        draft.put(new)
    return draft.decision()


def _launched_by_plan(task: TaskRecord, launch_id: str) -> bool:
    """Ranks started by the task's latest plan (launch or relaunch); True when unknown."""
    return not launch_id or launch_id.startswith(f"plan-{task.generation}/{task.task_id}/")


def _started_by(inc: Incident, task: TaskRecord, launch_id: str) -> bool:
    """The reporting ranks were started by the incident's current rung (True when unknown).

    A retry in place may not restart anything (it waits), so any later iteration counts.
    """
    if not launch_id or inc.stage is _L.RETRY_IN_PLACE:
        return True
    if inc.stage is _L.TRANSITION:
        return _launched_by_plan(task, launch_id)
    return launch_id.startswith(f"{inc.incident_id}/{inc.stage.value}/{inc.attempts_at(inc.stage)}/")


_STAGE_TIMEOUT: Final = {
    _L.RETRY_IN_PLACE: "retry_timeout_s",
    _L.RESTART_PROCESSES: "restart_timeout_s",
    _L.TRANSITION: "transition_timeout_s",
}


def on_tick(snapshot: Snapshot, now_s: float) -> Decision:
    """Climb every incident whose rung got no iteration within its timeout.

    A timed-out retry retries again or restarts; a timed-out restart or transition
    restarts (while restarts remain) or isolates the incident's node; with nothing left
    to isolate the operator is asked. Deterministic in (snapshot, now_s).
    """
    draft = _Draft(snapshot, now_s)
    pol = snapshot.policy
    for inc in sorted(snapshot.incidents.values(), key=lambda i: i.incident_id):
        if inc.task_id is None or inc.stage not in _STAGE_TIMEOUT:
            continue
        timeout_s = float(getattr(pol, _STAGE_TIMEOUT[inc.stage]))
        if now_s - inc.last_action_s < timeout_s:
            continue
        task = draft.task(inc.task_id)
        if task.state not in LIVE_TASK_STATES:
            continue
        wanted = _L.RESTART_PROCESSES if inc.stage is _L.TRANSITION else inc.stage
        target = _target_rung(draft, inc, wanted)
        detail = f"no iteration {now_s - inc.last_action_s:.0f} s after {inc.stage.value}"
        node = inc.node
        if target is _L.ISOLATE and (node in inc.isolated_nodes or node not in task.nodes):
            why = f"{detail}; nothing left to isolate"
            draft.put(replace(inc.moved(_L.ESCALATED_TO_OPERATOR, now_s), note=why, last_action_s=now_s))
            draft.act(NotifyOperator(f"{inc.incident_id}/notify/stuck", inc.incident_id, why))
            continue
        _climb(draft, task, inc, target, _Fault(node, _timeout_status(inc), detail, rank_died=True))
    return draft.decision()


def _timeout_status(inc: Incident) -> str:
    return ErrorStatus.TASK_HANG.value if inc.stage is _L.TRANSITION else inc.status.value


def on_operator_confirm_drain(snapshot: Snapshot, incident_id: str, now_s: float) -> Decision:
    """The operator confirmed the drain the limiter held back: drain and replan.

    Raises InvalidArgument when the incident does not exist or awaits no drain.
    """
    inc = snapshot.incidents.get(incident_id)
    if inc is None or inc.stage is not _L.ESCALATED_TO_OPERATOR or inc.pending_drain is None:
        raise InvalidArgument(f"incident {incident_id!r} has no drain waiting for confirmation")
    draft = _Draft(snapshot, now_s)
    task = snapshot.tasks.get(inc.task_id) if inc.task_id is not None else None
    fault = _Fault(inc.pending_drain, inc.status.value, "confirmed by operator")
    _isolate(draft, task, inc, fault, confirmed=True)
    return draft.decision()


_IN_SERVICE: Final = frozenset({NodeHealth.HEALTHY, NodeHealth.SUSPECT, NodeHealth.RETURNING})


def on_operator_drain(snapshot: Snapshot, node: str, reason: str, now_s: float) -> Decision:
    """An operator's drain (``unicornctl drain NODE --reason TEXT``): the node leaves every plan.

    The node is drained with ``unicorn: operator: <reason>`` and held, so only an
    operator's resume brings it back (a resume straight in Slurm is drained again, see
    :func:`on_node_join`); a replan moves its task off it. The drain limiter does not
    apply (a person decided) and the drain is not counted against it. A node already
    draining or drained is only held and given the new reason; the same request again
    changes nothing. Unknown node or empty reason: InvalidArgument, nothing changed.
    """
    if node not in snapshot.nodes:
        raise InvalidArgument(f"unknown node {node!r}; known: {', '.join(sorted(snapshot.nodes)) or 'none'}")
    if not reason.strip():
        raise InvalidArgument("an operator's drain needs a reason")
    draft = _Draft(snapshot, now_s)
    rec = snapshot.nodes[node]
    text = _drain_reason(draft, "operator:", reason)
    if rec.health not in _IN_SERVICE:
        if rec.held and rec.reason == text:
            return draft.note(f"node {node} is already {rec.health} for {text!r}")
        draft.put(replace(rec, held=True, reason=text))
        draft.act(DrainNode(f"operator-drain/{node}/{rec.joins}/{zlib.crc32(text.encode()):08x}", node, text))
        return draft.note(f"node {node} is already {rec.health}: held, reason now {text!r}")
    draft.put(replace(rec.with_health(NodeHealth.DRAINING, text), held=True))
    base = f"operator-drain/{node}/{rec.joins}"
    draft.act(DrainNode(f"{base}/drain", node, text))
    draft.act(Replan(f"{base}/replan", f"operator drained {node}"))
    return draft.note(f"node {node} drained by an operator ({text}), replan")


# --- membership: nodes and tasks ----------------------------------------------------


def on_node_join(snapshot: Snapshot, node: str, now_s: float, *, by_operator: bool = False) -> Decision:
    """A node appeared or came back in Slurm (``by_operator``: ``unicornctl node resume``).

    A held node (too many failures) that an operator did not resume is drained again
    and the operator told. Otherwise it runs the node check first (``returning``), or
    with ``Policy.node_check_on_join`` off becomes healthy and triggers a replan.
    Joining again while healthy or returning changes nothing.
    """
    draft = _Draft(snapshot, now_s)
    known = node in snapshot.nodes
    rec = snapshot.node(node)
    if known and rec.health in (NodeHealth.HEALTHY, NodeHealth.RETURNING, NodeHealth.SUSPECT):
        return Decision(notes=(f"node {node} is {rec.health}; join ignored",))
    joins = rec.joins + 1
    base = f"join/{node}/{joins}"
    if rec.held and not by_operator:
        reason = _drain_reason(
            draft, "held", f"{len(rec.failures_s)} failures; resume with unicornctl node resume {node}"
        )
        draft.put(replace(rec, joins=joins, reason=reason))
        draft.act(DrainNode(f"{base}/drain", node, reason))
        draft.act(NotifyOperator(f"{base}/notify", None, f"node {node} came back but is held: {reason}"))
        return draft.decision()
    rec = replace(rec, joins=joins, held=False if by_operator else rec.held)
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


def on_node_check(snapshot: Snapshot, node: str, passed: bool, now_s: float, detail: str = "") -> Decision:
    """Outcome of the node check of a returning node: healthy + replan, or drained again."""
    rec = snapshot.nodes.get(node)
    if rec is None or rec.health is not NodeHealth.RETURNING:
        return Decision(notes=(f"node {node}: check result while not returning; ignored",))
    draft = _Draft(snapshot, now_s)
    base = f"join/{node}/{rec.joins}"
    if passed:
        draft.put(rec.with_health(NodeHealth.HEALTHY, ""))
        draft.act(Replan(f"{base}/replan", f"node {node} joined"))
        return draft.decision()
    pol = draft.policy
    failures = _recent((*rec.failures_s, now_s), now_s, pol.node_failure_window_s)
    reason = _drain_reason(draft, "node_check_failed", detail)
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
    draft = _Draft(snapshot, now_s)
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
    draft = _Draft(snapshot, now_s)
    end = TaskState.FINISHED if ok else TaskState.FAILED
    draft.put(replace(task.with_state(end), nodes=()))
    for name in task.nodes:
        rec = draft.node(name)
        if rec.task_id == task_id:
            draft.put(replace(rec, task_id=None))
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
    if task.state in (TaskState.FINISHED, TaskState.FAILED, TaskState.STOPPED):
        return Decision()
    draft = _Draft(snapshot, now_s)
    draft.put(replace(task.with_state(TaskState.STOPPED), nodes=()))
    for name in task.nodes:
        rec = draft.node(name)
        if rec.task_id == task_id:
            draft.put(replace(rec, task_id=None))
        if task.job_id is not None:
            draft.stop_agent(f"task/{task_id}/stop/{name}", task.job_id, name)
    inc = snapshot.open_incident(task_id)
    if inc is not None:
        draft.put(replace(inc.moved(_L.CLOSED, now_s), note=f"task stopped: {why}"))
        draft.act(CloseIncident(f"{inc.incident_id}/close", inc.incident_id))
    draft.act(Replan(f"task/{task_id}/stopped", f"task {task_id} stopped: {why}"))
    draft.notes.append(f"task {task_id} stopped: {why}")
    return draft.decision()
