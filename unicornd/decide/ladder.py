"""The error-handling ladder: findings open and climb an incident; time and failed actions climb it too.

See :mod:`unicornd.decide` for the ladder's table."""

from __future__ import annotations

import re
import zlib
from dataclasses import replace
from typing import Final

from detect.isolation import CHECK_AT_ONCE, PAIRED_CHECK, Confirmation, Verdict
from detect.statuses import ErrorStatus, Severity
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import AgentAction
from unicorn_core.slurm.hostlist import compress, expand
from unicornd.actions import (
    CheckNode,
    CloseIncident,
    Decision,
    DrainNode,
    NotifyOperator,
    Replan,
    RestartAgent,
    RollBack,
    SendCommand,
)
from unicornd.decide.common import (
    AGENT_RULES,
    DEAD_NODE_RULES,
    EVIDENCE_CHARS,
    RUNG_LEVEL,
    RUNG_OF_SEVERITY,
    WAITING_FOR_PLAN,
    Draft,
    Fault,
    Finding,
    drain_reason,
    recent,
    remember,
    seen_in,
    step_id,
)
from unicornd.state import (
    LIVE_TASK_STATES,
    Incident,
    LadderStage,
    NodeHealth,
    Rollback,
    Snapshot,
    StageEntry,
    TaskRecord,
    TaskState,
)

_L = LadderStage

# --- the ladder ----------------------------------------------------------------------


def _target_rung(draft: Draft, inc: Incident, wanted: LadderStage) -> LadderStage:
    """The rung to run now: the wanted one, never below the current in-place rung, and one
    up for every rung whose attempts are used up."""
    pol = draft.policy
    target = wanted
    if inc.stage in (_L.RETRY_IN_PLACE, _L.RESTART_PROCESSES) and RUNG_LEVEL[inc.stage] > RUNG_LEVEL[target]:
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


def _count_recovery(draft: Draft, task_id: str) -> None:
    """One more recovery for the breaker and the budget (old budget entries dropped)."""
    task = draft.task(task_id)
    now_s = draft.now_s
    times = recent((*task.recovery_times_s, now_s), now_s, draft.policy.budget_window_s)
    task = replace(
        task, recoveries_without_progress=task.recoveries_without_progress + 1, recovery_times_s=times
    )
    draft.put(task.with_state(TaskState.RECOVERING))


def _breaker(draft: Draft, task: TaskRecord) -> str | None:
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


def _stop_task(draft: Draft, task: TaskRecord, inc: Incident, why: str) -> None:
    """Breaker tripped: ranks save and stop, the task is stopped, the operator is told."""
    inc = replace(inc.moved(_L.ESCALATED_TO_OPERATOR, draft.now_s), note=why, last_action_s=draft.now_s)
    draft.put(inc)
    draft.put(replace(draft.task(task.task_id).with_state(TaskState.STOPPED), ended_s=draft.now_s))
    if task.job_id is not None:
        for node in task.nodes:
            if draft.node(node).health is NodeHealth.HEALTHY:
                draft.stop_agent(f"{inc.incident_id}/stop/{node}", task.job_id, node)
    why = f"task {task.task_id} stopped: {why}"
    draft.act(NotifyOperator(f"{inc.incident_id}/notify/stopped", inc.incident_id, why))
    draft.notes.append(f"{inc.incident_id}: {why}")


def _drain(draft: Draft, inc: Incident, fault: Fault, *, confirmed: bool) -> Incident | None:
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
    # A straggler works, slower: its drain counts against the drain limiter, not as a
    # failure (no MTBF sample, never held for the failure limit).
    failed = fault.status != ErrorStatus.STRAGGLER.value
    failures = recent(
        (*rec.failures_s, now_s) if failed else rec.failures_s, now_s, pol.node_failure_window_s
    )
    held = rec.held or (failed and len(failures) >= pol.node_failure_limit)
    reason = drain_reason(draft, fault.status, f"{inc.incident_id} {fault.detail}")
    draft.put(
        replace(
            rec.with_health(NodeHealth.DRAINING, reason),
            failures_s=failures,
            drains_s=recent((*rec.drains_s, now_s), now_s, pol.drain_window_s),
            held=held,
        )
    )
    step = step_id(inc, _L.ISOLATE, inc.attempts_at(_L.ISOLATE), "drain", node)
    draft.act(DrainNode(step, node, reason, down=fault.rule in DEAD_NODE_RULES))
    if held and not rec.held:
        draft.notes.append(
            f"node {node}: {len(failures)} failures in {pol.node_failure_window_s:g} s; "
            "held until an operator resumes it"
        )
    return replace(inc, isolated_nodes=(*inc.isolated_nodes, node), pending_drain=None)


