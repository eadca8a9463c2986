"""Iterations reported by the ranks: the no-progress breaker's mark, and the proof that a
recovery (or a launch) worked."""

from __future__ import annotations

from dataclasses import replace

from unicorn_core.config import PlanConfig
from unicorn_core.errors import InvalidArgument
from unicornd import calibrate
from unicornd.actions import (
    CloseIncident,
    Decision,
)
from unicornd.calibrate import IterationSample
from unicornd.decide.common import (
    AWAITING_PROGRESS,
    Draft,
)
from unicornd.state import (
    LIVE_TASK_STATES,
    Incident,
    LadderStage,
    Snapshot,
    TaskRecord,
    TaskState,
)

_L = LadderStage
_PLAN_DEFAULTS = PlanConfig()

# --- progress, time, operator -------------------------------------------------------


def on_progress(
    snapshot: Snapshot,
    task_id: str,
    iteration: int,
    now_s: float,
    *,
    reported_s: float | None = None,
    launch_id: str = "",
    sample: IterationSample | None = None,
    plan: PlanConfig = _PLAN_DEFAULTS,
) -> Decision:
    """An iteration was reported (``reported_s``: when the rank finished it; default ``now_s``).

    Passing the task's highest iteration resets the no-progress breaker. An iteration
    reported after the latest recovery action, by ranks that action started, closes the
    open incident (``resumed`` then ``closed``) and the task is running again; so does one
    after a launch. ``launch_id`` is the action that started the reporting ranks (the
    agent's tag; "" = unknown, then the time alone decides): an iteration finished by ranks
    about to be replaced arrives after the action but must not count as its success.
    While the task's job is being requeued, iterations only move the mark (they come from
    ranks the requeue is about to kill). Empty decision when nothing changes (most calls).

    Calibration (:mod:`unicornd.calibrate`, windows from ``plan``): the first iteration of
    ranks just started begins their warm-up and, after a plan's launch, ends a measured
    transition; ``sample`` (a training step's timing) of a running task's new iteration is
    a measured iteration time of its layout.
    """
    if iteration < 0:
        raise InvalidArgument(f"iteration must be >= 0, got {iteration}")
    task = snapshot.tasks.get(task_id)
    if task is None or task.state not in LIVE_TASK_STATES:
        return Decision()
    at = now_s if reported_s is None else reported_s
    draft = Draft(snapshot, now_s)
    new = task
    if task.last_iteration is None or iteration > task.last_iteration:
        new = replace(new, last_iteration=iteration, last_iteration_s=at, recoveries_without_progress=0)
    if (
        task.requeue is None and task.starting() and task.launched_s is not None and at > task.launched_s
    ):  # the launch's first iteration (once per launch: the ladder's start-up wait ends)
        new = replace(new, first_iteration_s=at)
    inc = snapshot.open_incident(task_id)
    cal = snapshot.calibration
    if task.requeue is not None:
        pass  # ranks about to be killed by the requeue: their iterations prove nothing
    elif inc is not None:
        if inc.stage in AWAITING_PROGRESS and at > inc.last_action_s and _started_by(inc, task, launch_id):
            closed = inc.moved(_L.RESUMED, now_s).moved(_L.CLOSED, now_s)
            note = f"resumed at iteration {iteration}"
            if inc.rollback is not None:
                closed, new, note = _rolled_back(closed, new, iteration, launch_id, note)
            draft.put(replace(closed, note=note))
            draft.act(CloseIncident(f"{inc.incident_id}/close", inc.incident_id))
            new = new.with_state(TaskState.RUNNING)
            draft.notes.append(f"{inc.incident_id}: {note}, closed")
            by_plan = inc.stage is _L.TRANSITION
            cal = calibrate.on_started(cal, task, iteration, at_s=at, plan=plan, by_plan=by_plan)
    elif (
        task.state is TaskState.LAUNCHING
        and (task.launched_s is None or at > task.launched_s)
        and _launched_by_plan(task, launch_id)
    ):
        new = new.with_state(TaskState.RUNNING)
        cal = calibrate.on_started(cal, task, iteration, at_s=at, plan=plan, by_plan=True)
    elif sample is not None and task.state is TaskState.RUNNING:
        cal = calibrate.on_iteration(cal, task, iteration, sample, plan=plan, at_s=at)
    if new != task:
        draft.put(new)
    if cal != snapshot.calibration:
        draft.calibration = cal
    return draft.decision()


def _rolled_back(
    inc: Incident, task: TaskRecord, iteration: int, launch_id: str, note: str
) -> tuple[Incident, TaskRecord, str]:
    """The first iteration of the rolled-back ranks: the version they restored is the one
    before it (the built-in trainer reports every iteration, skipped ones too; Megatron-LM
    logs no line for a skipped one, so there it is the one before the skipped iterations that
    precede it), recorded on the incident's and the task's roll back. Unknown ranks (no
    launch id) or a version that is not older than the skipped data (the trainer did not
    roll back) record none, and say so."""
    rollback = inc.rollback
    assert rollback is not None
    version = iteration - 1
    if task.framework == "megatron":
        for first, last in task.skip_ranges():  # merged and sorted: one pass walks back
            if first <= version <= last:
                version = first - 1
    if not launch_id.startswith(rollback.launch) or not 0 <= version < rollback.first:
        unknown = f"{note} after the roll back (iterations {rollback.skipped} skipped; version unknown)"
        return inc, task, unknown
    done = replace(rollback, version=version)
    rollbacks = tuple(done if r == rollback else r for r in task.rollbacks)
    where = (
        f"version {version}"
        if version
        else f"the initial state (no saved version older than iteration {rollback.first} in any tier)"
    )
    note = f"{note}: rolled back to {where}, iterations {rollback.skipped} skipped"
    return replace(inc, rollback=done), replace(task, rollbacks=rollbacks), note


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
