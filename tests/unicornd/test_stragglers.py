"""Stragglers in unicornd: replace when the gain beats the transition cost, else report.

Pure decisions (:func:`unicornd.decide.on_straggler`, snapshot + verdict + clock) for both
branches and every reason not to replace; the detector turning compute times into verdicts
(and clearing a reported node); the whole path from agents' iteration reports to a drained
straggler on a real Redis.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from detect.classify import load_classifier
from detect.statuses import ErrorStatus, Severity
from detect.stragglers import Straggler
from plan.hardware import gpu_spec
from plan.objective import HOUR_S, FailureModel, TransitionModel
from tests.unicornd.coord_world import apply, finding, of_kind, render, task, world
from unicorn_core.config import AgentConfig, Config, DetectConfig, PlanConfig
from unicorn_core.keys import RedisKeys
from unicorn_core.protocol import IterationTiming
from unicornd.actions import Decision, DrainNode, Replan, Requeue
from unicornd.cli.status import render_incidents
from unicornd.core import Core
from unicornd.decide import StragglerFinding, on_finding, on_straggler, on_tick, resolve
from unicornd.decide.stragglers import economics
from unicornd.detector import Detector
from unicornd.inputs import AgentInputs
from unicornd.replan import PlanContext
from unicornd.state import Incident, LadderStage, NodeHealth, Policy, Snapshot, StageEntry, TaskState
from unicornd.store import Store

L = LadderStage
T0 = 1_700_000_000.0
CTX = PlanContext(gpu_spec("a100-80g"), FailureModel(), lambda _gpn, _gen: render)


def cluster(nodes: int = 5, policy: Policy | None = None) -> Snapshot:
    """Task a (job 1) runs on n1..n4; n5.. idle."""
    return world(nodes, [task("a", 1, ["n1", "n2", "n3", "n4"])], policy)


def slow(
    node: str = "n2", *, ratio: float = 2.0, rank: int = 2, iteration_s: float = 0.3, recovered: bool = False
) -> Straggler:
    """A verdict: ``node`` computes ``ratio`` x its peers' 0.1 s per iteration."""
    return Straggler(
        node=node,
        rank=rank,
        stage=0,
        ratio=ratio,
        compute_s=0.1 * ratio,
        peers_compute_s=0.1,
        iteration_s=iteration_s,
        windows=3,
        first_iteration=20,
        last_iteration=79,
        nodes=4,
        recovered=recovered,
    )


def found(fid: str, verdict: Straggler) -> StragglerFinding:
    return StragglerFinding(fid, 1, verdict)


# --- the numbers -------------------------------------------------------------------------------


def test_the_gain_is_the_throughput_won_until_the_next_failure_and_the_cost_a_transition() -> None:
    """By hand: the task iterates in 0.3 s; n2 computes 0.1 s more than its peers, so replaced
    it would iterate in 0.2 s. Five plannable nodes at the 672 h prior MTBF fail every 134.4 h."""
    snap = cluster()
    a = snap.tasks["a"]
    money = economics(snap, a, slow(), T0, PlanConfig())
    flop = a.weight * a.model.model_flop_per_iteration() / 1e12
    assert (money.iteration_s, money.replaced_iteration_s) == (0.3, pytest.approx(0.2))
    assert money.waf_now == pytest.approx(flop / 0.3) and money.waf_replaced == pytest.approx(flop / 0.2)
    assert money.running_s == 672 * HOUR_S / 5
    assert money.transition_s == TransitionModel().transition_s(a.spec())
    assert money.gain == pytest.approx((flop / 0.2 - flop / 0.3) * 672 * HOUR_S / 5)
    assert money.cost == pytest.approx(flop / 0.3 * money.transition_s)
    assert money.gain > 1000 * money.cost


# --- replace -----------------------------------------------------------------------------------


