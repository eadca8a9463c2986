"""Confirm before isolating (issue 17): each row of the isolation gate as a decision."""

from __future__ import annotations

from dataclasses import replace

import pytest

from detect.isolation import CONFIRMED_BY, ISOLATION, Confirmation, Isolation, Verdict, confirms, verdict
from detect.statuses import ErrorStatus, Severity
from tests.unicornd.coord_world import apply, finding, of_kind, task, world
from unicornd.actions import CheckNode, DrainNode, Outcome, OutcomeStatus, RestartAgent, SendCommand
from unicornd.decide import HEARTBEAT_TIMEOUT, on_finding, on_outcome
from unicornd.state import LadderStage, NodeHealth, Policy, Snapshot, TaskState

E = ErrorStatus
L = LadderStage
T0 = 1_700_000_000.0


def snap3(max_restarts: int = 1) -> Snapshot:
    policy = Policy(max_process_restarts=max_restarts, no_progress_limit=10, recovery_budget=10)
    return world(6, [task("a", 1, ["n1", "n2", "n3"])], policy)


def test_the_table_never_isolates_for_the_training_code_and_names_a_source_for_the_rest() -> None:
    assert ISOLATION[E.OTHER_SOFTWARE_ERROR] is Isolation.NEVER
    assert ISOLATION[E.ILLEGAL_MEMORY_ACCESS] is Isolation.NEVER
    for status, row in ISOLATION.items():
        assert (row is Isolation.NEVER) == (not CONFIRMED_BY[status]), status
    assert E.NONE not in ISOLATION
    # Nothing the training process writes is a confirmation.
    for status in ISOLATION:
        assert not confirms(status, ""), status
        assert not confirms(status, "agent:nvlink_failure"), status
    assert verdict(E.LOST_CONNECTION, "slurm") is Verdict.DRAIN
    assert verdict(E.LOST_CONNECTION, "nvml") is Verdict.CHECK, "NVML says nothing about a silent node"
    assert verdict(E.ECC_ERROR, "ssh") is Verdict.CHECK, "reaching a node says nothing about its memory"
    assert verdict(E.ECC_ERROR, "kernel_log") is Verdict.DRAIN
    assert verdict(E.NCCL_TIMEOUT, "node_check") is Verdict.DRAIN
    assert verdict(E.OTHER_SOFTWARE_ERROR, "operator") is Verdict.NEVER


def test_a_sev1_line_the_training_printed_restarts_in_place_and_drains_nothing() -> None:
    snap = snap3()
    printed = replace(finding("f1", 1, "n2", E.NVLINK_ERROR, confirmed_by=""), evidence="NVLink errors: 3")
    d = on_finding(snap, printed, T0)
    after = apply(snap, d)
    assert not of_kind(d.actions, DrainNode) and not of_kind(d.actions, CheckNode)
    assert sorted(a.node for a in of_kind(d.actions, SendCommand)) == ["n1", "n2", "n3"]  # type: ignore[attr-defined]
    assert after.incidents["a.1"].stage is L.RESTART_PROCESSES
    assert any("not confirmed out of band" in n for n in d.notes)


@pytest.mark.parametrize(
    ("status", "source"),
    [
        (E.LOST_CONNECTION, Confirmation.SLURM),
        (E.LOST_CONNECTION, Confirmation.SSH),
        (E.ECC_ERROR, Confirmation.NVML),
        (E.GPU_DRIVER_ERROR, Confirmation.KERNEL_LOG),
    ],
)
def test_a_confirmed_node_fault_drains_at_once(status: ErrorStatus, source: Confirmation) -> None:
    snap = snap3()
    d = on_finding(snap, finding("f1", 1, "n2", status, confirmed_by=source.value), T0)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n2"]  # type: ignore[attr-defined]
    assert apply(snap, d).incidents["a.1"].stage is L.REPLAN


