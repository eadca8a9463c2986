"""The error-handling ladder (Unicron Fig. 7), breakers, drain limiter, idempotency, membership."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detect.statuses import ErrorStatus, Severity
from tests.unicornd.coord_world import apply, finding, of_kind, plan, render, task, world
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import AgentAction
from unicornd.actions import (
    CheckNode,
    CloseIncident,
    Decision,
    DrainNode,
    NotifyOperator,
    Outcome,
    OutcomeStatus,
    Replan,
    ResumeNode,
    SendCommand,
)
from unicornd.decide import (
    SLURM_NOT_RESPONDING,
    SSH_UNREACHABLE,
    Finding,
    on_finding,
    on_node_check,
    on_node_drained,
    on_node_join,
    on_operator_confirm_drain,
    on_outcome,
    on_progress,
    on_task_arrived,
    on_task_finished,
    on_tick,
)
from unicornd.replan import plan_transition
from unicornd.state import LadderStage, NodeHealth, Policy, Snapshot, TaskState

E = ErrorStatus
L = LadderStage
T0 = 1_700_000_000.0
POLICY = Policy()
AFTER_SETTLE = POLICY.settle_s + 1


def two_tasks(policy: Policy | None = None) -> Snapshot:
    """Task a (job 1) on n1,n2 and task b (job 2) on n3,n4; n5..n8 idle (2 drains per window)."""
    return world(8, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"])], policy)


def commands(decision: Decision, action: AgentAction) -> list[tuple[str, int]]:
    return [(a.node, a.job_id) for a in of_kind(decision.actions, SendCommand) if a.action is action]  # type: ignore[union-attr]


@dataclass(frozen=True)
class Step:
    """One finding after ``dt`` seconds, and what must happen."""

    dt: float
    status: ErrorStatus
    stage: LadderStage
    restarts_on: tuple[str, ...] = ()
    drains: tuple[str, ...] = ()
    rank_died: bool = False
    node: str = "n2"
    secondary: bool = False


LADDER_CASES = {
    "sev3 waits in place": [Step(0, E.CONNECTION_REFUSED_RESET, L.RETRY_IN_PLACE)],
    "sev3 with a dead rank restarts that rank only": [
        Step(0, E.CONNECTION_REFUSED_RESET, L.RETRY_IN_PLACE, restarts_on=("n2",), rank_died=True)
    ],
    "sev3 retried then escalated to restart then isolate": [
        Step(0, E.CONNECTION_REFUSED_RESET, L.RETRY_IN_PLACE),
        Step(AFTER_SETTLE, E.CONNECTION_REFUSED_RESET, L.RETRY_IN_PLACE),
        Step(AFTER_SETTLE, E.CONNECTION_REFUSED_RESET, L.RESTART_PROCESSES, restarts_on=("n1", "n2")),
        Step(AFTER_SETTLE, E.OTHER_NETWORK_ERROR, L.REPLAN, drains=("n2",)),
    ],
    "sev2 restarts every node of the task, no drain": [
        Step(0, E.OTHER_SOFTWARE_ERROR, L.RESTART_PROCESSES, restarts_on=("n1", "n2"), rank_died=True)
    ],
    "a failed restart isolates the node": [
        Step(0, E.CUDA_ERROR, L.RESTART_PROCESSES, restarts_on=("n1", "n2")),
        Step(AFTER_SETTLE, E.EXITED_ABNORMALLY, L.REPLAN, drains=("n2",)),
    ],
    "sev1 drains and replans at once": [Step(0, E.ECC_ERROR, L.REPLAN, drains=("n2",))],
    "consequences within the settle time are absorbed": [
        Step(0, E.OTHER_SOFTWARE_ERROR, L.RESTART_PROCESSES, restarts_on=("n1", "n2")),
        Step(1, E.NCCL_TIMEOUT, L.RESTART_PROCESSES, node="n1"),
        Step(1, E.EXITED_ABNORMALLY, L.RESTART_PROCESSES, node="n1"),
    ],
    "a worse finding within the settle time still climbs": [
        Step(0, E.CONNECTION_REFUSED_RESET, L.RETRY_IN_PLACE),
        Step(1, E.NVLINK_ERROR, L.REPLAN, drains=("n2",)),
    ],
    "secondary findings never climb": [
        Step(0, E.OTHER_SOFTWARE_ERROR, L.RESTART_PROCESSES, restarts_on=("n1", "n2")),
        Step(AFTER_SETTLE * 3, E.NCCL_TIMEOUT, L.RESTART_PROCESSES, node="n1", secondary=True),
    ],
    "a second faulty node waiting for the plan is drained too": [
        Step(0, E.ECC_ERROR, L.REPLAN, drains=("n2",)),
        Step(1, E.LOST_CONNECTION, L.REPLAN, drains=("n1",), node="n1"),
        Step(1, E.EXITED_ABNORMALLY, L.REPLAN, node="n1"),
    ],
}


@pytest.mark.parametrize("steps", LADDER_CASES.values(), ids=LADDER_CASES.keys())
def test_ladder(steps: list[Step]) -> None:
    snap, now = two_tasks(), T0
    for i, step in enumerate(steps):
        now += step.dt
        f = finding(f"f{i}", 1, step.node, step.status, rank_died=step.rank_died, secondary=step.secondary)
        d = on_finding(snap, f, now)
        snap = apply(snap, d)
        inc = snap.open_incident("a")
        assert inc is not None and inc.stage is step.stage, (i, d.notes)
        assert sorted(n for n, _ in commands(d, AgentAction.RESTART_RANKS)) == sorted(step.restarts_on), i
        drains = of_kind(d.actions, DrainNode)
        assert [a.node for a in drains] == list(step.drains), i  # type: ignore[union-attr]
        for drain in drains:
            assert drain.reason.startswith(f"unicorn: {step.status.value} a.1")  # type: ignore[union-attr]
            assert snap.nodes[drain.node].health is NodeHealth.DRAINING  # type: ignore[union-attr]
        assert bool(of_kind(d.actions, Replan)) == bool(step.drains), i
        assert snap.tasks["a"].state is TaskState.RECOVERING
    assert snap.tasks["b"].state is TaskState.RUNNING, "task b is untouched"
    assert all(n.health is NodeHealth.HEALTHY for n in (snap.nodes["n3"], snap.nodes["n4"]))


def test_progress_after_a_restart_closes_the_incident_and_resets_the_breaker() -> None:
    snap = two_tasks()
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.OTHER_SOFTWARE_ERROR), T0))
    assert snap.tasks["a"].recoveries_without_progress == 1
    early = on_progress(snap, "a", 11, T0 + 5, reported_s=T0 - 1)  # reported before the restart
    assert snap.open_incident("a") is not None and not of_kind(early.actions, CloseIncident)
    d = on_progress(snap, "a", 11, T0 + 5)
    snap = apply(snap, d)
    assert [a.incident_id for a in of_kind(d.actions, CloseIncident)] == ["a.1"]  # type: ignore[union-attr]
    inc = snap.incidents["a.1"]
    assert [e.stage for e in inc.timeline] == [L.DETECTED, L.RESTART_PROCESSES, L.RESUMED, L.CLOSED]
    assert snap.tasks["a"].state is TaskState.RUNNING
    assert snap.tasks["a"].recoveries_without_progress == 0
    assert snap.tasks["a"].last_iteration == 11
    assert on_progress(snap, "a", 11, T0 + 6).empty, "nothing changes on a repeated iteration"


def test_full_loop_sev1_plan_transition_resume() -> None:
    snap = two_tasks()
    d = on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0)
    snap = apply(snap, d)
    t = plan_transition(snap, plan({"a": 2, "b": 4}), render, T0 + 1)
    snap = apply(snap, t)
    assert snap.incidents["a.1"].stage is L.TRANSITION
    assert snap.tasks["a"].nodes == ("n1",) and snap.tasks["a"].state is TaskState.LAUNCHING
    snap = apply(snap, on_progress(snap, "a", 9, T0 + 5))  # resumed from a checkpoint below the mark
    assert snap.incidents["a.1"].stage is L.CLOSED
    assert snap.tasks["a"].state is TaskState.RUNNING
    assert snap.tasks["a"].recoveries_without_progress == 1, "iteration 9 did not pass the old mark 10"
    assert snap.tasks["b"] == two_tasks().tasks["b"]


def test_tick_climbs_rungs_that_see_no_iteration() -> None:
    snap = two_tasks()
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.CONNECTION_REFUSED_RESET), T0))
    assert on_tick(snap, T0 + POLICY.retry_timeout_s - 1).empty
    d = on_tick(snap, T0 + POLICY.retry_timeout_s)
    snap = apply(snap, d)
    assert snap.incidents["a.1"].attempts[L.RETRY_IN_PLACE] == 2
    assert commands(d, AgentAction.RESTART_RANKS) == [("n2", 1)]
    now = T0 + POLICY.retry_timeout_s * 2
    snap = apply(snap, on_tick(snap, now))
    assert snap.incidents["a.1"].stage is L.RESTART_PROCESSES
    d = on_tick(snap, now + POLICY.restart_timeout_s)
    # Restarts used up, nothing confirmed: a connection fault names no culprit, so the
    # paired check runs across the task's nodes before anything is drained.
    assert not of_kind(d.actions, DrainNode)
    checks = of_kind(d.actions, CheckNode)
    assert [(c.node, c.paired, c.job_id) for c in checks] == [("n2", ("n1", "n2"), 1)]  # type: ignore[union-attr]
    assert on_tick(snap, now + POLICY.restart_timeout_s) == d, "deterministic"
    snap = apply(snap, d)
    assert snap.incidents["a.1"].stage is L.ISOLATE and snap.incidents["a.1"].pending_check == ("n1", "n2")
    convicted = Outcome(
        checks[0].action_id, "check_node", OutcomeStatus.FAILED, "paired check: bad n1", nodes=("n1",)
    )
    d = on_outcome(snap, convicted, now + POLICY.restart_timeout_s + 30)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n1"]  # type: ignore[union-attr]
    assert apply(snap, d).incidents["a.1"].stage is L.REPLAN


def test_tick_after_a_failed_transition_with_nothing_left_to_isolate_asks_the_operator() -> None:
    snap = two_tasks(Policy(max_process_restarts=0))
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    snap = apply(snap, plan_transition(snap, plan({"a": 2, "b": 4}), render, T0))
    d = on_tick(snap, T0 + POLICY.transition_timeout_s)
    snap = apply(snap, d)
    assert snap.incidents["a.1"].stage is L.ESCALATED_TO_OPERATOR
    assert of_kind(d.actions, NotifyOperator) and not of_kind(d.actions, DrainNode)


# --- breakers -------------------------------------------------------------------------


def _crash_and_resume(snap: Snapshot, i: int, now: float, iteration: int) -> tuple[Snapshot, Decision]:
    d = on_finding(snap, finding(f"f{i}", 1, "n1", E.OTHER_SOFTWARE_ERROR), now)
    snap = apply(snap, d)
    if snap.tasks["a"].state is TaskState.RECOVERING:
        snap = apply(snap, on_progress(snap, "a", iteration, now + 1))
    return snap, d


def test_no_progress_breaker_stops_the_task_and_tells_the_operator() -> None:
    snap, limit = two_tasks(), POLICY.no_progress_limit
    for i in range(limit):  # each restart resumes, but training never passes iteration 10
        snap, d = _crash_and_resume(snap, i, T0 + 100 * i, iteration=5)
        assert commands(d, AgentAction.RESTART_RANKS), i
    assert snap.tasks["a"].recoveries_without_progress == limit
    snap, d = _crash_and_resume(snap, limit, T0 + 100 * limit, iteration=5)
    assert snap.tasks["a"].state is TaskState.STOPPED
    assert not commands(d, AgentAction.RESTART_RANKS)
    assert sorted(commands(d, AgentAction.STOP)) == [("n1", 1), ("n2", 1)]
    notes = of_kind(d.actions, NotifyOperator)
    assert len(notes) == 1 and "no-progress breaker" in notes[0].why  # type: ignore[union-attr]
    assert snap.incidents[f"a.{limit + 1}"].stage is L.ESCALATED_TO_OPERATOR
    assert on_finding(snap, finding("late", 1, "n1", E.CUDA_ERROR), T0 + 10**4).empty


def test_progress_past_the_mark_keeps_the_breaker_closed_but_the_budget_still_counts() -> None:
    snap = two_tasks(Policy(recovery_budget=4))
    for i in range(4):
        snap, _ = _crash_and_resume(snap, i, T0 + 100 * i, iteration=20 + i)
        assert snap.tasks["a"].state is TaskState.RUNNING
    assert snap.tasks["a"].recoveries_without_progress == 0
    snap, d = _crash_and_resume(snap, 9, T0 + 500, iteration=99)
    assert snap.tasks["a"].state is TaskState.STOPPED
    assert "budget" in of_kind(d.actions, NotifyOperator)[0].why  # type: ignore[union-attr]
    # An hour later the old recoveries have left the window.
    later = two_tasks(Policy(recovery_budget=4))
    later = replace(later, tasks={**later.tasks, "a": replace(later.tasks["a"], recovery_times_s=(T0,) * 4)})
    d = on_finding(later, finding("x", 1, "n1", E.CUDA_ERROR), T0 + POLICY.budget_window_s)
    assert commands(d, AgentAction.RESTART_RANKS)


@pytest.mark.parametrize("layout", ["one task on 20 nodes", "20 one-node tasks"])
def test_storm_of_sev1_findings_drains_at_most_the_limit_and_notifies(layout: str) -> None:
    if layout == "one task on 20 nodes":
        tasks = [task("big", 1, [f"n{i}" for i in range(1, 21)])]
    else:
        tasks = [task(f"t{i}", i, [f"n{i}"]) for i in range(1, 21)]
    snap = world(24, tasks)
    limit = POLICY.drain_limit(24)
    drained: list[str] = []
    notified = 0
    for i in range(1, 21):  # 20 findings within a minute, each on another node
        job = 1 if layout == "one task on 20 nodes" else i
        d = on_finding(snap, finding(f"f{i}", job, f"n{i}", E.ECC_ERROR), T0 + 3 * i)
        snap = apply(snap, d)
        drained += [a.node for a in of_kind(d.actions, DrainNode)]  # type: ignore[union-attr]
        notified += len(of_kind(d.actions, NotifyOperator))
    assert len(drained) == limit == 6
    assert notified >= 1
    in_service = [n for n in snap.nodes.values() if n.health in (NodeHealth.HEALTHY, NodeHealth.SUSPECT)]
    assert len(in_service) == 24 - limit
    waiting = [i for i in snap.incidents.values() if i.stage is L.ESCALATED_TO_OPERATOR]
    assert waiting and all("drain limit" in i.note for i in waiting)
    # The window slides: after it, drains are allowed again.
    d = on_finding(snap, finding("later", None, "n23", E.LOST_CONNECTION), T0 + 60 + POLICY.drain_window_s)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n23"]  # type: ignore[union-attr]


def test_operator_confirms_a_held_back_drain() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"])])  # limit: 1 drain
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n1", E.ECC_ERROR), T0))
    d = on_finding(snap, finding("f2", 2, "n3", E.GPU_DRIVER_ERROR), T0 + 5)
    snap = apply(snap, d)
    assert not of_kind(d.actions, DrainNode) and of_kind(d.actions, NotifyOperator)
    assert snap.nodes["n3"].health is NodeHealth.SUSPECT
    assert snap.incidents["b.1"].pending_drain == "n3"
    with pytest.raises(InvalidArgument, match="no drain waiting"):
        on_operator_confirm_drain(snap, "a.1", T0 + 6)
    d = on_operator_confirm_drain(snap, "b.1", T0 + 6)
    snap = apply(snap, d)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n3"]  # type: ignore[union-attr]
    assert of_kind(d.actions, Replan)
    assert snap.incidents["b.1"].stage is L.REPLAN and snap.nodes["n3"].health is NodeHealth.DRAINING


# --- idempotency ------------------------------------------------------------------------


def test_same_finding_twice_changes_nothing_and_ids_are_stable() -> None:
    snap = two_tasks()
    f = finding("1700000000000-0", 1, "n2", E.ECC_ERROR)
    first = on_finding(snap, f, T0)
    assert on_finding(snap, f, T0) == first, "same snapshot, same input: same decision and ids"
    assert on_finding(snap, f, T0 + 30).action_ids() == first.action_ids(), "ids do not depend on the clock"
    after = apply(snap, first)
    again = on_finding(after, f, T0 + 1)
    assert again.empty and "already handled" in again.notes[0]


findings = st.builds(
    lambda i, job, node, status, died: finding(f"e{i}", job, f"n{node}", status, rank_died=died),
    st.integers(0, 30),
    st.sampled_from([1, 2, None]),
    st.integers(1, 4),
    st.sampled_from([s for s in ErrorStatus if s is not ErrorStatus.NONE]),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(findings, st.floats(0, 40)), max_size=12), st.integers(0, 11))
def test_replaying_any_event_never_repeats_an_action(
    events: list[tuple[Finding, float]], replay: int
) -> None:
    """Apply a stream of findings and progress; a redelivered finding adds no action."""
    snap, now, done = two_tasks(), T0, set()
    drained: list[str] = []
    for i, (f, dt) in enumerate(events):
        now += dt
        d = on_finding(snap, f, now)
        assert not (set(d.action_ids()) & done), "an action id was issued twice"
        done |= set(d.action_ids())
        drained += [a.node for a in of_kind(d.actions, DrainNode)]  # type: ignore[union-attr]
        snap = apply(snap, d)
        if i == replay:
            assert not on_finding(snap, f, now + 1).actions
        if i % 3 == 2:
            for tid in ("a", "b"):
                snap = apply(snap, p := on_progress(snap, tid, 10 + i, now + 0.5))
                done |= set(p.action_ids())
    assert len(drained) == len(set(drained)), "no node drained twice"
    assert len(drained) <= POLICY.drain_limit(len(snap.nodes)) or now - T0 >= POLICY.drain_window_s


# --- membership -------------------------------------------------------------------------


def test_node_join_runs_the_check_then_replans() -> None:
    snap = two_tasks()
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    snap = apply(snap, on_node_drained(snap, "n2", T0 + 1))
    assert snap.nodes["n2"].health is NodeHealth.DRAINED
    d = on_node_join(snap, "n2", T0 + 100)
    snap = apply(snap, d)
    assert [type(a) for a in d.actions] == [CheckNode] and snap.nodes["n2"].health is NodeHealth.RETURNING
    assert on_node_join(snap, "n2", T0 + 101).empty, "a second join while returning changes nothing"
    d = on_node_check(snap, "n2", True, T0 + 102)
    snap = apply(snap, d)
    assert snap.nodes["n2"].health is NodeHealth.HEALTHY
    assert [type(a) for a in d.actions] == [Replan]


def test_failed_node_check_drains_again() -> None:
    snap = world(2, [])
    snap = apply(snap, on_node_join(snap, "n9", T0))  # a new node
    assert snap.nodes["n9"].health is NodeHealth.RETURNING
    d = on_node_check(snap, "n9", False, T0 + 1, detail="nvidia-smi: GPU 1 missing")
    snap = apply(snap, d)
    reasons = [a.reason for a in of_kind(d.actions, DrainNode)]  # type: ignore[union-attr]
    assert reasons == ["unicorn: node_check_failed nvidia-smi: GPU 1 missing"]
    assert snap.nodes["n9"].health is NodeHealth.DRAINING and len(snap.nodes["n9"].failures_s) == 1


def test_a_node_failing_repeatedly_stays_drained_until_an_operator_resumes_it() -> None:
    pol = Policy(node_failure_limit=2, drain_window_s=1.0)
    snap, now = world(4, [task("a", 1, ["n1", "n2"])], pol), T0
    for round_ in range(2):
        snap = apply(snap, on_finding(snap, finding(f"f{round_}", 1, "n2", E.ECC_ERROR), now))
        snap = apply(snap, on_node_drained(snap, "n2", now + 1))
        if round_ == 0:
            snap = apply(snap, on_node_join(snap, "n2", now + 10))
            snap = apply(snap, on_node_check(snap, "n2", True, now + 11))
            snap = apply(snap, plan_transition(snap, plan({"a": 4}), render, now + 12))
            snap = apply(snap, on_progress(snap, "a", 50, now + 20))
        now += 1000
    assert snap.nodes["n2"].held
    d = on_node_join(snap, "n2", now)
    snap = apply(snap, d)
    assert [type(a) for a in d.actions] == [DrainNode, NotifyOperator]
    assert snap.nodes["n2"].health is NodeHealth.DRAINED
    d = on_node_join(snap, "n2", now + 1, by_operator=True)
    snap = apply(snap, d)
    assert [type(a) for a in d.actions] == [ResumeNode, CheckNode]
    assert not snap.nodes["n2"].held and snap.nodes["n2"].health is NodeHealth.RETURNING


def test_join_without_node_check_replans_at_once() -> None:
    snap = world(2, [], Policy(node_check_on_join=False))
    d = on_node_join(snap, "n5", T0)
    assert [type(a) for a in d.actions] == [Replan]
    assert apply(snap, d).nodes["n5"].health is NodeHealth.HEALTHY


def test_task_arrival_and_end_trigger_replans() -> None:
    snap = two_tasks()
    new = task("c", 3, [], state=TaskState.PENDING)
    d = on_task_arrived(snap, new, T0)
    assert [a.action_id for a in d.actions] == ["task/c/arrived"]
    snap = apply(snap, d)
    assert on_task_arrived(snap, new, T0).empty
    with pytest.raises(InvalidArgument, match="already registered"):
        on_task_arrived(snap, replace(new, weight=2.0), T0)
    snap = apply(snap, on_finding(snap, finding("f", 1, "n1", E.CUDA_ERROR), T0))
    d = on_task_finished(snap, "a", T0 + 1)
    snap = apply(snap, d)
    assert snap.tasks["a"].state is TaskState.FINISHED and snap.tasks["a"].nodes == ()
    assert snap.incidents["a.1"].stage is L.CLOSED
    assert {type(a) for a in d.actions} == {CloseIncident, Replan}
    assert snap.owner("n1") is None
    assert on_task_finished(snap, "a", T0 + 2).empty
    with pytest.raises(InvalidArgument, match="unknown task"):
        on_task_finished(snap, "zzz", T0)


def test_findings_that_no_longer_apply_are_ignored() -> None:
    snap = two_tasks()
    assert on_finding(snap, finding("f1", 99, "n1", E.ECC_ERROR), T0).actions == ()
    assert on_finding(snap, finding("f2", 1, "n3", E.ECC_ERROR), T0).actions == (), "node of another task"
    idle = world(3, [task("a", 1, ["n1"])])
    d = on_finding(idle, finding("f3", None, "n3", E.LOST_CONNECTION), T0)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n3"]  # type: ignore[union-attr]
    assert apply(idle, d).incidents["node.n3.f3"].stage is L.CLOSED
    assert on_finding(idle, finding("f4", None, "n3", E.CUDA_ERROR, severity=Severity.SEV2), T0).actions == ()


def test_a_node_drained_outside_unicorn_is_not_drained_again() -> None:
    snap = two_tasks()
    snap = apply(snap, on_node_drained(snap, "n2", T0, reason="admin: bad fan"))
    d = on_finding(snap, finding("f1", 1, "n2", E.LOST_CONNECTION), T0 + 1)
    snap = apply(snap, d)
    assert not of_kind(d.actions, DrainNode) and of_kind(d.actions, Replan)
    assert snap.incidents["a.1"].stage is L.REPLAN and snap.nodes["n2"].reason == "admin: bad fan"


def test_finding_from_a_detect_classification() -> None:
    from detect.classify import BENIGN, Classification

    c = Classification(E.ECC_ERROR, Severity.SEV1, "xid-48", "Xid 48: DBE", secondary=False)
    f = Finding.of(c, finding_id="1-0", job_id=1, node="n2", rank=3, rank_died=True, confirmed_by="nvml")
    assert f is not None and (f.status, f.severity, f.rule, f.evidence, f.rank, f.confirmed_by) == (
        E.ECC_ERROR, Severity.SEV1, "xid-48", "Xid 48: DBE", 3, "nvml",
    )  # fmt: skip
    assert Finding.of(BENIGN, finding_id="1-1", job_id=1, node="n2") is None
    d = on_finding(two_tasks(), f, T0)
    assert [a.reason for a in of_kind(d.actions, DrainNode)] == [
        "unicorn: ecc_error a.1 xid-48 rank 3: Xid 48: DBE"
    ]  # type: ignore[union-attr]
    # The same line printed by a rank, with nothing out of band behind it: restart in place.
    printed = Finding.of(c, finding_id="1-2", job_id=1, node="n2", rank=3, rank_died=True)
    assert printed is not None and printed.confirmed_by == ""
    d = on_finding(two_tasks(), printed, T0)
    assert not of_kind(d.actions, DrainNode) and not of_kind(d.actions, CheckNode)
    assert sorted(n for n, _ in commands(d, AgentAction.RESTART_RANKS)) == ["n1", "n2"]


def test_only_a_node_confirmed_dead_is_set_down_before_the_drain() -> None:
    """Unreachable over SSH, or NOT_RESPONDING in slurmctld's view while its agent is silent:
    DOWN first, so the job loses the node before any requeue (Slurm 22.05 starts a job
    requeued while a node of it still completes with an empty GRES allocation)."""
    snap = two_tasks()
    lost = replace(finding("f1", 1, "n2", E.LOST_CONNECTION), rule=SSH_UNREACHABLE)
    by_slurm = replace(finding("f4", 1, "n2", E.LOST_CONNECTION), rule=SLURM_NOT_RESPONDING)
    silent = finding("f2", 1, "n2", E.LOST_CONNECTION)  # heartbeat only: unconfirmed
    ecc = finding("f3", 1, "n2", E.ECC_ERROR)
    drains = [of_kind(on_finding(snap, f, T0).actions, DrainNode) for f in (lost, by_slurm, silent, ecc)]
    assert [[a.down for a in d] for d in drains] == [[True], [True], [False], [False]]  # type: ignore[attr-defined]


def test_the_same_code_error_after_a_restart_stops_the_task_and_drains_nothing() -> None:
    """A deterministic bug in the training code raises again after the restart: that is not
    the node's fault, so the task stops and the operator is told; no node is drained."""
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    first = replace(
        finding("e1", 1, "n2", E.OTHER_SOFTWARE_ERROR, rank=1),
        evidence="ValueError: shapes (4, 16) and (8, 16) not aligned at iteration 12",
    )
    snap = apply(snap, on_finding(snap, first, T0))
    assert snap.incidents["a.1"].stage is L.RESTART_PROCESSES
    again = replace(
        first, finding_id="e2", evidence="ValueError: shapes (4, 16) and (8, 16) not aligned at iteration 13"
    )
    d = on_finding(snap, again, T0 + snap.policy.settle_s + 1)
    after = apply(snap, d)
    assert after.tasks["a"].state is TaskState.STOPPED
    assert after.incidents["a.1"].stage is L.ESCALATED_TO_OPERATOR
    assert "an error of the training code" in after.incidents["a.1"].note
    assert not of_kind(d.actions, DrainNode)
    assert all(n.health is NodeHealth.HEALTHY for n in after.nodes.values())
    # A CUDA error after the restart can be the GPU's: the node check runs before any drain.
    other = replace(
        again,
        finding_id="e3",
        status=E.CUDA_ERROR,
        evidence="RuntimeError: CUDA error: unspecified launch failure",
        confirmed_by="",
    )
    d = on_finding(snap, other, T0 + snap.policy.settle_s + 1)
    assert not of_kind(d.actions, DrainNode)
    assert [a.node for a in of_kind(d.actions, CheckNode)] == ["n2"]  # type: ignore[union-attr]