def test_a_straggler_with_an_idle_spare_is_drained_and_the_task_replanned_onto_the_spare() -> None:
    snap = cluster()
    d = on_straggler(snap, found("e1:straggler:n2", slow()), T0)
    (drain,) = of_kind(d.actions, DrainNode)
    assert drain.node == "n2"  # type: ignore[attr-defined]
    assert drain.reason.startswith("unicorn: straggler a.1 2.00x its peers' compute time (rank 2)")  # type: ignore[attr-defined]
    assert of_kind(d.actions, Replan)
    after = apply(snap, d)
    inc = after.incidents["a.1"]
    assert (inc.status, inc.stage, inc.isolated_nodes, inc.rank) == (
        ErrorStatus.STRAGGLER,
        L.REPLAN,
        ("n2",),
        2,
    )
    assert "replaced" in inc.note and "wTFLOP" in inc.note
    assert after.tasks["a"].state is TaskState.RECOVERING and after.nodes["n2"].health is NodeHealth.DRAINING
    # The ladder's replan: a keeps its other nodes and takes the spare (a shrink and a grow
    # are two resizes of one job run: it is requeued onto them).
    moved = resolve(snap, d, CTX, T0)
    assert [r.nodes for r in of_kind(moved.actions, Requeue)] == [("n1", "n3", "n4", "n5")]  # type: ignore[attr-defined]
    assert moved.applied_to(snap).tasks["a"].nodes == ("n1", "n3", "n4", "n5")
    # A drain, not a failure: the node's record and the MTBF calibration count no failure.
    assert after.nodes["n2"].failures_s == () and after.nodes["n2"].drains_s == (T0,)
    assert moved.applied_to(snap).calibration.node_failures == snap.calibration.node_failures


# --- report ------------------------------------------------------------------------------------


def reported(d: Decision, snap: Snapshot) -> Incident:
    assert not d.actions, d.actions
    after = apply(snap, d)
    (inc,) = d.incidents
    assert inc.status is ErrorStatus.STRAGGLER
    assert inc.task_id is None and inc.stage is L.DETECTED and inc.is_open and inc.node == "n2"
    assert after.open_incident("a") is None and after.tasks["a"].state is TaskState.RUNNING
    assert inc.evidence.startswith("task a: n2 (rank 2, stage 0) computes 2.00x as long as")
    return inc


def test_without_a_spare_the_straggler_is_reported_and_the_ladder_stays_free() -> None:
    snap = cluster(nodes=4)
    d = on_straggler(snap, found("e1:straggler:n2", slow()), T0)
    inc = reported(d, snap)
    assert "not replaced: no healthy idle node to take its place" in inc.note
    assert "replacing it gains" in inc.note
    # unicornctl incidents lists it, open, with the numbers and why.
    after = apply(snap, d)
    text = render_incidents(after, include_closed=False, now_s=T0 + 1)
    assert f"{inc.incident_id}  open  straggler SEV3  no task  node n2 rank 2  stage detected" in text
    assert (
        "note: n2 (rank 2, stage 0) computes 2.00x" in text and "not replaced: no healthy idle node" in text
    )
    # A real fault of the task afterwards climbs its own ladder as usual.
    fault = on_finding(after, finding("e2", 1, "n3", ErrorStatus.ECC_ERROR), T0 + 5)
    assert [a.node for a in of_kind(fault.actions, DrainNode)] == ["n3"]  # type: ignore[attr-defined]


def test_when_the_gain_does_not_beat_the_cost_the_straggler_is_reported() -> None:
    """A node MTBF of 6 minutes: the next failure comes before a transition pays off."""
    snap = cluster()
    d = on_straggler(snap, found("e1:straggler:n2", slow()), T0, plan=PlanConfig(node_mtbf_h=0.1))
    inc = reported(d, snap)
    assert "does not beat the transition cost" in inc.note
    assert "no healthy idle node" not in inc.note


def test_the_drain_limiter_other_users_jobs_and_the_breaker_each_keep_it_a_report() -> None:
    limited = cluster(policy=Policy(max_drain_fraction=0.0, min_drains_per_window=0))
    inc = reported(on_straggler(limited, found("e1", slow()), T0), limited)
    assert "drain limit reached (0 in 600 s)" in inc.note
    snap = cluster()
    shared = snap.apply(nodes=[replace(snap.nodes["n2"], jobs=(1, 99))])
    inc = reported(on_straggler(shared, found("e1", slow()), T0), shared)
    assert "other users' jobs [99] run on n2" in inc.note
    tired = snap.apply(tasks=[replace(snap.tasks["a"], recoveries_without_progress=3)])
    inc = reported(on_straggler(tired, found("e1", slow()), T0), tired)
    assert "no-progress breaker" in inc.note


