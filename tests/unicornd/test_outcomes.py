"""Outcomes flow back into decide: failed actions and agents' answers fail their rung at once,
refused resizes become requeues, requeues wait for the job in the snapshot, and the
requests a decision makes (replan, new agent) are resolved purely before commit."""

from __future__ import annotations

from dataclasses import replace

from detect.statuses import ErrorStatus
from plan.hardware import gpu_spec
from plan.objective import FailureModel
from tests.unicornd.coord_world import apply, finding, of_kind, plan, render, task, world
from unicorn_core.protocol import AgentAction
from unicornd.actions import (
    CheckNode,
    Decision,
    DrainNode,
    Grow,
    LaunchAgents,
    NotifyOperator,
    Outcome,
    OutcomeStatus,
    Replan,
    Requeue,
    RestartAgent,
    SendCommand,
)
from unicornd.decide import (
    on_finding,
    on_job_running,
    on_node_finished,
    on_node_join,
    on_outcome,
    on_tick,
    resolve,
)
from unicornd.replan import REQUEUE_QUEUED_LIMIT_S, REQUEUE_TIMEOUT_S, PlanContext, plan_transition
from unicornd.state import LadderStage, NodeHealth, Policy, Snapshot, TaskState

T0 = 1_700_000_000.0
L = LadderStage
CTX = PlanContext(gpu_spec("a100-80g"), FailureModel(24.0), lambda _gpn, _gen: render)


def failed(action_id: str, detail: str = "boom", node: str = "n1") -> Outcome:
    return Outcome(action_id, Outcome.AGENT_COMMAND, OutcomeStatus.FAILED, detail, node)


def restarting(status: ErrorStatus = ErrorStatus.OTHER_SOFTWARE_ERROR) -> tuple[Snapshot, str]:
    """Task a on n1,n2 after a SEV2 (``status``): restart_processes #1 (of 3) was ordered;
    the n1 command's id."""
    policy = Policy(max_process_restarts=3, no_progress_limit=10, recovery_budget=10)
    snap = world(4, [task("a", 1, ["n1", "n2"])], policy)
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n1", status, confirmed_by=""), T0))
    inc = snap.incidents["a.1"]
    assert inc.stage is L.RESTART_PROCESSES and inc.attempts_at(L.RESTART_PROCESSES) == 1
    return snap, "a.1/restart_processes/1/restart_ranks/n1"


def test_a_failed_restart_command_fails_its_rung_at_once_with_the_agent_error() -> None:
    snap, cmd = restarting()
    d = on_outcome(snap, failed(cmd, "FileNotFoundError: [Errno 2] No such file: '/nope'"), T0 + 0.5)
    inc = apply(snap, d).incidents["a.1"]
    # Long before restart_timeout_s: the rung failed on the agent's answer.
    assert inc.attempts_at(L.RESTART_PROCESSES) == 2
    assert any("No such file" in e.detail for e in inc.timeline)
    sent = [a.action_id for a in of_kind(d.actions, SendCommand)]
    assert sent == ["a.1/restart_processes/2/restart_ranks/n1", "a.1/restart_processes/2/restart_ranks/n2"]


def test_a_plan_start_that_fails_while_its_task_waits_in_place_climbs_to_a_restart() -> None:
    """Found in CI (the system test of a relaunch that cannot start): the old ranks'
    reactions to the relaunch's SIGTERM (SEV3 lines) opened an incident that waits in place
    just before the agent answered the relaunch failed. Only recorded, the task had no ranks
    and nothing happened until the wait timed out. A failed start climbs to a restart at once."""
    policy = Policy(max_process_restarts=1, no_progress_limit=10, recovery_budget=10)
    snap = world(4, [task("a", 1, ["n1", "n2"])], policy)
    sev3 = finding("f1", 1, "n1", ErrorStatus.OTHER_NETWORK_ERROR, confirmed_by="")
    snap = apply(snap, on_finding(snap, sev3, T0))
    assert snap.incidents["a.1"].stage is L.RETRY_IN_PLACE
    gen = snap.tasks["a"].generation
    d = on_outcome(snap, failed(f"plan-{gen}/a/relaunch/n1", "CommandNotFound: /nope/torchrun"), T0 + 0.3)
    snap = apply(snap, d)
    inc = snap.incidents["a.1"]
    assert inc.stage is L.RESTART_PROCESSES, inc.timeline
    assert any("CommandNotFound" in e.detail for e in inc.timeline)
    assert [a.action_id for a in of_kind(d.actions, SendCommand)] == [
        "a.1/restart_processes/1/restart_ranks/n1",
        "a.1/restart_processes/1/restart_ranks/n2",
    ]
    # The restart fails to start too: restarts are used up; a start error never isolates.
    d = on_outcome(snap, failed("a.1/restart_processes/1/restart_ranks/n1", "CommandNotFound"), T0 + 1)
    inc = apply(snap, d).incidents["a.1"]
    assert inc.stage is L.ESCALATED_TO_OPERATOR and "not isolating" in inc.note, inc.note
    assert not of_kind(d.actions, DrainNode) and not of_kind(d.actions, CheckNode)