def test_a_held_back_drain_of_a_node_confirmed_dead_is_set_down_when_the_operator_confirms() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"])])  # limit: 1 drain
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n1", E.ECC_ERROR), T0))
    dead = replace(finding("f2", 2, "n3", E.LOST_CONNECTION), rule=SLURM_NOT_RESPONDING)
    snap = apply(snap, on_finding(snap, dead, T0 + 5))
    assert snap.incidents["b.1"].pending_drain == "n3"
    d = on_operator_confirm_drain(snap, "b.1", T0 + 6)
    assert [(a.node, a.down) for a in of_kind(d.actions, DrainNode)] == [("n3", True)]  # type: ignore[union-attr]


def test_a_wait_in_place_during_start_up_waits_as_long_as_a_launch_may_take() -> None:
    # A benign SEV3 line printed while the ranks load and rendezvous (the safety bench saw it
    # restart the node's ranks, then the whole task, after 60 s): before the launch's first
    # iteration, no iteration is no evidence; the wait gets transition_timeout_s.
    launched = T0 - 5
    snap = world(4, [task("a", 1, ["n1", "n2"], launched_s=launched, last_iteration=None)])
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.CONNECTION_REFUSED_RESET), T0))
    assert snap.incidents["a.1"].stage is L.RETRY_IN_PLACE
    assert POLICY.transition_timeout_s > POLICY.retry_timeout_s
    assert on_tick(snap, T0 + POLICY.retry_timeout_s).empty
    assert on_tick(snap, T0 + POLICY.transition_timeout_s - 1).empty
    d = on_tick(snap, T0 + POLICY.transition_timeout_s)
    assert commands(d, AgentAction.RESTART_RANKS) == [("n2", 1)], "a start-up that never iterates climbs"
    # an iteration during the start-up wait closes the incident, as after any wait
    d = on_progress(snap, "a", 1, T0 + 100)
    assert [a.incident_id for a in of_kind(d.actions, CloseIncident)] == ["a.1"]  # type: ignore[union-attr]


