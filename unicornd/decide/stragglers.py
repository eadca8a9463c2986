"""Stragglers: replace a node persistently slower than its task's other nodes, or report it.

A straggler (:mod:`detect.stragglers`: its ranks' compute time at least ``[detect]
straggler_factor`` times the other nodes', windows in a row) is sub-healthy, not failed: the
node works, slower, and in lock-step training the whole task runs at its pace. Replacing it
costs the task a transition; keeping it costs throughput until the next failure replans the
cluster anyway. So, with F(t) = weight x model FLOPs per iteration / t (weighted FLOP/s,
Unicron's WAF)::

    t_now      = the task's median iteration time in the straggler's window
    t_replaced = t_now - (compute_s - peers_compute_s)   the node at its peers' speed (a
                                                          healthy spare is as fast as they are)
    gain       = (F(t_replaced) - F(t_now)) x D_running   D_running = node MTBF / plannable nodes
    cost       = F(t_now) x D_transition

The node MTBF is the calibrated one (:attr:`Snapshot.calibration`, ``[plan] node_mtbf_h``
as prior) and D_transition the task's measured transition time (the analytic one as
prior), as the planner uses them; ``[plan] calibrate = false`` takes the priors, as the
planner then does. The streak's least slow window gives the numbers (a conservative gain).

**Replace** (all must hold): the task runs with no incident open, the gain beats the cost,
a healthy idle node (plannable, no task's) is free to take the node's place, the drain
limiter allows a drain, no other user's job runs on the node, the task's recovery budget
and no-progress breaker allow a recovery, and this rank of the task was not replaced as a
straggler before (the same rank slow on another node is the rank's own work, not the
node). Replacing is the ladder's isolate rung (:func:`unicornd.decide.ladder._isolate`): a
task incident with status ``straggler``, the node drained with ``unicorn: straggler ...``,
and the cluster replanned; the incident closes once the task iterates again.

**Report** otherwise: an incident on the node without a task (so it never holds up the
task's own ladder), left at ``detected``, whose note says how much slower and why it was not
replaced, with the numbers. It closes when the node recovers (its ``recovered`` verdict) or
no longer runs a task (:func:`unicornd.decide.on_tick`).

**Reported, then replaced**: the detector repeats its verdict while the node stays slow
(every ``windows`` windows). A repeat re-decides a node with an open report: if it may be
replaced now (a spare freed, the drain limiter's window passed), the report closes
(``superseded``) and the node is replaced; otherwise it is only noted.

Never twice otherwise: a node replaced or reported within ``[recovery]
straggler_cooldown_s`` (a closed report, a replacement) is only noted. Pure: functions of
the snapshot, the input and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from detect.statuses import ErrorStatus
from detect.stragglers import Straggler
from plan.calibration import node_mtbf_h, transition_s
from plan.objective import HOUR_S, TransitionModel
from unicorn_core.config import PlanConfig
from unicorn_core.errors import InvalidArgument
from unicornd.actions import Decision
from unicornd.calibrate import node_hours
from unicornd.decide.common import EVIDENCE_CHARS, Draft, Fault, Finding, seen_in
from unicornd.decide.ladder import _breaker, _isolate, _new_incident
from unicornd.state import ENDED_STATES, Incident, LadderStage, Snapshot, TaskRecord, TaskState

_L = LadderStage
_PLAN_DEFAULTS = PlanConfig()


@dataclass(frozen=True)
class StragglerFinding:
    """A :class:`detect.stragglers.Straggler` verdict about a node of job ``job_id``;
    ``finding_id`` identifies the evidence (the stream entry): a second delivery changes
    nothing."""

    finding_id: str
    job_id: int
    straggler: Straggler

    def __post_init__(self) -> None:
        if not self.finding_id:
            raise InvalidArgument("finding_id must be non-empty")


@dataclass(frozen=True)
class Economics:
    """What replacing a straggler gains and costs, in weighted TFLOP (module doc)."""

    iteration_s: float
    replaced_iteration_s: float
    waf_now: float
    waf_replaced: float
    running_s: float
    transition_s: float

    @property
    def gain(self) -> float:
        return (self.waf_replaced - self.waf_now) * self.running_s

    @property
    def cost(self) -> float:
        return self.waf_now * self.transition_s

    def describe(self) -> str:
        return (
            f"replacing it gains {self.gain:.4g} wTFLOP ({self.waf_replaced:.4g} instead of "
            f"{self.waf_now:.4g} wTFLOP/s, iteration {self.replaced_iteration_s:.4g} s instead of "
            f"{self.iteration_s:.4g} s, for {self.running_s / HOUR_S:.3g} h to the next failure) "
            f"against a transition cost of {self.cost:.4g} wTFLOP ({self.transition_s:.3g} s)"
        )


def economics(
    snapshot: Snapshot, task: TaskRecord, s: Straggler, now_s: float, plan: PlanConfig
) -> Economics:
    """The gain and cost of replacing straggler ``s`` of ``task`` (module doc)."""
    t_now = max(s.iteration_s, s.compute_s, 1e-9)
    t_replaced = min(t_now, max(t_now - (s.compute_s - s.peers_compute_s), 1e-9))
    flop = task.weight * task.model.model_flop_per_iteration() / 1e12
    analytic = TransitionModel().transition_s(task.spec())
    if plan.calibrate:
        cal = snapshot.calibration
        mtbf_h = node_mtbf_h(
            plan.node_mtbf_h, plan.mtbf_prior_failures, cal.node_failures, node_hours(snapshot, now_s)
        )
        moved = transition_s(analytic, plan.transition_prior_samples, cal.transitions.get(task.task_id))
    else:
        mtbf_h, moved = plan.node_mtbf_h, analytic
    nodes = max(len(snapshot.plannable()), 1)
    return Economics(t_now, t_replaced, flop / t_now, flop / t_replaced, mtbf_h * HOUR_S / nodes, moved)


def on_straggler(
    snapshot: Snapshot, found: StragglerFinding, now_s: float, *, plan: PlanConfig = _PLAN_DEFAULTS
) -> Decision:
    """Replace the straggler, report it, or (``recovered``) close its report; see the module doc.

    Ignored (notes only): evidence seen before, a job no task has, a task not running (an
    incident open, launching, requeued) or no longer on the node, and a node acted on within
    the cooldown. A node with an open report is re-decided: replaced if it may be now."""
    draft = Draft(snapshot, now_s)
    s = found.straggler
    if s.recovered:
        return _recovered(draft, found)
    task = snapshot.task_of_job(found.job_id)
    why_ignored = _ignored(snapshot, found, task, now_s)
    if why_ignored is not None:
        return draft.note(why_ignored)
    assert task is not None  # _ignored refuses a missing task
    money = economics(snapshot, task, s, now_s, plan)
    why_not = _why_not_replace(draft, task, s, money)
    c = s.classification()
    assert c.severity is not None  # a straggler is SEV3
    finding = Finding(
        finding_id=found.finding_id,
        job_id=found.job_id,
        node=s.node,
        rank=s.rank,
        status=c.status,
        severity=c.severity,
        rule=c.rule,
        evidence=f"task {task.task_id}: {s.describe()}",
    )
    report = open_report(snapshot, s.node)
    if why_not:
        if report is not None:  # a repeat of a reported straggler: still not replaceable
            return draft.note(
                f"straggler {s.node}: reported in {report.incident_id}; {s.describe()}; "
                f"still not replaced: {'; '.join(why_not)}"
            )
        why = f"{s.describe()}; {money.describe()}; not replaced: {'; '.join(why_not)}"
        _report(draft, task, finding, why)
        return draft.decision()
    number = task.incidents_opened + 1
    inc = _new_incident(f"{task.task_id}.{number}", task.task_id, finding, now_s)
    why = f"{s.describe()}; {money.describe()}: replaced"
    inc = replace(inc, note=why)
    if report is not None:  # reported before, replaceable now (e.g. a spare freed)
        closed = report.moved(_L.CLOSED, now_s)
        draft.put(replace(closed, note=f"{report.note[:900]}; superseded: replaced in {inc.incident_id}"))
        draft.notes.append(f"{report.incident_id}: superseded by {inc.incident_id}")
    draft.put(replace(task, incidents_opened=number).with_state(TaskState.RECOVERING))
    detail = (
        f"{s.ratio:.2f}x its peers' compute time (rank {s.rank}); "
        f"gain {money.gain:.3g} > cost {money.cost:.3g} wTFLOP"
    )
    fault = Fault(s.node, ErrorStatus.STRAGGLER.value, detail, rule=finding.rule)
    _isolate(draft, draft.task(task.task_id), inc, fault)
    draft.notes.append(f"{inc.incident_id}: straggler {s.node}: {why}")
    return draft.decision()


def _recovered(draft: Draft, found: StragglerFinding) -> Decision:
    """The node is no longer slower: its open report (if any) closes."""
    s = found.straggler
    report = open_report(draft.snap, s.node)
    if report is None or seen_in(draft.snap, found.finding_id) is not None:
        return draft.note(f"straggler {s.node} recovered; no report open")
    closed = replace(report.moved(_L.CLOSED, draft.now_s), note=f"recovered: {s.describe()}")
    draft.put(replace(closed, finding_ids=(*closed.finding_ids, found.finding_id)))
    return draft.note(f"{report.incident_id}: {s.node} recovered, closed")


def _ignored(
    snapshot: Snapshot, found: StragglerFinding, task: TaskRecord | None, now_s: float
) -> str | None:
    """Why the verdict changes nothing (None: it is decided)."""
    s = found.straggler
    seen = seen_in(snapshot, found.finding_id)
    if seen is not None:
        return f"straggler {found.finding_id}: already handled in {seen.incident_id}"
    if task is None or task.state is not TaskState.RUNNING or s.node not in task.nodes:
        where = "no task" if task is None else f"task {task.task_id} is {task.state} on {list(task.nodes)}"
        return f"straggler {found.finding_id} on {s.node}: {where}; ignored"
    inc = snapshot.open_incident(task.task_id)
    if inc is not None:
        return (
            f"straggler {found.finding_id} on {s.node}: {inc.incident_id} of {task.task_id} is open; ignored"
        )
    if open_report(snapshot, s.node) is not None:
        return None  # re-decided: replaced if it may be now, else noted (module doc)
    last = _last_act(snapshot, s.node, now_s)
    if last is not None:
        return (
            f"straggler {s.node}: acted on in {last.incident_id} {now_s - last.opened_s:.0f} s ago "
            f"(cooldown {snapshot.policy.straggler_cooldown_s:g} s); {s.describe()}"
        )
    return None


def _why_not_replace(draft: Draft, task: TaskRecord, s: Straggler, money: Economics) -> list[str]:
    """Why the straggler must not be replaced now ([] when it may)."""
    snap, pol = draft.snap, draft.policy
    out = []
    if not money.gain > money.cost:
        out.append(f"the gain ({money.gain:.4g} wTFLOP) does not beat the transition cost ({money.cost:.4g})")
    busy = {n for t in snap.tasks.values() if t.state not in ENDED_STATES for n in t.nodes}
    if not [n for n in snap.plannable() if n not in busy]:
        out.append("no healthy idle node to take its place")
    limit = pol.drain_limit(max(len(snap.nodes), 1))
    if draft.drains_within_window() >= limit:
        out.append(f"drain limit reached ({limit} in {pol.drain_window_s:g} s)")
    others = snap.foreign_jobs(s.node)
    if others:
        out.append(f"other users' jobs {list(others)} run on {s.node}")
    stop = _breaker(draft, task)
    if stop is not None:
        out.append(stop)
    before = _replaced_rank(snap, task, s.rank)
    if before is not None:
        out.append(
            f"rank {s.rank} was replaced as a straggler on {before.node} before ({before.incident_id}): "
            "slow again elsewhere, its own work is the likelier cause than the node"
        )
    return out


def _report(draft: Draft, task: TaskRecord, finding: Finding, why: str) -> None:
    """An open incident on the node, without a task (it holds up no ladder), at ``detected``."""
    now_s = draft.now_s
    inc = _new_incident(f"straggler.{finding.node}.{finding.finding_id}", None, finding, now_s)
    draft.put(replace(inc, note=why[:1000], evidence=finding.evidence[:EVIDENCE_CHARS]))
    draft.notes.append(f"{inc.incident_id}: straggler {finding.node} of task {task.task_id} reported: {why}")


def open_report(snapshot: Snapshot, node: str) -> Incident | None:
    """The open straggler report on ``node`` (an incident without a task), if any."""
    for inc in snapshot.incidents.values():
        if inc.is_open and inc.task_id is None and inc.node == node and inc.status is ErrorStatus.STRAGGLER:
            return inc
    return None


def _last_act(snapshot: Snapshot, node: str, now_s: float) -> Incident | None:
    """The newest straggler incident (report or replacement) on ``node`` within the cooldown."""
    window = snapshot.policy.straggler_cooldown_s
    recent = [
        inc
        for inc in snapshot.incidents.values()
        if inc.status is ErrorStatus.STRAGGLER and inc.node == node and now_s - inc.opened_s < window
    ]
    return max(recent, key=lambda i: (i.opened_s, i.incident_id), default=None)


def _replaced_rank(snapshot: Snapshot, task: TaskRecord, rank: int) -> Incident | None:
    """An incident (still kept) that replaced ``task``'s ``rank`` as a straggler."""
    for inc in snapshot.incidents.values():
        if (
            inc.task_id == task.task_id
            and inc.status is ErrorStatus.STRAGGLER
            and inc.rank == rank
            and inc.isolated_nodes
        ):
            return inc
    return None