def test_an_outcome_of_an_earlier_attempt_is_stale_and_only_recorded() -> None:
    snap, cmd = restarting()
    snap = apply(snap, on_outcome(snap, failed(cmd), T0 + 0.5))  # attempt 2 now
    d = on_outcome(snap, failed(cmd.replace("/n1", "/n2")), T0 + 0.6)  # attempt 1's other node
    assert not d.actions
    assert apply(snap, d).incidents["a.1"].attempts_at(L.RESTART_PROCESSES) == 2


def test_a_done_command_only_dates_the_settle_time_from_when_it_was_performed() -> None:
    snap, cmd = restarting()
    d = on_outcome(snap, Outcome(cmd, Outcome.AGENT_COMMAND, OutcomeStatus.DONE, "restarted"), T0 + 1)
    after = apply(snap, d)
    assert not d.actions and after.tasks == snap.tasks
    assert after.incidents["a.1"] == replace(snap.incidents["a.1"], last_action_s=T0 + 1)
    # an outcome that arrives dated earlier than the decision moves nothing back
    assert on_outcome(
        snap, Outcome(cmd, Outcome.AGENT_COMMAND, OutcomeStatus.DONE, "restarted"), T0 - 1
    ).empty


def test_the_consequence_of_a_restart_replayed_after_a_takeover_is_absorbed() -> None:
    """A new leader replays the finding that restarts the task at the finding's own time
    (T0) but performs the restart 8 s later; the old ranks' SIGKILL exit 5 s after that (a
    stopped rank, killed after the grace) is the restart's consequence, not a new failure.
    Dated from the decision it would be 13 s > settle_s = 10 s, and the task climbed to a
    node check and was stopped (the soak bench's cycle 26)."""
    snap, cmd = restarting()
    sent = Outcome(cmd, Outcome.AGENT_COMMAND, OutcomeStatus.DONE, "restart_ranks sent")
    snap = apply(snap, on_outcome(snap, sent, T0 + 8))
    killed = finding("f2", 1, "n1", ErrorStatus.EXITED_ABNORMALLY, confirmed_by="")
    d = on_finding(snap, killed, T0 + 13)
    after = apply(snap, d)
    assert not d.actions, d.actions
    assert after.incidents["a.1"].stage is L.RESTART_PROCESSES
    assert after.incidents["a.1"].attempts_at(L.RESTART_PROCESSES) == 1


def test_a_rank_of_the_restart_itself_that_dies_fails_the_restart_at_once() -> None:
    """The same exit 5 s after the restart was performed, but stamped with the restart's own
    launch: the ranks it started died (a checkpoint no rank could load, in CI), not the ones it
    replaced (those are stamped with the launch before and the detector drops them). Absorbed,
    the task had no ranks until restart_timeout_s; it climbs at once."""
    snap, cmd = restarting()
    sent = Outcome(cmd, Outcome.AGENT_COMMAND, OutcomeStatus.DONE, "restart_ranks sent")
    snap = apply(snap, on_outcome(snap, sent, T0 + 8))
    died = finding("f2", 1, "n1", ErrorStatus.EXITED_ABNORMALLY, rank_died=True, confirmed_by="")
    assert not on_finding(snap, died, T0 + 13).actions  # unknown or replaced launch: absorbed
    d = on_finding(snap, replace(died, current_launch=True), T0 + 13)
    after = apply(snap, d).incidents["a.1"]
    assert d.actions and after.attempts_at(L.RESTART_PROCESSES) == 2, (d.notes, after.stage)