def test_unconfirmed_silence_starts_a_new_agent_and_drains_nothing() -> None:
    """Heartbeat lost, SSH off or unable to log in, Slurm still sees the node: restart the
    agent there; Slurm's NOT_RESPONDING (with the silence) is what confirms a dead node."""
    snap = snap3()
    silent = replace(
        finding("hb", 1, "n2", E.LOST_CONNECTION, confirmed_by=""), rule=HEARTBEAT_TIMEOUT, rank=None
    )
    d = on_finding(snap, silent, T0)
    assert not of_kind(d.actions, DrainNode)
    assert [a.node for a in of_kind(d.actions, RestartAgent)] == ["n2"]  # type: ignore[attr-defined]
    snap = apply(snap, d)
    dead = replace(silent, finding_id="slurm:n2:0:1", rule="slurm_not_responding", confirmed_by="slurm")
    d = on_finding(snap, dead, T0 + 8)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n2"]  # type: ignore[attr-defined]


def test_a_code_error_flagged_sev1_still_never_drains_and_stops_after_the_restarts() -> None:
    snap = snap3(max_restarts=1)
    bug = replace(
        finding("f1", 1, "n2", E.OTHER_SOFTWARE_ERROR, severity=Severity.SEV1),
        evidence="ValueError: bad config",
    )
    snap = apply(snap, on_finding(snap, bug, T0))
    assert snap.incidents["a.1"].stage is L.RESTART_PROCESSES
    d = on_finding(snap, replace(bug, finding_id="f2", node="n3"), T0 + 60)
    after = apply(snap, d)
    assert not of_kind(d.actions, DrainNode) and not of_kind(d.actions, CheckNode)
    assert after.tasks["a"].state is TaskState.STOPPED
    assert "never of a node" in after.incidents["a.1"].note
    assert all(n.health is NodeHealth.HEALTHY for n in after.nodes.values())


def nccl_timeouts_until_check(snap: Snapshot) -> tuple[Snapshot, CheckNode]:
    timeout = finding("f1", 1, "n1", E.NCCL_TIMEOUT, confirmed_by="")
    snap = apply(snap, on_finding(snap, timeout, T0))
    now = T0
    for i in range(2, 10):
        now += 60
        d = on_finding(snap, replace(timeout, finding_id=f"f{i}"), now)
        snap = apply(snap, d)
        checks = of_kind(d.actions, CheckNode)
        if checks:
            assert not of_kind(d.actions, DrainNode)
            return snap, checks[0]  # type: ignore[return-value]
    raise AssertionError("no check")


def test_a_collective_timeout_runs_the_paired_check_and_drains_the_node_it_names() -> None:
    """The rank on n1 reported the timeout; n3 stalled it. Only n3 is drained."""
    snap, check = nccl_timeouts_until_check(snap3())
    assert check.paired == ("n1", "n2", "n3") and check.job_id == 1
    assert snap.incidents["a.1"].pending_check == ("n1", "n2", "n3")
    out = Outcome(check.action_id, "check_node", OutcomeStatus.FAILED, "paired check: bad n3", nodes=("n3",))
    d = on_outcome(snap, out, T0 + 1000)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n3"]  # type: ignore[attr-defined]
    after = apply(snap, d)
    assert after.incidents["a.1"].isolated_nodes == ("n3",) and after.incidents["a.1"].stage is L.REPLAN
    assert after.nodes["n1"].health is NodeHealth.HEALTHY


def test_a_paired_check_that_names_nobody_asks_the_operator_and_drains_nothing() -> None:
    snap, check = nccl_timeouts_until_check(snap3())
    out = Outcome(check.action_id, "check_node", OutcomeStatus.FAILED, "paired check: unresolved n1,n2")
    d = on_outcome(snap, out, T0 + 1000)
    after = apply(snap, d)
    assert not of_kind(d.actions, DrainNode)
    assert after.incidents["a.1"].stage is L.ESCALATED_TO_OPERATOR
    assert "could not name a bad node" in after.incidents["a.1"].note


def test_an_unconfirmed_sev1_on_an_idle_node_is_noted_not_drained() -> None:
    snap = snap3()
    d = on_finding(snap, finding("f1", None, "n5", E.GPU_DRIVER_ERROR, confirmed_by=""), T0)
    assert not d.actions and "not confirmed" in d.notes[0]
    d = on_finding(snap, finding("f2", None, "n5", E.GPU_DRIVER_ERROR, confirmed_by="kernel_log"), T0)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n5"]  # type: ignore[attr-defined]