def _isolate(
    draft: Draft, task: TaskRecord | None, inc: Incident, fault: Fault, *, confirmed: bool = False
) -> None:
    """Rung SEV1: drain the node and ask for a replan, or ask the operator to confirm."""
    pol, now_s = draft.policy, draft.now_s
    was_waiting = inc.stage in WAITING_FOR_PLAN
    # Other users' jobs on the node: unicorn never drains it on its own; a person may.
    others = () if confirmed else draft.snap.foreign_jobs(fault.node)
    drained = None if others else _drain(draft, _enter(inc, _L.ISOLATE, now_s), fault, confirmed=confirmed)
    if drained is None:
        why = (
            f"node {fault.node} also runs other users' jobs {list(others)}: not drained; "
            f"confirm the drain of {fault.node} for {fault.status}"
            if others
            else f"drain limit reached: {draft.drains_within_window()} drains "
            f"in the last {pol.drain_window_s:g} s "
            f"(limit {pol.drain_limit(max(len(draft.snap.nodes), 1))} of {len(draft.snap.nodes)} nodes); "
            f"confirm the drain of {fault.node} for {fault.status}"
        )
        if inc.stage is not _L.ESCALATED_TO_OPERATOR:
            inc = inc.moved(_L.ESCALATED_TO_OPERATOR, now_s)
        draft.put(replace(inc, pending_drain=fault.node, note=why, last_action_s=now_s))
        _mark_suspect(draft, fault)
        held_back = "foreign" if others else "drain-limit"
        draft.act(NotifyOperator(f"{inc.incident_id}/notify/{held_back}/{fault.node}", inc.incident_id, why))
        draft.notes.append(f"{inc.incident_id}: {why}")
        return
    attempt = drained.attempts_at(_L.ISOLATE)
    waiting = drained.moved(_L.REPLAN, now_s)
    reason = f"{drained.incident_id}: drained {fault.node} ({fault.status})"
    draft.act(Replan(step_id(drained, _L.REPLAN, attempt, "replan", "cluster"), reason))
    draft.notes.append(f"{drained.incident_id}: isolate {fault.node} ({fault.status}), replan")
    if task is None:  # an idle node: nothing to resume once it is out
        draft.put(replace(waiting.moved(_L.CLOSED, now_s), note="idle node drained"))
        draft.act(CloseIncident(f"{drained.incident_id}/close", drained.incident_id))
        return
    draft.put(waiting)
    if not was_waiting:  # more nodes lost before the plan came: still one recovery
        _count_recovery(draft, task.task_id)


def _mark_suspect(draft: Draft, fault: Fault) -> None:
    """While the operator decides, a node a SEV1 points at is marked suspect (visible in status)."""
    rec = draft.node(fault.node)
    if rec.health is NodeHealth.HEALTHY:
        draft.put(rec.with_health(NodeHealth.SUSPECT, drain_reason(draft, fault.status, fault.detail)))


def _never_why(inc: Incident, fault: Fault) -> str:
    restarts = inc.attempts_at(_L.RESTART_PROCESSES)
    again = " (the same error again)" if _same_error_again(inc, fault) else ""
    return (
        f"{fault.status} after {restarts} restart(s){again}: {fault.detail[:200]}; an error of the "
        f"training code, its data or configuration, never of a node: not isolating {fault.node}"
    )


def _confirm(draft: Draft, task: TaskRecord, inc: Incident, fault: Fault) -> None:
    """An unconfirmed fault asks for isolation: run the node check before any drain.

    For a collective or network fault (:data:`detect.isolation.PAIRED_CHECK`) the
    reporting rank's node is not the suspect: the paired check runs across all of the
    job's nodes in service and names the bad one. The outcome comes back through
    :func:`on_check_outcome`."""
    now_s = draft.now_s
    inc = _enter(inc, _L.ISOLATE, now_s)
    attempt = inc.attempts_at(_L.ISOLATE)
    in_service = tuple(n for n in task.nodes if _drainable(draft, n))
    if fault.error_status in PAIRED_CHECK and len(in_service) >= 2 and task.job_id is not None:
        nodes = in_service
        action = CheckNode(
            step_id(inc, _L.ISOLATE, attempt, "check", "paired"), fault.node, nodes, task.job_id
        )
        what = f"paired check across {', '.join(nodes)}"
    else:
        nodes = (fault.node,)
        check_id = step_id(inc, _L.ISOLATE, attempt, "check", fault.node)
        action = CheckNode(check_id, fault.node, job_id=task.job_id if fault.node in task.nodes else None)
        what = f"node check on {fault.node}"
    why = f"{fault.status} not confirmed by any out-of-band source: {what} before any drain"
    draft.put(replace(inc.noted(why, now_s), pending_check=nodes, note=why))
    draft.put(draft.task(task.task_id).with_state(TaskState.RECOVERING))
    draft.act(action)
    draft.notes.append(f"{inc.incident_id}: {why}")


