"""Roll back past a loss spike or NaN (issue 23, item 2): the pure decision, its rendering
for both trainers, and the records it leaves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from detect.classify import load_classifier
from detect.statuses import ErrorStatus, Severity
from plan.hardware import gpu_spec
from plan.objective import FailureModel
from tests.unicornd.coord_world import MODEL, apply, finding, of_kind, task, world
from unicorn_core.config import AgentConfig, DetectConfig
from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.layout import Layout
from unicorn_core.protocol import AgentAction, FaultReport, ProcessExit
from unicornd.actions import NotifyOperator, RollBack, SendCommand
from unicornd.decide import Finding, on_finding, on_progress, resolve
from unicornd.detector import Detector, JobEvidence
from unicornd.launch import render_task, renderer
from unicornd.replan import PlanContext
from unicornd.state import Incident, LadderStage, Rollback, Snapshot, TaskRecord, TaskState
from unicornd.store import snapshot_from_json, snapshot_to_json

T0 = 1_700_000_000.0
AGENT = AgentConfig(bin_dir="/opt/u/bin", rendezvous_host="h")
CTX = PlanContext(gpu_spec("a100-80g"), FailureModel(24.0), lambda gpn, gen: renderer(AGENT, gpn, gen))
NODES = ("n1", "n2")


def snap() -> Snapshot:
    return world(3, [task("a", 1, NODES, last_iteration=45)])


def spike(
    fid: str,
    iteration: int,
    *,
    status: ErrorStatus = ErrorStatus.LOSS_SPIKE,
    launch_id: str = "plan-0/a/launch",
    span: int = 1,
) -> Finding:
    base = finding(fid, 1, "n2", status, rank=3)
    return replace(
        base,
        evidence=f"loss 9.1 at iteration {iteration} is 4.2x the running median",
        iteration=iteration,
        span=span,
        launch_id=launch_id,
    )


def rolled_back(k: int = 40) -> tuple[Snapshot, Rollback]:
    """The snapshot after a spike at ``k`` was decided and resolved, and its roll back."""
    s = snap()
    d = resolve(s, on_finding(s, spike("f1", k), T0), CTX, T0)
    s = apply(s, d)
    return s, s.tasks["a"].rollbacks[-1]


def test_a_spike_rolls_back_past_its_iteration_on_every_node_and_skips_its_data() -> None:
    s = snap()
    d = on_finding(s, spike("f1", 40), T0)
    backs = [a for a in d.actions if isinstance(a, RollBack)]
    assert sorted(b.node for b in backs) == list(NODES)
    after = apply(s, d)
    (rb,) = after.tasks["a"].rollbacks
    assert (rb.first, rb.last, rb.iteration) == (40, 40, 40)
    inc = after.incidents["a.1"]
    assert inc.rollback == rb and inc.stage is LadderStage.RESTART_PROCESSES
    assert "older than iteration 40" in inc.note and "40-40" in inc.note
    assert after.tasks["a"].state is TaskState.RECOVERING
    # resolved: a relaunch of the same command with the skipped range, nothing else
    resolved = resolve(s, d, CTX, T0)
    assert not of_kind(resolved.actions, RollBack)
    sends = [a for a in of_kind(resolved.actions, SendCommand) if isinstance(a, SendCommand)]
    assert {a.node for a in sends} == set(NODES)
    for send in sends:
        assert send.action is AgentAction.RELAUNCH
        assert send.action_id.startswith(rb.launch)
        assert send.argv[-1] == "--skip-iterations=40-40"
        assert "--iterations" in send.argv  # the task's own command is kept


def test_a_megatron_report_spanning_several_iterations_skips_all_of_them() -> None:
    s = snap()
    d = on_finding(s, spike("f1", 40, status=ErrorStatus.NAN_LOSS, span=5), T0)
    (rb,) = apply(s, d).tasks["a"].rollbacks
    assert (rb.first, rb.last) == (36, 40)


def test_a_grad_norm_explosion_restarts_in_place_without_a_roll_back() -> None:
    s = snap()
    d = on_finding(s, spike("f1", 40, status=ErrorStatus.GRAD_NORM_EXPLOSION), T0)
    assert not of_kind(d.actions, RollBack)
    assert {a.action for a in d.actions if isinstance(a, SendCommand)} == {AgentAction.RESTART_RANKS}
    assert not apply(s, d).tasks["a"].rollbacks


def test_the_first_iteration_of_the_rolled_back_ranks_records_the_restored_version() -> None:
    s, rb = rolled_back(40)
    launch = f"{rb.launch}n2"
    # a late iteration of the replaced ranks proves nothing
    assert on_progress(s, "a", 46, T0 + 1, launch_id="plan-0/a/launch").incidents == ()
    d = on_progress(s, "a", 31, T0 + 2, launch_id=launch)
    after = apply(s, d)
    inc = after.incidents["a.1"]
    assert inc.stage is LadderStage.CLOSED
    assert inc.rollback is not None and inc.rollback.version == 30
    assert after.tasks["a"].rollbacks[-1].version == 30
    assert "rolled back to version 30, iterations 40-40 skipped" in inc.note
    assert after.tasks["a"].state is TaskState.RUNNING


def test_no_saved_version_older_than_the_spike_is_a_restart_from_the_initial_state() -> None:
    """The trainer found no version older than the spike in any tier: it starts from its
    initial (seeded) state and says so; unicornd records version 0 and why."""
    s, rb = rolled_back(7)
    after = apply(s, on_progress(s, "a", 1, T0 + 2, launch_id=f"{rb.launch}n1"))
    inc = after.incidents["a.1"]
    assert inc.rollback is not None and inc.rollback.version == 0
    assert "initial state (no saved version older than iteration 7" in inc.note


def test_ranks_that_did_not_roll_back_record_no_version() -> None:
    """A first iteration at or past the spike: the ranks did not restore an older version
    (e.g. a trainer without the option); the incident says the version is unknown."""
    s, rb = rolled_back(40)
    after = apply(s, on_progress(s, "a", 41, T0 + 2, launch_id=f"{rb.launch}n1"))
    inc = after.incidents["a.1"]
    assert inc.rollback is not None and inc.rollback.version is None
    assert "version unknown" in inc.note


def test_a_repeated_spike_at_the_same_data_stops_the_task_with_the_reason() -> None:
    s, rb = rolled_back(40)
    s = apply(s, on_progress(s, "a", 31, T0 + 2, launch_id=f"{rb.launch}n2"))
    # the data right after the skipped range spikes too: the same bad stretch
    d = on_finding(s, spike("f2", 41, launch_id=f"{rb.launch}n2"), T0 + 30)
    after = apply(s, d)
    assert not of_kind(d.actions, RollBack)
    assert after.tasks["a"].state is TaskState.STOPPED
    inc = after.incidents["a.2"]
    assert inc.stage is LadderStage.ESCALATED_TO_OPERATOR
    assert "repeated loss spike at iteration 41 after rollback" in inc.note
    assert "iterations 40-40 skipped, restored version 30" in inc.note
    (notice,) = [a for a in d.actions if isinstance(a, NotifyOperator)]
    assert "repeated loss spike at iteration 41 after rollback" in notice.why
    stops = [a for a in d.actions if isinstance(a, SendCommand) and a.action is AgentAction.STOP]
    assert len(stops) == len(NODES)


def test_a_repeat_while_the_roll_back_is_still_open_stops_its_incident() -> None:
    s, rb = rolled_back(40)
    d = on_finding(s, spike("f2", 40, launch_id=f"{rb.launch}n1"), T0 + 1)
    after = apply(s, d)
    assert after.tasks["a"].state is TaskState.STOPPED
    assert "repeated loss spike at iteration 40 after rollback" in after.incidents["a.1"].note
    assert not of_kind(d.actions, RollBack)


def test_a_spike_of_the_replaced_ranks_is_ignored_and_a_new_one_later_rolls_back_again() -> None:
    s, rb = rolled_back(40)
    stale = on_finding(s, spike("f2", 44, launch_id="plan-0/a/launch"), T0 + 1)
    assert stale.actions == () and stale.tasks == () and "replaces; ignored" in stale.notes[0]
    s = apply(s, on_progress(s, "a", 31, T0 + 2, launch_id=f"{rb.launch}n2"))
    d = on_finding(s, spike("f3", 70, launch_id=f"{rb.launch}n2"), T0 + 60)
    after = apply(s, d)
    assert len(of_kind(d.actions, RollBack)) == len(NODES)
    assert after.tasks["a"].skip_ranges() == ((40, 40), (70, 70))
    resolved = resolve(s, d, CTX, T0 + 60)
    send = next(a for a in resolved.actions if isinstance(a, SendCommand))
    assert send.argv[-1] == "--skip-iterations=40-40,70-70"


def test_the_records_round_trip_and_old_snapshots_without_them_still_load() -> None:
    s, _rb = rolled_back(40)
    again = snapshot_from_json(snapshot_to_json(s), s.policy)
    assert again.tasks["a"].rollbacks == s.tasks["a"].rollbacks
    assert again.incidents["a.1"].rollback == s.incidents["a.1"].rollback
    old_task = s.tasks["a"].to_dict()
    del old_task["rollbacks"]
    assert TaskRecord.from_dict(old_task).rollbacks == ()
    old_inc = s.incidents["a.1"].to_dict()
    del old_inc["rollback"]
    assert Incident.from_dict(old_inc).rollback is None


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"first": 0}, InvalidArgument),
        ({"last": 39}, InvalidArgument),
        ({"version": 40}, InvalidArgument),
        ({"first": "40"}, ProtocolError),
    ],
)
def test_a_bad_stored_roll_back_is_refused_on_decode(
    change: dict[str, object], error: type[Exception]
) -> None:
    s, _rb = rolled_back(40)
    data = s.tasks["a"].to_dict()
    data["rollbacks"][0].update(change)
    with pytest.raises(error):
        TaskRecord.from_dict(data)


def test_rendering_appends_each_trainers_own_skip_flag() -> None:
    rollbacks = (
        Rollback(40, 40, 40, "a.1", "a.1/restart_processes/1/rollback/", T0),
        Rollback(36, 38, 38, "a.2", "a.2/restart_processes/1/rollback/", T0),
    )
    cfg = AGENT
    layout = Layout(tp=1, pp=1, dp=2, micro_batch=1, global_batch=MODEL.global_batch)
    base = TaskRecord("a", "a", MODEL, ("unicorn-train", "--iterations=100"), job_id=1, nodes=("n1",))
    builtin = render_task(
        replace(base, rollbacks=rollbacks), layout, ("n1",), cfg=cfg, gpus_per_node=2, generation=1
    )
    assert builtin["n1"][-1] == "--skip-iterations=36-38,40-40"
    assert not any(
        "skip" in t for t in render_task(base, layout, ("n1",), cfg=cfg, gpus_per_node=2, generation=1)["n1"]
    )
    megatron = replace(
        base,
        framework="megatron",
        command=("/w/pretrain_gpt.py", "--save", "/c", "--save-interval", "5", "--iterations-to-skip", "3"),
        rollbacks=rollbacks,
    )
    argv = render_task(megatron, layout, ("n1",), cfg=cfg, gpus_per_node=2, generation=1)["n1"]
    # Megatron numbers the step it is about to train by the steps done: log line k is k-1;
    # the user's own value is kept in the one flag (argparse keeps the last one only)
    at = argv.index("--iterations-to-skip")
    assert argv[at:] == ["--iterations-to-skip", "3", "35", "36", "37", "39"]
    assert argv.count("--iterations-to-skip") == 1
    # Megatron's rerun state machine must not resume a re-run saved before the NaN
    assert argv[at - 2 : at] == ["--rerun-mode", "disabled"]
    plain = render_task(
        replace(megatron, rollbacks=()), layout, ("n1",), cfg=cfg, gpus_per_node=2, generation=1
    )
    assert "--rerun-mode" not in plain["n1"]


def test_a_finding_with_a_bad_iteration_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        replace(spike("f1", 40), iteration=0)
    assert spike("f1", 3, span=5).bad_iterations() == (1, 3)
    assert (
        replace(spike("f1", 40), status=ErrorStatus.ECC_ERROR, severity=Severity.SEV1).bad_iterations()
        is None
    )


MEGATRON_NAN = (
    "ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 0 at iteration #12 "
    "invocation #1 (message='found NaN in local forward loss calculation')"
)
"""Megatron-LM 0.16.1's own line for a NaN loss (its default --rerun-mode validate_results);
it then re-runs the step, saves iteration 11 and exits 16 (tests/system/test_megatron_nan.py)."""


def megatron_finding(fid: str, found: JobEvidence) -> Finding:
    f = Finding.of(
        found.classification,
        finding_id=fid,
        job_id=found.job_id,
        node=found.evidence.node,
        rank=found.evidence.rank,
        rank_died=found.evidence.source == "exit",
        iteration=found.iteration,
        span=found.span,
        launch_id=found.launch_id,
    )
    assert f is not None
    return f


def test_megatrons_nan_line_rolls_back_and_its_ranks_exit_after_it_changes_nothing() -> None:
    """Megatron-LM prints no ``lm loss: nan`` line: the agent sends its NaN message as a
    fault report, which names the iteration; the rank's exit 16 that follows (its output
    holds the same line) comes from ranks before the roll back and is ignored, not taken
    for a repeat that would stop the task."""
    d = Detector(DetectConfig(), AGENT, load_classifier(None))
    line = FaultReport(
        job_id=1, node="n1", wall_time_s=T0, status="nan_loss", severity="SEV2", rule="training_nan",
        rank=None, evidence=MEGATRON_NAN,
    )  # fmt: skip
    (found,) = d.on_message(line, 10.0)
    assert (found.classification.status, found.iteration, found.span) == (ErrorStatus.NAN_LOSS, 12, 1)
    command = ("/w/pretrain_gpt.py", "--save", "/c", "--save-interval", "5")
    s = world(3, [task("a", 1, NODES, last_iteration=11, framework="megatron", command=command)])
    resolved = resolve(s, on_finding(s, megatron_finding("f1", found), T0), CTX, T0)
    s = apply(s, resolved)
    (rb,) = s.tasks["a"].rollbacks
    assert (rb.first, rb.last) == (12, 12) and s.incidents["a.1"].status is ErrorStatus.NAN_LOSS
    sends = [a for a in resolved.actions if isinstance(a, SendCommand)]
    assert {a.node for a in sends} == set(NODES)
    for send in sends:
        assert list(send.argv[-4:]) == ["--rerun-mode", "disabled", "--iterations-to-skip", "11"]

    tail = f"{MEGATRON_NAN}\nWARNING:megatron.core.rerun_state_machine:Saving a checkpoint and exiting now."
    exit16 = ProcessExit(
        job_id=1, node="n1", wall_time_s=T0 + 2, rank=0, local_rank=0, pid=99, exit_code=16, signal=None,
        error_file_text=None, stderr_tail=tail,
    )  # fmt: skip
    (again,) = d.on_message(exit16, 12.0)
    assert (again.classification.status, again.iteration) == (ErrorStatus.NAN_LOSS, 12)
    stale = on_finding(s, megatron_finding("f2", again), T0 + 2)
    assert stale.actions == () and stale.tasks == () and "from ranks before it; ignored" in stale.notes[0]

    # Megatron logs no line for the skipped iteration: its first line after restoring 11 is 13
    after = apply(s, on_progress(s, "a", 13, T0 + 12, launch_id=f"{rb.launch}n2"))
    inc = after.incidents["a.1"]
    assert inc.stage is LadderStage.CLOSED and inc.rollback is not None and inc.rollback.version == 11
    assert "rolled back to version 11, iterations 12-12 skipped" in inc.note
    assert after.tasks["a"].state is TaskState.RUNNING
    # Once the new ranks reported, the same NaN line is theirs (they did not skip it): a
    # repeat at the same data stops the task, with the reason.
    repeat = on_finding(after, megatron_finding("f3", again), T0 + 20)
    stopped = apply(after, repeat)
    assert stopped.tasks["a"].state is TaskState.STOPPED, repeat.notes


def test_the_rolled_back_ranks_naming_a_skipped_iteration_still_stop_the_task() -> None:
    """Only a report of unknown ranks naming skipped data is taken for an old one: the
    rolled-back ranks themselves reporting it (a trainer that did not skip) stop the task."""
    s, rb = rolled_back(40)
    mine = on_finding(s, spike("f2", 40, status=ErrorStatus.NAN_LOSS, launch_id=f"{rb.launch}n1"), T0 + 1)
    assert apply(s, mine).tasks["a"].state is TaskState.STOPPED
    unknown = on_finding(s, spike("f3", 40, status=ErrorStatus.NAN_LOSS, launch_id=""), T0 + 1)
    assert unknown.actions == () and "ignored" in unknown.notes[0]
    beyond = on_finding(s, spike("f4", 41, status=ErrorStatus.NAN_LOSS, launch_id=""), T0 + 1)
    assert apply(s, beyond).tasks["a"].state is TaskState.STOPPED  # right after the skipped data