def test_a_command_that_keeps_failing_to_start_asks_the_operator_and_drains_nothing() -> None:
    snap, _ = restarting()
    pol = snap.policy
    for attempt in range(1, pol.max_process_restarts + 1):
        aid = f"a.1/restart_processes/{attempt}/restart_ranks/n1"
        d = on_outcome(snap, failed(aid, "FileNotFoundError: '/nope/torchrun'"), T0 + attempt)
        snap = apply(snap, resolve(snap, d, CTX, T0 + attempt))
    inc = snap.incidents["a.1"]
    assert inc.stage is L.ESCALATED_TO_OPERATOR and not inc.isolated_nodes
    assert "fails to start" in inc.note and "not isolating n1" in inc.note
    assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())


def restarts_refused() -> Snapshot:
    """Task a after a CUDA error whose every restart command the stream refused (not the
    training command: the step onto n1): restarts used up."""
    snap, _ = restarting(ErrorStatus.CUDA_ERROR)
    for attempt in range(1, snap.policy.max_process_restarts + 1):
        aid = f"a.1/restart_processes/{attempt}/restart_ranks/n1"
        out = Outcome(aid, "send_command", OutcomeStatus.FAILED, "XADD refused")
        snap = apply(snap, resolve(snap, on_outcome(snap, out, T0 + attempt), CTX, T0 + attempt))
    return snap


def test_a_launch_that_srun_refuses_climbs_as_a_node_fault() -> None:
    """Not the training command but the step onto the node failed: the ladder climbs as usual."""
    snap = restarts_refused()
    # Restarts used up: the node check confirms before the drain.
    inc = snap.incidents["a.1"]
    assert inc.stage is L.ISOLATE and inc.pending_check == ("n1",)
    assert snap.nodes["n1"].health is NodeHealth.HEALTHY
    aid = f"a.1/isolate/{inc.attempts_at(L.ISOLATE)}/check/n1"
    sick = Outcome(
        aid, "check_node", OutcomeStatus.FAILED, "node check failed (exit 1): gpu 0", nodes=("n1",)
    )
    now = T0 + 60
    snap = apply(snap, resolve(snap, on_outcome(snap, sick, now), CTX, now))
    assert snap.nodes["n1"].health is NodeHealth.DRAINING


def test_a_node_that_passes_its_check_is_not_drained_and_the_task_stops() -> None:
    """Restarts used up on an unconfirmed fault and the node passes its check: the fault is
    not the node's; the task stops, the operator is told, nothing is drained."""
    snap = restarts_refused()
    inc = snap.incidents["a.1"]
    aid = f"a.1/isolate/{inc.attempts_at(L.ISOLATE)}/check/n1"
    stale = on_outcome(snap, Outcome("a.1/isolate/0/check/n1", "check_node", OutcomeStatus.DONE), T0 + 59)
    assert not stale.actions and apply(snap, stale).incidents["a.1"].stage is L.ISOLATE, "stale attempt"
    d = on_outcome(snap, Outcome(aid, "check_node", OutcomeStatus.DONE, "gpu: skipped; disk ok"), T0 + 60)
    snap = apply(snap, resolve(snap, d, CTX, T0 + 60))
    inc = snap.incidents["a.1"]
    assert inc.stage is L.ESCALATED_TO_OPERATOR and "passed the node check" in inc.note
    assert snap.tasks["a"].state is TaskState.STOPPED
    assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())
    assert not of_kind(d.actions, DrainNode)


def transition(snap: Snapshot, gpus: dict[str, int], now: float) -> tuple[Snapshot, Decision]:
    d = plan_transition(snap, plan(gpus), render, now)
    return apply(snap, d), d


def test_a_failed_relaunch_fails_the_transition_rung() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", ErrorStatus.ECC_ERROR), T0))
    snap, d = transition(snap, {"a": 2}, T0 + 1)
    assert snap.incidents["a.1"].stage is L.TRANSITION
    relaunch = next(a for a in of_kind(d.actions, SendCommand) if a.action is AgentAction.RELAUNCH)  # type: ignore[union-attr]
    d = on_outcome(snap, failed(relaunch.action_id, "rejected: relaunch without a training command"), T0 + 2)
    inc = apply(snap, d).incidents["a.1"]
    assert inc.stage is L.RESTART_PROCESSES
    assert any("relaunch without a training command" in e.detail for e in inc.timeline)