def test_once_a_relaunch_iterates_below_the_old_mark_a_wait_in_place_has_the_usual_timeout() -> None:
    # A relaunch resumes from a checkpoint below the task's highest iteration (1000): its
    # first iteration ends the start-up, whatever its number (the mark does not move).
    launched = T0 - 400
    snap = world(4, [task("a", 1, ["n1", "n2"], launched_s=launched, last_iteration=1000)])
    for i, it in enumerate(range(900, 950)):
        snap = apply(snap, on_progress(snap, "a", it, launched + 10 + i))
    assert snap.tasks["a"].last_iteration == 1000 and snap.tasks["a"].first_iteration_s == launched + 10
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.CONNECTION_REFUSED_RESET), T0))
    d = on_tick(snap, T0 + POLICY.retry_timeout_s)
    assert commands(d, AgentAction.RESTART_RANKS) == [("n2", 1)]
    # the next launch starts again: its own first iteration is still to come
    relaunched = replace(snap.tasks["a"], launched_s=T0 + 1)
    assert relaunched.first_iteration_s is not None and relaunched.first_iteration_s <= T0 + 1
    again = apply(snap, on_progress(replace(snap, tasks={"a": relaunched}), "a", 901, T0 + 2))
    assert again.tasks["a"].first_iteration_s == T0 + 2
