"""Progress closes an incident only when it comes from ranks the current rung started."""

from __future__ import annotations

from detect.statuses import ErrorStatus
from tests.unicornd.coord_world import apply, finding, task, world
from unicornd.decide import on_finding, on_progress
from unicornd.state import LadderStage, Snapshot, TaskState

T0 = 1_700_000_000.0


def restarting() -> Snapshot:
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", ErrorStatus.OTHER_SOFTWARE_ERROR), T0))
    assert snap.incidents["a.1"].stage is LadderStage.RESTART_PROCESSES
    return snap


def test_in_flight_iteration_of_replaced_ranks_does_not_close() -> None:
    snap = restarting()
    # Finished after the restart was ordered, but by the ranks it is replacing.
    d = on_progress(snap, "a", 9, T0 + 1, reported_s=T0 + 0.5, launch_id="plan-1/a/launch")
    assert apply(snap, d).incidents["a.1"].is_open


def test_iteration_of_restarted_ranks_closes() -> None:
    snap = restarting()
    rid = "a.1/restart_processes/1/restart_ranks/n1"
    after = apply(snap, on_progress(snap, "a", 6, T0 + 9, reported_s=T0 + 8, launch_id=rid))
    assert after.incidents["a.1"].stage is LadderStage.CLOSED
    assert after.tasks["a"].state is TaskState.RUNNING


def test_untagged_iteration_falls_back_to_time() -> None:
    snap = restarting()
    assert apply(snap, on_progress(snap, "a", 9, T0 + 1, reported_s=T0 - 1)).incidents["a.1"].is_open
    closed = apply(snap, on_progress(snap, "a", 9, T0 + 1, reported_s=T0 + 0.5))
    assert not closed.incidents["a.1"].is_open