def test_the_same_rank_slow_again_after_a_replacement_is_only_reported() -> None:
    """Rank 2 was replaced as a straggler on n9 two hours ago; now it is slow on n2: the
    rank's own work is the likelier cause, draining another node would not help."""
    snap = cluster()
    old = Incident(
        incident_id="a.1",
        task_id="a",
        node="n9",
        rank=2,
        status=ErrorStatus.STRAGGLER,
        severity=Severity.SEV3,
        rule="straggler",
        evidence="",
        opened_s=T0 - 7200,
        stage=L.CLOSED,
        timeline=(StageEntry(L.DETECTED, T0 - 7200), StageEntry(L.CLOSED, T0 - 7000)),
        isolated_nodes=("n9",),
    )
    snap = snap.apply(incidents=[old], tasks=[replace(snap.tasks["a"], incidents_opened=1)])
    inc = reported(on_straggler(snap, found("e1", slow()), T0), snap)
    assert "rank 2 was replaced as a straggler on n9 before (a.1)" in inc.note


# --- never twice, recovery, stale reports ---------------------------------------------------


def test_a_report_closes_when_the_node_recovers_and_the_cooldown_holds_off_a_new_one() -> None:
    snap = cluster(nodes=4)
    snap = apply(snap, on_straggler(snap, found("e1", slow()), T0))
    (inc_id,) = snap.incidents
    # Slow again while reported: noted only; the same evidence again: no-op.
    again = on_straggler(snap, found("e2", slow()), T0 + 60)
    assert again.empty and "reported in" in again.notes[0]
    assert on_straggler(snap, found("e1", slow()), T0 + 60).empty
    snap = apply(snap, on_straggler(snap, found("e3", slow(recovered=True)), T0 + 100))
    assert snap.incidents[inc_id].stage is L.CLOSED and snap.incidents[inc_id].note.startswith("recovered: ")
    # Slow again within the cooldown (3600 s from the report): nothing new.
    within = on_straggler(snap, found("e4", slow()), T0 + 200)
    assert within.empty and "cooldown 3600 s" in within.notes[0]
    # After it: reported again.
    later = on_straggler(snap, found("e5", slow()), T0 + 3700)
    assert reported(later, snap).incident_id != inc_id


def test_a_reported_straggler_is_replaced_once_a_spare_frees() -> None:
    """No spare when found: reported. Repeats while nothing changed are noted; the repeat
    after a node came free replaces it, and the report closes as superseded."""
    snap = cluster(nodes=4)
    snap = apply(snap, on_straggler(snap, found("e1", slow()), T0))
    (report_id,) = snap.incidents
    still = on_straggler(snap, found("e2", slow()), T0 + 60)
    assert still.empty and "still not replaced: no healthy idle node" in still.notes[0]
    freed = world(5, [task("a", 1, ["n1", "n2", "n3", "n4"])]).nodes["n5"]
    snap = snap.apply(nodes=[freed])
    d = on_straggler(snap, found("e3", slow()), T0 + 120)
    assert [a.node for a in of_kind(d.actions, DrainNode)] == ["n2"]  # type: ignore[attr-defined]
    after = apply(snap, d)
    report = after.incidents[report_id]
    assert report.stage is L.CLOSED and "superseded: replaced in a.1" in report.note
    assert after.incidents["a.1"].status is ErrorStatus.STRAGGLER and after.incidents["a.1"].is_open