def on_check_outcome(
    draft: Draft, task: TaskRecord, inc: Incident, *, ok: bool, nodes: tuple[str, ...], detail: str
) -> None:
    """The node check :func:`_confirm` asked for came back.

    Failed on some nodes: each is confirmed bad (``node_check``) and isolated. Passed:
    the nodes are fine, so the fault is not theirs; restarts are already used up, so the
    task stops and the operator is told (nothing is drained). Failed without naming a
    node (the paired check could not tell): the operator is asked."""
    now_s = draft.now_s
    checked = inc.pending_check
    inc = replace(inc.noted(f"node check: {detail}", now_s), pending_check=())
    if ok:
        which = ", ".join(checked) or inc.node
        why = (
            f"{which} passed the node check ({detail[:200]}): the {inc.status} is not a fault of "
            f"{'these nodes' if len(checked) > 1 else 'the node'}; nothing drained"
        )
        _stop_task(draft, task, inc, why)
        return
    bad = [n for n in nodes if n in checked and _drainable(draft, n)]
    if not bad:
        why = f"the node check could not name a bad node ({detail[:200]}); nothing drained"
        draft.put(replace(inc.moved(_L.ESCALATED_TO_OPERATOR, now_s), note=why, last_action_s=now_s))
        draft.act(NotifyOperator(f"{inc.incident_id}/notify/unconfirmed", inc.incident_id, why))
        draft.notes.append(f"{inc.incident_id}: {why}")
        return
    for node in bad:
        fault = Fault(
            node, inc.status.value, f"node check failed: {detail}", confirmed_by=Confirmation.NODE_CHECK
        )
        current = draft.incidents.get(inc.incident_id, inc)
        if current.stage is _L.ESCALATED_TO_OPERATOR or not current.is_open:
            break
        _climb(draft, draft.task(task.task_id), current, _L.ISOLATE, fault)