def test_a_check_that_never_answers_asks_the_operator_and_drains_nothing() -> None:
    from unicornd.decide import on_tick
    from unicornd.decide.ladder import CHECK_BACKSTOP_S

    snap, check = nccl_timeouts_until_check(snap3())
    waiting = snap.incidents["a.1"]
    assert on_tick(snap, waiting.last_action_s + CHECK_BACKSTOP_S - 1).incidents == ()
    d = on_tick(snap, waiting.last_action_s + CHECK_BACKSTOP_S + 1)
    after = apply(snap, d)
    assert (
        after.incidents["a.1"].stage is L.ESCALATED_TO_OPERATOR and not after.incidents["a.1"].pending_check
    )
    assert not of_kind(d.actions, DrainNode)
    late = Outcome(check.action_id, "check_node", OutcomeStatus.FAILED, "late", nodes=("n3",))
    assert not of_kind(on_outcome(after, late, T0 + 5000).actions, DrainNode), "a late answer is stale"


def test_only_nvml_readings_of_unrecoverable_faults_confirm() -> None:
    from detect.classify import load_classifier
    from unicorn_core.protocol import GpuFaultKind
    from unicornd.inputs import _nvml_confirms

    c = load_classifier()
    assert _nvml_confirms(c.classify_gpu(GpuFaultKind.ECC_UNCORRECTABLE, 1))
    assert _nvml_confirms(c.classify_gpu(GpuFaultKind.REMAPPED_ROWS, 1))
    assert _nvml_confirms(c.classify_gpu(GpuFaultKind.XID, 79))
    assert not _nvml_confirms(c.classify_gpu(GpuFaultKind.NVLINK_ERROR, 3)), "corrected link errors"
    assert not _nvml_confirms(c.classify_gpu(GpuFaultKind.TEMPERATURE, 95))
    assert not _nvml_confirms(c.classify_gpu(GpuFaultKind.DRIVER_ERROR, 1))


@pytest.mark.parametrize("status", [E.NAN_LOSS, E.LOSS_SPIKE, E.GRAD_NORM_EXPLOSION])
def test_a_training_state_finding_restarts_in_place_and_never_drains(status: ErrorStatus) -> None:
    """A NaN, a loss spike or a grad-norm explosion is the training's state, not a node's:
    restart in place; once restarts are used up the task stops and nothing is drained,
    even flagged SEV1."""
    assert ISOLATION[status] is Isolation.NEVER
    snap = snap3(max_restarts=1)
    spike = replace(finding("f1", 1, "n3", status), evidence="lm loss 9.1 at iteration 40")
    d = on_finding(snap, spike, T0)
    snap = apply(snap, d)
    assert not of_kind(d.actions, DrainNode) and not of_kind(d.actions, CheckNode)
    assert snap.incidents["a.1"].stage is L.RESTART_PROCESSES
    again = replace(spike, finding_id="f2", severity=Severity.SEV1)
    d = on_finding(snap, again, T0 + 60)
    after = apply(snap, d)
    assert not of_kind(d.actions, DrainNode) and not of_kind(d.actions, CheckNode)
    assert after.tasks["a"].state is TaskState.STOPPED
    assert all(n.health is NodeHealth.HEALTHY for n in after.nodes.values())


def test_silent_data_corruption_runs_the_paired_check_and_drains_only_what_it_names() -> None:
    snap = snap3()
    sdc = replace(
        finding("f1", 1, "n2", E.SILENT_DATA_CORRUPTION, confirmed_by=""), evidence="n2 anomalous twice"
    )  # as the detector reports it: from the training's numbers, unconfirmed
    d = on_finding(snap, sdc, T0)
    assert not of_kind(d.actions, DrainNode)
    (check,) = of_kind(d.actions, CheckNode)
    assert check.paired  # type: ignore[attr-defined]