def test_a_failed_launch_of_a_healthy_task_opens_an_incident_on_that_node() -> None:
    snap = world(4, [task("a", 1, ["n1"]), task("b", 2, ["n3", "n4"])])
    snap, d = transition(snap, {"a": 4, "b": 4}, T0)
    relaunch = next(a for a in of_kind(d.actions, SendCommand) if a.action is AgentAction.RELAUNCH)  # type: ignore[union-attr]
    d = on_outcome(snap, failed(relaunch.action_id, "bad executable", "n1"), T0 + 1)
    after = apply(snap, d)
    inc = after.open_incident("a")
    assert inc is not None and inc.node == "n1" and inc.rule == "start_failed"
    assert after.tasks["a"].state is TaskState.RECOVERING


def test_a_refused_grow_becomes_a_requeue_and_voids_the_rest_of_the_plan() -> None:
    snap = world(4, [task("a", 1, ["n1"]), task("b", 2, ["n3", "n4"])])
    snap, d = transition(snap, {"a": 4, "b": 4}, T0)
    grow = of_kind(d.actions, Grow)[0]
    out = Outcome(grow.action_id, grow.kind, OutcomeStatus.UNSUPPORTED, "JobId=1 has allocated GRES")
    d = on_outcome(snap, out, T0 + 1)
    assert d.cancels == ("plan-1/a/",)
    assert [(type(a), a.nodes) for a in d.actions] == [(Requeue, ("n1", "n2"))]  # type: ignore[union-attr]
    snap = apply(snap, d)
    wait = snap.tasks["a"].requeue
    assert wait is not None and wait.action_id == "plan-1/a/grow/requeue" and wait.done_s is None
    # The job still RUNNING before the requeue is done: nothing yet.
    assert on_job_running(snap, 1, T0 + 2, T0 + 2, lambda _g: render).empty
    snap = apply(snap, on_outcome(snap, Outcome(wait.action_id, "requeue", OutcomeStatus.DONE), T0 + 3))
    # A poll started before the requeue returned does not count either.
    assert on_job_running(snap, 1, T0 + 2.5, T0 + 4, lambda _g: render).empty
    d = on_job_running(snap, 1, T0 + 4, T0 + 4, lambda _g: render)
    launch = of_kind(d.actions, LaunchAgents)
    assert [la.action_id for la in launch] == ["plan-1/a/grow/requeue/launch"]
    assert launch[0].nodes == ("n1", "n2")  # type: ignore[union-attr]
    assert apply(snap, d).tasks["a"].requeue is None


def test_findings_of_a_job_being_requeued_are_ignored_until_it_runs() -> None:
    snap = world(4, [task("a", 1, ["n1"]), task("b", 2, ["n3", "n4"])])
    snap, d = transition(snap, {"a": 4, "b": 4}, T0)
    grow = of_kind(d.actions, Grow)[0]
    snap = apply(snap, on_outcome(snap, Outcome(grow.action_id, "grow", OutcomeStatus.FAILED, "x"), T0 + 1))
    d = on_finding(snap, finding("f9", 1, "n1", ErrorStatus.EXITED_ABNORMALLY), T0 + 2)
    assert not d.actions and not d.incidents and "being requeued" in d.notes[0]
    assert on_node_finished(snap, 1, "n1", T0 + 2).empty


def test_a_requeue_that_never_runs_asks_the_operator_at_its_deadline() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("c", 3, [], state=TaskState.PENDING)])
    snap, _ = transition(snap, {"a": 4, "c": 4}, T0)
    wait = snap.tasks["c"].requeue
    assert wait is not None
    # Still queued behind other allocation changes (they run one at a time): no deadline
    # yet. Found by the 4,096-node hour: a deadline counted from the plan's commit passed
    # before the requeue ran; the wait ended, and the requeue that still ran then killed
    # the agents of a task unicornd no longer held as requeued.
    assert not on_tick(snap, T0 + 3 * REQUEUE_TIMEOUT_S).actions
    # A requeue never performed (its owed action lost) ends at the backstop.
    lost = on_tick(snap, T0 + REQUEUE_QUEUED_LIMIT_S + 1)
    assert [type(a) for a in lost.actions] == [NotifyOperator]
    done_at = T0 + 3 * REQUEUE_TIMEOUT_S
    snap = apply(snap, on_outcome(snap, Outcome(wait.action_id, "requeue", OutcomeStatus.DONE), done_at))
    assert not on_tick(snap, done_at + REQUEUE_TIMEOUT_S - 1).actions
    d = on_tick(snap, done_at + REQUEUE_TIMEOUT_S + 1)
    assert [type(a) for a in d.actions] == [NotifyOperator]
    assert apply(snap, d).tasks["c"].requeue is None