def _climb(draft: Draft, task: TaskRecord, inc: Incident, target: LadderStage, fault: Fault) -> None:
    """Run rung ``target`` for the task's incident (breakers first).

    Isolation is gated by :mod:`detect.isolation`: a fault no node can cause stops the
    task; an unconfirmed one runs the node check first (:func:`_confirm`); only a
    confirmed one drains."""
    if target is _L.ISOLATE:
        gate = fault.verdict()
        if gate is Verdict.NEVER:
            _stop_task(draft, task, inc, _never_why(inc, fault))
            return
        if gate is Verdict.CHECK:
            _confirm(draft, task, inc, fault)
            return
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
    if target is _L.RESTART_PROCESSES and fault.bad_iterations is not None:
        _roll_back(draft, task, inc, fault, bad=fault.bad_iterations, job_id=task.job_id)
        return
    inc = _enter(inc, target, draft.now_s)
    attempt = inc.attempts_at(target)
    nodes = (fault.node,) if target is _L.RETRY_IN_PLACE else task.nodes
    draft.put(draft.task(task.task_id).with_state(TaskState.RECOVERING))
    if acts:
        for n in nodes:
            if n == fault.node and fault.rule in AGENT_RULES:  # no agent to take the command
                draft.act(
                    RestartAgent(
                        step_id(inc, target, attempt, "restart_agent", n), task.task_id, task.job_id, n
                    )
                )
                continue
            draft.act(
                SendCommand(
                    action_id=step_id(inc, target, attempt, "restart_ranks", n),
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


# --- roll back past a loss spike or NaN (issue 23) --------------------------------------

_SPIKE_WORDS: Final = {ErrorStatus.LOSS_SPIKE: "loss spike", ErrorStatus.NAN_LOSS: "NaN loss"}


def _roll_back(
    draft: Draft, task: TaskRecord, inc: Incident, fault: Fault, *, bad: tuple[int, int], job_id: int
) -> None:
    """The restart rung of a loss spike or NaN: every node's ranks restart from the newest
    version older than the bad iterations and skip their data (:class:`RollBack`, rendered
    with the task's skipped ranges). The task and the incident record the roll back."""
    now_s = draft.now_s
    inc = _enter(inc, _L.RESTART_PROCESSES, now_s)
    attempt = inc.attempts_at(_L.RESTART_PROCESSES)
    launch = step_id(inc, _L.RESTART_PROCESSES, attempt, "rollback", "")
    first, last = bad
    rollback = Rollback(
        first=first,
        last=last,
        iteration=max(fault.iteration, last),
        incident_id=inc.incident_id,
        launch=launch,
        decided_s=now_s,
    )
    current = draft.task(task.task_id)
    draft.put(replace(current, rollbacks=(*current.rollbacks, rollback)).with_state(TaskState.RECOVERING))
    for node in task.nodes:
        draft.act(RollBack(f"{launch}{node}", task.task_id, job_id, node))
    _count_recovery(draft, task.task_id)
    what = _SPIKE_WORDS.get(inc.status, fault.status)
    why = (
        f"roll back past the {what} at iteration {rollback.iteration}: restart from the newest saved "
        f"version older than iteration {first}, skipping the data of iterations {rollback.skipped}"
    )
    draft.put(replace(inc.noted(why, now_s), rollback=rollback, note=why))
    draft.notes.append(f"{inc.incident_id}: restart_processes #{attempt} ({fault.status}): {why}")


def _repeated(task: TaskRecord, bad: tuple[int, int]) -> Rollback | None:
    """The task's roll back whose skipped data the bad iterations ``bad`` overlap or directly
    follow: the same data spikes again (or the data was not the cause), and rolling back
    once more would loop."""
    for rollback in reversed(task.rollbacks):
        if bad[0] <= rollback.last + 1 and rollback.first <= bad[1]:
            return rollback
    return None


def _from_replaced_ranks(snapshot: Snapshot, task: TaskRecord, finding: Finding) -> bool:
    """A loss finding reported by ranks that the task's latest roll back is replacing (its
    incident is still open and the report's launch id is not the roll back's): those ranks
    trained on the bad data; what they report now proves nothing."""
    if not task.rollbacks or not finding.launch_id:
        return False
    latest = task.rollbacks[-1]
    inc = snapshot.incidents.get(latest.incident_id)
    return inc is not None and inc.is_open and not finding.launch_id.startswith(latest.launch)


def _only_skipped_data(snapshot: Snapshot, task: TaskRecord, finding: Finding, bad: tuple[int, int]) -> bool:
    """A finding from unknown ranks (no launch id: one classified from a message's text,
    such as Megatron-LM's NaN line and the exit of the rank that printed it) that names only
    iterations a roll back skips, while that roll back is under way (its incident open, the
    new ranks not reported yet): ranks from before it sent it (the same NaN, seen again in
    another report). Once the new ranks reported, such a finding is theirs: a repeat."""
    if finding.launch_id:
        return False
    return any(
        r.first <= bad[0]
        and bad[1] <= r.last
        and r.version is None
        and (inc := snapshot.incidents.get(r.incident_id)) is not None
        and inc.is_open
        for r in task.rollbacks
    )


def _on_loss_finding(draft: Draft, task: TaskRecord, finding: Finding, bad: tuple[int, int]) -> bool:
    """A loss spike or NaN of a task that was rolled back before: a stale report is noted, a
    repeat at the same data stops the task with the reason. True when handled here."""
    snapshot = draft.snap
    if _from_replaced_ranks(snapshot, task, finding):
        draft.notes.append(
            f"finding {finding.finding_id}: {finding.status} at iteration {finding.iteration} from ranks "
            f"launched by {finding.launch_id}, which roll back {task.rollbacks[-1].incident_id} "
            "replaces; ignored"
        )
        return True
    if _only_skipped_data(snapshot, task, finding, bad):
        draft.notes.append(
            f"finding {finding.finding_id}: {finding.status} at iteration {finding.iteration}, whose data "
            f"the task skips since a roll back: from ranks before it; ignored"
        )
        return True
    again = _repeated(task, bad)
    if again is None:
        return False
    inc = snapshot.open_incident(task.task_id)
    if inc is None:
        number = task.incidents_opened + 1
        inc = _new_incident(f"{task.task_id}.{number}", task.task_id, finding, draft.now_s)
        draft.put(replace(draft.task(task.task_id), incidents_opened=number))
    else:
        inc = remember(draft, inc, finding)
    restored = (
        f"restored version {again.version}"
        if again.version is not None
        else f"restored a version older than iteration {again.first}"
    )
    what = _SPIKE_WORDS.get(finding.status, finding.status.value)
    why = (
        f"repeated {what} at iteration {finding.iteration} after rollback "
        f"({again.incident_id}: iterations {again.skipped} skipped, {restored}); "
        "rolling back again would loop on the same data"
    )
    _stop_task(draft, draft.task(task.task_id), inc, why)
    return True


def _wanted(draft: Draft, finding: Finding) -> LadderStage:
    """The rung a finding asks for: its severity's, except that a SEV1 whose node fault is
    not confirmed (or that no node can cause) restarts in place (:mod:`detect.isolation`),
    and one of :data:`detect.isolation.CHECK_AT_ONCE` goes to its check (never a drain)."""
    wanted = RUNG_OF_SEVERITY[finding.severity]
    if (
        wanted is _L.ISOLATE
        and finding.status in CHECK_AT_ONCE
        and Fault.of(finding).verdict() is Verdict.CHECK
    ):
        return _L.ISOLATE  # the finding is the repeated evidence: its check runs now, no drain yet
    if wanted is _L.ISOLATE and Fault.of(finding).verdict() is not Verdict.DRAIN:
        draft.notes.append(
            f"finding {finding.finding_id}: {finding.status} on {finding.node} not confirmed "
            "out of band; restart in place"
        )
        return _L.RESTART_PROCESSES
    return wanted


def _new_incident(incident_id: str, task_id: str | None, finding: Finding, now_s: float) -> Incident:
    return Incident(
        incident_id=incident_id,
        task_id=task_id,
        node=finding.node,
        rank=finding.rank,
        status=finding.status,
        severity=finding.severity,
        rule=finding.rule,
        evidence=finding.evidence[:EVIDENCE_CHARS],
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
    draft = Draft(snapshot, now_s)
    seen = seen_in(snapshot, finding.finding_id)
    if seen is not None:
        return draft.note(f"finding {finding.finding_id}: already handled in {seen.incident_id}")
    if finding.status is ErrorStatus.STRAGGLER:  # sub-healthy: a cost decision, never the ladder's
        return draft.note(
            f"finding {finding.finding_id}: a straggler is decided with its measurements "
            "(unicornd.decide.stragglers), not by the ladder; ignored"
        )
    task = _task_for(snapshot, finding)
    if task is None:
        return _on_node_finding(draft, finding)
    if task.requeue is not None:
        return draft.note(
            f"finding {finding.finding_id}: job {task.job_id} is being requeued "
            f"({task.requeue.action_id}); its processes end on purpose"
        )
    if task.state not in LIVE_TASK_STATES or finding.node not in task.nodes:
        return draft.note(
            f"finding {finding.finding_id}: task {task.task_id} is {task.state} "
            f"on {list(task.nodes)}; ignored"
        )
    bad = finding.bad_iterations()
    inc = snapshot.open_incident(task.task_id)
    if bad is not None and _on_loss_finding(draft, task, finding, bad):
        pass  # a stale report, or the same data again: handled there
    elif inc is None:
        number = task.incidents_opened + 1
        inc = _new_incident(f"{task.task_id}.{number}", task.task_id, finding, now_s)
        draft.put(replace(task, incidents_opened=number).with_state(TaskState.RECOVERING))
        target = _target_rung(draft, inc, _wanted(draft, finding))
        _climb(draft, draft.task(task.task_id), inc, target, Fault.of(finding))
    else:
        _update_incident(draft, task, remember(draft, inc, finding), finding)
    return draft.decision()


def _update_incident(draft: Draft, task: TaskRecord, inc: Incident, finding: Finding) -> None:
    """A further finding for a task with an open incident: absorb it or climb."""
    wanted = _wanted(draft, finding)
    fault = Fault.of(finding)
    where = f"{finding.status} on {finding.node}"
    if inc.stage is _L.ESCALATED_TO_OPERATOR:
        if wanted is _L.ISOLATE:
            _mark_suspect(draft, fault)
        draft.put(inc)
        draft.notes.append(f"{inc.incident_id}: waiting for the operator; {where} recorded")
        return
    if inc.stage in WAITING_FOR_PLAN or (inc.stage is _L.TRANSITION and wanted is _L.ISOLATE):
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
        aid = step_id(inc, _L.RESTART_PROCESSES, attempt, "restart_agent", finding.node)
        draft.act(RestartAgent(aid, task.task_id, task.job_id, finding.node))
        draft.put(replace(inc, last_action_s=draft.now_s))
        draft.notes.append(f"{inc.incident_id}: agent on {finding.node} gone during the restart; new agent")
        return
    # A rank of the launch or restart just ordered that dies is that action failing, never its
    # consequence (the ranks it replaced report under their own launch, and the detector
    # drops those). Absorbed, it left the task without ranks until the rung's timeout: seen in
    # CI, a restart's ranks died at load 8 s after it and nothing happened for 180 s.
    own_failure = finding.rank_died and finding.current_launch
    if finding.secondary or (settling and not own_failure and RUNG_LEVEL[wanted] <= RUNG_LEVEL[inc.stage]):
        draft.put(inc)
        why = "secondary" if finding.secondary else f"within {draft.policy.settle_s:g} s of the last action"
        draft.notes.append(f"{inc.incident_id}: {where} absorbed ({why})")
        return
    target = _target_rung(draft, inc, wanted)
    _climb(draft, task, inc, target, fault)


_VOLATILE: Final = re.compile(r"0x[0-9a-fA-F]+|\d+")


def signature(status: ErrorStatus, evidence: str) -> str:
    """What identifies an error across restarts: its status and the first line of its
    evidence with numbers, addresses and pids masked (ranks, iterations and timestamps
    differ between two runs of the same bug)."""
    first = evidence.strip().splitlines()[0] if evidence.strip() else ""
    return f"{status.value}|{_VOLATILE.sub('#', first)}"


def _same_error_again(inc: Incident, fault: Fault) -> bool:
    """The fault's evidence has the incident's signature (see :func:`signature`)."""
    if inc.attempts_at(_L.RESTART_PROCESSES) == 0:
        return False
    detail = fault.detail.split(": ", 1)[-1]
    return signature(inc.status, detail) == signature(inc.status, inc.evidence)


def _drainable(draft: Draft, node: str) -> bool:
    return draft.node(node).health in (NodeHealth.HEALTHY, NodeHealth.SUSPECT)


def _task_for(snapshot: Snapshot, finding: Finding) -> TaskRecord | None:
    if finding.job_id is not None:
        return snapshot.task_of_job(finding.job_id)
    for task in snapshot.tasks.values():
        if finding.node in task.nodes and task.state in LIVE_TASK_STATES:
            return task
    return None


def _on_node_finding(draft: Draft, finding: Finding) -> Decision:
    """A fault outside any known job: only a SEV1 on a node in service matters (drain, replan)."""
    if finding.job_id is not None:
        return draft.note(f"finding {finding.finding_id}: no task has job {finding.job_id}; ignored")
    existing = draft.snap.open_node_incident(finding.node)
    if existing is not None:  # waiting for the operator: record only
        draft.put(remember(draft, existing, finding))
        return draft.decision()
    if finding.severity is not Severity.SEV1 or not _drainable(draft, finding.node):
        return draft.note(f"finding {finding.finding_id}: {finding.severity} on idle {finding.node}; noted")
    if Fault.of(finding).verdict() is not Verdict.DRAIN:
        return draft.note(
            f"finding {finding.finding_id}: {finding.status} on idle {finding.node} not confirmed "
            "out of band; noted, not drained"
        )
    inc = _new_incident(f"node.{finding.node}.{finding.finding_id}", None, finding, draft.now_s)
    _isolate(draft, None, inc, Fault.of(finding))
    return draft.decision()


CHECK_BACKSTOP_S: Final = 900.0
"""An incident waiting for its node check longer than this asks the operator (the check's
own timeouts, 120 s per node check or 60 s per paired test plus retries, end far sooner;
this only catches an answer that never came)."""

_STAGE_TIMEOUT: Final = {
    _L.RETRY_IN_PLACE: "retry_timeout_s",
    _L.RESTART_PROCESSES: "restart_timeout_s",
    _L.TRANSITION: "transition_timeout_s",
}


def on_tick(snapshot: Snapshot, now_s: float) -> Decision:
    """Climb every incident whose rung got no iteration within its timeout, fail every
    requeue whose job did not run again by its deadline, and drop the records whose time
    in the snapshot is over (:meth:`Snapshot.expired`: a daemon that runs for months keeps
    a day of ended tasks and closed incidents, not all of them).

    A timed-out retry retries again or restarts; a timed-out restart or transition
    restarts (while restarts remain) or isolates the incident's node; with nothing left
    to isolate the operator is asked. A straggler report on a node that no longer runs a
    task closes. Deterministic in (snapshot, now_s).
    """
    draft = Draft(snapshot, now_s)
    pol = snapshot.policy
    for inc in sorted(snapshot.incidents.values(), key=lambda i: i.incident_id):
        if inc.task_id is None or inc.stage not in _STAGE_TIMEOUT:
            continue
        task = draft.task(inc.task_id)
        timeout_s = float(getattr(pol, _STAGE_TIMEOUT[inc.stage]))
        if inc.stage is _L.RETRY_IN_PLACE and task.starting():
            # Before the launch's first iteration (ranks loading, compiling, joining the
            # rendezvous) "no iteration" says nothing about the fault: the wait gets the time
            # a launch gets. Found by the safety bench: a benign SEV3 line printed during
            # start-up restarted the node's ranks after retry_timeout_s (60 s), then the task.
            timeout_s = max(timeout_s, pol.transition_timeout_s)
        if now_s - inc.last_action_s < timeout_s:
            continue
        if task.state not in LIVE_TASK_STATES or task.requeue is not None:
            continue
        detail = f"no iteration {now_s - inc.last_action_s:.0f} s after {inc.stage.value}"
        rung_failed(draft, task, inc, detail, status=_timeout_status(inc))
    for inc in sorted(snapshot.incidents.values(), key=lambda i: i.incident_id):
        if inc.stage is _L.ISOLATE and inc.pending_check and now_s - inc.last_action_s > CHECK_BACKSTOP_S:
            why = f"no answer from the node check on {', '.join(inc.pending_check)}; nothing drained"
            draft.put(replace(inc.moved(_L.ESCALATED_TO_OPERATOR, now_s), note=why, pending_check=()))
            draft.act(NotifyOperator(f"{inc.incident_id}/notify/check-lost", inc.incident_id, why))
            draft.notes.append(f"{inc.incident_id}: {why}")
    for inc in sorted(snapshot.incidents.values(), key=lambda i: i.incident_id):
        if (
            inc.is_open
            and inc.task_id is None
            and inc.status is ErrorStatus.STRAGGLER
            and not any(inc.node in t.nodes and t.state in LIVE_TASK_STATES for t in snapshot.tasks.values())
        ):  # a straggler report (unicornd.decide.stragglers) on a node that left its task
            draft.put(
                replace(inc.moved(_L.CLOSED, now_s), note=f"{inc.note}; closed: {inc.node} runs no task")
            )
            draft.notes.append(f"{inc.incident_id}: {inc.node} runs no task any more; report closed")
    for task in sorted(snapshot.tasks.values(), key=lambda t: t.task_id):
        wait = task.requeue
        # Until the requeue has returned, its deadline is only a backstop
        # (REQUEUE_QUEUED_LIMIT_S): it may be queued behind other allocation changes, and
        # its own outcome ends the wait if it fails. Found by the 4,096-node hour: with 120 s
        # from the commit, a replan's later requeues passed their deadline before they ran,
        # the wait ended, and each requeue that still ran killed its job's agents, whose
        # silence then restarted a job Slurm held PENDING.
        if wait is not None and now_s > wait.deadline_s and task.state in LIVE_TASK_STATES:
            why = f"job {task.job_id} did not run again within the requeue deadline ({wait.action_id})"
            start_failed(draft, draft.task(task.task_id), why)
    tasks, incidents = snapshot.expired(now_s)
    if tasks or incidents:
        draft.notes.append(f"state: {len(tasks)} ended task(s), {len(incidents)} incident(s) dropped")
        return replace(draft.decision(), drop_tasks=tasks, drop_incidents=incidents)
    return draft.decision()


def rung_failed(
    draft: Draft, task: TaskRecord, inc: Incident, detail: str, *, status: str = "", start_error: bool = False
) -> None:
    """The incident's current rung failed (no iteration in time, or its action failed):
    the same rung again while attempts remain, else the next one up; with nothing left to
    isolate, the operator is asked. ``detail`` goes into the incident's timeline.

    ``start_error``: the training command itself failed to start (an agent answered a
    restart or relaunch with an error, e.g. a missing executable). Such a failure says
    nothing against the node: it never isolates one; once restarts are used up the
    operator is asked instead.
    """
    now_s = draft.now_s
    inc = inc.noted(f"{inc.stage.value} failed: {detail}", now_s)
    # A start that failed is never retried in place (a wait cannot start processes)
    waits = inc.stage is _L.TRANSITION or (start_error and inc.stage is _L.RETRY_IN_PLACE)
    wanted = _L.RESTART_PROCESSES if waits else inc.stage
    target = _target_rung(draft, inc, wanted)
    node = inc.node
    nothing_left = node in inc.isolated_nodes or node not in task.nodes
    if target is _L.ISOLATE and (nothing_left or start_error):
        why = f"{detail}; nothing left to isolate"
        if start_error and not nothing_left:
            why = f"the training command fails to start ({detail}); not isolating {node} for it"
        draft.put(replace(inc.moved(_L.ESCALATED_TO_OPERATOR, now_s), note=why, last_action_s=now_s))
        draft.act(NotifyOperator(f"{inc.incident_id}/notify/stuck", inc.incident_id, why))
        draft.notes.append(f"{inc.incident_id}: {why}")
        return
    _climb(draft, task, inc, target, Fault(node, status or inc.status.value, detail, rank_died=True))


def start_failed(draft: Draft, task: TaskRecord, why: str) -> None:
    """The task's (re)start cannot happen (its requeued job never ran again, or Slurm
    refused the requeue): unicorn stops acting on it and asks the operator. Its incident,
    if any, is escalated; the wait ends so its job's events count again."""
    now_s = draft.now_s
    draft.put(replace(task, requeue=None))
    inc = draft.snap.open_incident(task.task_id)
    target = inc.incident_id if inc is not None else None
    if inc is not None and inc.stage is not _L.ESCALATED_TO_OPERATOR:
        draft.put(replace(inc.moved(_L.ESCALATED_TO_OPERATOR, now_s), note=why, last_action_s=now_s))
    aid = f"task/{task.task_id}/{task.generation}/notify/start-failed"
    draft.act(NotifyOperator(aid, target, f"task {task.task_id}: {why}"))
    draft.notes.append(f"task {task.task_id}: {why}")


def _timeout_status(inc: Incident) -> str:
    return ErrorStatus.TASK_HANG.value if inc.stage is _L.TRANSITION else inc.status.value


def on_operator_confirm_drain(snapshot: Snapshot, incident_id: str, now_s: float) -> Decision:
    """The operator confirmed the drain the limiter held back: drain and replan.

    Raises InvalidArgument when the incident does not exist or awaits no drain.
    """
    inc = snapshot.incidents.get(incident_id)
    if inc is None or inc.stage is not _L.ESCALATED_TO_OPERATOR or inc.pending_drain is None:
        raise InvalidArgument(f"incident {incident_id!r} has no drain waiting for confirmation")
    draft = Draft(snapshot, now_s)
    task = snapshot.tasks.get(inc.task_id) if inc.task_id is not None else None
    rule = inc.rule if inc.pending_drain == inc.node else ""  # a dead node is set DOWN first
    fault = Fault(
        inc.pending_drain,
        inc.status.value,
        "confirmed by operator",
        rule=rule,
        confirmed_by=Confirmation.OPERATOR,
    )
    _isolate(draft, task, inc, fault, confirmed=True)
    return draft.decision()


_IN_SERVICE: Final = frozenset({NodeHealth.HEALTHY, NodeHealth.SUSPECT, NodeHealth.RETURNING})


def on_operator_drain(snapshot: Snapshot, node: str, reason: str, now_s: float) -> Decision:
    """An operator's drain (``unicornctl drain NODES --reason TEXT``): the nodes leave every plan.

    ``node``: a node, or a Slurm hostlist of nodes (``n[1-16]``: a rack). Each node is
    drained with ``unicorn: operator: <reason>`` and held, so only an operator's resume
    brings it back (a resume straight in Slurm is drained again, see
    :func:`on_node_join`); one replan moves the tasks off them all. The drains are
    adjacent actions of one reason, which the executor sends to Slurm in one call. The
    drain limiter does not apply (a person decided) and the drains are not counted
    against it. A node already draining or drained is only held and given the new reason;
    the same request again changes nothing. An unknown node (outside the scope, too), a
    node other users' jobs run on, a bad hostlist or an empty reason: InvalidArgument,
    nothing changed.
    """
    nodes = list(dict.fromkeys(expand(node)))
    if not nodes:
        raise InvalidArgument("an operator's drain needs a node")
    unknown = [n for n in nodes if n not in snapshot.nodes]
    if unknown:
        raise InvalidArgument(
            f"unknown node {compress(unknown)!r}; known: {compress(sorted(snapshot.nodes)) or 'none'}"
        )
    if not reason.strip():
        raise InvalidArgument("an operator's drain needs a reason")
    for n in nodes:
        others = snapshot.foreign_jobs(n)
        if others:
            raise InvalidArgument(
                f"node {n} runs other users' jobs {list(others)}, not unicorn's: unicorn does not "
                f"drain it (scontrol update nodename={n} state=drain does, if that is meant)"
            )
    draft = Draft(snapshot, now_s)
    text = drain_reason(draft, "operator:", reason)
    drained: list[str] = []
    for n in nodes:
        rec = snapshot.nodes[n]
        if rec.health not in _IN_SERVICE:
            if rec.held and rec.reason == text:
                draft.notes.append(f"node {n} is already {rec.health} for {text!r}")
                continue
            draft.put(replace(rec, held=True, reason=text))
            draft.act(DrainNode(f"operator-drain/{n}/{rec.joins}/{zlib.crc32(text.encode()):08x}", n, text))
            draft.notes.append(f"node {n} is already {rec.health}: held, reason now {text!r}")
            continue
        draft.put(replace(rec.with_health(NodeHealth.DRAINING, text), held=True))
        draft.act(DrainNode(f"operator-drain/{n}/{rec.joins}/drain", n, text))
        drained.append(n)
    if drained:
        first = snapshot.nodes[drained[0]]
        draft.act(
            Replan(
                f"operator-drain/{drained[0]}/{first.joins}/replan", f"operator drained {compress(drained)}"
            )
        )
        draft.notes.append(f"node {compress(drained)} drained by an operator ({text}), replan")
    return draft.decision()