def test_a_report_closes_once_its_node_runs_no_task() -> None:
    snap = cluster(nodes=4)
    snap = apply(snap, on_straggler(snap, found("e1", slow()), T0))
    (inc_id,) = snap.incidents
    assert on_tick(snap, T0 + 1).empty  # still the task's node: stays open
    moved = snap.apply(tasks=[replace(snap.tasks["a"], nodes=("n1", "n3", "n4"))])
    closed = apply(moved, on_tick(moved, T0 + 2)).incidents[inc_id]
    assert closed.stage is L.CLOSED and closed.note.endswith("closed: n2 runs no task")


def test_stale_and_foreign_verdicts_change_nothing() -> None:
    snap = cluster()
    recovering = snap.apply(tasks=[snap.tasks["a"].with_state(TaskState.RECOVERING)])
    d = on_straggler(recovering, found("e1", slow()), T0)
    assert d.empty and "is recovering" in d.notes[0]
    assert on_straggler(snap, found("e1", slow(node="n5")), T0).empty  # not the task's node
    assert on_straggler(snap, StragglerFinding("e1", 7, slow()), T0).empty  # no task has job 7
    assert on_straggler(snap, found("e1", slow(recovered=True)), T0).empty  # nothing reported
    # The ladder never acts on a straggler status, whatever reaches it.
    ladder = on_finding(snap, finding("e1", 1, "n2", ErrorStatus.STRAGGLER), T0)
    assert ladder.empty and "not by the ladder" in ladder.notes[0]


# --- the detector -----------------------------------------------------------------------------


def timing(node: int, iteration: int, compute_s: float | None) -> IterationTiming:
    return IterationTiming(
        job_id=1,
        node=f"n{node}",
        wall_time_s=T0 + iteration,
        rank=node - 1,
        iteration=iteration,
        duration_s=0.3,
        samples=None,
        compute_s=compute_s,
    )


def test_the_detector_names_the_straggler_from_compute_times_and_clears_a_reported_node() -> None:
    det = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    out = []
    for it in range(1, 90):
        for n in (1, 2, 3, 4):
            out += det.on_message(timing(n, it, 0.2 if n == 2 else 0.1), float(it))
    (jf,) = out  # windows 1-3 (iterations 20-79), judged at iteration 81
    assert jf.straggler is not None and jf.straggler.node == "n2" and jf.evidence.source == "straggler:n2"
    assert jf.classification.status is ErrorStatus.STRAGGLER
    # Reports without compute times (Megatron-LM's) give nothing.
    assert not any(det.on_message(timing(n, 100 + i, None), 100.0) for i in range(100) for n in (1, 2, 3, 4))
    # unicornd restarted: a fresh detector learns n2's open report from the snapshot and clears it.
    snap = cluster(nodes=4)
    after = apply(snap, on_straggler(snap, found("e1", slow()), T0))
    det = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    det.follow(snap, after, Decision(), 0.0)
    out = [
        jf
        for it in range(1, 90)
        for n in (1, 2, 3, 4)
        for jf in det.on_message(timing(n, it, 0.1), float(it))
    ]
    assert [(jf.straggler.node, jf.straggler.recovered) for jf in out if jf.straggler] == [("n2", True)]


async def test_agents_reports_of_a_slow_node_end_in_its_drain(redis_url: str) -> None:
    """The whole path on a real Redis: iteration reports with compute times -> detector ->
    on_straggler -> committed: n2 draining, the task's incident waiting for its replan's
    transition, n5 planned in."""
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(Config().redis.key_prefix)
    core = Core(Store(client, keys, Policy()), CTX)
    detector = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    agents = AgentInputs(Config(), core, detector)
    try:
        await core.start(cluster())
        for it in range(1, 82):
            for n in (1, 2, 3, 4):
                entry = f"{int((T0 + it) * 1000)}-{n}"
                await agents.on_message(
                    timing(n, it, 0.2 if n == 2 else 0.1), float(it), entry, keys.events(1)
                )
        snap = core.snap
        inc = snap.incidents["a.1"]
        assert inc.status is ErrorStatus.STRAGGLER and inc.stage is L.TRANSITION
        assert snap.nodes["n2"].health is NodeHealth.DRAINING
        assert snap.tasks["a"].nodes == ("n1", "n3", "n4", "n5")
    finally:
        await client.aclose()