def test_a_failed_requeue_asks_the_operator() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("c", 3, [], state=TaskState.PENDING)])
    snap, _ = transition(snap, {"a": 4, "c": 4}, T0)
    d = on_outcome(
        snap, Outcome("plan-1/c/requeue", "requeue", OutcomeStatus.FAILED, "slurm said no"), T0 + 1
    )
    assert [type(a) for a in d.actions] == [NotifyOperator] and "slurm said no" in d.actions[0].why  # type: ignore[union-attr]


def test_node_check_outcome_decides_the_returning_node() -> None:
    snap = world(2, [])
    snap = apply(snap, on_node_join(snap, "n3", T0))
    check = of_kind(on_node_join(world(2, []), "n3", T0).actions, CheckNode)[0]
    ok = on_outcome(snap, Outcome(check.action_id, "check_node", OutcomeStatus.DONE, "ok"), T0 + 1)
    assert apply(snap, ok).nodes["n3"].health is NodeHealth.HEALTHY
    bad = on_outcome(snap, Outcome(check.action_id, "check_node", OutcomeStatus.FAILED, "gpu 0: ecc"), T0 + 1)
    assert apply(snap, bad).nodes["n3"].health is NodeHealth.DRAINING


def test_every_node_finishing_ends_the_task() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    d = on_node_finished(snap, 1, "n1", T0)
    snap = apply(snap, d)
    assert snap.tasks["a"].finished_nodes == ("n1",) and snap.tasks["a"].state is TaskState.RUNNING
    assert on_node_finished(snap, 1, "n1", T0).empty  # the same report again
    snap = apply(snap, on_node_finished(snap, 1, "n2", T0 + 1))
    assert snap.tasks["a"].state is TaskState.FINISHED


def test_a_restart_clears_finished_nodes() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"], finished_nodes=("n1",))])
    d = resolve(snap, on_finding(snap, finding("f", 1, "n2", ErrorStatus.OTHER_SOFTWARE_ERROR), T0), CTX, T0)
    assert apply(snap, d).tasks["a"].finished_nodes == ()


def test_resolve_replaces_replan_and_restart_agent_requests() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3"])])
    asked = Decision(
        actions=(
            RestartAgent("i/restart_agent/n2", "a", 1, "n2"),
            Replan("r1", "first"),
            Replan("r2", "second"),
        )
    )
    d = resolve(snap, asked, CTX, T0)
    assert not any(isinstance(a, Replan | RestartAgent) for a in d.actions)
    launch = d.actions[0]
    assert isinstance(launch, LaunchAgents) and launch.clear_commands
    assert launch.commands[0].argv == tuple(
        render(snap.tasks["a"], snap.tasks["a"].layout, ("n1", "n2"))["n2"]
    )  # type: ignore[arg-type]
    assert d.plan_generation == 1, "one replan for both requests"
    assert any(n.startswith("replan: first; second") for n in d.notes)


def test_a_restart_agent_for_a_node_the_task_left_is_dropped_with_a_note() -> None:
    snap = world(4, [task("a", 1, ["n1"])])
    d = resolve(snap, Decision(actions=(RestartAgent("x", "a", 1, "n4"),)), CTX, T0)
    assert not d.actions and "no longer runs on n4" in d.notes[0]


def test_an_unappliable_plan_is_noted_not_raised() -> None:
    snap = world(2, [replace(task("c", 3, [], state=TaskState.PENDING), job_id=None)])
    d = resolve(snap, Decision(actions=(Replan("r", "why"),)), CTX, T0)
    assert not d.actions and d.plan_generation is None
    assert any("replan not applied" in n and "no Slurm job" in n for n in d.notes)
